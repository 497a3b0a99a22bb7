"""Chunked attention as a batch of chunks: one fused call where every chunk attends within itself.

When the only rules are chunks (and causality inside them) on a square call whose first index
starts a chunk, the ``(b, h, l, d)`` heads are cut into ``(b * l / C, h, C, d)`` and handed to
PyTorch's fused kernel at once: the ``l * C`` pairs of the chunks are computed, nothing else,
forward and backward, in one kernel call (a last, shorter chunk gets a call of its own).

Shape legend: b batch, h heads, hk key/value heads, l length, C chunk size, d head size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._reasons import not_fused_alone
from selfattn.functional._kernels import fused_attention
from selfattn.masks import Causal, Chunks

__all__ = ["CHUNKS"]


def _chunk_size(call: AttentionCall) -> int | None:
    found = call.visibility.find(Chunks)
    return found.size if isinstance(found, Chunks) else None


def _declines(call: AttentionCall) -> str | None:
    size = _chunk_size(call)
    if size is None:
        return "no chunks"
    if any(isinstance(rule, Chunks) and rule.size != size for rule in call.visibility.rules):
        return "chunks of several sizes: the route cuts the keys by one"
    if not call.visibility.only(Causal, Chunks):
        return "rules other than chunks and causal"
    if not call.visibility.square:
        return "not a square call (queries and keys differ)"
    if not isinstance(call.num_queries, int) or call.compiling:
        return "compiling: the chunks are cut by the length"
    if call.visibility.q_first % size:
        return "the first query does not start a chunk"
    if call.term is not None or call.bias is not None or call.return_weights or not call.four_d:
        return not_fused_alone(call)
    if call.num_queries <= size:
        return "one chunk: the fused route takes it as it is"
    return None


def _as_chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """``(b, h, m * C, d)`` -> ``(b * m, h, C, d)``: each chunk one batch entry.

    A view when the heads were split from a ``(b, l, h * d)`` projection (the usual layout);
    a copy only when the heads are laid out head-major.
    """
    b, h, length, d = x.shape
    return x.view(b, h, length // size, size, d).transpose(1, 2).reshape(-1, h, size, d)  # via (b, m, h, C, d)


def _run(call: AttentionCall) -> Output:
    size = _chunk_size(call)
    assert size is not None
    q, k, v = call.q, call.k, call.v
    b, length = q.shape[0], q.shape[2]
    whole = length // size * size
    causal = call.visibility.causal

    def attend(q_part: torch.Tensor, k_part: torch.Tensor, v_part: torch.Tensor) -> torch.Tensor:
        return fused_attention(
            q_part, k_part, v_part, causal=causal, dropout_p=call.dropout_p, scale=call.scale, mask=None, bias=None
        )

    q_chunks, k_chunks, v_chunks = (_as_chunks(x[..., :whole, :], size) for x in (q, k, v))  # (b * m, h, C, d)
    out = attend(q_chunks, k_chunks, v_chunks)  # (b * m, h, C, dv)
    out = out.view(b, -1, *out.shape[1:]).transpose(1, 2).flatten(2, 3)  # (b, h, m, C, dv) -> (b, h, whole, dv)
    if whole < length:  # the last, shorter chunk
        tail = attend(q[..., whole:, :], k[..., whole:, :], v[..., whole:, :])
        out = torch.cat((out, tail), dim=-2)
    return Output(out)


CHUNKS = Route("chunks", _declines, _run)
