"""The checks of a :class:`~selfattn.MultiHeadAttention` call: shapes, lengths, masks, positions.

Each raises ``ValueError`` naming the argument and the value it got.

Shape legend: b batch, lq queries, lk keys, h heads, d* feature sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

import selfattn._validation as _validation
import selfattn.masks as masks
from selfattn._validation import ArgumentTypeError, require_bool, require_position
from selfattn.cache import KVCache
from selfattn.core.documents import cumulative_lengths_to_document_ids, document_positions

__all__ = [
    "Request",
    "check_request",
    "check_inputs",
    "check_masks",
    "check_skip_padded_queries",
    "check_valid_lens",
    "lift_position_axes",
    "require_int_tensor",
    "resolve_positions",
    "split_position_axes",
    "zero_padding",
]


def require_int_tensor(name: str, value: object, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
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


def check_inputs(module: Any, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    weight = module.W_q.weight
    query_size, key_size, value_size = module.query_size, module.key_size, module.value_size
    _check_input("queries", queries, query_size, weight)
    # Self-attention passes one tensor three times: checked once (each check is a decoding step's time).
    if keys is not queries or key_size != query_size:
        _check_input("keys", keys, key_size, weight)
    if not ((values is queries and value_size == query_size) or (values is keys and value_size == key_size)):
        _check_input("values", values, value_size, weight)
    if not queries.shape[0] == keys.shape[0] == values.shape[0]:
        raise ValueError(
            f"queries, keys and values must share the batch size, got {queries.shape[0]}, {keys.shape[0]}, {values.shape[0]}"
        )
    if keys.shape[1] != values.shape[1]:
        raise ValueError(f"keys and values must have the same length, got {keys.shape[1]} and {values.shape[1]}")


def _check_input(name: str, t: torch.Tensor, size: int, weight: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != size:
        raise ValueError(f"{name} must have shape (batch, length, {size}), got {tuple(getattr(t, 'shape', ()))}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    # autocast casts inside the projections (asked only when the dtypes differ: a decoding step's time)
    if t.device != weight.device or (t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type)):
        raise ValueError(
            f"{name} must be {weight.dtype} on {weight.device} like this layer's weights, "
            f"got {t.dtype} on {t.device} (convert the input or call .to() on the layer)"
        )


def check_valid_lens(valid_lens: torch.Tensor, batch: int, num_queries: int, max_keys: int) -> torch.Tensor:
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
    if _validation.is_compiling():
        return valid_lens.long()  # value checks would read the tensor back: eager mode only
    if valid_lens.is_floating_point():
        if not torch.equal(valid_lens, valid_lens.round()):
            raise ValueError(f"valid_lens must hold whole numbers, got {valid_lens.tolist()}")
        valid_lens = valid_lens.long()
    if valid_lens.numel():
        low, high = int(valid_lens.min()), int(valid_lens.max())
        if low < 0 or high > max_keys:
            raise ValueError(f"valid_lens must lie in [0, {max_keys}] (the number of keys), got {valid_lens.tolist()}")
    return valid_lens


def check_masks(
    module: Any,
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
        shapes = ((num_queries, total), (batch, num_queries, total), (batch, module.num_heads, num_queries, total))
        if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) not in shapes:
            got_mask = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else repr(attn_mask)
            raise ValueError(f"attn_mask must have shape {' or '.join(map(str, shapes))}, got {got_mask}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be bool (True = attend) or floating point, got {attn_mask.dtype}")
        if attn_mask.is_floating_point() and not _validation.is_compiling():
            # -inf masks and a finite value adds; +inf or NaN would turn the query's whole row into NaN.
            unusable = torch.isnan(attn_mask) | torch.isposinf(attn_mask)
            if bool(unusable.any()):
                raise ValueError(
                    f"attn_mask must hold finite values or -inf (masked), got {int(unusable.sum())} NaN or +inf"
                )
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
        document_ids = require_int_tensor("document_ids", document_ids, ((batch, num_queries),))
    if cache is not None and cache.length and (document_ids is None) == cache.has_documents:
        if cache.has_documents:
            raise ValueError("the cache holds a packed sequence: give document_ids for the new tokens too")
        raise ValueError("the cache holds keys without document ids: reset() it before passing document_ids")
    return attn_mask, key_padding_mask, document_ids


def split_position_axes(
    module: Any,
    positions: torch.Tensor | None,
    key_positions: torch.Tensor | None,
    batch: int,
    num_queries: int,
    num_new_keys: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """M-RoPE's 3-D positions taken apart: ``(positions, key_positions, q_axes, k_axes)``.

    Positions ``(3, b, l)`` (time, height, width) go whole to an encoding whose
    ``position_axes`` is 3 (``q_axes``/``k_axes``); the rest of the call (the cache, score
    terms, visibility) uses their temporal row ``p[0]``, ``(b, l)``. Any other layer given
    3-D positions raises.
    """
    if positions is None and key_positions is None:
        return None, None, None, None  # nothing given (a decoding step): nothing to split
    axes = getattr(module.position, "position_axes", 1)

    def split(name: str, value: torch.Tensor | None, count: int) -> torch.Tensor | None:
        if not isinstance(value, torch.Tensor) or value.dim() != 3:
            return None
        if axes != 3:
            encoding = "no position encoding" if module.position is None else type(module.position).__name__
            raise ValueError(
                f"{name} of shape {tuple(value.shape)} are 3-D, M-RoPE's (3, batch, length); this layer has "
                f"{encoding}, which takes ({count},) or ({batch}, {count})"
            )
        return require_int_tensor(name, value, ((3, batch, count),))

    q_axes = split("positions", positions, num_queries)
    k_axes = split("key_positions", key_positions, num_new_keys)
    if q_axes is not None:
        positions = q_axes[0]
        if key_positions is None:
            k_axes = q_axes  # self-attention: the keys are the queries (resolve_positions checks the lengths)
    if k_axes is not None and key_positions is not None:
        key_positions = k_axes[0]
    return positions, key_positions, q_axes, k_axes


def lift_position_axes(
    module: Any, axes: torch.Tensor | None, positions: torch.Tensor, batch: int
) -> torch.Tensor | None:
    """The ``(3, b, l)`` positions an M-RoPE encoding gets (text positions on every axis), else None."""
    if getattr(module.position, "position_axes", 1) != 3:
        return None
    return axes.to(positions.device) if axes is not None else positions.expand(3, batch, positions.shape[-1])


def resolve_positions(
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
) -> tuple[torch.Tensor, torch.Tensor, int | None, int | None]:
    """Positions of the queries ``(lq,)``/``(b, lq)`` and of the new keys ``(lk,)``/``(b, lk)``, and the first
    of each as an int when they count up from it (made here from ``offset``, not given), else None."""
    if offset is not None and (positions is not None or document_ids is not None):
        raise ValueError("give either offset or positions/document_ids, not both (offset is the shorthand)")
    if positions is None and document_ids is not None:
        # (b, l): each document starts at 0, or goes on from the cache's newest key
        positions = document_positions(document_ids, previous=None if cache is None else cache.last_documents)
    first = 0
    if positions is not None:
        q_positions = require_int_tensor("positions", positions, ((num_queries,), (batch, num_queries))).to(device)
    else:
        if offset is not None:
            offset = require_position("offset", offset, num_queries)
        else:
            offset = 0 if cache is None else cache.length  # the cache's own count: nothing to check
        q_positions = torch.arange(offset, offset + num_queries, device=device)  # (lq,)
        first = offset
    if key_positions is not None:
        shapes = ((num_new_keys,), (batch, num_new_keys))
        q_first = first if positions is None else None
        return q_positions, require_int_tensor("key_positions", key_positions, shapes).to(device), q_first, None
    if positions is None:
        # Queries are the last lq of all keys: new key j sits at offset + lq - lk_new + j.
        start = first + num_queries - num_new_keys if cache is not None else first + num_queries - total
        if start == first and num_new_keys == num_queries:
            return q_positions, q_positions, first, start  # self-attention: the same positions, made once
        return q_positions, torch.arange(start, start + num_new_keys, device=device), first, start
    if num_new_keys != num_queries:
        raise ValueError(
            f"key_positions are needed: positions give the {num_queries} queries' positions, "
            f"and there are {num_new_keys} keys"
        )
    return q_positions, q_positions, None, None


def check_skip_padded_queries(
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


def zero_padding(
    valid_rows: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs with their padded rows zeroed, each shared tensor zeroed once.

    ``valid_rows`` ``(b, l)`` marks the valid query rows. The keys and values are the same
    tokens (self-attention), possibly cut after the longest valid length ``lk <= l``: their
    rows are marked by ``valid_rows[:, :lk]``, never by the whole mask, which would broadcast
    a shorter key tensor to ``l`` rows.
    """
    zeroed: dict[int, torch.Tensor] = {}
    for x in (queries, keys, values):
        if id(x) not in zeroed:
            assert x.shape[1] <= valid_rows.shape[1], "keys are never longer than the queries here"
            padded = ~valid_rows[:, : x.shape[1], None]  # (b, l or lk, 1)
            zeroed[id(x)] = x.masked_fill(padded, 0.0)  # masked_fill, not a product: a NaN there is dropped
    return zeroed[id(queries)], zeroed[id(keys)], zeroed[id(values)]


