"""Dropout with no score term on CPU, tile by tile of one ``(batch, head)`` slice, on one-thread workers.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from selfattn.functional._block_common import (
    MAX_BLOCK,
    MIN_BLOCK,
    _as_4d,
    _compute_dtype,
    _settle_empty_rows,
    _softmax_backward,
    _Workspace,
)
from selfattn.functional._block_plan import _Plan
from selfattn.functional._dropout_masks import _keep_factors, _keep_mask, dropout_keep_probability

# Dropout alone on CPU (no score term): one (batch, head) slice at a time, so that a tile of
# scores stays in the 32 MiB L3 cache between its matrix products and its elementwise passes,
# and the slices go to worker threads that each run PyTorch ops on one thread (see _slice_pool).
SLICE_TILE_BYTES = 2 * 2**20
# Below this many scores per slice (lq * lk) a tile is too small to pay for its own Python
# loop and ops: the batched explicit path takes the call instead.
SLICED_MIN_SCORES = 2**16
_slice_pool: ThreadPoolExecutor | None = None


def choose_slice_block(num_queries: int, num_keys: int, *, dtype: torch.dtype) -> int:
    """Queries per tile of the per-slice dropout route: the largest power of two whose ``(block, lk)`` scores fit 2 MiB.

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


def _run_slices(count: int, work: Callable[[int], None]) -> None:
    """``work(s)`` for every slice, on the one-thread workers when there are enough slices to share."""
    threads = torch.get_num_threads()

    def without_grad(s: int) -> None:  # grad mode is per thread: the workers start with it on
        with torch.no_grad():
            work(s)

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


def _slice_keep(
    plan: _Plan, slice_index: int, block_index: int, shape: Sequence[int], dtype: torch.dtype, workspace: _Workspace
) -> torch.Tensor:
    """Keep factors (1.0 / 0.0) of one tile, seeded by (call seed, slice, block): the same in both passes."""
    return _keep_factors(shape, _slice_seed(plan, slice_index, block_index), plan.dropout_p, dtype, workspace)


def _slice_seed(plan: _Plan, slice_index: int, block_index: int) -> int:
    return (plan.block_seed(block_index) + slice_index * 0xBF58476D1CE4E5B9) % 2**63


def _slice_tile_probs(
    qs: torch.Tensor, ks: torch.Tensor, visible: torch.Tensor | None, workspace: _Workspace
) -> torch.Tensor:
    """Softmax of one tile's scores, ``(block, keys)``, in place in the workspace (``qs`` already scaled)."""
    scores = torch.matmul(qs, ks.t(), out=workspace.get("scores", (qs.shape[0], ks.shape[0]), qs.dtype))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    return probs


def _slice_tiles(plan: _Plan, device: torch.device) -> tuple[float, list[tuple[int, int, int, int]], list[Any]]:
    """What both passes of the per-slice route share: ``1 / keep``, the blocks, and each block's visibility and empty rows."""
    blocks = [(index, start, end, keys.stop) for index, start, end, keys in plan.blocks()]  # keys from the first
    visibles = [_settle_empty_rows(plan.visible(start, end, slice(0, keys), device)) for _, start, end, keys in blocks]
    return 1.0 / dropout_keep_probability(plan.dropout_p), blocks, visibles


