"""Prefix-LM attention as two fused calls: the prefix among itself, and causal attention for the rest.

``causal() | prefix(P)`` on a whole sequence lets query ``i < P`` see keys ``j < P`` and query
``i >= P`` see keys ``j <= i`` (the prefix is before it anyway). So the rows past the prefix
are plain causal attention, and the prefix rows are full attention over the prefix: one causal
call of PyTorch's fused kernel for every row (its first ``P`` rows are then replaced; they cost
``P^2 / 2`` pairs), and one unmasked call for the ``P x P`` prefix, forward and backward. A dense
mask would send the call to the kernel with every ``(l, l)`` pair and a mask to read.

Shape legend: b batch, h heads, l length, P prefix length, dv value size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.functional._kernels import fused_attention
from selfattn.masks import Any, Causal, Prefix

__all__ = ["PREFIX"]


def _prefix_length(call: AttentionCall) -> int | None:
    """``P`` when the call's one rule is ``causal() | prefix(P)`` with an int ``P``, else None."""
    rules = call.visibility.rules
    if len(rules) != 1 or not isinstance(rules[0], Any) or len(rules[0].rules) != 2:
        return None
    kinds = {type(rule): rule for rule in rules[0].rules}
    prefix = kinds.get(Prefix)
    if Causal not in kinds or not isinstance(prefix, Prefix) or not isinstance(prefix.lengths, int):
        return None
    return prefix.lengths


def _declines(call: AttentionCall) -> str | None:
    length = _prefix_length(call)
    if length is None:
        return "not causal() | prefix(n) with an int n"
    if not call.visibility.square or call.visibility.q_first != 0:
        return "not a whole sequence (a square call from its first token)"
    if call.compiling:
        return "compiling: the prefix is cut by its length"
    if call.term is not None or call.bias is not None or call.return_weights or not call.four_d:
        return "a score term, a float bias, the weights or heads not (b, h, l, d)"
    if not 0 < length < call.num_queries:
        return "the prefix is empty or the whole sequence"
    return None


def _run(call: AttentionCall) -> Output:
    length = _prefix_length(call)
    assert length is not None
    q, k, v = call.q, call.k, call.v

    def attend(q_part: torch.Tensor, k_part: torch.Tensor, v_part: torch.Tensor, causal: bool) -> torch.Tensor:
        return fused_attention(
            q_part, k_part, v_part, causal=causal, dropout_p=call.dropout_p, scale=call.scale, mask=None, bias=None
        )

    rest = attend(q, k, v, True)  # (b, h, l, dv); its first P rows are replaced
    prefix = attend(q[..., :length, :], k[..., :length, :], v[..., :length, :], False)  # (b, h, P, dv)
    return Output(torch.cat((prefix, rest[..., length:, :]), dim=-2))


PREFIX = Route("prefix", _declines, _run)
