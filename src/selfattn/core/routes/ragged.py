"""A ragged batch: each group of sequences of one valid length attends over its own keys only, no mask.

Shape legend: b batch, h heads, l queries, dh head size, d model size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._groups import length_groups, pick_rows, project_keys, ragged_declines
from selfattn.functional._kernels import fused_attention

__all__ = ["RAGGED"]


def _run(call: AttentionCall) -> Output:
    """``(b, lq, h * dh)``, the heads merged and ready for ``W_o``.

    Query rows past a sequence's valid length are kept, and see its valid keys, as on the
    masked path. A group whose sequences are neighbours in the batch is read as a view; the
    others are gathered with one ``index_select`` each. Outputs are written straight into one
    buffer (or, for one group in one call, returned as they are).
    """
    assert call.inputs is not None and call.ragged_lengths is not None
    q, causal, dropout_p = call.q, call.visibility.causal, call.dropout_p
    batch, heads, num_queries, _ = q.shape
    merged = q.new_empty(batch, num_queries, heads * call.value_dim)  # (b, lq, h * dv)

    def attend(q_g: torch.Tensor, k_g: torch.Tensor, v_g: torch.Tensor, causal: bool) -> torch.Tensor:
        return fused_attention(
            q_g, k_g, v_g, mask=None, bias=None, causal=causal, dropout_p=dropout_p, scale=call.scale
        )

    for length, take in length_groups(call.ragged_lengths, q.device):

        def put(start: int, out_g: torch.Tensor, take: slice | torch.Tensor = take) -> None:
            # (b_g, h, l_g, dh) -> (b_g, l_g, d): a view of the kernel's (b_g, l_g, h, dh) output
            merged[take, start : start + out_g.shape[-2]] = out_g.transpose(1, 2).flatten(2)

        if length == 0:
            merged[take] = 0.0  # no key to see: a zero row, as on the masked path
            continue
        q_g = pick_rows(q, take)  # (b_g, h, lq, dh)
        k_g, v_g = project_keys(call.inputs, length, take)  # (b_g, hk, length, dh)
        if causal and length < num_queries:
            # Queries before the valid length are a square causal problem; later ones see all `length` keys.
            put(0, attend(q_g[..., :length, :], k_g, v_g, True))
            put(length, attend(q_g[..., length:, :], k_g, v_g, False))
        else:
            out_g = attend(q_g, k_g, v_g, causal)  # (b_g, h, lq, dh)
            if isinstance(take, slice) and take == slice(0, batch):
                return Output(out_g.transpose(1, 2).flatten(2), stage="merged")  # one group: no buffer
            put(0, out_g)
    return Output(merged, stage="merged")


def _declines(call: AttentionCall) -> str | None:
    reason = ragged_declines(call)
    if reason is None and call.inputs is not None and call.inputs.skip_padded_queries:
        reason = "skip_padded_queries: the valid-rows route's"
    return reason


RAGGED = Route("ragged", _declines, _run)
