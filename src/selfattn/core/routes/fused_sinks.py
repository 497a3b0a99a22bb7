"""Attention sinks in one call of the CPU flash kernel, by its log-sum-exp.

A sink logit ``s`` joins each row's denominator and adds no value, so the output with the sink
is the kernel's output times the keys' share ``f = sigmoid(lse - s)``, and the kernel's own backward,
handed that output, its own log-sum-exp and the incoming gradient times ``f``, gives the exact gradients
of ``q, k, v``; the sink's is ``-sum(p_sink * rowsum(dO * O))``. With no other mask than the kernel's
causal one, this is one call forward and one backward, where the blockwise route loops over blocks.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import blocks_decline, heads
from selfattn.core.routes._decode import decode_step, decode_step_for, takes_decode_step
from selfattn.core.routes._reasons import holding
from selfattn.functional._block_common import _compute_dtype, _flash_backward, _flash_forward, _keys_share
from selfattn.functional._kernels import attention_weights

__all__ = ["FUSED_SINKS"]


class _FlashWithSinks(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, causal: bool, scale: float
    ) -> torch.Tensor:
        kernel: tuple[torch.Tensor, torch.Tensor] = _flash_forward(q, k, v, 0.0, causal, scale=scale)
        out, lse = kernel  # (b, h, lq, dv), (b, h, lq)
        compute = _compute_dtype(q.dtype)
        share = _keys_share(lse.to(compute), sinks.detach().to(compute))  # (b, h, lq)
        out = out * share.unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse, share)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, out, lse, share = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the formula written in plain ops
            inputs = (q, k, v, sinks)
            weights = attention_weights(q, k, causal=ctx.causal, scale=ctx.scale, sinks=sinks)
            recomputed = torch.matmul(weights, v)  # (b, h, lq, dv)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(recomputed, wanted, grad_out, create_graph=True))
            return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)
        # The kernel's backward on its own log-sum-exp (the weights without the sink, P) with the incoming gradient
        # times the share f: its P (f dO . v_j - f dO . out) is the sinks' f P (dO . v_j - dO . out), the gradient
        # of the scores, and its P^T (f dO) the values'; the output it reads is this one (f O).
        scaled = (grad_out * share.unsqueeze(-1).to(grad_out.dtype)).contiguous()
        dq, dk, dv = _flash_backward(scaled, q, k, v, out, lse, 0.0, ctx.causal, scale=ctx.scale)
        compute = share.dtype
        sink_weight = torch.sigmoid(sinks.detach().to(compute)[:, None] - lse.to(compute))  # (b, h, lq)
        row_dot = (grad_out.to(compute) * out.to(compute)).sum(dim=-1)  # (b, h, lq)
        dsinks = -(sink_weight * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


def _declines(call: AttentionCall) -> str | None:
    if call.sinks is None:
        return "no sinks"
    reason = blocks_decline(call)
    if reason is None and call.softcap is not None:
        reason = "a softcap (the scores must be computed)"
    elif reason is None and (call.term is not None or call.dropout_p > 0):
        reason = holding(("a score term", call.term is not None), ("dropout", call.dropout_p > 0))
    elif reason is None and not call.on_cpu:
        reason = "not on CPU (the kernel with a log-sum-exp is the CPU one)"
    elif reason is None and call.visibility.rules and not call.visibility.kernel_causal:
        reason = "a mask other than causal on a square"
    return reason


def _run(call: AttentionCall) -> Output:
    if takes_decode_step(call):
        return Output(decode_step(call))  # no copy of the keys per query head
    q, k, v = heads(call)
    assert call.sinks is not None
    out: torch.Tensor = _FlashWithSinks.apply(q, k, v, call.sinks, call.visibility.causal, call.scale)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return Output(out)


FUSED_SINKS = Route("fused sinks", _declines, _run, modifies_scores=True, step_for=decode_step_for)
