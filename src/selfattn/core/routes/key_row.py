"""A key-only score term (ALiBi's causal form) seen alike by every query: one row of float mask, flash blocks.

Shape legend: b batch, h heads, lq queries, lk keys, dv value size.
"""

from __future__ import annotations

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import cpu_term_declines, plan_for, run_plan
from selfattn.core.routes._decode import decode_step, takes_decode_step
from selfattn.core.routes._reasons import not_simple_term
from selfattn.functional._block_common import _compute_dtype
from selfattn.functional._block_key_rows import _key_only_bias

__all__ = ["KEY_ROW"]


def _declines(call: AttentionCall) -> str | None:
    reason = cpu_term_declines(call)
    if reason is None and call.visibility.causal:
        reason = "causal: each query sees other keys"
    elif reason is None and not call.simple_term:
        reason = not_simple_term(call)
    elif reason is None and not call.visibility.same_for_every_query:
        reason = "queries see different keys"
    elif reason is None and (call.num_keys == 0 or not call.key_only):
        reason = "the term has no key-only form"
    return reason


def _run(call: AttentionCall) -> Output:
    assert call.term is not None and call.k_positions is not None
    key_bias = _key_only_bias(call.term, call.k_positions, call.visibility, _compute_dtype(call.dtype))
    if takes_decode_step(call):
        return Output(decode_step(call, key_bias))  # (1 or b, h, 1, lk): finite, no rule hides a key
    # The mask is one row: a block costs O(lk) however many queries it has.
    plan = plan_for(call, block=call.block_size or call.num_queries, key_bias=key_bias)
    return Output(run_plan(call, plan))


KEY_ROW = Route("blockwise key row", _declines, _run)
