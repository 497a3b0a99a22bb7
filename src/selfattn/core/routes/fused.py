"""PyTorch's fused kernel (``scaled_dot_product_attention``): the default route.

Shape legend: b batch, h heads, lq queries, dv value size.
"""

from __future__ import annotations

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route, Step
from selfattn.functional._kernels import fused_attention
from selfattn.functional._unmasked import causal_square_step, fused_unmasked, unmasked_step

__all__ = ["FUSED"]


def _declines(call: AttentionCall) -> str | None:
    return None  # the kernel takes every call that no faster route took


def _run(call: AttentionCall) -> Output:
    bias = call.full_bias()
    rules = call.visibility.rules
    if not rules and bias is None:  # nothing to prepare: a decoding step's call
        return Output(fused_unmasked(call.q, call.k, call.v, scale=call.scale, dropout_p=call.dropout_p))
    kernel_causal = bool(rules) and bias is None and call.visibility.kernel_causal
    mask = None if kernel_causal or not rules else call.dense_mask()  # no rule (decoding): no mask to render
    out = fused_attention(
        call.q, call.k, call.v, mask=mask, bias=bias, causal=kernel_causal, dropout_p=call.dropout_p,
        scale=call.scale, checked=True,
    )  # fmt: skip
    return Output(out)  # (b, h, lq, dv)


def _step_for(call: AttentionCall, causal: bool) -> Step | None:
    """``_run``'s path for a call with no bias or dropout, and no rule or (``causal``) the causal one on a square."""
    if call.modifies_scores:
        return None  # the kernel applies no softcap or sinks: the dispatcher gives such calls other routes
    if not causal:
        return unmasked_step(call.q, call.k, call.v, call.scale)
    return causal_square_step(call.scale) if call.num_queries == call.num_keys else None


FUSED = Route("fused", _declines, _run, step_for=_step_for)
