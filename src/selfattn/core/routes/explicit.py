"""Scores, softmax and weighted sum written out: the route that returns the weights, and the value term's.

Shape legend: b batch, h heads, lq queries, lk keys, dv value size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.functional._kernels import _repeat_kv, attention_weights

__all__ = ["EXPLICIT", "EXPLICIT_MODIFIERS", "EXPLICIT_VALUE_TERM"]


def _declines_weights(call: AttentionCall) -> str | None:
    return None if call.return_weights else "the weights were not asked for"


def _declines_value_term(call: AttentionCall) -> str | None:
    return None if call.value_term else "no value term"


def _declines_modifiers(call: AttentionCall) -> str | None:
    return None if call.modifies_scores else "no softcap and no sinks"


def _run(call: AttentionCall) -> Output:
    """``weights @ v`` (plus the term's value term), and the weights before dropout."""
    mask = call.dense_mask()
    weights = attention_weights(
        call.q, call.k, mask=mask, bias=call.full_bias(), scale=call.scale, softcap=call.softcap, sinks=call.sinks
    )
    dropped = F.dropout(weights, p=call.dropout_p) if call.dropout_p > 0 else weights
    out = torch.matmul(dropped, _repeat_kv(call.q, call.v))  # (b, h, lq, dv)
    if mask is not None:
        # A row the mask lets see no key weighs every key 0, and 0 times a NaN value it does not see is NaN: its
        # output is zeros, as on the fused route (whatever the weights asked for). Read off the mask, not the
        # weights: the tour's product distances (selfattn.tour.paths) follow the weights, not the mask.
        out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    if call.term is not None and call.value_term:
        assert call.q_positions is not None and call.k_positions is not None
        out = out + call.term.value_term(dropped, q_positions=call.q_positions, k_positions=call.k_positions)
    if call.term is not None and call.softcap is None:
        # A term's bias formed from a query holding an infinity can be -inf at every key, which attention_weights
        # reads as a mask (a row that sees no key: zeros); the formula's row is NaN, as the fused route gives.
        guard = call.q.sum(dim=-1, keepdim=True).mul(0)  # (b, h, lq, 1)
        out, weights = out + guard.to(out.dtype), weights + guard.to(weights.dtype)
    return Output(out, weights if call.return_weights else None)


EXPLICIT_VALUE_TERM = Route("explicit value term", _declines_value_term, _run, modifies_scores=True)
EXPLICIT = Route("explicit", _declines_weights, _run, modifies_scores=True)
#: Softcap or sinks where no blockwise route could take them (a compiled graph, a float bias): O(lq * lk) memory.
EXPLICIT_MODIFIERS = Route("explicit softcap/sinks", _declines_modifiers, _run, modifies_scores=True)
