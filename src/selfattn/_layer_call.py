"""One call of :class:`~selfattn.MultiHeadAttention`, described for the dispatcher, and its output finished.

:func:`describe` turns a checked request into an :class:`~selfattn.core.call.AttentionCall`: heads
projected on first use (through the layer's parts), positions, the cache's keys (or, for a
``shared_kv`` layer, another layer's), and what each query may see. :func:`finish` projects the
route's output out, zeroes padded rows and commits the cache.

Shape legend:
    b: batch, lq: queries, lk: keys, h: heads, hk: key/value heads, dh: head size, dv: value head size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

import selfattn._validation as _validation
import selfattn.masks as masks
from selfattn._cache_checks import claim
from selfattn.cache import CachedKeys
from selfattn.core.call import AttentionCall, ModuleInputs, causal_hides_nothing
from selfattn.core.inputs import Request, zero_padding
from selfattn.core.route import Output
from selfattn.masks import Visibility
from selfattn.positional.base import QueryKeyEncoding, ScoreEncoding
from selfattn.positional.rotary import RotaryPositionalEncoding
from selfattn.shared_cache import SharedKVView

__all__ = ["describe", "encoding_positions", "finish", "for_heads", "updates_cached_keys"]


class _Seen(NamedTuple):
    """The keys the queries of one call may see: the new ones, or what the cache holds."""

    positions: torch.Tensor  # (lk,) or (b, lk)
    padding: torch.Tensor | None  # (b, lk), True = padding
    documents: torch.Tensor | None  # (b, lk)
    first_index: int  # index of the first of them in the whole sequence
    num_keys: int  # lk

    @classmethod
    def new_keys(cls, request: Request) -> _Seen:
        return cls(request.k_positions, request.key_padding_mask, request.key_documents, 0, request.keys.shape[1])


def _per_head(positions: torch.Tensor) -> torch.Tensor:
    return positions[:, None, :] if positions.dim() == 2 else positions  # (b, 1, l) broadcasts over heads


def encoding_positions(positions: torch.Tensor, axes: torch.Tensor | None) -> torch.Tensor:
    """The positions the projections take: M-RoPE's ``(3, b, l)`` axes when there are some, else ``positions``."""
    return positions if axes is None else axes


def for_heads(positions: torch.Tensor) -> torch.Tensor:
    """``(l,)``, ``(b, l)`` or M-RoPE's ``(3, b, l)`` as the encodings take them over heads."""
    return positions if positions.dim() == 3 else _per_head(positions)


def updates_cached_keys(encoding: QueryKeyEncoding) -> bool:
    """Whether ``encoding.update_cached_keys`` may change a cache: not the base's no-op, nor a rotary's that
    re-rotates nothing (:attr:`~selfattn.positional.RotaryPositionalEncoding.rerotates_cache` False)."""
    hook = type(encoding).update_cached_keys
    if hook is QueryKeyEncoding.update_cached_keys:
        return False
    if isinstance(encoding, RotaryPositionalEncoding) and hook is RotaryPositionalEncoding.update_cached_keys:
        return encoding.rerotates_cache
    return True


