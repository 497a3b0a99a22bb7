"""Dropout and softcapping with no score term on CPU, tile by tile of one ``(batch, head)`` slice, on one-thread workers.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from selfattn.functional._block_common import (
    MAX_BLOCK,
    MIN_BLOCK,
    _as_4d,
    _cap_in_place,
    _compute_dtype,
    _settle_empty_rows,
    _softmax_backward,
    _Workspace,
)
from selfattn.functional._block_plan import _Plan
from selfattn.functional._dropout_masks import _keep_factors, _keep_mask, dropout_keep_probability
from selfattn.masks import Causal

# Dropout or a softcap (sinks with either) on CPU, no score term: one (batch, head) slice at a time, so
# that a tile of scores stays in cache between its matrix products and its elementwise passes,
# and the slices go to worker threads that each run PyTorch ops on one thread (see _slice_pool).
SLICE_TILE_BYTES = 2 * 2**20
# Below this many scores per slice (lq * lk) a tile is too small to pay for its own Python
# loop and ops: the batched explicit path takes the call instead.
SLICED_MIN_SCORES = 2**16
_slice_pool: ThreadPoolExecutor | None = None


def choose_slice_block(num_queries: int, num_keys: int, *, dtype: torch.dtype) -> int:
    """Queries per tile of the per-slice route: the largest power of two whose ``(block, lk)`` scores fit 2 MiB.

    Clamped to ``[16, 512]`` and to ``lq``; lk=4096 in float32 gives 128, lk=16384 gives 32.
    """
    itemsize = torch.empty(0, dtype=_compute_dtype(dtype)).element_size()
    rows = max(SLICE_TILE_BYTES // max(num_keys * itemsize, 1), 1)
    block = 1 << (rows.bit_length() - 1)  # largest power of two <= rows
    return max(1, min(num_queries, max(MIN_BLOCK, min(MAX_BLOCK, block))))


def _one_thread_each(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers whose PyTorch ops each run on one thread (no OpenMP team per op).

    ``torch.set_num_threads`` is per thread for OpenMP but also sets the process default that
    new threads start from; every worker sets and reads its count at once behind a barrier
    (so none starts from a restored default), then the caller's count is put back.
    """
    global _slice_pool
    if _slice_pool is not None and _slice_pool._max_workers == threads:
        return _slice_pool
    previous = torch.get_num_threads()
    barrier = threading.Barrier(threads)

    def settle() -> None:
        torch.set_num_threads(1)
        torch.get_num_threads()  # fixes this thread's count now, while the default is 1
        barrier.wait()

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="selfattn-slices")
    try:
        for future in [pool.submit(settle) for _ in range(threads)]:
            future.result()
    finally:
        torch.set_num_threads(previous)
    _slice_pool = pool
    return pool


def _run_slices(count: int, work: Callable[[int, _Workspace], None], device: torch.device) -> None:
    """``work(s, workspace)`` for every slice, on the one-thread workers when there are enough slices to share.

    Each thread keeps one workspace for all its slices of the call: PyTorch's CPU allocator does
    not cache, so a fresh 2 MiB tile buffer per slice would be mapped and page-faulted again.
    """
    threads = torch.get_num_threads()
    local = threading.local()

    def without_grad(s: int) -> None:  # grad mode is per thread: the workers start with it on
        if not hasattr(local, "workspace"):
            local.workspace = _Workspace(device)
        with torch.no_grad():
            work(s, local.workspace)

    if threads > 1 and count >= threads:
        list(_one_thread_each(threads).map(without_grad, range(count)))
    else:
        for s in range(count):
            without_grad(s)


def _pick(t: torch.Tensor | None, batch: int, head: int) -> torch.Tensor | None:
    """Slice ``(batch, head)`` of a tensor broadcastable to ``(b, h, ...)``: ``(...)``."""
    if t is None:
        return None
    t = _as_4d(t)
    return t[batch if t.shape[0] > 1 else 0, head if t.shape[1] > 1 else 0]