class _SlicedDropoutAttention(torch.autograd.Function):
    """Attention with dropout and no score term on CPU, tile by tile of one ``(batch, head)`` slice.

    Tile ``(slice s, block i)`` has ``(block, keys)`` scores (2 MiB, :func:`choose_slice_block`),
    so its softmax, keep mask and products read what the previous step left in cache instead of
    streaming ``(b, h, block, lk)`` tensors from memory. Slices are independent (their key and
    value gradients too), so worker threads take whole slices. The keep mask of a tile is
    seeded by (call seed, slice, block index): the backward pass redraws it, and it does not
    depend on how many threads run.
    """

    @staticmethod
    def forward(ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        compute = _compute_dtype(q.dtype)
        batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
        out = q.new_empty(batch, heads, q.shape[-2], v.shape[-1])  # (b, h, lq, dv)
        inverse_keep, blocks, visibles = _slice_tiles(plan, q.device)

        def work(s: int) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (_pick(t, b, h) for t in (q, k, v))
            assert qs is not None and ks is not None and vs is not None
            workspace = _Workspace(q.device)
            for (index, start, end, keys), (visible, empty) in zip(blocks, visibles, strict=True):
                probs = _slice_tile_probs(
                    qs[start:end].to(compute) * plan.scale, ks[:keys].to(compute), _pick(visible, b, h), workspace
                )
                probs.mul_(_slice_keep(plan, s, index, probs.shape, compute, workspace))
                tile = torch.matmul(probs, vs[:keys].to(compute)).mul_(inverse_keep)  # (block, dv)
                empty_rows = _pick(empty, b, h)
                if empty_rows is not None:
                    tile = tile.masked_fill_(empty_rows, 0.0)
                out[b, h, start:end] = tile

        _run_slices(batch * heads, work)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            inputs = [q, k, v]
            wanted = [t.requires_grad for t in inputs]
            out = _sliced_dropout_reference(plan, q, k, v)
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, *(next(grads) if w else None for w in wanted))
        with torch.no_grad():
            return _SlicedDropoutAttention._backward(plan, q, k, v, grad_out)

    @staticmethod
    def _backward(
        plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        compute = _compute_dtype(q.dtype)
        batch, heads = grad_out.shape[:2]
        # Per-slice gradients, (b, h, ., .); a broadcast input sums its own afterwards.
        dq = torch.empty(batch, heads, *q.shape[-2:], dtype=compute, device=q.device)
        dk = torch.zeros(batch, heads, *k.shape[-2:], dtype=compute, device=k.device)
        dv = torch.zeros(batch, heads, *v.shape[-2:], dtype=compute, device=v.device)
        inverse_keep, blocks, visibles = _slice_tiles(plan, q.device)

        def work(s: int) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (_pick(t, b, h) for t in (q, k, v))
            assert qs is not None and ks is not None and vs is not None
            gs, dqs, dks, dvs = grad_out[b, h], dq[b, h], dk[b, h], dv[b, h]
            workspace = _Workspace(q.device)
            for (index, start, end, keys), (visible, empty) in zip(blocks, visibles, strict=True):
                kc, vc = ks[:keys].to(compute), vs[:keys].to(compute)
                q_scaled = qs[start:end].to(compute) * plan.scale  # (block, d)
                probs = _slice_tile_probs(q_scaled, kc, _pick(visible, b, h), workspace)
                keep = _slice_keep(plan, s, index, probs.shape, compute, workspace)
                g_scaled = gs[start:end].to(compute) * inverse_keep  # dropout's 1 / keep, on the small side
                empty_rows = _pick(empty, b, h)
                if empty_rows is not None:
                    g_scaled.masked_fill_(empty_rows, 0.0)  # the output of an empty row is a constant zero
                grad = torch.matmul(g_scaled, vc.t(), out=workspace.get("grad", probs.shape, compute)).mul_(keep)
                grad = _softmax_backward(grad, probs)  # (block, keys)
                dvs[:keys].addmm_(probs.mul_(keep).t(), g_scaled)  # probs is not needed after this
                torch.matmul(grad, kc, out=dqs[start:end]).mul_(plan.scale)
                dks[:keys].addmm_(grad.t(), q_scaled)

        _run_slices(batch * heads, work)
        return (
            None,
            dq.sum_to_size(q.shape).to(q.dtype),
            dk.sum_to_size(k.shape).to(k.dtype),
            dv.sum_to_size(v.shape).to(v.dtype),
        )


def _sliced_keep_mask(plan: _Plan, index: int, batch: int, heads: int, rows: int, keys: int) -> torch.Tensor:
    """Block ``index``'s keep mask of the per-slice route, ``(b, h, rows, keys)`` bool, as the tiles draw it."""
    tiles = [
        _keep_mask((rows, keys), _slice_seed(plan, s, index), plan.dropout_p, torch.device("cpu"))
        for s in range(batch * heads)
    ]
    return torch.stack(tiles).view(batch, heads, rows, keys)


def _sliced_dropout_reference(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What :class:`_SlicedDropoutAttention` computes, in differentiable ops with the same masks (double backward)."""
    compute = _compute_dtype(q.dtype)
    inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
    batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
    pieces = []
    for index, start, end, span in plan.blocks():
        keys = span.stop  # this route's plans do not skip leading keys
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., :keys, :].to(compute), v[..., :keys, :].to(compute)
        visible, empty = _settle_empty_rows(plan.visible(start, end, span, q.device))
        scores = torch.matmul(qc * plan.scale, kc.transpose(-2, -1))  # (b, h, block, keys)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        keep = _sliced_keep_mask(plan, index, batch, heads, end - start, keys)
        weights = torch.softmax(scores, dim=-1) * keep * inverse_keep
        block_out = torch.matmul(weights, vc)  # (b, h, block, dv)
        if empty is not None:
            block_out = block_out.masked_fill(empty, 0.0)
        pieces.append(block_out)
    return torch.cat(pieces, dim=-2).to(q.dtype)  # (b, h, lq, dv)
