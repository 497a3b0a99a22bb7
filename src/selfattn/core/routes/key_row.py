"""A key-only score term (ALiBi's causal form) seen alike by every query: one row of float mask, flash blocks.

A decoding step (:func:`takes_decode_step`, no rule) is one row of bias and :func:`decode_step`'s matmuls, which
run on any device: on CUDA this route takes those steps before FlexAttention's compiled call would (its launch
costs more than the step's work).

Shape legend: b batch, h heads, lq queries, lk keys, dv value size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import blocks_decline, plan_for, run_plan
from selfattn.core.routes._decode import decode_step, takes_decode_step
from selfattn.core.routes._reasons import not_simple_term
from selfattn.functional._block_common import _as_4d, _compute_dtype
from selfattn.functional._block_key_rows import _key_only_bias

__all__ = ["KEY_ROW"]


def _declines(call: AttentionCall) -> str | None:
    if call.term is None:
        return "no score term"
    reason = blocks_decline(call)
    if reason is None and not call.on_cpu and not (takes_decode_step(call) and not call.visibility.rules):
        reason = "not on CPU (the flash kernel of these blocks is the CPU one) and not a decoding step"
    elif reason is None and call.visibility.causal:
        reason = "causal: each query sees other keys"
    elif reason is None and not call.simple_term:
        reason = not_simple_term(call)
    elif reason is None and not call.visibility.same_for_every_query:
        reason = "queries see different keys"
    elif reason is None and (call.num_keys == 0 or not call.key_only):
        reason = "the term has no key-only form"
    return reason


def _decoding_key_bias(call: AttentionCall) -> torch.Tensor:
    """:func:`_key_only_bias` where every key is visible (a decoding step), in two ops: ``(1 or b, h, 1, lk)``.

    Its anchor is then each sequence's last key position, so the row is the same to the bit.
    """
    assert call.term is not None and call.k_positions is not None
    positions = call.k_positions.long().reshape(-1, 1, 1, call.num_keys)  # (1 or b, 1, 1, lk)
    row = call.term.key_only_term(positions - positions.amax(dim=-1, keepdim=True), _compute_dtype(call.dtype))
    assert row is not None  # the route took the call: the term has a key-only form
    return _as_4d(row)


def _run(call: AttentionCall) -> Output:
    assert call.term is not None and call.k_positions is not None
    if takes_decode_step(call) and not call.visibility.rules:
        return Output(decode_step(call, _decoding_key_bias(call)))
    key_bias = _key_only_bias(call.term, call.k_positions, call.visibility, _compute_dtype(call.dtype))
    if takes_decode_step(call):
        return Output(decode_step(call, key_bias))  # -inf at hidden keys, and the rules applied again
    # The mask is one row: a block costs O(lk) however many queries it has.
    plan = plan_for(call, block=call.block_size or call.num_queries, key_bias=key_bias)
    return Output(run_plan(call, plan))


KEY_ROW = Route("blockwise key row", _declines, _run)
