"""The "sparse selection" route's arithmetic: gathered attention per block of queries, forward and backward.

The forward pass keeps no gathered rows: it returns the output and each row's log-sum-exp, and
the backward pass gathers each block's rows again and recomputes its weights (as flash
attention recomputes its tiles). Left to autograd, every block's gathered keys and values
would be kept until the backward pass: ``lq x t x (d + dv)`` numbers per kv head, 154 GB for a
16,384-token DeepSeek-V3.2 prefill in the absorbed form (top-k 2048, keys and values the 576-wide
latent), where the keys hold 38 MB.

Shape legend: b batch, h heads, hk key/value heads, g = h / hk, lq queries, lk keys,
t picks per query, q block of queries, d head size, dv value size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SeenOf", "sparse_attention_blocks"]

#: ``seen_of(start, end)``: bool ``(b, 1 or h, q, t)``, which picks of queries ``[start, end)`` are attended.
SeenOf = Callable[[int, int], torch.Tensor]


class _Rows:
    """Storage for one block's gathered key and value rows, allocated once per pass and reused block after block.

    ``index_select`` into reused storage measured 4x faster than into a fresh tensor (16,384 rows
    of 576 floats, one thread: a fresh tensor of several MiB is page-faulted in each time). When
    the values are the keys' first ``dv`` features (absorbed latent attention hands the latent
    ``[c, k_rope]`` as the keys and its view ``c`` as the values), the rows are gathered once and
    the values read from them.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: int):
        self.shared = _leading_features(k, v)
        self.keys = k.new_empty(rows, k.shape[-1])
        self.values = None if self.shared else v.new_empty(rows, v.shape[-1])

    def gather(self, k: torch.Tensor, v: torch.Tensor, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``picks (q, t)`` of one head's ``k (lk, d)`` and ``v (lk, dv)``: ``(q, t, d)``, ``(q, t, dv)``."""
        flat, count = picks.reshape(-1), picks.numel()
        keys = torch.index_select(k, 0, flat, out=self.keys[:count]).view(*picks.shape, -1)
        if self.values is None:
            return keys, keys[..., : v.shape[-1]]
        return keys, torch.index_select(v, 0, flat, out=self.values[:count]).view(*picks.shape, -1)


def _leading_features(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``v`` is ``k[..., :dv]``: the same storage, rows and strides, its features a prefix of the keys'."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.shape[:-1] == k.shape[:-1]
        and v.shape[-1] <= k.shape[-1]
        and v.stride() == k.stride()
    )


def _weights(
    q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights (q, g, t), log-sum-exp (q, g))`` of queries ``q (q, g, d)`` over their rows ``keys (q, t, d)``.

    ``seen (q, 1 or g, t)``. Given ``lse`` (the backward pass), the weights are recomputed from it.
    A row that sees no key gets zero weights and a log-sum-exp of 0 (finite: no NaN anywhere).
    """
    # keys @ q^T, not q @ keys^T: with few query rows (g heads, 16 in DeepSeek's absorbed form) the product
    # reads the gathered rows as they lie (1.6x faster measured, 16 x 576 against 2048 rows, one thread).
    scores = torch.bmm(keys, q.transpose(1, 2)).transpose(1, 2) * scale  # (q, g, t), laid out (q, t, g)
    if lse is None:
        masked = scores.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(masked, dim=-1)
        # 0 where the row sees no key, decided by what it sees: an infinite query's scores may all be -inf (or
        # one +inf), and the formula's NaN must stay, not become a zero row
        lse = torch.where(seen.any(dim=-1), lse, 0.0)
    weights = torch.where(seen, torch.exp(scores - lse[..., None]), 0.0)
    # Divided by their sum (the same in both passes): lse's float32 rounding at scores of 1e4 (5e-4) left rows
    # summing to 1 - 5e-4, an output 0.05 off and a query's gradient 150% off float64. A row that sees no key
    # keeps its zeros, a NaN row its NaN.
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, 1.0), lse


def _heads(q_heads: int, kv_heads: int, seen: torch.Tensor, s: int, j: int) -> tuple[slice, torch.Tensor]:
    """The query heads of kv head ``j`` and their ``seen`` rows ``(1 or g, q, t)`` in sequence ``s``."""
    group = q_heads // kv_heads
    query_heads = slice(j * group, (j + 1) * group)
    return query_heads, seen[s, query_heads] if seen.shape[1] > 1 else seen[s]


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, picks: torch.Tensor, seen_of: SeenOf, scale: float, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (b, h, lq, dv), lse (b, h, lq))``, one block of queries, sequence and kv head at a time."""
    (b, h, lq, _), hk = q.shape, k.shape[1]
    out, lse = q.new_zeros(b, h, lq, v.shape[-1]), q.new_zeros(b, h, lq)
    rows = _Rows(k, v, min(block, lq) * picks.shape[-1])
    for start in range(0, lq, block):
        end = min(start + block, lq)
        seen = seen_of(start, end)
        for s in range(b):
            for j in range(hk):
                heads, head_seen = _heads(h, hk, seen, s, j)
                keys, values = rows.gather(k[s, j], v[s, j], picks[s, start:end])
                qg = q[s, heads, start:end].transpose(0, 1)  # (q, g, d)
                weights, row_lse = _weights(qg, keys, head_seen.transpose(0, 1), scale, None)
                out[s, heads, start:end] = torch.bmm(weights, values).transpose(0, 1)
                lse[s, heads, start:end] = row_lse.transpose(0, 1)
    return out, lse


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v: each block's rows gathered again, its weights recomputed from the saved lse."""
    q, k, v, picks, lse = ctx.saved_tensors
    (b, h, lq, _), hk = q.shape, k.shape[1]
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = _Rows(k, v, min(ctx.block, lq) * picks.shape[-1])
    for start in range(0, lq, ctx.block):
        end = min(start + ctx.block, lq)
        seen = ctx.seen_of(start, end)
        for s in range(b):
            for j in range(hk):
                heads, head_seen = _heads(h, hk, seen, s, j)
                block_picks = picks[s, start:end]
                keys, values = rows.gather(k[s, j], v[s, j], block_picks)
                qg = q[s, heads, start:end].transpose(0, 1)  # (q, g, d)
                row_lse = lse[s, heads, start:end].transpose(0, 1)
                weights, _ = _weights(qg, keys, head_seen.transpose(0, 1), ctx.scale, row_lse)  # (q, g, t)
                grad_o = grad_out[s, heads, start:end].transpose(0, 1)  # (q, g, dv)
                flat = block_picks.reshape(-1)
                grad_v[s, j].index_add_(0, flat, torch.bmm(weights.transpose(1, 2), grad_o).flatten(0, 1))
                grad_weights = torch.bmm(grad_o, values.transpose(1, 2))  # (q, g, t)
                # A query's whole row of picks is in the block, so the softmax's correction is summed here.
                correction = (weights * grad_weights).sum(-1, keepdim=True)
                grad_scores = weights * (grad_weights - correction) * ctx.scale  # (q, g, t)
                grad_q[s, heads, start:end] = torch.bmm(grad_scores, keys).transpose(0, 1)
                grad_k[s, j].index_add_(0, flat, torch.bmm(grad_scores.transpose(1, 2), qg).flatten(0, 1))
    return grad_q, grad_k, grad_v


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        q, k, v, picks, seen_of, scale, block = args
        out, lse = _forward(q, k, v, picks, seen_of, scale, block)
        ctx.save_for_backward(q, k, v, picks, lse)
        ctx.seen_of, ctx.scale, ctx.block = seen_of, scale, block
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (*_backward(ctx, grads[0].contiguous()), None, None, None, None)


def sparse_attention_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, picks: torch.Tensor, seen_of: SeenOf, scale: float, block: int
) -> torch.Tensor:
    """Attention of ``q (b, h, lq, d)`` over its picks ``(b, lq, t)`` of ``k (b, hk, lk, d)``, ``v (b, hk, lk, dv)``.

    ``picks`` are valid key indices (an unused or repeated slot is hidden by ``seen_of``); blocks
    of ``block`` queries. Returns ``(b, h, lq, dv)``; differentiable in ``q``, ``k`` and ``v`` with
    memory for the inputs, the output and one block's rows.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out: torch.Tensor = _SparseAttention.apply(q, k, v, picks, seen_of, scale, block)  # type: ignore[no-untyped-call]
        return out
    return _forward(q, k, v, picks, seen_of, scale, block)[0]
