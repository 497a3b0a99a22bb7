"""Dropout or a softcap (sinks with them) and no score term on CPU: one ``(batch, head)`` slice at a time, in tiles.

Shape legend: b batch, h heads, lq queries, dv value size.
"""

from __future__ import annotations

import torch

import selfattn.functional._block_sliced as _block_sliced
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import blocks_decline, heads, plan_for

__all__ = ["SLICED"]


def _declines(call: AttentionCall) -> str | None:
    if call.term is not None:
        return "a score term"
    if call.dropout_p == 0 and call.softcap is None:
        return "no dropout and no softcap"
    reason = blocks_decline(call)
    if reason is None and not call.on_cpu:
        reason = "not on CPU"
    elif reason is None and call.num_queries * call.num_keys < _block_sliced.SLICED_MIN_SCORES:
        reason = f"fewer than {_block_sliced.SLICED_MIN_SCORES} scores per slice"
    return reason


def _run(call: AttentionCall) -> Output:
    block = call.block_size or _block_sliced.choose_slice_block(call.num_queries, call.num_keys, dtype=call.dtype)
    plan = plan_for(call, block=block, skip_leading_keys=True)
    q, k, v = heads(call)
    out: torch.Tensor = _block_sliced._SlicedAttention.apply(plan, q, k, v, call.sinks)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return Output(out)


SLICED = Route("sliced", _declines, _run, modifies_scores=True)