class Request(NamedTuple):
    """A checked call of :meth:`MultiHeadAttention.forward`."""

    queries: torch.Tensor  # (b, lq, dq)
    keys: torch.Tensor  # (b, lk_new, dk); past the longest valid length dropped
    values: torch.Tensor  # (b, lk_new, dv)
    valid_lens: torch.Tensor | None  # (b,) or (b, lq)
    causal: bool
    return_weights: bool
    cache: KVCache | None
    attn_mask: torch.Tensor | None  # (1 or b, 1 or h, lq, total)
    key_padding_mask: torch.Tensor | None  # (b, lk_new), True = padding
    document_ids: torch.Tensor | None  # (b, lq)
    key_documents: torch.Tensor | None  # (b, lk_new)
    q_positions: torch.Tensor  # (lq,) or (b, lq)
    k_positions: torch.Tensor  # (lk_new,) or (b, lk_new)
    total: int  # keys in the whole sequence, the queries being its last lq
    valid_rows: torch.Tensor | None  # (b, lq) bool, with skip_padded_queries
    mask: masks.Rule | None = None  # the caller's rule, joined to the others by "and"
    q_axes: torch.Tensor | None = None  # (3, b, lq) for an M-RoPE encoding (q_positions is its row 0)
    k_axes: torch.Tensor | None = None  # (3, b, lk_new)
    q_first_position: int | None = None  # q_positions[0] when they count up from it (made from offset)
    k_first_position: int | None = None  # k_positions[0] likewise


