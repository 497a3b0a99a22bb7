"""A small causal transformer language model over any of selfattn's positional encodings.

Shape legend: b batch, l positions, d model size (num_hiddens), v vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from selfattn._scripting import NotScriptable
from selfattn._validation import require_non_negative_int, require_positive_int, require_probability
from selfattn.cache import KVCache
from selfattn.models.block import TransformerBlock
from selfattn.models.recipe import LayerRecipe, LayerSizes, check_recipes, check_stack
from selfattn.positional.base import InputEncoding, PositionalEncoding, QueryKeyEncoding
from selfattn.positional.registry import NAMES, build
from selfattn.positional.rotary import RotaryPositionalEncoding
from selfattn.shared_cache import SharedKVCache, SharedKVView

__all__ = ["TransformerLM"]

_ONE_DIMENSIONAL = tuple(name for name in NAMES if not name.startswith("sinusoidal") or name == "sinusoidal")


class TransformerLM(NotScriptable, nn.Module):
    """Token embedding, a positional encoding, ``num_layers`` causal blocks, a tied output head.

    ``position`` names an encoding of :func:`selfattn.positional.build` (``"none"`` is NoPE,
    the causal mask alone). An input encoding (sinusoidal, learned) is added to the scaled
    token embeddings; a query/key encoding (rotary) or a score encoding (ALiBi, T5, Shaw) is
    built once and given to every block, so its parameters, if any, are shared by the layers.
    Token embeddings are drawn from N(0, 1/d) and multiplied by sqrt(d), so they are on the
    scale of the sinusoids; the output head reuses the embedding matrix.

    Args:
        vocab_size: number of token ids ``v``.
        num_hiddens: model size ``d``.
        num_heads: attention heads; must divide ``d``.
        num_layers: number of blocks.
        position: encoding name, one of :data:`selfattn.positional.NAMES` except the N-D sinusoids.
        max_len: positions the model serves: the learned table's size, and the default size of
            the caches :meth:`generate` makes.
        ffn_hiddens: MLP hidden size (default ``4 d``).
        dropout: dropout in the blocks.
        norm_first: pre-LN blocks if True, post-LN if False.
        residual: keep the blocks' residual connections.
        mlp: keep the blocks' MLPs.
        position_options: extra constructor options for the encoding (e.g. ``{"max_distance": 8}``).
        layers: one :class:`~selfattn.models.LayerRecipe` per layer (default: the plain recipe
            for every layer): NoPE layers, per-layer rotary bases, windows, chunks, softcap,
            sinks, QK-norm, gates, head counts and sizes, layers reading an earlier layer's keys
            and values (see :func:`~selfattn.models.repeat_pattern`).

    A layer with ``shares_kv_with=i`` reads what layer ``i`` attended to: in a full pass the
    model hands it layer ``i``'s keys and values (through a cache of this pass), and when decoding
    its cache (:meth:`make_caches`) is a :class:`~selfattn.models.SharedKVView` of layer
    ``i``'s :class:`~selfattn.models.SharedKVCache`, so the keys are stored once.

    Shape:
        tokens ``(b, l)`` int64 -> logits ``(b, l, v)``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_hiddens: int,
        num_heads: int,
        num_layers: int,
        *,
        position: str = "rotary",
        max_len: int = 1024,
        ffn_hiddens: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        residual: bool = True,
        mlp: bool = True,
        position_options: Mapping[str, Any] | None = None,
        layers: Sequence[LayerRecipe] | None = None,
    ):
        super().__init__()
        self.vocab_size = require_positive_int("vocab_size", vocab_size)
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.num_layers = require_positive_int("num_layers", num_layers)
        self.max_len = require_positive_int("max_len", max_len)
        require_probability("dropout", dropout)
        if position not in _ONE_DIMENSIONAL:
            raise ValueError(f"position must be one of {', '.join(_ONE_DIMENSIONAL)}; got {position!r}")
        self.position_name = position
        options = dict(position_options or {})
        if position == "learned":
            options.setdefault("max_len", self.max_len)
        encoding = build(position, num_hiddens=num_hiddens, num_heads=num_heads, **options)
        self.input_encoding: InputEncoding | None = encoding if isinstance(encoding, InputEncoding) else None
        self.position: PositionalEncoding | None = None if self.input_encoding is not None else encoding
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.layers = check_recipes(layers, self.num_layers) if layers is not None else [LayerRecipe()] * num_layers
        check_stack(self.layers, num_hiddens, num_heads)
        positions = _layer_positions(self.layers, self.position, position, options, num_hiddens, num_heads)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                num_hiddens,
                num_heads,
                4 * num_hiddens if ffn_hiddens is None else ffn_hiddens,
                dropout,
                position=layer_position,
                norm_first=norm_first,
                residual=residual,
                mlp=mlp,
                recipe=recipe,
            )
            for recipe, layer_position in zip(self.layers, positions, strict=True)
        )
        self.norm = nn.LayerNorm(num_hiddens)
        nn.init.normal_(self.embedding.weight, std=num_hiddens**-0.5)

    @property
    def encoding(self) -> PositionalEncoding:
        """The positional encoding module, as :func:`~selfattn.positional.build` made it."""
        encoding = self.input_encoding if self.input_encoding is not None else self.position
        assert encoding is not None
        return encoding

    def make_caches(self, max_len: int | None = None) -> list[KVCache]:
        """One empty :class:`~selfattn.KVCache` per block, for ``max_len`` positions (default ``self.max_len``).

        A layer whose keys and values later layers read gets a :class:`~selfattn.models.SharedKVCache`,
        and each of those layers a :class:`~selfattn.models.SharedKVView` of it, which stores nothing.
        """
        max_len = self.max_len if max_len is None else require_positive_int("max_len", max_len)
        return [cache for cache in self._caches(max_len, every_layer=True) if cache is not None]

    def _caches(self, max_len: int, every_layer: bool) -> list[KVCache | None]:
        """Caches of ``max_len`` for every layer, or (``every_layer=False``) only for those that share keys."""
        read = {recipe.shares_kv_with for recipe in self.layers}
        caches: list[KVCache | None] = []
        for index, recipe in enumerate(self.layers):
            source = None if recipe.shares_kv_with is None else caches[recipe.shares_kv_with]
            if isinstance(source, SharedKVCache):
                caches.append(SharedKVView(source))
            elif index in read:
                caches.append(SharedKVCache(max_len))
            else:
                caches.append(KVCache(max_len) if every_layer else None)
        return caches

    def _check_shared_caches(self, caches: Sequence[KVCache]) -> None:
        """Each sharing layer's cache is a view of its source's (else it would read another layer's keys, or none)."""
        for index, recipe in enumerate(self.layers):
            source = recipe.shares_kv_with
            if source is None:
                continue
            cache = caches[index]
            if not isinstance(cache, SharedKVView) or cache.source is not caches[source]:
                raise ValueError(
                    f"caches[{index}] must be a SharedKVView of caches[{source}] (layer {index} reads layer "
                    f"{source}'s keys and values), got {type(cache).__name__}: make the caches with make_caches()"
                )

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, length), got {tuple(getattr(tokens, 'shape', ()))}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must hold integer ids (int64 or int32), got dtype {tokens.dtype}")
        if tokens.shape[1] == 0:
            raise ValueError("tokens must hold at least one position, got length 0")

    def _check_positions(
        self, positions: torch.Tensor, batch: int, length: int, caches: Sequence[KVCache] | None
    ) -> torch.Tensor:
        if caches is not None:
            raise ValueError("positions and caches cannot be combined: decode with consecutive positions")
        if self.input_encoding is None and not isinstance(self.position, QueryKeyEncoding):
            raise ValueError(
                f"positions only apply to absolute and rotary encodings, not {self.position_name!r} "
                "(a relative encoding sees distances only)"
            )
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dim() not in (1, 2)
            or positions.shape[-1] != length
            or (positions.dim() == 2 and positions.shape[0] != batch)
            or positions.is_floating_point()
        ):
            raise ValueError(
                f"positions must be an integer tensor of shape ({length},) or ({batch}, {length}), got {positions!r}"
            )
        if length > 1 and not bool((positions[..., 1:] > positions[..., :-1]).all()):
            raise ValueError("positions must be strictly increasing")
        if int(positions[..., 0].min()) < 0:
            raise ValueError(f"positions must be non-negative, got {int(positions[..., 0].min())}")
        return positions.long()

    def forward(
        self,
        tokens: torch.Tensor,
        valid_lens: torch.Tensor | None = None,
        *,
        offset: int | None = None,
        caches: Sequence[KVCache] | None = None,
        positions: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Next-token logits for every position of ``tokens``.

        Args:
            tokens: ``(b, l)`` token ids.
            valid_lens: ``(b,)`` lengths of right-padded sequences (causal attention never
                looks right, so padding only matters to the positions past each length).
            offset: absolute position of ``tokens[:, 0]`` (default 0, or the caches' length).
            caches: one :class:`~selfattn.KVCache` per block (see :meth:`make_caches`).
            positions: ``(l,)`` strictly increasing positions for the tokens instead of
                ``offset, offset + 1, ...``, or ``(b, l)``: each sequence its own (randomized
                positions drawn per sequence; absolute and rotary encodings).
            return_hidden: also return the hidden states: the block input and each block's
                output, ``num_layers + 1`` tensors ``(b, l, d)`` (before the final norm).

        Returns:
            ``(b, l, v)`` logits, or ``(logits, hidden)``.
        """
        self._check_tokens(tokens)
        length = tokens.shape[1]
        if caches is not None and len(caches) != self.num_layers:
            raise ValueError(f"caches must hold one KVCache per block ({self.num_layers}), got {len(caches)}")
        if caches is not None:
            self._check_shared_caches(caches)
        if positions is not None:
            if offset is not None:
                raise ValueError("give either offset or positions, not both")
            positions = self._check_positions(positions, tokens.shape[0], length, caches)
        if offset is None:
            offset = 0 if caches is None else caches[0].length
        offset = require_non_negative_int("offset", offset)
        if bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(
                f"tokens must lie in [0, {self.vocab_size}), got {tokens.min().item()}..{tokens.max().item()}"
            )
        return self._logits(tokens, valid_lens, offset, caches, positions, return_hidden)

    def _logits(
        self,
        tokens: torch.Tensor,
        valid_lens: torch.Tensor | None,
        offset: int,
        caches: Sequence[KVCache] | None,
        positions: torch.Tensor | None,
        return_hidden: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`forward` on checked arguments (``generate``'s own tokens are ids by construction: no host read)."""
        x = self.embedding(tokens) * math.sqrt(self.num_hiddens)  # (b, l, d)
        if self.input_encoding is not None:
            if positions is None:
                x = self.input_encoding(x, offset=offset)
            else:  # dropout(x + P[positions]), as the offset path: not x + dropout(P)[positions]
                x = self.input_encoding(x, positions=positions)
        # Token i sits at positions[i]; the attention's encoding transforms queries and keys there itself.
        block_offset = offset if positions is None else None
        hidden = [x]
        # A full pass hands each shared layer's keys and values to its readers through caches of this pass.
        layer_caches: Sequence[KVCache | None] = (
            self._caches(tokens.shape[1], every_layer=False) if caches is None else caches
        )
        for index, block in enumerate(self.blocks):
            cache = layer_caches[index]
            x = block(x, valid_lens, causal=True, offset=block_offset, cache=cache, positions=positions)
            hidden.append(x)
        logits = self.norm(x) @ self.embedding.weight.T  # (b, l, v)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with one :class:`~selfattn.KVCache` per block.

        Args:
            prompt: ``(b, l)`` token ids.
            max_new_tokens: tokens to append.

        Returns:
            ``(b, l + max_new_tokens)``: the prompt followed by the argmax tokens, in the prompt's dtype.

        The prompt goes through :meth:`forward` (and its hooks); each decoded token, an argmax id and
        so valid by construction, goes straight to the blocks without ``forward``'s range check, a
        host read per token (its forward hooks do not fire for them).
        """
        self._check_tokens(prompt)
        max_new_tokens = require_non_negative_int("max_new_tokens", max_new_tokens)
        total = prompt.shape[1] + max_new_tokens
        if self.input_encoding is not None and self.position_name == "learned" and total > self.max_len:
            raise ValueError(f"prompt + max_new_tokens = {total} positions exceed max_len={self.max_len}")
        if max_new_tokens == 0:
            return prompt.clone()
        caches = self.make_caches(total)
        logits = self(prompt, caches=caches)
        assert isinstance(logits, torch.Tensor)
        out = [prompt]
        for step in range(max_new_tokens):
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (b, 1)
            out.append(next_token.to(prompt.dtype))  # the prompt's id dtype, as with no new token
            if step + 1 < max_new_tokens:
                decoded = self._logits(next_token, None, caches[0].length, caches, None, False)  # an argmax: a valid id
                assert isinstance(decoded, torch.Tensor)
                logits = decoded
        return torch.cat(out, dim=1)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, position={self.position_name!r}, max_len={self.max_len}"


def _layer_positions(
    layers: Sequence[LayerRecipe],
    model_position: PositionalEncoding | None,
    name: str,
    options: Mapping[str, Any],
    num_hiddens: int,
    num_heads: int,
) -> list[PositionalEncoding | None]:
    """Each layer's encoding inside attention: the model's, or one built for the layer's rotary base or sizes.

    One encoding per distinct rotary base and size it is built for (the heads a score encoding biases,
    the head size a rotary turns), shared by the layers that have them: a layer that reads another
    layer's keys then encodes its queries with the very module that encoded those keys.
    """
    own: dict[tuple[int, int, float | None], PositionalEncoding] = {}
    by_heads = isinstance(getattr(model_position, "num_heads", None), int)
    by_size = isinstance(getattr(model_position, "head_dim", None), int)
    positions: list[PositionalEncoding | None] = []
    for recipe in layers:
        if recipe.rotary_base is not None and not isinstance(model_position, RotaryPositionalEncoding):
            raise ValueError(f"a layer has rotary_base={recipe.rotary_base}, but position={name!r} is not rotary")
        sizes = recipe.sizes(num_hiddens, num_heads)
        if not recipe.position or model_position is None:
            positions.append(None)
        elif recipe.rotary_base is None and _fits(model_position, sizes):
            positions.append(model_position)
        else:
            key = (sizes.num_heads if by_heads else 0, sizes.head_dim if by_size else 0, recipe.rotary_base)
            if key not in own:
                given = options if recipe.rotary_base is None else {**options, "base": recipe.rotary_base}
                inner = sizes.num_heads * sizes.head_dim
                own[key] = build(name, num_hiddens=inner, num_heads=sizes.num_heads, **given)
            positions.append(own[key])
    return positions


def _fits(encoding: PositionalEncoding, sizes: LayerSizes) -> bool:
    """Whether ``encoding`` was built for a layer of these sizes (the heads it biases, the head size it rotates)."""
    built_heads, built_size = getattr(encoding, "num_heads", None), getattr(encoding, "head_dim", None)
    return (not isinstance(built_heads, int) or built_heads == sizes.num_heads) and (
        not isinstance(built_size, int) or built_size == sizes.head_dim
    )