def finish(
    module: Any, request: Request, call: AttentionCall, result: Output
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Project out, zero padded query rows, commit the cache, pad the weights to every key."""
    out = result.out
    if result.stage == "heads":
        out = out.transpose(1, 2).flatten(2)  # (b, h, lq, dv) -> (b, lq, h * dv)
    if result.stage != "projected":
        queries = request.queries
        if module.gated and request.valid_rows is not None:  # padded rows reach no gate
            queries = queries.masked_fill(~request.valid_rows[:, :, None], 0.0)
        out = module.project_output(out, queries)  # (b, lq, d)
    if request.valid_rows is not None:
        out = out.masked_fill(~request.valid_rows[:, :, None], 0.0)  # padded query rows: zero, no W_o bias
    if request.cache is not None:
        request.cache.commit()  # the new keys count as stored only once attention has succeeded
    if not request.return_weights:
        return out
    weights = result.weights
    assert weights is not None
    if request.valid_rows is not None:
        weights = weights.masked_fill(~request.valid_rows[:, None, :, None], 0.0)  # (b, h, lq, lk)
    # Keys never scored (skipped padding, or dropped by a windowed cache) weigh 0: (b, h, lq, total).
    first = call.visibility.k_first
    return out, F.pad(weights, (first, request.total - first - weights.shape[-1]))


def describe(module: Any, request: Request) -> AttentionCall:
    """The call: lazily projected heads, positions, the cache's keys, and what each query may see."""
    queries, keys = request.queries, request.keys
    batch, num_queries = queries.shape[:2]

    zeroed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs, with padded rows zeroed for skip_padded_queries (a NaN there reaches nothing)."""
        if request.valid_rows is None:
            return queries, keys, request.values
        if not zeroed:  # once for the queries and the keys alike
            zeroed.append(zero_padding(request.valid_rows, queries, keys, request.values))
        return zeroed[0]

    def make_q() -> torch.Tensor:
        q: torch.Tensor = module.project_queries(
            inputs()[0], encoding_positions(request.q_positions, request.q_axes), request.q_first_position
        )  # (b, h, lq, dh)
        return q

    position = module.position  # read once: a submodule's lookup goes through nn.Module.__getattr__

    def project_kv() -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(position, QueryKeyEncoding):
            _update_cached_keys(position, request)
        k = module.project_keys(
            inputs()[1], encoding_positions(request.k_positions, request.k_axes), request.k_first_position
        )  # (b, hk, lk_new, dh)
        v = module.project_values(inputs()[2], inputs()[1])  # (b, hk, lk_new, dv)
        return k, v

    seen = _Seen.new_keys(request)
    make_kv = project_kv
    if module.shared_kv:  # another layer's keys: what it attended to, read from its cache
        stored = _shared_keys(module, request)
        seen = _Seen(stored.positions, stored.padding, stored.documents, stored.first_index, stored.keys.shape[-2])
        make_kv = lambda: (stored.keys, stored.values)  # noqa: E731
    elif request.cache is not None:  # what the cache holds decides the visibility: gather it now
        claim(request.cache, module)
        k, v = project_kv()
        stored = request.cache.update(
            k, v, positions=request.k_positions, padding=request.key_padding_mask,
            documents=request.key_documents, commit=False,
        )  # fmt: skip
        seen = _Seen(stored.positions, stored.padding, stored.documents, stored.first_index, stored.keys.shape[-2])
        make_kv = lambda: (stored.keys, stored.values)  # noqa: E731
    visibility, bias = _visibility(module, request, seen)
    return AttentionCall(
        shape=(
                batch, module.num_heads, module.num_kv_heads, num_queries, seen.num_keys, module.head_dim,
                module.value_head_dim,
            ),
        visibility=visibility,
        device=queries.device,
        dtype=module.W_q.weight.dtype,
        make_q=make_q,
        make_kv=make_kv,
        q_positions=request.q_positions,
        k_positions=seen.positions,
        term=position if isinstance(position, ScoreEncoding) else None,
        bias=bias,
        dropout_p=module.dropout if module.training else 0.0,
        scale=module.scale,
        softcap=module.softcap,
        sinks=module.sinks,
        return_weights=request.return_weights,
        block_size=module.block_size,
        inputs=ModuleInputs(
            module, queries, keys, request.values,
            request.q_positions if request.q_axes is None else request.q_axes,  # the encoding's positions
            request.k_positions if request.k_axes is None else request.k_axes,
            module.skip_padded_queries, request.cache is not None,
        ),
    )  # fmt: skip


def _shared_keys(module: Any, request: Request) -> CachedKeys:
    """What the source layer's latest call attended to, through the ``SharedKVView`` a ``shared_kv`` layer needs."""
    cache = request.cache
    if not isinstance(cache, SharedKVView):
        got = "none" if cache is None else type(cache).__name__
        raise ValueError(
            "cache must be a SharedKVView (selfattn.models) of the source layer's SharedKVCache: a layer with "
            f"shared_kv=True reads another layer's keys and values; got {got}"
        )
    return cache.read(request.keys.shape[1], module.num_kv_heads, module.head_dim, module.value_head_dim)


def _update_cached_keys(encoding: QueryKeyEncoding, request: Request) -> None:
    """Give the encoding the positions of the stored keys and the new ones (dynamic rotary re-rotates the cache).

    A windowed cache holds only some keys (``cache.stored`` of ``cache.length``), with their own
    positions: those are the keys to re-rotate, and a window that slid past others changes nothing.
    """
    cache = request.cache
    if cache is None or not updates_cached_keys(encoding):
        return  # the positions would be gathered for nothing (a rotary without length scaling)
    cached, new_positions = cache.positions, request.k_positions
    if cached is None:  # an empty cache: the encoding notes the length its keys are rotated at
        encoding.update_cached_keys(cache, new_positions)
        return
    if cached.dim() != new_positions.dim():  # one of them per sequence: both per sequence
        batch = request.queries.shape[0]
        cached, new_positions = cached.expand(batch, -1), new_positions.expand(batch, -1)
    encoding.update_cached_keys(cache, torch.cat((cached, new_positions), dim=-1))


def _visibility(module: Any, request: Request, seen: _Seen) -> tuple[Visibility, torch.Tensor | None]:
    """What each query may see (and a float ``attn_mask``'s finite part, a bias)."""
    num_queries = request.queries.shape[1]
    visibility = Visibility(num_queries, seen.num_keys, request.total - num_queries, seen.first_index)
    mask, bias = request.attn_mask, None
    if mask is not None:
        mask = mask[..., seen.first_index : seen.first_index + seen.num_keys]
        if mask.is_floating_point():
            bias = mask.masked_fill(mask == float("-inf"), 0.0)  # -inf goes into the bool mask
            mask = mask != float("-inf")
    if (
        mask is None
        and _only_causal(module, request, seen)
        and causal_hides_nothing(visibility)
        and not _validation.is_compiling()  # as AttentionCall: a graph keeps the rule (no guard on the sizes)
    ):
        return visibility, bias  # decoding: the causal rule hides nothing, and AttentionCall would drop it
    both = request.document_ids is not None and seen.documents is not None
    visibility = visibility.with_rules(
        masks.causal() if request.causal else None,
        None if module.window is None else masks.window(module.window),
        _chunks(module, request, seen),
        None if request.valid_lens is None else masks.ValidLengths(request.valid_lens),  # checked: check_valid_lens
        None if seen.padding is None else masks.key_padding(seen.padding),
        masks.documents(request.document_ids, seen.documents) if both else None,  # type: ignore[arg-type]
        None if mask is None else masks.dense(mask),
        request.mask,
    )
    return visibility, bias


def _only_causal(module: Any, request: Request, seen: _Seen) -> bool:
    """Whether the call's one rule would be ``causal`` (or none): no window, chunks, lengths, padding, documents
    or rule of the caller (``attn_mask`` is tested by the caller)."""
    return (
        module.window is None
        and module.chunk_size is None
        and request.valid_lens is None
        and seen.padding is None
        and request.document_ids is None
        and request.mask is None
    )


def _chunks(module: Any, request: Request, seen: _Seen) -> masks.Rule | None:
    """``chunk_size`` as a rule: chunks of token indices when positions are the indices, else of positions."""
    if module.chunk_size is None:
        return None
    q_positions, k_positions = request.q_positions, seen.positions
    num_queries = request.queries.shape[1]
    first_query = request.total - num_queries
    if q_positions.dim() == 1 and k_positions.dim() == 1 and not _validation.is_compiling():
        by_index = torch.arange(first_query, request.total, device=q_positions.device)
        keys_by_index = torch.arange(seen.first_index, seen.first_index + seen.num_keys, device=k_positions.device)
        if torch.equal(q_positions, by_index) and torch.equal(k_positions, keys_by_index):
            return masks.chunks(module.chunk_size)  # indices: blocks can skip other chunks' keys
    return masks.chunks(module.chunk_size, query_positions=q_positions, key_positions=k_positions)