def _gradient_like(t: torch.Tensor, batch: int, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``(b, h, l, d)`` gradient in ``dtype``, with ``t``'s strides when ``t`` has every (batch, head)."""
    if tuple(t.shape[:2]) == (batch, heads):
        return torch.empty_like(t, dtype=dtype)
    return t.new_empty(batch, heads, *t.shape[2:], dtype=dtype)


def _slice_rows(
    t: torch.Tensor, batch: int, head: int, dtype: torch.dtype, workspace: _Workspace, name: str
) -> torch.Tensor:
    """Slice ``(batch, head)`` of a ``(b or 1, h or 1, l, d)`` tensor as contiguous ``(l, d)`` rows in ``dtype``,
    copied into the workspace: heads split from a ``(b, l, h * d)`` projection are strided, and every tile reads them.
    """
    picked = _pick(t, batch, head)
    assert picked is not None
    return workspace.get(name, picked.shape, dtype).copy_(picked)


def _slice_keep(
    plan: _Plan, slice_index: int, block_index: int, shape: Sequence[int], dtype: torch.dtype, workspace: _Workspace
) -> torch.Tensor:
    """Keep factors (1.0 / 0.0) of one tile, seeded by (call seed, slice, block): the same in both passes."""
    return _keep_factors(shape, _slice_seed(plan, slice_index, block_index), plan.dropout_p, dtype, workspace)


def _slice_seed(plan: _Plan, slice_index: int, block_index: int) -> int:
    return (plan.block_seed(block_index) + slice_index * 0xBF58476D1CE4E5B9) % 2**63


class _Tile(NamedTuple):
    """One block of queries as every slice sees it: the keys it reaches, what it hides, its empty rows."""

    block_index: int
    start: int
    end: int
    keys: slice
    hidden_columns: slice  # the tile's columns (counted from keys.start) that hide some key
    hidden: torch.Tensor | None  # bool, True = hidden, broadcastable to (b, h, block, hidden columns)
    empty: torch.Tensor | None  # bool (..., block, 1): rows that see no key, zeroed after


def _slice_tiles(plan: _Plan, device: torch.device) -> list[_Tile]:
    """The tiles both passes walk: each block's keys, and its hidden pairs narrowed to the columns that hold any
    (for causal attention the diagonal square, so the mask touches one column in ``lk / block``)."""
    return [_slice_tile(plan, index, start, end, keys, device) for index, start, end, keys in plan.blocks()]


def _slice_tile(plan: _Plan, index: int, start: int, end: int, keys: slice, device: torch.device) -> _Tile:
    visibility = plan.visibility
    # Causal alone: query `start` sees every key before `first_hidden`, so only the columns from
    # there on are looked at (when it sees a key at all; else the general case finds the empty rows).
    first_hidden = visibility.q_first + start + 1 - visibility.k_first  # a local key index
    if visibility.causal and visibility.only(Causal) and first_hidden > keys.start:
        if first_hidden >= keys.stop:
            return _Tile(index, start, end, keys, slice(0, 0), None, None)
        visible = plan.visible(start, end, slice(first_hidden, keys.stop), device)
        assert visible is not None
        return _Tile(index, start, end, keys, slice(first_hidden - keys.start, keys.stop - keys.start), ~visible, None)
    visible, empty = _settle_empty_rows(plan.visible(start, end, keys, device))
    columns, hidden = slice(0, 0), None
    if visible is not None:
        hidden_anywhere = (~visible).reshape(-1, visible.shape[-1]).any(dim=0).nonzero().flatten()  # (columns,)
        if hidden_anywhere.numel():
            columns = slice(int(hidden_anywhere[0]), int(hidden_anywhere[-1]) + 1)
            hidden = ~visible[..., columns]
    return _Tile(index, start, end, keys, columns, hidden, empty)


def _slice_tile_probs(
    qs: torch.Tensor,
    ks: torch.Tensor,
    tile: _Tile,
    hidden: torch.Tensor | None,
    workspace: _Workspace,
    softcap: float | None,
    sink: float | None,
    *,
    want_slope: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Softmax of one tile's (capped) scores in place in the workspace: the keys' weights ``(block, keys)``, the whole
    softmax ``(block, keys + 1 if sink)``, and with ``want_slope`` the cap's derivative ``(block, keys)``.

    ``qs`` comes scaled, and divided by the softcap if there is one (a ``(block, d)`` product, not a
    ``(block, keys)`` one); ``hidden`` is this slice's part of ``tile.hidden``. A sink logit is one
    more column of the softmax (it takes weight and adds no value); its column holds the sink's weight.
    """
    rows, width = qs.shape[0], ks.shape[0]
    whole = workspace.get("scores", (rows, width + (sink is not None)), qs.dtype)
    scores = torch.matmul(qs, ks.t(), out=whole[:, :width])  # (block, keys)
    slope = None
    if softcap is not None:
        slope = _cap_in_place(scores, softcap, workspace, want_slope=want_slope, divided=True)
    if hidden is not None:
        scores[:, tile.hidden_columns].masked_fill_(hidden, float("-inf"))
    if sink is not None:
        whole[:, width].fill_(sink)
    torch.ops.aten._softmax.out(whole, -1, False, out=whole)
    return whole[:, :width], whole, slope


class _SlicedAttention(torch.autograd.Function):
    """Attention with dropout and/or a softcap (and sinks) and no score term on CPU, tile by tile of one slice.

    Tile ``(slice s, block i)`` has ``(block, keys)`` scores (2 MiB, :func:`choose_slice_block`),
    so its cap, softmax, keep mask and products read what the previous step left in cache
    instead of streaming ``(b, h, block, lk)`` tensors from memory. Slices are independent
    (their key and value gradients too), so worker threads take whole slices. The keep mask of
    a tile is seeded by (call seed, slice, block index): the backward pass redraws it, and it
    does not depend on how many threads run.
    """

    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        compute = _compute_dtype(q.dtype)
        batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
        out = q.new_empty(batch, heads, q.shape[-2], v.shape[-1])  # (b, h, lq, dv)
        out_compute = out if out.dtype == compute else torch.empty_like(out, dtype=compute)
        inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
        tiles = _slice_tiles(plan, q.device)
        score_factor = plan.scale if plan.softcap is None else plan.scale / plan.softcap
        sink_logits = None if sinks is None else sinks.detach().to(compute).tolist()  # one float per query head

        def work(s: int, workspace: _Workspace) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (
                _slice_rows(t, b, h, compute, workspace, name) for t, name in zip((q, k, v), "qkv", strict=True)
            )
            for tile in tiles:
                start, end, keys = tile.start, tile.end, tile.keys
                probs, _, _ = _slice_tile_probs(
                    qs[start:end] * score_factor, ks[keys], tile, _pick(tile.hidden, b, h),
                    workspace, plan.softcap, None if sink_logits is None else sink_logits[h],
                )  # fmt: skip
                if plan.dropout_p > 0:
                    probs.mul_(_slice_keep(plan, s, tile.block_index, probs.shape, compute, workspace))
                rows = torch.matmul(probs, vs[keys], out=out_compute[b, h, start:end])  # (block, dv)
                if plan.dropout_p > 0:
                    rows.mul_(inverse_keep)
                empty_rows = _pick(tile.empty, b, h)
                if empty_rows is not None:
                    rows.masked_fill_(empty_rows, 0.0)

        _run_slices(batch * heads, work, q.device)
        if out_compute is not out:
            out.copy_(out_compute)
        ctx.plan, ctx.tiles, ctx.with_sinks = plan, tiles, sinks is not None
        ctx.save_for_backward(q, k, v, *([] if sinks is None else [sinks]))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *rest = ctx.saved_tensors
        sinks = rest[0] if ctx.with_sinks else None
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            inputs = [q, k, v, *rest]
            wanted = [t.requires_grad for t in inputs]
            out = _sliced_reference(plan, q, k, v, sinks)
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, *(next(grads) if w else None for w in wanted), *([] if ctx.with_sinks else [None]))
        with torch.no_grad():
            return _SlicedAttention._backward(plan, ctx.tiles, q, k, v, sinks, grad_out)

    @staticmethod
    def _backward(
        plan: _Plan,
        tiles: list[_Tile],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        grad_out: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        compute = _compute_dtype(q.dtype)
        batch, heads = grad_out.shape[:2]
        # Per-slice gradients, (b, h, ., .), laid out as the inputs are (heads split from a (b, l, h * d)
        # projection then need no copy to go back); a broadcast input sums its own afterwards.
        dq, dk, dv = (_gradient_like(t, batch, heads, compute) for t in (q, k, v))
        sink_logits = None if sinks is None else sinks.detach().to(compute).tolist()
        sink_grads = torch.zeros(batch, heads, dtype=compute, device=q.device)  # per slice, summed over the batch
        inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)

        def work(s: int, workspace: _Workspace) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (
                _slice_rows(t, b, h, compute, workspace, name) for t, name in zip((q, k, v), "qkv", strict=True)
            )
            gs = _slice_rows(grad_out, b, h, compute, workspace, "g")
            # The keys' and values' gradients gather transposed, (d, lk): g^T @ probs runs about a third
            # faster than probs^T @ g (measured 90 against 66 GFLOP/s on one core, 128-row tiles).
            dks_t = workspace.get("dk_t", (ks.shape[1], ks.shape[0]), compute).zero_()
            dvs_t = workspace.get("dv_t", (vs.shape[1], vs.shape[0]), compute).zero_()
            for tile in tiles:
                start, end, keys = tile.start, tile.end, tile.keys
                kc, vc = ks[keys], vs[keys]
                q_scaled = qs[start:end] * plan.scale  # (block, d)
                q_for_scores = q_scaled if plan.softcap is None else q_scaled / plan.softcap
                sink = None if sink_logits is None else sink_logits[h]
                probs, whole, slope = _slice_tile_probs(
                    q_for_scores, kc, tile, _pick(tile.hidden, b, h), workspace, plan.softcap, sink, want_slope=True
                )
                g_scaled = gs[start:end]
                keep = None
                if plan.dropout_p > 0:
                    keep = _slice_keep(plan, s, tile.block_index, probs.shape, compute, workspace)
                    g_scaled = g_scaled * inverse_keep  # dropout's 1 / keep, on the small side
                empty_rows = _pick(tile.empty, b, h)
                if empty_rows is not None:
                    g_scaled = g_scaled.masked_fill(empty_rows, 0.0)  # the output of an empty row is a constant zero
                grad_whole = workspace.get("grad", whole.shape, compute)  # the sink's column: it adds no value
                grad = torch.matmul(g_scaled, vc.t(), out=grad_whole[:, : probs.shape[1]])  # (block, keys)
                if keep is not None:
                    grad.mul_(keep)
                if sink is not None:
                    grad_whole[:, -1].zero_()
                grad_whole = _softmax_backward(grad_whole, whole)  # the sink's column gets its logit's gradient
                grad = grad_whole[:, : probs.shape[1]]
                if sink is not None:
                    sink_grads[b, h] += grad_whole[:, -1].sum()
                dvs_t[:, keys].addmm_(g_scaled.t().contiguous(), probs if keep is None else probs.mul_(keep))
                if slope is not None:
                    grad.mul_(slope)  # through the cap, to the logit before it
                torch.matmul(grad, kc, out=dq[b, h, start:end]).mul_(plan.scale)
                dks_t[:, keys].addmm_(q_scaled.t().contiguous(), grad)
            dk[b, h].copy_(dks_t.t())
            dv[b, h].copy_(dvs_t.t())

        _run_slices(batch * heads, work, q.device)
        return (
            None,
            dq.sum_to_size(q.shape).to(q.dtype),
            dk.sum_to_size(k.shape).to(k.dtype),
            dv.sum_to_size(v.shape).to(v.dtype),
            None if sinks is None else sink_grads.sum(dim=0).to(sinks.dtype),
        )


def _sliced_keep_mask(plan: _Plan, index: int, batch: int, heads: int, rows: int, keys: slice) -> torch.Tensor:
    """Block ``index``'s keep mask of the per-slice route, ``(b, h, rows, keys)`` bool, as the tiles draw it."""
    width = keys.stop - keys.start
    tiles = [
        _keep_mask((rows, width), _slice_seed(plan, s, index), plan.dropout_p, torch.device("cpu"))
        for s in range(batch * heads)
    ]
    return torch.stack(tiles).view(batch, heads, rows, width)


def _sliced_reference(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """What :class:`_SlicedAttention` computes, in differentiable ops with the same masks (double backward)."""
    compute = _compute_dtype(q.dtype)
    inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
    batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
    pieces = []
    for index, start, end, keys in plan.blocks():
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., keys, :].to(compute), v[..., keys, :].to(compute)
        visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
        scores = torch.matmul(qc * plan.scale, kc.transpose(-2, -1))  # (b, h, block, keys)
        if plan.softcap is not None:
            scores = torch.tanh(scores / plan.softcap) * plan.softcap
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores, dim=-1)
        else:  # the sink is one more column of the softmax, then left out
            sink_column = sinks.to(compute)[:, None, None].expand(*scores.shape[:-1], 1)  # (b, h, block, 1)
            weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
        if plan.dropout_p > 0:
            weights = weights * _sliced_keep_mask(plan, index, batch, heads, end - start, keys) * inverse_keep
        block_out = torch.matmul(weights, vc)  # (b, h, block, dv)
        if empty is not None:
            block_out = block_out.masked_fill(empty, 0.0)
        pieces.append(block_out)
    return torch.cat(pieces, dim=-2).to(q.dtype)  # (b, h, lq, dv)