def check_request(
    module: Any,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid_lens: torch.Tensor | None,
    causal: bool,
    return_weights: bool,
    offset: int | None,
    cache: KVCache | None,
    positions: torch.Tensor | None,
    key_positions: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    cumulative_lengths: torch.Tensor | Sequence[torch.Tensor | Sequence[int]] | None,
    mask: masks.Rule | None = None,
) -> Request:
    """Check every argument; derive positions, document ids and the rows that are padding."""
    causal, return_weights = require_bool("causal", causal), require_bool("return_weights", return_weights)
    check_inputs(module, queries, keys, values)
    if mask is not None and not isinstance(mask, masks.Rule):
        raise ValueError(
            f"mask must be a selfattn.masks rule (e.g. masks.causal() | masks.prefix(n)), got {type(mask).__name__}"
            + (" (a tensor goes in attn_mask)" if isinstance(mask, torch.Tensor) else "")
        )
    if cache is not None and not isinstance(cache, KVCache):
        raise ArgumentTypeError(f"cache must be a KVCache, got {type(cache).__name__} {cache!r}")
    batch, num_queries, num_new_keys = queries.shape[0], queries.shape[1], keys.shape[1]
    if cache is not None and cache.sink_tokens:
        # Its kept keys are not consecutive in the sequence, and these read each key's index there.
        by_index = {
            "window": module.window, "chunk_size": module.chunk_size, "mask": mask,
            "valid_lens": valid_lens, "attn_mask": attn_mask,
        }  # fmt: skip
        given = [name for name, value in by_index.items() if value is not None]
        if given:
            raise ValueError(
                f"a KVCache with sink_tokens={cache.sink_tokens} drops the keys between its sinks and its window, "
                f"so {' and '.join(given)} (which read where keys sit in the sequence) cannot be used with it"
            )
    elif cache is not None and cache.window is not None and (module.window is None or cache.window < module.window):
        raise ValueError(f"cache keeps only a window of {cache.window} keys, and this layer has window={module.window}")
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
    attn_mask, key_padding_mask, document_ids = check_masks(
        module, attn_mask, key_padding_mask, document_ids, batch, num_queries, num_new_keys, total, cache
    )
    positions, key_positions, q_axes, k_axes = split_position_axes(
        module, positions, key_positions, batch, num_queries, num_new_keys
    )
    q_positions, k_positions, q_first, k_first = resolve_positions(
        batch, num_queries, num_new_keys, total, offset, positions, key_positions, document_ids, cache,
        queries.device,
    )  # fmt: skip
    lifted: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if getattr(module.position, "position_axes", 1) == 3:  # M-RoPE: its (3, b, l) positions
        lifted = (
            lift_position_axes(module, q_axes, q_positions, batch), lift_position_axes(module, k_axes, k_positions, batch)
        )  # fmt: skip
    request = Request(
        queries, keys, values, valid_lens, causal, return_weights, cache, attn_mask, key_padding_mask,
        document_ids, document_ids, q_positions, k_positions, total, None, mask, *lifted, q_first, k_first,
    )  # fmt: skip
    return request if valid_lens is None else _check_lengths(module, request)


