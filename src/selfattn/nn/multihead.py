"""``torch.nn.MultiheadAttention``'s interface over selfattn's attention.

Shape legend:
    b: batch, h: heads, l: queries (target length), s: keys (source length), e: ``embed_dim``,
    dh: head size ``e / h``, hk: key/value heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._scripting import NotScriptable
from selfattn._validation import require_bool, require_positive_int, require_probability
from selfattn.attention import MultiHeadAttention as _CoreAttention
from selfattn.cache import KVCache
from selfattn.functional import attention
from selfattn.nn._torch_masks import check_torch_inputs, describe_tensor, torch_masks
from selfattn.positional import PositionalEncoding, build

__all__ = ["MultiheadAttention"]


def _none_or_dims(t: torch.Tensor | None) -> str:
    return "None" if t is None else describe_tensor(t)


def _always_run_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that changes nothing: its presence is what matters.

    ``nn.TransformerEncoderLayer`` in eval hands the whole layer to torch's fused kernel, which
    reads ``in_proj_weight`` and never calls ``self_attn``, unless some submodule carries a hook.
    This one makes that check decline, so the drop-in always runs with its own semantics.
    """
    return None


class MultiheadAttention(NotScriptable, nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention``: same constructor, ``forward``, parameters and ``state_dict``.

    Replacing ``torch.nn.MultiheadAttention`` by this class is the whole migration: a torch
    ``state_dict`` loads as it is (``in_proj_weight`` or ``q/k/v_proj_weight``,
    ``in_proj_bias``, ``out_proj``, ``bias_k``/``bias_v``), masks mean what they mean in torch
    (a bool ``attn_mask`` or ``key_padding_mask`` is True where attention is *not* allowed; a
    float one is added to the scores), and it works as ``self_attn`` of
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``. Attention itself runs in
    :func:`selfattn.functional.attention`, or, with selfattn's own options, in
    :class:`selfattn.MultiHeadAttention` on these parameters.

    Known differences from torch, all deliberate:

    * a query whose keys are all masked gets a zero output row before ``out_proj`` (and zero
      weights) instead of NaN;
    * the weights returned in training with ``dropout > 0`` are those before dropout;
    * the output is always contiguous (torch's is a transposed view with ``batch_first`` in
      training);
    * flags and probabilities are checked: ``need_weights`` must be True or False, ``dropout``
      in ``[0, 1)`` (torch takes any truthy value, and a dropout of 1, which drops every weight).

    Inside torch's ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` this module
    always runs, in training and in eval: it carries a no-op forward pre-hook, and torch's
    layer then declines its fused fast path (which would read ``in_proj_weight``, never call
    this module, skip selfattn's options and give NaN rows). In eval with
    ``src_key_padding_mask`` and ``batch_first``, torch's encoder may turn its input into
    nested tensors; it decides when it is built (yes with torch's attention or with this
    module without selfattn's options; with them ``_qkv_same_embed_dim`` reads False, and no).
    This module then gets one nested tensor of sequences ``(l_i, e)`` as query, key and value,
    attends within each sequence and returns a nested tensor, and the encoder pads its output
    with zeros, as with torch's attention. So the encoder's output at every token that is not
    padding is the same in eval as in training (without dropout) and, without selfattn's
    options, equals torch's with the same weights; padded tokens are zeros where the encoder
    went nested and computed otherwise; a sequence whose keys are all masked stays finite.

    Args:
        embed_dim: model size ``e``.
        num_heads: heads ``h``; must divide ``embed_dim``.
        dropout: dropout on the attention weights, in training.
        bias: biases on the input and output projections.
        add_bias_kv: learn one more key and value, appended to every sequence.
        add_zero_attn: append a key and a value of zeros after the projections.
        kdim: feature size of the keys (default ``embed_dim``).
        vdim: feature size of the values (default ``embed_dim``).
        batch_first: inputs and outputs are ``(b, l, e)`` instead of ``(l, b, e)``.
        device: where the parameters are created.
        dtype: dtype of the parameters.
        position: selfattn's encoding inside attention: a
            :class:`~selfattn.positional.PositionalEncoding` that rotates queries and keys or
            biases the scores, or its name for :func:`selfattn.positional.build` (``"rotary"``,
            ``"alibi"``, ...).
        window: sliding-window attention (see :class:`selfattn.MultiHeadAttention`).
        num_kv_heads: key/value heads ``hk`` (grouped-query attention); must divide ``num_heads``.
            The key and value projections then have ``hk * dh`` outputs.
    """

    _core: _CoreAttention
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        position: PositionalEncoding | str | None = None,
        window: int | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self._check_sizes(embed_dim, num_heads, kdim, vdim, dropout)
        for name, flag in (
            ("bias", bias),
            ("add_bias_kv", add_bias_kv),
            ("add_zero_attn", add_zero_attn),
            ("batch_first", batch_first),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        if isinstance(position, str):
            position = build(position, num_hiddens=embed_dim, num_heads=num_heads)
        self.num_kv_heads = num_heads if num_kv_heads is None else require_positive_int("num_kv_heads", num_kv_heads)
        extras = position is not None or window is not None or self.num_kv_heads != num_heads
        if extras and (add_bias_kv or add_zero_attn):
            raise ValueError("add_bias_kv and add_zero_attn do not combine with position, window or num_kv_heads")
        self._build_core(bias, position, window, dtype)
        self._extras = extras
        self._packed = self.kdim == embed_dim and self.vdim == embed_dim
        # nn.TransformerEncoderLayer's fast path reads in_proj_weight and skips forward (and so
        # position, window and GQA); this flag is one of its conditions.
        self._qkv_same_embed_dim = self._packed and not extras
        self._make_parameters(bias, add_bias_kv, {"device": device, "dtype": dtype})
        self._reset_parameters()
        self.register_forward_pre_hook(_always_run_forward)

    def _check_sizes(self, embed_dim: int, num_heads: int, kdim: int | None, vdim: int | None, dropout: float) -> None:
        """Set ``embed_dim``, ``num_heads``, ``head_dim``, ``kdim``, ``vdim`` and ``dropout``, each checked."""
        self.embed_dim = require_positive_int("embed_dim", embed_dim)
        self.num_heads = require_positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else require_positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else require_positive_int("vdim", vdim)
        self.dropout = require_probability("dropout", dropout)

    def _build_core(
        self, bias: bool, position: PositionalEncoding | None, window: int | None, dtype: torch.dtype | None
    ) -> None:
        """selfattn's layer that runs with selfattn's options; it validates position, window and num_kv_heads.

        It runs on this module's parameters (``torch.func.functional_call``), so its own are
        placeholders on "meta". It is kept out of the module tree: state_dict and .to() see torch's names only.
        """
        core = _CoreAttention(
            self.embed_dim,
            self.num_heads,
            self.dropout,
            bias=bias,
            key_size=self.kdim,
            value_size=self.vdim,
            position=position,
            num_kv_heads=self.num_kv_heads,
            window=window,
            device="meta",
            dtype=dtype,
        )
        object.__setattr__(self, "_core", core)
        self.position = position
        self.window = core.window

    def _make_parameters(self, bias: bool, add_bias_kv: bool, factory: dict[str, Any]) -> None:
        """torch's parameters, under torch's names: packed or separate input projections, biases, ``out_proj``."""
        embed_dim = self.embed_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self._split = (embed_dim, kv_dim, kv_dim)
        if self._packed:
            self.in_proj_weight = nn.Parameter(torch.empty(sum(self._split), embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(sum(self._split), **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None

    def _reset_parameters(self) -> None:
        """Torch's initialization, in torch's order (same seed, same weights)."""
        if self._packed:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None and self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    # nn.TransformerEncoderLayer's fast path calls this (it reads only num_heads).
    merge_masks = nn.MultiheadAttention.merge_masks

    def _projection_weights(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
        """``(W_q, W_k, W_v)`` and their biases, in torch's layout."""
        if self.in_proj_weight is not None:
            weights = tuple(torch.split(self.in_proj_weight, list(self._split)))
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases: tuple[torch.Tensor | None, ...] = (None, None, None)
        if self.in_proj_bias is not None:
            biases = tuple(torch.split(self.in_proj_bias, list(self._split)))
        return weights, biases

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        causal: bool = False,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention`` does.

        Args:
            query: ``(l, b, e)``, ``(b, l, e)`` with ``batch_first``, or ``(l, e)`` unbatched.
            key: ``(s, b, kdim)`` (same layout as ``query``).
            value: ``(s, b, vdim)``.
            key_padding_mask: ``(b, s)`` (``(s,)`` unbatched): bool, True = ignore the key, or
                float added to the scores.
            need_weights: also return the attention weights.
            attn_mask: ``(l, s)`` or ``(b * h, l, s)`` (``(h, l, s)`` unbatched): bool, True =
                not allowed, or float added to the scores.
            average_attn_weights: average the weights over the heads.
            is_causal: a hint that ``attn_mask`` is the causal mask (torch's rule: it needs
                ``attn_mask``; without ``key_padding_mask`` and ``need_weights`` the mask is
                replaced by the causal one; with selfattn's options the mask is always used).
                To ask for causal attention without building a mask, use ``causal``.
            causal: selfattn's causal attention: query ``i`` sees keys up to its own index,
                aligned to the last key (with a cache, the newest query sees every key).
            cache: a :class:`~selfattn.KVCache` for incremental decoding (batch-first ``(b, l, e)``
                inside: one cache per layer).
            positions: integer positions of the queries ``(l,)`` or ``(b, l)``, for ``position``.
            document_ids: ``(b, l)`` packed-document labels (self-attention).

        Returns:
            ``(output, weights)``: output like ``query`` with ``e`` features; weights ``(b, l, s)``
            averaged over heads or ``(b, h, l, s)``, unbatched without ``b``, or None when
            ``need_weights`` is False.

        Raises:
            ValueError: inputs or masks of the wrong rank, shape or dtype, ``is_causal`` without
                ``attn_mask``, selfattn options with ``add_bias_kv``/``add_zero_attn``.
        """
        need_weights = require_bool("need_weights", need_weights)
        if any(isinstance(t, torch.Tensor) and t.is_nested for t in (query, key, value)):
            return self._nested_self_attention(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal)
        batched = check_torch_inputs(self, query, key, value)
        if not batched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask and needs attn_mask "
                "(torch's rule); pass causal=True for causal attention without a mask"
            )
        selfattn_options = self._extras or cache is not None or positions is not None or document_ids is not None
        if selfattn_options or causal:
            out, weights = self._forward_with_options(
                query, key, value, key_padding_mask, need_weights, attn_mask, batched, causal, cache, positions,
                document_ids,
            )  # fmt: skip
        else:
            out, weights = self._forward_as_torch(
                query, key, value, key_padding_mask, need_weights, attn_mask, batched, is_causal
            )
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (b, l, s)
        if not batched:
            return out[0], None if weights is None else weights[0]
        # torch's (l, b, e) output is contiguous: callers .view() it
        return (out if self.batch_first else out.transpose(0, 1).contiguous()), weights

    def _forward_as_torch(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        batched: bool,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` without selfattn's options, on batch-first ``(b, l, e)`` inputs: torch's semantics."""
        batch, num_queries, num_keys = query.shape[0], query.shape[1], key.shape[1]
        mask, bias = torch_masks(self, attn_mask, key_padding_mask, batched, batch, num_queries, num_keys)
        if is_causal and key_padding_mask is None and not need_weights:
            # torch trusts the hint: causal (aligned top-left, as its kernel, over the appended keys too)
            keys_after = num_keys + (self.bias_k is not None) + self.add_zero_attn
            mask = torch.ones(num_queries, keys_after, dtype=torch.bool, device=query.device).tril()
            bias = None
        return self._attend(query, key, value, mask, bias, need_weights)

    def _forward_with_options(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        batched: bool,
        causal: bool,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` with selfattn's options, on batch-first ``(b, l, e)`` inputs: torch's masks, then the core."""
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(
                "causal, cache, positions and document_ids do not combine with add_bias_kv or add_zero_attn"
            )
        padding = None
        if cache is not None and isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dtype == torch.bool:
            # the cache remembers the padding of the new keys: the core takes it as it is
            padding, key_padding_mask = key_padding_mask, None
        elif cache is not None and key_padding_mask is not None:
            raise ValueError(f"with a cache, key_padding_mask must be bool, got {describe_tensor(key_padding_mask)}")
        batch, num_queries, num_keys = query.shape[0], query.shape[1], key.shape[1]
        total = num_keys + (0 if cache is None else cache.length)
        mask, bias = torch_masks(self, attn_mask, key_padding_mask, batched, batch, num_queries, total)
        return self._core_forward(
            query, key, value, mask, bias, padding, causal, need_weights, cache, positions, document_ids
        )

    def _nested_self_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> tuple[torch.Tensor, None]:
        """Self-attention within each sequence of a nested tensor, as ``nn.TransformerEncoder`` passes it.

        Shape:
            query ``(b, l_i, e)`` nested (``key`` and ``value`` the same tensor) -> ``(b, l_i, e)``
            nested: the sequences are padded to ``(b, l, e)``, attend with their padding masked,
            and are cut back to their lengths.
        """
        if key is not query or value is not query:
            raise ValueError("a nested tensor is taken for self-attention only: pass it as query, key and value")
        if key_padding_mask is not None or attn_mask is not None or is_causal or need_weights:
            raise ValueError(
                "with a nested tensor (each sequence at its own length) key_padding_mask, attn_mask and "
                f"is_causal must be unset and need_weights False, got key_padding_mask={_none_or_dims(key_padding_mask)}, "
                f"attn_mask={_none_or_dims(attn_mask)}, is_causal={is_causal}, need_weights={need_weights}"
            )
        if query.dim() != 3 or query.size(-1) != self.embed_dim:
            raise ValueError(f"a nested query must hold sequences (l_i, {self.embed_dim}), got {query.dim()}-D ones")
        lengths = [sequence.shape[0] for sequence in query.unbind()]
        padded = query.to_padded_tensor(0.0)  # (b, l, e)
        positions = torch.arange(padded.shape[1], device=padded.device)
        padding = positions >= torch.tensor(lengths, device=padded.device)[:, None]  # (b, l), True = padding
        layout = padded if self.batch_first else padded.transpose(0, 1)
        out = self.forward(layout, layout, layout, key_padding_mask=padding, need_weights=False)[0]
        out = out if self.batch_first else out.transpose(0, 1)
        rows = [row[:length] for row, length in zip(out, lengths, strict=True)]
        return torch.nested.as_nested_tensor(rows, layout=query.layout), None

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        need_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Torch's computation on batch-first inputs: project, add bias/zero keys, attend, project."""
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projection_weights()
        batch, num_queries, _ = query.shape
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)  # (b, l or s, e)
        extra_keys = []
        if self.bias_k is not None and self.bias_v is not None:
            extra_keys.append((self.bias_k.expand(batch, 1, -1), self.bias_v.expand(batch, 1, -1)))
        if self.add_zero_attn:
            zeros = k.new_zeros(batch, 1, self.embed_dim)
            extra_keys.append((zeros, zeros))
        for k_extra, v_extra in extra_keys:
            k, v = torch.cat((k, k_extra), dim=1), torch.cat((v, v_extra), dim=1)
            # the appended key is visible to every query (attend, add 0), unless the mask already covers it
            if mask is not None and mask.shape[-1] < k.shape[1]:
                mask = F.pad(mask, (0, 1), value=True)
            bias = None if bias is None else F.pad(bias, (0, 1), value=0.0)
        # (b, h, l or s, dh); each length given: a batch of 0 leaves view's -1 nothing to infer from
        q, k, v = (t.view(batch, t.shape[1], self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        result = attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, return_weights=need_weights)
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, num_queries, self.embed_dim))  # (b, l, e)
        return out, weights

    def _core_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        padding: torch.Tensor | None,
        causal: bool,
        need_weights: bool,
        cache: KVCache | None,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """selfattn's :class:`~selfattn.MultiHeadAttention` on batch-first inputs and this module's parameters."""
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projection_weights()
        params = {"W_q.weight": w_q, "W_k.weight": w_k, "W_v.weight": w_v, "W_o.weight": self.out_proj.weight}
        if b_q is not None and b_k is not None and b_v is not None:
            params |= {"W_q.bias": b_q, "W_k.bias": b_k, "W_v.bias": b_v, "W_o.bias": self.out_proj.bias}
        attn_mask = mask if bias is None else (bias if mask is None else bias.masked_fill(~mask, float("-inf")))
        if attn_mask is not None:
            batch, num_queries, total = query.shape[0], query.shape[1], attn_mask.shape[-1]
            attn_mask = attn_mask.expand(batch, self.num_heads, num_queries, total)
        core: _CoreAttention = self._core
        core.train(self.training)
        core.dropout = self.dropout  # torch's attribute may be changed after construction
        options = {
            "causal": causal,
            "return_weights": need_weights,
            "cache": cache,
            "positions": positions,
            "attn_mask": attn_mask,
            "key_padding_mask": padding,
            "document_ids": document_ids,
        }
        result = torch.func.functional_call(core, params, (query, key, value), options, strict=False)
        return result if isinstance(result, tuple) else (result, None)
