"""Multi-head attention with the chapter's ``valid_lens``, causal masks, positions and a cache.

Shape legend:
    b: batch, lq: queries, lk: keys, h: heads, hk: key/value heads, dh: head size
    (num_hiddens / h), d: num_hiddens, dq / dk / dv: feature sizes of queries / keys / values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import ArgumentTypeError, require_position, require_positive_int, require_probability
from selfattn.cache import KVCache
from selfattn.functional import attention, attention_weights, blockwise_attention, flex_score_attention
from selfattn.functional._attention import _fused_kernel, _repeat_kv
from selfattn.functional._flex import flex_applies
from selfattn.positional.base import PositionalEncoding, QueryKeyEncoding, ScoreEncoding

__all__ = ["MultiHeadAttention"]

# Ragged batches run one fused call per distinct valid length; past this many, one masked call.
_MAX_LENGTH_GROUPS = 8

# A pure sliding window runs one sequence at a time once a row's key and value bands would hold this
# many elements as a batched copy. Measured on one core (attention alone, batched / per row):
# b=64 l=256 w=8 d=64 0.25x (27K elements), b=16 l=512 w=16 0.9x (71K), b=8 l=1024 w=64 d=256 1.26x
# (910K), b=4 l=4096 w=128 d=512 1.9x, b=2 l=16384 w=512 2.1x.
_PER_ROW_BAND_ELEMENTS = 1 << 19


class _Keys(NamedTuple):
    """Everything known about the keys the queries of one call may see."""

    k: torch.Tensor  # (b, hk, lk, dh)
    v: torch.Tensor  # (b, hk, lk, dh)
    positions: torch.Tensor  # (lk,) or (b, lk)
    padding: torch.Tensor | None  # (b, lk) bool, True = padding
    documents: torch.Tensor | None  # (b, lk)
    first_index: int  # index of the first of them in the whole sequence
    total: int  # keys in the whole sequence, the queries being its last lq


def _is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _require_int_tensor(name: str, value: object, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    if (
        not isinstance(value, torch.Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
        or tuple(value.shape) not in shapes
    ):
        want = " or ".join(str(shape) for shape in shapes)
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{name} must be an integer tensor of shape {want}, got {got}")
    return value.long()


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """:func:`~selfattn.functional.attention` without weights: one tensor, ``(b, h, lq, dv)``."""
    out = attention(q, k, v, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out


def document_positions(
    document_ids: torch.Tensor, *, previous: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Positions that restart at 0 where ``document_ids`` ``(b, l)`` changes, ``(b, l)`` int64.

    Args:
        document_ids: ``(b, l)`` integer document labels.
        previous: document id and position ``(b,)`` of the token just before these (a cache's
            newest key): tokens that continue its document continue its positions.
    """
    index = torch.arange(document_ids.shape[-1], device=document_ids.device)  # (l,)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if previous is not None:
        starts[:, 0] = document_ids[:, 0] != previous[0]
    first = torch.where(starts, index, torch.full_like(index, -1)).cummax(dim=-1).values  # (b, l); -1: no start yet
    positions = index - first
    if previous is None:
        return positions
    return torch.where(first < 0, previous[1][:, None] + 1 + index, positions)


def cumulative_lengths_to_document_ids(
    cumulative_lengths: torch.Tensor | Sequence[torch.Tensor | Sequence[int]], batch: int, length: int
) -> torch.Tensor:
    """Document ids ``(b, l)`` from cumulative lengths (flash-attn's ``cu_seqlens``): document ``i`` gets id ``i``.

    Args:
        cumulative_lengths: ``(k + 1,)`` integers ``0 = c_0 < c_1 < ... < c_k = l`` shared by
            every row (document ``i`` holds tokens ``c_i .. c_{i+1} - 1``), or one such
            sequence per row (a list of ``b``, each with its own ``k``; or a ``(b, k + 1)`` tensor).
        batch: ``b``.
        length: the packed length ``l``.

    Raises:
        ValueError: not integers, fewer than 2 entries, not starting at 0, not strictly
            increasing, or not ending at ``length``; a list of the wrong length.
    """
    shared = isinstance(cumulative_lengths, torch.Tensor) and cumulative_lengths.dim() == 1
    if not shared and isinstance(cumulative_lengths, (list, tuple)):
        shared = all(isinstance(item, int) and not isinstance(item, bool) for item in cumulative_lengths)
    if shared:
        rows = [_check_cumulative_lengths("cumulative_lengths", cumulative_lengths, length)]
    else:
        if not isinstance(cumulative_lengths, (torch.Tensor, list, tuple)) or len(cumulative_lengths) != batch:
            got = (
                tuple(cumulative_lengths.shape) if isinstance(cumulative_lengths, torch.Tensor) else cumulative_lengths
            )
            raise ValueError(
                f"cumulative_lengths must be a 1-D integer tensor (k + 1,) shared by every row, or {batch} of them "
                f"(one per row), got {got!r}"
            )
        rows = [
            _check_cumulative_lengths(f"cumulative_lengths[{i}]", row, length)
            for i, row in enumerate(cumulative_lengths)
        ]
    tokens = torch.arange(length, device=rows[0].device)  # (l,)
    ids = torch.stack([torch.searchsorted(row, tokens, right=True) - 1 for row in rows])  # (1 or b, l)
    return ids.expand(batch, length)


def _check_cumulative_lengths(name: str, value: object, length: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be integers, got {value!r}") from None
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if value.dim() != 1 or value.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries (0 and the packed length), got shape {tuple(value.shape)}"
        )
    value = value.long()
    if _is_compiling():
        return value  # value checks would read the tensor back: eager mode only
    listed = value.tolist()
    if listed[0] != 0:
        raise ValueError(f"{name} must start at 0, got {listed}")
    if any(b <= a for a, b in itertools.pairwise(listed)):
        raise ValueError(f"{name} must be strictly increasing (no empty document), got {listed}")
    if listed[-1] != length:
        raise ValueError(f"{name} must end at the packed length {length}, got {listed}")
    return value