def _check_lengths(module: Any, request: Request) -> Request:
    """Valid lengths checked; with ``skip_padded_queries`` the padded rows zeroed; keys no query sees dropped."""
    cache, queries, keys = request.cache, request.queries, request.keys
    batch, num_queries, num_new_keys = queries.shape[0], queries.shape[1], keys.shape[1]
    max_keys = request.total if cache is None or cache.max_len is None else cache.max_len
    assert request.valid_lens is not None
    valid_lens = check_valid_lens(request.valid_lens, batch, num_queries, max_keys).to(queries.device)
    request = request._replace(valid_lens=valid_lens)
    if module.skip_padded_queries:
        check_skip_padded_queries(valid_lens, num_queries, num_new_keys, cache)
        valid_rows = torch.arange(num_queries, device=queries.device) < valid_lens[:, None]  # (b, lq)
        request = request._replace(valid_rows=valid_rows)
    if cache is not None or _validation.is_compiling():
        return request
    # Keys at or past the longest valid length are invisible to every query: skip them.
    kept = max(int(valid_lens.max()), 1) if valid_lens.numel() else num_new_keys
    if kept >= num_new_keys:
        return request
    trimmed = request.keys[:, :kept]
    return request._replace(
        keys=trimmed,
        values=trimmed if request.values is request.keys else request.values[:, :kept],  # one tensor stays one
        k_positions=request.k_positions[..., :kept],
        k_axes=None if request.k_axes is None else request.k_axes[..., :kept],
        key_padding_mask=None if request.key_padding_mask is None else request.key_padding_mask[:, :kept],
        attn_mask=None if request.attn_mask is None else request.attn_mask[..., :kept],
        key_documents=None if request.key_documents is None else request.key_documents[:, :kept],
        mask=None
        if request.mask is None
        else masks.on_first_keys(request.mask, batch, num_queries, num_new_keys, kept),
    )
