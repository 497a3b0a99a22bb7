"""Sparse attention over each query's selected keys (DeepSeek sparse attention): gather them, softmax over them.

A call whose visibility holds :func:`selfattn.masks.selected` picks ``t`` keys per query. Where
``t`` is a small share of the keys, this route gathers, for a block of queries at a time, each
query's picked keys and values and computes scores, softmax and the weighted sum over those
``t`` alone: O(lq * t) pairs instead of the O(lq * lk) a dense masked pass computes. The other
rules (causal, padding, documents ...) are evaluated on the picked pairs only, so the answer is
the dense masked one: a key picked twice counts once, an unused slot (-1) and a pick another rule
hides get no weight, a query that sees no key gets zeros.

Shape legend: b batch, h heads, hk key/value heads, g = h / hk, lq queries, lk keys,
t picks per query, q block of queries, d head size, dv value size.
"""

from __future__ import annotations

import torch

from selfattn._mask_rules import Indices
from selfattn._mask_selection import Selected
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._reasons import holding
from selfattn.core.routes._sparse_kernel import sparse_attention_blocks
from selfattn.functional._block_common import _compute_dtype
from selfattn.masks import Visibility

__all__ = ["SPARSE", "SPARSE_MANY_QUERIES", "SPARSE_MAX_SHARE", "SPARSE_MIN_GROUP", "sparse_block_size"]

#: The route takes a call when each query picks at most this share of the keys; past it a dense pass costs less.
SPARSE_MAX_SHARE = 0.25

#: Past this many queries, a call whose gathered rows serve fewer than :data:`SPARSE_MIN_GROUP` query
#: heads each goes to a dense masked pass: on CPU the gathers are memory-bound, and with one query head
#: per key/value head (DeepSeek-V3.2's multi-head shape) prefill on this route measured 0.35x the speed
#: of dense attention at n=4096, top-k 512, while a decoded token measured 8.1x faster
#: (``benchmarks/sparse_selection.py``, BENCHMARKS.md section ``latent-sparse-cpu-dsa``).
SPARSE_MANY_QUERIES = 64
#: Query heads per key/value head from which the gathered rows pay for themselves at any query count
#: (the absorbed-latent shape, 16 heads over one latent, measured 2.27x faster in prefill).
SPARSE_MIN_GROUP = 8

#: The keys (or values) one kv head gathers for a block of queries stay under this many elements (8 MiB in float32).
GATHERED_ELEMENTS = 1 << 21


def _declines(call: AttentionCall) -> str | None:
    selection = call.visibility.find(Selected)
    if selection is None:
        return "no selection of keys (masks.selected)"
    reason = holding(
        ("a score term", call.term is not None),
        ("a float bias (attn_mask)", call.bias is not None),
        ("the weights were asked for", call.return_weights),
        ("dropout", call.dropout_p > 0),
        ("q, k, v are not (b, h, l, d)", not call.four_d),
        ("compiling: the gathers' block loop is eager Python", call.compiling),
    )
    if reason:
        return reason
    assert isinstance(selection, Selected)
    picks = selection.indices.shape[-1]
    if picks > SPARSE_MAX_SHARE * call.num_keys:
        return (
            f"{picks} picks per query of {call.num_keys} keys: more than {SPARSE_MAX_SHARE:.0%} of them, "
            "a dense masked pass costs less"
        )
    group = call.heads // max(call.kv_heads, 1)
    if call.num_queries > SPARSE_MANY_QUERIES and group < SPARSE_MIN_GROUP:
        return (
            f"{call.num_queries} queries (more than {SPARSE_MANY_QUERIES}) whose gathered keys serve {group} head(s) "
            f"each (fewer than {SPARSE_MIN_GROUP}): gathering costs more than a dense masked pass"
        )
    return None


def sparse_block_size(call: AttentionCall, picks: int) -> int:
    """Queries per block: the call's ``block_size``, or as many as keep one head's gathered rows under :data:`GATHERED_ELEMENTS`."""
    if call.block_size is not None:
        return call.block_size
    per_query = max(picks, 1) * max(call.head_dim, call.value_dim)
    return max(1, min(call.num_queries, GATHERED_ELEMENTS // per_query))


def _unique_picks(indices: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picks, kept)`` ``(b, lq, t)``: sorted picks with -1 read as key 0, and which slots name a key first.

    Sorting puts a key picked twice next to itself, so its second slot is dropped; sorted reads
    also gather keys in order.
    """
    ordered = indices.long().sort(dim=-1).values.expand(batch, -1, -1)
    kept = ordered >= 0
    kept[..., 1:] &= ordered[..., 1:] != ordered[..., :-1]
    return ordered.clamp(min=0), kept


def _seen(rest: Visibility, kept: torch.Tensor, start: int, picks: torch.Tensor, heads: int) -> torch.Tensor:
    """Bool ``(b, 1 or h, q, t)``: the kept picks of queries ``[start, start + q)`` that every other rule allows."""
    seen = kept[:, None]  # (b, 1, q, t)
    if not rest.rules:
        return seen
    b = torch.arange(picks.shape[0], device=picks.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=picks.device).view(1, -1, 1, 1)
    q_local = torch.arange(start, start + picks.shape[1], device=picks.device).view(1, 1, -1, 1)
    k_local = picks[:, None]  # (b, 1, q, t)
    where = Indices(q_local + rest.q_first, k_local + rest.k_first, q_local, k_local)
    for rule in rest.rules:  # the scalar form takes index tensors that broadcast, batch and head included
        seen = seen & rule.scalar(where, b, h)
    return seen


def _run(call: AttentionCall) -> Output:
    selection = call.visibility.find(Selected)
    assert isinstance(selection, Selected)
    rest = call.visibility.excluding(selection)  # another selection stays: its picks are read like any rule's
    compute = _compute_dtype(call.dtype)
    q, k, v = (t.to(compute) for t in (call.q, call.k, call.v))
    picks, kept = _unique_picks(selection.indices, call.batch)

    def seen_of(start: int, end: int) -> torch.Tensor:
        return _seen(rest, kept[:, start:end], start, picks[:, start:end], call.heads)

    block = sparse_block_size(call, picks.shape[-1])
    out = sparse_attention_blocks(q, k, v, picks, seen_of, call.scale, block)
    return Output(out.to(call.dtype))


SPARSE = Route("sparse selection", _declines, _run)
