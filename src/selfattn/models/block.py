"""One transformer block: self-attention and an MLP, each with a LayerNorm and a residual.

Shape legend: b batch, l positions, d model size (num_hiddens).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from selfattn._scripting import NotScriptable
from selfattn._validation import require_positive_int, require_probability
from selfattn.attention import MultiHeadAttention
from selfattn.cache import KVCache
from selfattn.models.recipe import LayerRecipe, check_recipe
from selfattn.positional.base import PositionalEncoding

__all__ = ["TransformerBlock"]


class TransformerBlock(NotScriptable, nn.Module):
    """Self-attention followed by a two-layer GELU MLP.

    With ``norm_first=True`` (pre-LN, GPT-2 and later)::

        x = x + drop(attention(norm_1(x)));  x = x + drop(mlp(norm_2(x)))

    and with ``norm_first=False`` (post-LN, the original transformer and the chapter's
    ``AddNorm``)::

        x = norm_1(x + drop(attention(x)));  x = norm_2(x + drop(mlp(x)))

    ``residual=False`` drops the ``x +`` terms (the deep-stack experiment: how fast a stack of
    attention layers forgets position without them); ``mlp=False`` drops the MLP half.

    Args:
        num_hiddens: model size ``d``.
        num_heads: attention heads; must divide ``d``.
        ffn_hiddens: hidden size of the MLP.
        dropout: dropout on the attention weights and on each branch's output.
        position: a query/key (rotary) or score (ALiBi, T5, Shaw) encoding used by the
            attention; input encodings belong to the model, not the block.
        norm_first: pre-LN if True, post-LN if False.
        residual: keep the residual connections.
        mlp: keep the MLP half of the block.
        bias: biases in the attention projections and the MLP.
        recipe: the attention's options (window, chunks, softcap, sinks, QK-norm, gate,
            temperature, scale, its own head counts and head size) as a
            :class:`~selfattn.models.LayerRecipe`; its ``position`` and ``rotary_base`` are for the
            model, which passes this block its ``position``. With ``shares_kv_with``, the attention
            reads another layer's keys and values (``shared_kv=True``) and every call needs
            ``cache``, a :class:`~selfattn.models.SharedKVView` of that layer's cache.

    Shape:
        x ``(b, l, d)`` -> ``(b, l, d)``.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        ffn_hiddens: int,
        dropout: float = 0.0,
        *,
        position: PositionalEncoding | None = None,
        norm_first: bool = True,
        residual: bool = True,
        mlp: bool = True,
        bias: bool = False,
        recipe: LayerRecipe | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.ffn_hiddens = require_positive_int("ffn_hiddens", ffn_hiddens)
        self.dropout_p = require_probability("dropout", dropout)
        self.norm_first, self.residual, self.has_mlp = bool(norm_first), bool(residual), bool(mlp)
        recipe = LayerRecipe() if recipe is None else check_recipe(recipe, "recipe")
        heads, kv_heads, head_dim = recipe.sizes(num_hiddens, require_positive_int("num_heads", num_heads))
        options = recipe.attention_options()
        if kv_heads != heads:
            options["num_kv_heads"] = kv_heads
        if heads * head_dim != num_hiddens:  # heads of their own size: project from and back to d
            options |= dict.fromkeys(("query_size", "key_size", "value_size", "output_size"), num_hiddens)
        inner = heads * head_dim
        self.attention = MultiHeadAttention(inner, heads, dropout, bias=bias, position=position, **options)
        self.norm_1 = nn.LayerNorm(num_hiddens)
        self.mlp: nn.Sequential | None = None
        self.norm_2: nn.LayerNorm | None = None
        if self.has_mlp:
            self.norm_2 = nn.LayerNorm(num_hiddens)
            self.mlp = nn.Sequential(
                nn.Linear(num_hiddens, ffn_hiddens, bias=bias),
                nn.GELU(),
                nn.Linear(ffn_hiddens, num_hiddens, bias=bias),
            )
        self.dropout = nn.Dropout(dropout)

    def _attend(
        self,
        x: torch.Tensor,
        valid_lens: torch.Tensor | None,
        causal: bool,
        offset: int | None,
        cache: KVCache | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        out = self.attention(x, x, x, valid_lens, causal=causal, offset=offset, cache=cache, positions=positions)
        assert isinstance(out, torch.Tensor)
        return cast(torch.Tensor, self.dropout(out))

    def forward(
        self,
        x: torch.Tensor,
        valid_lens: torch.Tensor | None = None,
        *,
        causal: bool = False,
        offset: int | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the block on ``x`` ``(b, l, d)``.

        Args:
            x: ``(b, l, d)``.
            valid_lens: ``(b,)`` or ``(b, l)`` key lengths, as in :class:`~selfattn.MultiHeadAttention`.
            causal: each position sees only itself and earlier ones.
            offset: absolute position of ``x[:, 0]`` (default 0, or ``cache.length``).
            cache: this block's :class:`~selfattn.KVCache` for incremental decoding.
            positions: integer positions of the tokens, ``(l,)`` or ``(b, l)``, instead of
                ``offset, offset + 1, ...`` (e.g. randomized positions). The attention's encoding
                applies its own query and key transforms at them, and a cache stores them.
                Give either ``offset`` or ``positions``.

        Returns:
            ``(b, l, d)``.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.num_hiddens:
            raise ValueError(
                f"x must have shape (batch, length, {self.num_hiddens}), got {tuple(getattr(x, 'shape', ()))}"
            )
        if self.norm_first:
            x = self._add(x, self._attend(self.norm_1(x), valid_lens, causal, offset, cache, positions))
            if self.mlp is not None and self.norm_2 is not None:
                x = self._add(x, self.dropout(self.mlp(self.norm_2(x))))
        else:
            x = self.norm_1(self._add(x, self._attend(x, valid_lens, causal, offset, cache, positions)))
            if self.mlp is not None and self.norm_2 is not None:
                x = self.norm_2(self._add(x, self.dropout(self.mlp(x))))
        return x

    def _add(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + branch if self.residual else branch

    def extra_repr(self) -> str:
        return (
            f"num_hiddens={self.num_hiddens}, ffn_hiddens={self.ffn_hiddens}, norm_first={self.norm_first}, "
            f"residual={self.residual}, mlp={self.has_mlp}"
        )