def _length_groups(lengths: list[int], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """``(length, rows)`` per distinct length, shortest first: a slice for neighbouring rows, else an index tensor."""
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for length in sorted(set(lengths)):
        rows = [row for row, value in enumerate(lengths) if value == length]
        if rows == list(range(rows[0], rows[-1] + 1)):
            groups.append((length, slice(rows[0], rows[-1] + 1)))
        else:
            groups.append((length, torch.tensor(rows, device=device)))
    return groups


def _pick_rows(x: torch.Tensor, take: slice | torch.Tensor) -> torch.Tensor:
    """Rows ``take`` of ``x``'s first dimension: a view for a slice, one ``index_select`` otherwise."""
    return x[take] if isinstance(take, slice) else x.index_select(0, take)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, named as in the chapter.

    The projections ``W_q, W_k, W_v, W_o`` are ``nn.Linear`` layers, so a ``state_dict``
    saved from the textbook's ``MultiHeadAttention`` loads as it is.

    Differences from the textbook, all deliberate:

    * a query whose valid length is 0 attends to nothing: its output row and weights are
      zeros (the textbook returns a uniform average over the padding);
    * keys at or past the longest valid length are never projected nor scored, and a batch
      whose sequences have few distinct valid lengths runs one fused call per length, each
      on its own keys only;
    * ``causal=True`` with fewer queries than keys aligns the mask to the last key;
    * with ``skip_padded_queries=True`` (opt-in), padded query rows are zeros, not computed.

    Args:
        num_hiddens: output size ``d``, split over the heads.
        num_heads: number of query heads ``h``; must divide ``num_hiddens``.
        dropout: dropout on the attention weights (training only).
        bias: whether the four projections have a bias.
        query_size: feature size of the queries (default ``num_hiddens``).
        key_size: feature size of the keys (default ``num_hiddens``).
        value_size: feature size of the values (default ``num_hiddens``).
        position: a query/key encoding (rotary) or a score encoding (ALiBi, T5, Shaw, Kerple,
            FIRE) applied inside attention. Encodings added to the input are applied by the caller.
        num_kv_heads: heads of the keys and values ``hk`` (grouped-query attention; 1 is
            multi-query attention); must divide ``num_heads``. Key/value head ``j`` serves
            query heads ``j * g .. j * g + g - 1`` (``g = h / hk``, as Llama's ``repeat_kv``),
            ``W_k`` and ``W_v`` have ``hk * dh`` outputs and a cache stores only ``hk`` heads.
            Default ``num_heads``.
        window: sliding-window attention: with ``causal=True`` query ``i`` sees keys
            ``i - window + 1 .. i``, otherwise keys with ``|i - j| < window`` (indices in the
            whole sequence, cache included). Long sequences cost O(l * window).
        device: where the parameters are created (``"meta"`` for deferred initialization,
            then ``to_empty()`` and :meth:`reset_parameters`).
        dtype: dtype of the parameters.
        block_size: queries per block when attention goes blockwise (score encodings, dropout);
            default :func:`~selfattn.functional.choose_block_size` from the sizes of each call.
        skip_padded_queries: self-attention over a padded batch with per-sequence ``valid_lens``
            ``(b,)``: rows ``i >= valid_lens[s]`` of sequence ``s`` are padding as queries too.
            Their output (and attention weights) are exactly zero, with no ``W_o`` bias, and
            the padded rows of the queries, keys and values are never read (a NaN there reaches
            no output and no gradient), so each valid row equals running its sequence alone at
            its own length. Ragged batches then project and attend only each sequence's valid
            rows; other paths (masks, windows, score encodings, compiled graphs) compute the
            padded rows from zeros and discard them. Default ``False``: the chapter's masked
            softmax, where a padded query attends over its sequence's valid keys. Needs
            ``valid_lens`` of shape ``(b,)``, as many queries as keys and no cache (else
            ``ValueError``); without ``valid_lens`` it changes nothing.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        position: PositionalEncoding | None = None,
        num_kv_heads: int | None = None,
        window: int | None = None,
        block_size: int | None = None,
        skip_padded_queries: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.num_heads = require_positive_int("num_heads", num_heads)
        if num_hiddens % num_heads:
            raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
        self.num_kv_heads = num_heads if num_kv_heads is None else require_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        self.window = None if window is None else require_positive_int("window", window)
        self.head_dim = num_hiddens // num_heads
        self.dropout = require_probability("dropout", dropout)
        sizes = {}
        for name, size in (("query_size", query_size), ("key_size", key_size), ("value_size", value_size)):
            sizes[name] = num_hiddens if size is None else require_positive_int(name, size)
        self.query_size, self.key_size, self.value_size = sizes["query_size"], sizes["key_size"], sizes["value_size"]
        if position is not None and not isinstance(position, (QueryKeyEncoding, ScoreEncoding)):
            raise ValueError(
                f"position must rotate queries/keys or bias the scores, got {type(position).__name__} "
                "(add input encodings to the input instead)"
            )
        self.position = position
        self.block_size = None if block_size is None else require_positive_int("block_size", block_size)
        if not isinstance(skip_padded_queries, bool):
            raise ValueError(f"skip_padded_queries must be True or False, got {skip_padded_queries!r}")
        self.skip_padded_queries = skip_padded_queries
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        kv_hiddens = self.num_kv_heads * self.head_dim
        self.W_q = nn.Linear(self.query_size, num_hiddens, bias=bias, **factory)
        self.W_k = nn.Linear(self.key_size, kv_hiddens, bias=bias, **factory)
        self.W_v = nn.Linear(self.value_size, kv_hiddens, bias=bias, **factory)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias, **factory)

    def reset_parameters(self) -> None:
        """Reset ``position`` (built before this module), then re-draw the projections as ``nn.Linear`` does.

        With the same seed this repeats a normal construction, so meta-device modules can be
        materialized with ``to_empty()`` and this method.
        """
        reset = getattr(self.position, "reset_parameters", None)
        if callable(reset):
            reset()
        for linear in (self.W_q, self.W_k, self.W_v, self.W_o):
            linear.reset_parameters()

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, position: PositionalEncoding | None = None
    ) -> MultiHeadAttention:
        """The same attention as ``module`` (an ``nn.MultiheadAttention``), with its weights copied.

        Projections (``in_proj`` or the separate ``q/k/v_proj`` of ``kdim``/``vdim``), the
        output projection, their biases and the dropout are copied, on ``module``'s device
        and dtype. Call the result with batch-first tensors ``(b, l, d)`` whatever
        ``module.batch_first`` was, and note that a bool ``attn_mask`` here means True =
        attend (``nn.MultiheadAttention``: True = masked out); ``key_padding_mask`` means
        the same in both.

        Raises:
            ValueError: for ``add_bias_kv`` or ``add_zero_attn``, which have no equivalent here.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(f"module must be an nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("module uses add_bias_kv or add_zero_attn, which MultiHeadAttention does not have")
        has_bias = module.in_proj_bias is not None
        if has_bias != (module.out_proj.bias is not None):
            raise ValueError("module has a bias on only some projections; MultiHeadAttention has all or none")
        weight = module.out_proj.weight
        mha = cls(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            bias=has_bias,
            key_size=module.kdim,
            value_size=module.vdim,
            position=position,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            if module.in_proj_weight is not None:
                weights = module.in_proj_weight.chunk(3)
            else:
                weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            for linear, w in zip((mha.W_q, mha.W_k, mha.W_v), weights, strict=True):
                linear.weight.copy_(w)
            mha.W_o.weight.copy_(module.out_proj.weight)
            if has_bias:
                for linear, b in zip((mha.W_q, mha.W_k, mha.W_v), module.in_proj_bias.chunk(3), strict=True):
                    linear.bias.copy_(b)
                mha.W_o.bias.copy_(module.out_proj.bias)
        return mha.train(module.training)

    def _split_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        b, length, _ = x.shape
        heads = self.num_heads if heads is None else heads
        return x.view(b, length, heads, self.head_dim).transpose(1, 2)  # (b, heads, l, dh)

    def _check_inputs(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, t, size in (
            ("queries", queries, self.query_size),
            ("keys", keys, self.key_size),
            ("values", values, self.value_size),
        ):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != size:
                raise ValueError(
                    f"{name} must have shape (batch, length, {size}), got {tuple(getattr(t, 'shape', ()))}"
                )
            if not t.is_floating_point():
                raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
            weight = self.W_q.weight
            mixed_ok = torch.is_autocast_enabled(t.device.type)  # autocast casts inside the projections
            if (t.dtype != weight.dtype and not mixed_ok) or t.device != weight.device:
                raise ValueError(
                    f"{name} must be {weight.dtype} on {weight.device} like this layer's weights, "
                    f"got {t.dtype} on {t.device} (convert the input or call .to() on the layer)"
                )
        if not queries.shape[0] == keys.shape[0] == values.shape[0]:
            raise ValueError(
                f"queries, keys and values must share the batch size, got {queries.shape[0]}, {keys.shape[0]}, {values.shape[0]}"
            )
        if keys.shape[1] != values.shape[1]:
            raise ValueError(f"keys and values must have the same length, got {keys.shape[1]} and {values.shape[1]}")

    @staticmethod
    def _check_valid_lens(valid_lens: torch.Tensor, batch: int, num_queries: int, max_keys: int) -> torch.Tensor:
        if not isinstance(valid_lens, torch.Tensor):
            try:
                valid_lens = torch.as_tensor(valid_lens)
            except (TypeError, ValueError, RuntimeError):
                raise ArgumentTypeError(
                    f"valid_lens must be a tensor (or list) of lengths, got {type(valid_lens).__name__} {valid_lens!r}"
                ) from None
        if valid_lens.shape not in ((batch,), (batch, num_queries)):
            raise ValueError(
                f"valid_lens must have shape ({batch},) or ({batch}, {num_queries}), got {tuple(valid_lens.shape)}"
            )
        if valid_lens.dtype == torch.bool or valid_lens.is_complex():
            raise ValueError(f"valid_lens must hold integer lengths, got dtype {valid_lens.dtype}")
        if _is_compiling():
            return valid_lens.long()  # value checks would read the tensor back: eager mode only
        if valid_lens.is_floating_point():
            if not torch.equal(valid_lens, valid_lens.round()):
                raise ValueError(f"valid_lens must hold whole numbers, got {valid_lens.tolist()}")
            valid_lens = valid_lens.long()
        if valid_lens.numel():
            low, high = int(valid_lens.min()), int(valid_lens.max())
            if low < 0 or high > max_keys:
                raise ValueError(
                    f"valid_lens must lie in [0, {max_keys}] (the number of keys), got {valid_lens.tolist()}"
                )
        return valid_lens

    def _check_masks(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        batch: int,
        num_queries: int,
        num_new_keys: int,
        total: int,
        cache: KVCache | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Validated ``(attn_mask (1 or b, 1 or h, lq, total), key_padding_mask (b, lk_new), document_ids)``."""
        if attn_mask is not None:
            shapes = ((num_queries, total), (batch, num_queries, total), (batch, self.num_heads, num_queries, total))
            if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) not in shapes:
                got_mask = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else repr(attn_mask)
                raise ValueError(f"attn_mask must have shape {' or '.join(map(str, shapes))}, got {got_mask}")
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise ValueError(f"attn_mask must be bool (True = attend) or floating point, got {attn_mask.dtype}")
            attn_mask = attn_mask[None, None] if attn_mask.dim() == 2 else attn_mask
            attn_mask = attn_mask[:, None] if attn_mask.dim() == 3 else attn_mask
        if key_padding_mask is not None and (
            not isinstance(key_padding_mask, torch.Tensor)
            or key_padding_mask.dtype != torch.bool
            or tuple(key_padding_mask.shape) != (batch, num_new_keys)
        ):
            got = (
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                if isinstance(key_padding_mask, torch.Tensor)
                else repr(key_padding_mask)
            )
            where = " (the new keys; the cache remembers earlier ones)" if cache is not None else ""
            raise ValueError(
                f"key_padding_mask must be bool (True = padding) of shape ({batch}, {num_new_keys}){where}, got {got}"
            )
        if document_ids is not None:
            if num_queries != num_new_keys:
                raise ValueError(
                    "document_ids needs self-attention over packed sequences: as many new keys as queries, "
                    f"got {num_queries} queries and {num_new_keys} keys"
                )
            document_ids = _require_int_tensor("document_ids", document_ids, ((batch, num_queries),))
        if cache is not None and cache.length and (document_ids is None) == cache.has_documents:
            if cache.has_documents:
                raise ValueError("the cache holds a packed sequence: give document_ids for the new tokens too")
            raise ValueError("the cache holds keys without document ids: reset() it before passing document_ids")
        return attn_mask, key_padding_mask, document_ids

    def _positions(
        self,
        batch: int,
        num_queries: int,
        num_new_keys: int,
        total: int,
        offset: int | None,
        positions: torch.Tensor | None,
        key_positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        cache: KVCache | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the queries ``(lq,)``/``(b, lq)`` and of the new keys ``(lk,)``/``(b, lk)``."""
        if offset is not None and (positions is not None or document_ids is not None):
            raise ValueError("give either offset or positions/document_ids, not both (offset is the shorthand)")
        if positions is None and document_ids is not None:
            # (b, l): each document starts at 0, or goes on from the cache's newest key
            positions = document_positions(document_ids, previous=None if cache is None else cache.last_documents)
        first = 0
        if positions is not None:
            q_positions = _require_int_tensor("positions", positions, ((num_queries,), (batch, num_queries))).to(device)
        else:
            if offset is None:
                offset = 0 if cache is None else cache.length
            offset = require_position("offset", offset, num_queries)
            q_positions = torch.arange(offset, offset + num_queries, device=device)  # (lq,)
            first = offset
        if key_positions is not None:
            shapes = ((num_new_keys,), (batch, num_new_keys))
            return q_positions, _require_int_tensor("key_positions", key_positions, shapes).to(device)
        if positions is None:
            # Queries are the last lq of all keys: new key j sits at offset + lq - lk_new + j.
            start = first + num_queries - num_new_keys if cache is not None else first + num_queries - total
            return q_positions, torch.arange(start, start + num_new_keys, device=device)
        if num_new_keys != num_queries:
            raise ValueError(
                f"key_positions are needed: positions give the {num_queries} queries' positions, "
                f"and there are {num_new_keys} keys"
            )
        return q_positions, q_positions

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid_lens: torch.Tensor | None = None,
        *,
        causal: bool = False,
        return_weights: bool = False,
        offset: int | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cumulative_lengths: torch.Tensor | Sequence[torch.Tensor | Sequence[int]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``queries`` to ``keys``/``values``.

        Every mask below combines with every other (a key is seen only if all allow it).
        Indices ``i``/``j`` count tokens in the whole sequence (cache included); positions are
        what the encodings see, and default to the indices shifted by ``offset``.

        Args:
            queries: ``(b, lq, dq)``.
            keys: ``(b, lk, dk)``.
            values: ``(b, lk, dv)``.
            valid_lens: ``(b,)`` or ``(b, lq)``; key ``j`` is visible iff ``j < valid_len``
                (with a cache, ``j`` counts every key stored, and lengths may reach
                ``cache.max_len``).
            causal: query ``i`` sees only keys up to its own index (lower-right aligned).
            return_weights: also return the ``(b, h, lq, lk)`` attention weights.
            offset: position of the first query (default 0, or ``cache.length``); the
                shorthand for ``positions = offset + arange(lq)``.
            cache: a :class:`~selfattn.KVCache` for incremental decoding.
            positions: integer positions of the queries, ``(lq,)`` or per sequence
                ``(b, lq)`` (left padding, packed documents); the new keys get the same ones
                in self-attention. Every encoding (rotary, ALiBi, T5, Shaw) uses them, and a
                cache stores them with the keys.
            key_positions: positions of the keys, ``(lk,)`` or ``(b, lk)``, when they are not
                the queries' (cross-attention).
            attn_mask: bool with **True = attend** (as ``scaled_dot_product_attention`` and
                :func:`selfattn.functional.attention`; the *opposite* of
                ``nn.MultiheadAttention``'s bool mask), or float, added to the scaled scores
                (``-inf`` masks). Shape ``(lq, lk)``, ``(b, lq, lk)`` or ``(b, h, lq, lk)``,
                ``lk`` counting every key (cache included).
            key_padding_mask: bool ``(b, lk)``, **True = padding** (as in torch); with a
                cache, it covers the new keys and the cache remembers it.
            document_ids: ``(b, l)`` integers labelling packed documents: a token sees only
                tokens of its own document, and positions restart at 0 at each document
                (unless ``positions`` are given). Self-attention. A cache stores them with the
                keys: pass the new tokens' ids on every later call; a token whose id is that
                of the previous token continues its document (and its positions), another
                starts a new one at position 0.
            cumulative_lengths: the packed documents as cumulative lengths instead (flash-attn's
                ``cu_seqlens``): ``(k + 1,)`` integers ``0 = c_0 < ... < c_k = l`` shared by
                every row, or a list of ``b`` of them (one per row); document ``i`` is tokens
                ``c_i .. c_{i+1} - 1`` and gets document id ``i``. With a cache, only while it is
                empty (later calls give ``document_ids``).

        Returns:
            ``(b, lq, d)``, or ``(output, weights)``.
        """
        self._check_inputs(queries, keys, values)
        if cache is not None and not isinstance(cache, KVCache):
            raise ArgumentTypeError(f"cache must be a KVCache, got {type(cache).__name__} {cache!r}")
        batch, num_queries, num_new_keys = queries.shape[0], queries.shape[1], keys.shape[1]
        if cache is not None and cache.window is not None and (self.window is None or cache.window < self.window):
            raise ValueError(
                f"cache keeps only a window of {cache.window} keys, and this layer has window={self.window}"
            )
        total = (0 if cache is None else cache.length) + num_new_keys
        if cumulative_lengths is not None:
            if document_ids is not None:
                raise ValueError("give document_ids or cumulative_lengths, not both")
            if num_queries != num_new_keys or (cache is not None and cache.length):
                raise ValueError(
                    "cumulative_lengths describe whole packed sequences: self-attention, and no keys in the cache "
                    "(give document_ids for the tokens that follow)"
                )
            document_ids = cumulative_lengths_to_document_ids(cumulative_lengths, batch, num_queries).to(queries.device)
        attn_mask, key_padding_mask, document_ids = self._check_masks(
            attn_mask, key_padding_mask, document_ids, batch, num_queries, num_new_keys, total, cache
        )
        device = queries.device
        q_positions, k_positions = self._positions(
            batch, num_queries, num_new_keys, total, offset, positions, key_positions, document_ids, cache, device
        )
        key_documents = document_ids
        valid_rows = None  # (b, lq) bool: the rows that are not padding, with skip_padded_queries
        if valid_lens is not None:
            max_keys = total if cache is None or cache.max_len is None else cache.max_len
            valid_lens = self._check_valid_lens(valid_lens, batch, num_queries, max_keys).to(device)
            if self.skip_padded_queries:
                self._check_skip_padded_queries(valid_lens, num_queries, num_new_keys, cache)
                if attn_mask is None and key_padding_mask is None and document_ids is None:
                    lengths = self._ragged_lengths(num_queries, total, valid_lens, return_weights)
                    if lengths is not None:
                        return self._ragged_valid_rows(queries, keys, values, q_positions, k_positions, lengths, causal)
                valid_rows = torch.arange(num_queries, device=device) < valid_lens[:, None]  # (b, lq)
                queries, keys, values = self._zero_padding(valid_rows, queries, keys, values)
            if cache is None and not _is_compiling():
                # Keys at or past the longest valid length are invisible to every query: skip them.
                kept = max(int(valid_lens.max()), 1) if valid_lens.numel() else num_new_keys
                if kept < num_new_keys:
                    self_attention = values is keys  # kept as one tensor: the ragged path reads it once
                    keys, num_new_keys = keys[:, :kept], kept
                    values = keys if self_attention else values[:, :kept]
                    k_positions = k_positions[..., :kept]
                    if key_padding_mask is not None:
                        key_padding_mask = key_padding_mask[:, :kept]
                    if attn_mask is not None:
                        attn_mask = attn_mask[..., :kept]
                    if key_documents is not None:
                        key_documents = key_documents[:, :kept]

        q = self._split_heads(self.W_q(queries), self.num_heads)  # (b, h, lq, dh)
        if isinstance(self.position, QueryKeyEncoding):
            q = self.position(q, self._per_head(q_positions))
        lengths = None
        if cache is None and attn_mask is None and key_padding_mask is None and document_ids is None:
            lengths = self._ragged_lengths(num_queries, total, valid_lens, return_weights)
        if lengths is not None:
            merged = self._ragged(q, keys, values, k_positions, lengths, causal)  # (b, lq, d)
            projected: torch.Tensor = self.W_o(merged)
            return projected  # (b, lq, d)
        k = self._split_heads(self.W_k(keys), self.num_kv_heads)  # (b, hk, lk_new, dh)
        v = self._split_heads(self.W_v(values), self.num_kv_heads)  # (b, hk, lk_new, dh)
        if isinstance(self.position, QueryKeyEncoding):
            cached = None if cache is None or cache.window is not None else cache.positions
            if cache is not None and cached is not None:
                # e.g. dynamic rotary re-rotates the cached keys to this call's frequencies
                new_positions = k_positions
                if cached.dim() != new_positions.dim():  # one of them per sequence: both per sequence
                    cached, new_positions = cached.expand(batch, -1), new_positions.expand(batch, -1)
                self.position.update_cached_keys(cache, torch.cat((cached, new_positions), dim=-1))
            k = self.position.encode_keys(k, self._per_head(k_positions))
        seen = self._gather_keys(k, v, k_positions, key_padding_mask, key_documents, cache, total)

        out, weights = self._attend(q, q_positions, seen, valid_lens, attn_mask, document_ids, causal, return_weights)
        out = out.transpose(1, 2).reshape(batch, num_queries, self.num_hiddens)  # (b, lq, d)
        out = self.W_o(out)
        assert isinstance(out, torch.Tensor)
        if valid_rows is not None:
            out = out.masked_fill(~valid_rows[:, :, None], 0.0)  # padded query rows: zero, no W_o bias
        if cache is not None:
            cache.commit()  # the new keys count as stored only once attention has succeeded
        if not return_weights:
            return out
        assert weights is not None
        if valid_rows is not None:
            weights = weights.masked_fill(~valid_rows[:, None, :, None], 0.0)  # (b, h, lq, lk)
        # Keys never scored (skipped padding, or dropped by a windowed cache) weigh 0: (b, h, lq, total).
        weights = F.pad(weights, (seen.first_index, total - seen.first_index - weights.shape[-1]))
        return out, weights

    @staticmethod
    def _per_head(positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None, :] if positions.dim() == 2 else positions  # (b, 1, l) broadcasts over heads

    @staticmethod
    def _gather_keys(
        k: torch.Tensor,
        v: torch.Tensor,
        k_positions: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        cache: KVCache | None,
        total: int,
    ) -> _Keys:
        if cache is None:
            return _Keys(k, v, k_positions, key_padding_mask, document_ids, 0, total)
        stored = cache.update(
            k, v, positions=k_positions, padding=key_padding_mask, documents=document_ids, commit=False
        )
        return _Keys(
            stored.keys, stored.values, stored.positions, stored.padding, stored.documents, stored.first_index, total
        )

    def _visibility(
        self,
        num_queries: int,
        keys: _Keys,
        valid_lens: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        causal: bool,
    ) -> tuple[torch.Tensor | None, bool]:
        """Bool mask ``(1 or b, 1 or h, lq, lk)`` (True = attend) and whether ``causal`` is left to the kernel."""
        device = keys.k.device
        num_keys = keys.k.shape[-2]
        q_index = torch.arange(keys.total - num_queries, keys.total, device=device)[:, None]  # (lq, 1)
        k_index = torch.arange(keys.first_index, keys.first_index + num_keys, device=device)  # (lk,)
        parts: list[torch.Tensor] = []
        if valid_lens is not None:
            lens = valid_lens[:, None, None, None] if valid_lens.dim() == 1 else valid_lens[:, None, :, None]
            parts.append(k_index < lens)  # (b, 1, 1 or lq, lk)
        if keys.padding is not None:
            parts.append(~keys.padding[:, None, None, :])  # (b, 1, 1, lk)
        if document_ids is not None and keys.documents is not None:
            parts.append((document_ids[:, :, None] == keys.documents[:, None, :])[:, None])  # (b, 1, lq, lk)
        if attn_mask is not None:
            slice_ = attn_mask[..., keys.first_index : keys.first_index + num_keys]
            parts.append(slice_ if slice_.dtype == torch.bool else slice_ != float("-inf"))
        aligned = keys.first_index == 0 and num_keys == keys.total
        if self.window is not None:
            distance = q_index - k_index  # (lq, lk): i - j; only built when used (int64, 8 GiB at n=32768)
            parts.append((distance >= 0) & (distance < self.window) if causal else distance.abs() < self.window)
        elif causal and not aligned:
            parts.append(q_index >= k_index)  # (lq, lk)
        leave_causal = causal and aligned and self.window is None
        if not parts:
            return None, leave_causal
        mask = parts[0]
        for part in parts[1:]:
            mask = mask & part
        return mask, leave_causal

    def _bias(
        self, q: torch.Tensor, q_positions: torch.Tensor, keys: _Keys, attn_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        bias = None
        if isinstance(self.position, ScoreEncoding):
            bias = self.position(q, q_positions=q_positions, k_positions=keys.positions)
        if attn_mask is not None and attn_mask.is_floating_point():
            extra = attn_mask[..., keys.first_index : keys.first_index + keys.k.shape[-2]]
            extra = extra.masked_fill(extra == float("-inf"), 0.0)  # -inf went into the bool mask
            bias = extra.to(q.dtype) if bias is None else bias + extra.to(bias.dtype)
        return bias

    def _attend(
        self,
        q: torch.Tensor,
        q_positions: torch.Tensor,
        keys: _Keys,
        valid_lens: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        causal: bool,
        return_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(b, h, lq, dh)`` output and, if asked, ``(b, h, lq, lk)`` weights."""
        dropout_p = self.dropout if self.training else 0.0
        explicit = return_weights or (isinstance(self.position, ScoreEncoding) and self.position.uses_weights)
        if not explicit and attn_mask is None and keys.first_index == 0 and keys.k.shape[-2] == keys.total:
            per_query_lens = valid_lens is not None and valid_lens.dim() == 2
            if not per_query_lens and self._banded_applies(q, keys):
                only_band = valid_lens is None and keys.padding is None and document_ids is None
                if only_band and dropout_p == 0 and not isinstance(self.position, ScoreEncoding):
                    return self._band_only(q, keys, causal), None
                return self._banded(q, q_positions, keys, valid_lens, document_ids, causal, dropout_p), None

        mask, leave_causal = self._visibility(q.shape[-2], keys, valid_lens, attn_mask, document_ids, causal)
        score = self.position if isinstance(self.position, ScoreEncoding) else None
        extra_bias = attn_mask is not None and attn_mask.is_floating_point()
        # Compiled graphs keep the dense path: the blockwise loop is eager Python with a custom autograd Function.
        blockwise = not return_weights and not extra_bias and not _is_compiling()
        if blockwise and (score is not None or dropout_p > 0):
            k, v = _repeat_kv(q, keys.k), _repeat_kv(q, keys.v)  # (b, h, lk, dh)
            flex = score is not None and score.compiles_in_flex and not score.uses_weights and dropout_p == 0
            if flex and flex_applies(q, v):
                out = flex_score_attention(
                    q, k, v, term=score, q_positions=q_positions, k_positions=keys.positions, mask=mask,
                    causal=leave_causal,
                )  # fmt: skip
            else:
                # Score terms and dropout go blockwise: O(block) memory, fused kernel per block where it can.
                out = blockwise_attention(
                    q, k, v, term=score, q_positions=q_positions, k_positions=keys.positions, mask=mask,
                    causal=leave_causal, dropout_p=dropout_p, block_size=self.block_size,
                )  # fmt: skip
            return out, None
        bias = self._bias(q, q_positions, keys, attn_mask)
        if isinstance(self.position, ScoreEncoding) and self.position.uses_weights:
            weights = attention_weights(q, keys.k, mask=mask, bias=bias, causal=leave_causal)
            dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
            out = torch.matmul(dropped, _repeat_kv(q, keys.v)) + self.position.value_term(
                dropped, q_positions=q_positions, k_positions=keys.positions
            )
            return out, weights
        if return_weights:
            out, weights = attention(
                q, keys.k, keys.v, mask=mask, bias=bias, causal=leave_causal, dropout_p=dropout_p, return_weights=True
            )
            return out, weights
        return _fused(q, keys.k, keys.v, mask=mask, bias=bias, causal=leave_causal, dropout_p=dropout_p), None

    # ------------------------------------------------------------------ ragged batches

    def _ragged_lengths(
        self, num_queries: int, total: int, valid_lens: torch.Tensor | None, return_weights: bool
    ) -> list[int] | None:
        """Per-sequence valid lengths when one fused call per distinct length beats one masked call."""
        if (
            valid_lens is None
            or valid_lens.dim() != 1
            or return_weights
            or _is_compiling()
            or self.window is not None
            or isinstance(self.position, ScoreEncoding)
            or num_queries != total
        ):
            return None
        lengths = [int(length) for length in valid_lens.tolist()]
        if len(set(lengths)) > _MAX_LENGTH_GROUPS:
            return None
        return lengths

    def _ragged(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_positions: torch.Tensor,
        lengths: list[int],
        causal: bool,
    ) -> torch.Tensor:
        """Each group of equal valid length projects and attends over its own keys only: no mask, no waste.

        Query rows past a sequence's valid length are kept, and see its valid keys, as on the
        masked path. A group whose sequences are neighbours in the batch is read as a view; the
        others are gathered with one ``index_select`` each. Outputs are written straight into
        one buffer (or, for one group in one call, returned as they are), so nothing is
        concatenated or permuted afterwards.

        Returns ``(b, lq, h * dh)``: the heads merged, ready for ``W_o``.
        """
        dropout_p = self.dropout if self.training else 0.0
        batch, heads, num_queries, head_dim = q.shape
        merged = q.new_empty(batch, num_queries, heads * head_dim)  # (b, lq, d)
        for length, take in _length_groups(lengths, q.device):

            def put(start: int, out_g: torch.Tensor, take: slice | torch.Tensor = take) -> None:
                # (b_g, h, l_g, dh) -> (b_g, l_g, d): a view of the kernel's (b_g, l_g, h, dh) output
                merged[take, start : start + out_g.shape[-2]] = out_g.transpose(1, 2).flatten(2)

            if length == 0:
                merged[take] = 0.0  # no key to see: a zero row, as on the masked path
                continue
            q_g = _pick_rows(q, take)  # (b_g, h, lq, dh)
            # (b_g, length, dk): one copy of the valid rows, read by both projections in self-attention
            key_rows = _pick_rows(keys[:, :length], take).contiguous()
            value_rows = key_rows if values is keys else _pick_rows(values[:, :length], take)
            k_g = self._split_heads(self.W_k(key_rows), self.num_kv_heads)  # (b_g, hk, length, dh)
            v_g = self._split_heads(self.W_v(value_rows), self.num_kv_heads)
            if isinstance(self.position, QueryKeyEncoding):
                positions = k_positions[..., :length]
                positions = _pick_rows(positions, take) if positions.dim() == 2 else positions
                k_g = self.position.encode_keys(k_g, self._per_head(positions))
            if causal and length < num_queries:
                # Queries before the valid length are a square causal problem; later ones see all `length` keys.
                put(0, _fused(q_g[..., :length, :], k_g, v_g, causal=True, dropout_p=dropout_p))
                put(length, _fused(q_g[..., length:, :], k_g, v_g, dropout_p=dropout_p))
            else:
                out_g = _fused(q_g, k_g, v_g, causal=causal, dropout_p=dropout_p)  # (b_g, h, lq, dh)
                if isinstance(take, slice) and take == slice(0, batch):
                    return out_g.transpose(1, 2).flatten(2)  # one group, one call: its output needs no buffer
                put(0, out_g)
        return merged

    # ------------------------------------------------------------------ skipped padded queries

    @staticmethod
    def _check_skip_padded_queries(
        valid_lens: torch.Tensor, num_queries: int, num_new_keys: int, cache: KVCache | None
    ) -> None:
        if valid_lens.dim() != 1:
            raise ValueError(
                "skip_padded_queries needs valid_lens of shape (batch,): per-query valid_lens "
                f"{tuple(valid_lens.shape)} do not say which query rows are padding"
            )
        if cache is not None:
            raise ValueError("skip_padded_queries does not apply with a cache (decoding); pass cache=None")
        if num_queries != num_new_keys:
            raise ValueError(
                "skip_padded_queries needs self-attention over a padded batch (as many queries as keys), "
                f"got {num_queries} queries and {num_new_keys} keys"
            )

    @staticmethod
    def _zero_padding(
        valid_rows: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs with their padded rows zeroed (``valid_rows`` ``(b, l)``), each shared tensor zeroed once."""
        padded = ~valid_rows[:, :, None]  # (b, l, 1)
        zeroed: dict[int, torch.Tensor] = {}
        for x in (queries, keys, values):
            if id(x) not in zeroed:
                zeroed[id(x)] = x.masked_fill(padded, 0.0)  # masked_fill, not a product: a NaN there is dropped
        return zeroed[id(queries)], zeroed[id(keys)], zeroed[id(values)]

    def _ragged_valid_rows(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        q_positions: torch.Tensor,
        k_positions: torch.Tensor,
        lengths: list[int],
        causal: bool,
    ) -> torch.Tensor:
        """``skip_padded_queries`` on a ragged batch: each group of equal valid length runs on its valid rows only.

        ``W_q, W_k, W_v``, attention and ``W_o`` see rows ``:length`` of the group's sequences
        (a view for neighbours in the batch, one ``index_select`` otherwise); the rest of the
        output stays zero. Packing every valid token for one projection instead measured no
        faster (b=4, n=2048, d=512, one core, a projection and its write-back: 24.0 vs 23.6 ms
        for lengths [n, n/4, n/4, n/4], 28.3 vs 27.6 ms for all n/2).
        Returns ``(b, l, d)``.
        """
        dropout_p = self.dropout if self.training else 0.0
        batch, num_queries, _ = queries.shape
        out = queries.new_zeros(batch, num_queries, self.num_hiddens)  # (b, l, d); padded rows stay zero
        for length, take in _length_groups(lengths, queries.device):
            if length == 0:
                continue  # no valid row: the output stays zero
            query_rows = _pick_rows(queries[:, :length], take)  # (b_g, length, dq)
            key_rows = query_rows if keys is queries else _pick_rows(keys[:, :length], take)
            value_rows = key_rows if values is keys else _pick_rows(values[:, :length], take)
            q_g = self._split_heads(self.W_q(query_rows), self.num_heads)  # (b_g, h, length, dh)
            k_g = self._split_heads(self.W_k(key_rows), self.num_kv_heads)  # (b_g, hk, length, dh)
            v_g = self._split_heads(self.W_v(value_rows), self.num_kv_heads)
            if isinstance(self.position, QueryKeyEncoding):
                q_pos, k_pos = (p[..., :length] for p in (q_positions, k_positions))
                q_pos, k_pos = (
                    _pick_rows(p, take) if p.dim() == 2 else p for p in (q_pos, k_pos)
                )  # (length,) or (b_g, length)
                q_g = self.position(q_g, self._per_head(q_pos))
                k_g = self.position.encode_keys(k_g, self._per_head(k_pos))
            out_g = _fused(q_g, k_g, v_g, causal=causal, dropout_p=dropout_p)  # (b_g, h, length, dh)
            projected: torch.Tensor = self.W_o(out_g.transpose(1, 2).flatten(2))  # (b_g, length, d)
            if isinstance(take, slice) and take == slice(0, batch) and length == num_queries:
                return projected  # nothing padded: the output needs no buffer
            out[take, :length] = projected
        return out

    # ------------------------------------------------------------------ sliding window

    def _block_size(self) -> int:
        assert self.window is not None
        # Smaller blocks waste less of each key band, larger ones run the kernel better. Measured
        # on one CPU core, attention alone vs full causal: n=16384 w=512, blocks of 64 12.8x, 128
        # 9.1x, 512 3.9x; n=1024 w=64, 16 2.1x, 64 2.6x, 128 1.2x; n=4096 w=128, 32 11x, 64 11x.
        # The band-only path (one shared mask), n=16384 w=512: 32 790 ms, 64 820, 128 900, 256 975.
        return max(16, min(64, 8 * self.window))

    def _banded_applies(self, q: torch.Tensor, keys: _Keys) -> bool:
        if self.window is None or q.shape[-2] != keys.k.shape[-2]:
            return False
        span = self._block_size() + 2 * (self.window - 1)
        return q.shape[-2] > 2 * span

    def _band_only(self, q: torch.Tensor, keys: _Keys, causal: bool) -> torch.Tensor:
        """Sliding window and nothing else, in O(l * window): every inner block of queries sees one band pattern.

        The queries split into a leading part (whose window reaches before key 0), inner blocks
        and a trailing part (whose window reaches past the last key). The inner blocks read their
        keys as overlapping views of the keys and share one ``(block, span)`` float mask, which
        the fused kernel broadcasts without a copy; the two edges are small dense problems.
        Returns ``(b, h, l, dh)``.
        """
        window = self.window
        assert window is not None
        batch, heads, length, head_dim = q.shape
        block, before = self._block_size(), window - 1
        after = 0 if causal else before
        span = block + before + after
        first = math.ceil(before / block)  # blocks before it see keys before index 0
        last = (length - after) // block  # blocks from it on see keys past the end
        start, stop = first * block, last * block  # the inner queries
        num_blocks = last - first  # >= 1: _banded_applies wants length > 2 * span
        if batch > 1 and 2 * num_blocks * span * keys.k.shape[1] * head_dim >= _PER_ROW_BAND_ELEMENTS:
            # Overlapping views of the keys cannot span sequences (the batch stride is no multiple of
            # a block's), so a batch copies every band: long rows go one at a time, as views.
            rows = [
                self._band_only(q[r : r + 1], keys._replace(k=keys.k[r : r + 1], v=keys.v[r : r + 1]), causal)
                for r in range(batch)
            ]
            return torch.cat([row.transpose(1, 2) for row in rows]).transpose(1, 2)  # (b, h, l, dh)

        def band(q_start: int, q_stop: int, k_start: int, k_stop: int) -> torch.Tensor:
            """Bool ``(lq, lk)``, True where query ``i`` may see key ``j`` (indices in the whole sequence)."""
            q_index = torch.arange(q_start, q_stop, device=q.device)[:, None]
            k_index = torch.arange(k_start, k_stop, device=q.device)
            distance = q_index - k_index  # (lq, lk): i - j
            return (distance >= 0) & (distance < window) if causal else distance.abs() < window

        def edge(q_start: int, q_stop: int) -> torch.Tensor:
            k_start, k_stop = max(0, q_start - before), min(length, q_stop + after)
            k, v = keys.k[..., k_start:k_stop, :], keys.v[..., k_start:k_stop, :]
            out = _fused(q[..., q_start:q_stop, :], k, v, mask=band(q_start, q_stop, k_start, k_stop))
            return out.transpose(1, 2)  # (b, lq, h, dh)

        def kv_bands(x: torch.Tensor) -> torch.Tensor:
            banded = x[..., start - before : stop + after, :].unfold(-2, span, block)  # (b, hk, blocks, dh, span)
            # (b * blocks, hk, span, dh): a view of x for one sequence, a copy for more
            return banded.permute(0, 2, 1, 4, 3).reshape(batch * num_blocks, x.shape[1], span, head_dim)

        q_b = q[..., start:stop, :].reshape(batch, heads, num_blocks, block, head_dim).transpose(1, 2)
        q_b = q_b.reshape(batch * num_blocks, heads, block, head_dim)  # (b * blocks, h, block, dh)
        pattern = q.new_zeros(block, span).masked_fill_(~band(before, before + block, 0, span), float("-inf"))
        inner = _fused_kernel(
            q_b, kv_bands(keys.k), kv_bands(keys.v), pattern, dropout_p=0.0, is_causal=False,
            scale=1 / math.sqrt(head_dim),
        )  # fmt: skip
        inner = inner.transpose(1, 2).reshape(batch, num_blocks * block, heads, -1)  # (b, stop - start, h, dh)
        out = torch.cat((edge(0, start), inner, edge(stop, length)), dim=1)  # (b, l, h, dh)
        return out.transpose(1, 2)

    def _banded(
        self,
        q: torch.Tensor,
        q_positions: torch.Tensor,
        keys: _Keys,
        valid_lens: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        """Sliding-window attention in O(l * window): each block of queries sees only its band of keys."""
        assert self.window is not None
        batch, heads, length, head_dim = q.shape
        block, before = self._block_size(), self.window - 1
        after = 0 if causal else self.window - 1
        num_blocks = math.ceil(length / block)
        span = block + before + after
        tail = num_blocks * block - length
        device = q.device

        def bands(x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            """``(..., l)`` per key -> ``(..., blocks, span)``: the keys each block of queries may see."""
            return F.pad(x, (before, tail + after), value=fill).unfold(-1, span, block)

        def kv_bands(x: torch.Tensor) -> torch.Tensor:
            padded = F.pad(x, (0, 0, before, tail + after))  # (b, hk, before + l + tail + after, dh)
            banded = padded.unfold(-2, span, block)  # (b, hk, blocks, dh, span)
            return banded.permute(0, 2, 1, 4, 3).reshape(batch * num_blocks, x.shape[1], span, x.shape[-1])

        def q_blocks(x: torch.Tensor, fill: int = 0) -> torch.Tensor:
            padded = F.pad(x, (0, tail), value=fill)
            return padded.view(*padded.shape[:-1], num_blocks, block)  # (..., blocks, block)

        k_b, v_b = kv_bands(keys.k), kv_bands(keys.v)  # (b * blocks, hk, span, dh)
        q_b = F.pad(q, (0, 0, 0, tail)).view(batch, heads, num_blocks, block, head_dim)
        q_b = q_b.transpose(1, 2).reshape(batch * num_blocks, heads, block, head_dim)  # (b * blocks, h, block, dh)

        index = torch.arange(length, device=device)
        q_index = q_blocks(index)  # (blocks, block)
        k_index = bands(index, -1)  # (blocks, span); -1 marks padding
        distance = q_index[:, :, None] - k_index[:, None, :]  # (blocks, block, span)
        band = (distance >= 0) & (distance < self.window) if causal else distance.abs() < self.window
        mask = (band & (k_index >= 0)[:, None, :])[None]  # (1, blocks, block, span)
        if valid_lens is not None:
            mask = mask & bands(index < valid_lens[:, None], False)[:, :, None, :]  # (b, blocks, block, span)
        if keys.padding is not None:
            mask = mask & bands(~keys.padding, False)[:, :, None, :]  # (b, blocks, block, span)
        if document_ids is not None:
            same = q_blocks(document_ids)[..., :, None] == bands(document_ids)[..., None, :]
            mask = mask & same  # (b, blocks, block, span)
        mask = mask.expand(batch, -1, -1, -1).reshape(batch * num_blocks, 1, block, span)

        bias = None
        if isinstance(self.position, ScoreEncoding):
            q_pos = q_blocks(q_positions.expand(batch, length)).reshape(batch * num_blocks, block)
            k_pos = bands(keys.positions.expand(batch, length)).reshape(batch * num_blocks, span)
            bias = self.position(q_b, q_positions=q_pos, k_positions=k_pos)  # (b * blocks, h, block, span)
        out = _fused(q_b, k_b, v_b, mask=mask, bias=bias, dropout_p=dropout_p)  # (b * blocks, h, block, dh)
        out = out.view(batch, num_blocks, heads, block, -1).transpose(1, 2)  # (b, h, blocks, block, dh)
        return out.reshape(batch, heads, num_blocks * block, -1)[:, :, :length]

    def extra_repr(self) -> str:
        extra = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        extra += "" if self.window is None else f", window={self.window}"
        extra += ", skip_padded_queries=True" if self.skip_padded_queries else ""
        return f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, dropout={self.dropout}{extra}"
