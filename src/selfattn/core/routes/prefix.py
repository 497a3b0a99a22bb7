"""Prefix-LM attention as two fused calls: the prefix among itself, and causal attention for the rest.

``causal() | prefix(P)`` on a whole sequence lets query ``i < P`` see keys ``j < P`` and query
``i >= P`` see keys ``j <= i`` (the prefix is before it anyway). So the rows past the prefix
are plain causal attention, and the prefix rows are full attention over the prefix: one causal
call of PyTorch's fused kernel for every row (its first ``P`` rows are then replaced; they cost
``P^2 / 2`` pairs), and one unmasked call for the ``P x P`` prefix, forward and backward; with
a length per sequence, one such call for the sequences of each length. A dense mask would send
the call to the kernel with every ``(l, l)`` pair and a mask to read.

Shape legend: b batch, h heads, l length, P prefix length, dv value size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._reasons import not_fused_alone
from selfattn.functional._kernels import fused_attention
from selfattn.masks import Any, Causal, Prefix

__all__ = ["PREFIX"]


def _prefix(call: AttentionCall) -> Prefix | None:
    """The prefix rule when the call's one rule is ``causal() | prefix(lengths)``, else None."""
    rules = call.visibility.rules
    if len(rules) != 1 or not isinstance(rules[0], Any) or len(rules[0].rules) != 2:
        return None
    kinds = {type(rule): rule for rule in rules[0].rules}
    prefix = kinds.get(Prefix)
    return prefix if Causal in kinds and isinstance(prefix, Prefix) else None


def _declines(call: AttentionCall) -> str | None:
    prefix = _prefix(call)
    if prefix is None:
        return "not causal() | prefix(lengths)"
    if not call.visibility.square or call.visibility.q_first != 0:
        return "not a whole sequence (a square call from its first token)"
    if call.compiling:
        return "compiling: the prefix is cut by its length"
    if call.term is not None or call.bias is not None or call.return_weights or not call.four_d:
        return not_fused_alone(call)
    lengths = prefix.lengths
    if isinstance(lengths, torch.Tensor) and lengths.shape[0] not in (1, call.batch):
        return f"{lengths.shape[0]} prefix lengths for a batch of {call.batch}"
    return None


def _run(call: AttentionCall) -> Output:
    prefix = _prefix(call)
    assert prefix is not None
    q, k, v = call.q, call.k, call.v
    batch, length = q.shape[0], q.shape[-2]
    lengths = prefix.lengths
    per_sequence = [lengths] * batch if isinstance(lengths, int) else lengths.expand(batch).tolist()

    def attend(q_part: torch.Tensor, k_part: torch.Tensor, v_part: torch.Tensor, causal: bool) -> torch.Tensor:
        return fused_attention(
            q_part, k_part, v_part, causal=causal, dropout_p=call.dropout_p, scale=call.scale, mask=None, bias=None
        )

    out = attend(q, k, v, True)  # (b, h, l, dv); the rows of each prefix are then replaced
    sizes = sorted({min(p, length) for p in per_sequence} - {0, 1})  # a prefix of 0 or 1 is causal already
    if sizes and out.requires_grad:
        out = out.clone()  # the fused kernel's backward reads its own output
    for size in sizes:
        rows = [i for i, p in enumerate(per_sequence) if min(p, length) == size]
        picked = slice(None) if len(rows) == batch else torch.tensor(rows, device=q.device)
        q_part, k_part, v_part = (_sequences(t, picked, size) for t in (q, k, v))  # (sequences, h, size, d)
        out[picked, :, :size] = attend(q_part, k_part, v_part, False)
    return Output(out)


def _sequences(t: torch.Tensor, picked: slice | torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` positions of the ``picked`` sequences of a ``(b or 1, h, l, d)`` tensor."""
    chosen = t if t.shape[0] == 1 or isinstance(picked, slice) else t[picked]
    return chosen[..., :size, :]


PREFIX = Route("prefix", _declines, _run)
