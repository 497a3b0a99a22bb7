"""A score term's elementwise form in FlexAttention's compiled kernel (CUDA).

Shape legend: b batch, h heads, lq queries, dv value size.
"""

from __future__ import annotations

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import blocks_decline, heads
from selfattn.functional._flex import FLEX_MIN_HEAD_SIZE, flex_attention_with

__all__ = ["FLEX"]


def _declines(call: AttentionCall) -> str | None:
    if call.term is None:
        return "no score term"
    reason = blocks_decline(call)
    if reason is None and call.device.type != "cuda":
        reason = "not on CUDA"
    elif reason is None and not (call.term.has_elementwise_form and call.term.compiles_in_flex):
        reason = "the term has no elementwise form FlexAttention compiles (pair_bias, compiles_in_flex)"
    elif reason is None and call.value_term:
        reason = "a value term needs the weights"
    elif reason is None and call.dropout_p > 0:
        reason = "dropout"
    elif reason is None and min(call.head_dim, call.value_dim) < FLEX_MIN_HEAD_SIZE:
        reason = f"head size below {FLEX_MIN_HEAD_SIZE}"
    return reason


def _run(call: AttentionCall) -> Output:
    return Output(flex_attention_with(call, *heads(call)))


FLEX = Route("flex", _declines, _run)
