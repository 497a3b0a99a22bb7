"""Score terms through FlexAttention (``torch.nn.attention.flex_attention``), for CUDA.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["flex_applies", "flex_score_attention"]

#: FlexAttention's compiled CUDA kernel rejects smaller head sizes ("NYI: embedding dimension of
#: the query, key, and value must be at least 16", seen with torch 2.11 on an H100).
FLEX_MIN_HEAD_SIZE = 16


def flex_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`flex_score_attention` should take ``q`` ``(..., d)`` and ``v`` ``(..., dv)``: on CUDA, d, dv >= 16."""
    return q.device.type == "cuda" and min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_SIZE


def flex_score_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    term: Any,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention with ``term``'s ``score_mod`` (:meth:`~selfattn.positional.ScoreEncoding.to_score_mod`).

    Hidden keys (``mask``, ``causal``, lower-right aligned) get ``-inf`` inside the
    ``score_mod``; a query that sees no key gets an output row of zeros. On CUDA the kernel
    is compiled (``torch.compile``); elsewhere FlexAttention runs its eager reference, which
    is how the CPU tests check it.

    Args:
        q: ``(b, h, lq, d)``; k: ``(b, h, lk, d)``; v: ``(b, h, lk, dv)``.
        term: a score encoding with :meth:`to_score_mod`.
        q_positions: integer ``(lq,)`` or ``(b, lq)``; k_positions: ``(lk,)`` or ``(b, lk)``.
        mask: bool, True = attend, broadcastable to ``(b, h, lq, lk)``.
        causal: query ``i`` attends keys ``j <= i + lk - lq``.
        scale: score scale, default ``1 / sqrt(d)``.

    Returns:
        ``(b, h, lq, dv)``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    batch, heads, num_queries, head_dim = q.shape
    num_keys = k.shape[-2]
    term_mod, _ = term.to_score_mod(q_positions=q_positions, k_positions=k_positions, q=q)
    full_mask = None if mask is None else mask.expand(batch, heads, num_queries, num_keys)  # a view, no copy
    shift = num_keys - num_queries

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        score = term_mod(score, b, h, q_idx, kv_idx)
        if causal:
            score = torch.where(kv_idx <= q_idx + shift, score, float("-inf"))
        if full_mask is not None:
            score = torch.where(full_mask[b, h, q_idx, kv_idx], score, float("-inf"))
        return score

    kernel = torch.compile(flex_attention) if q.device.type == "cuda" else flex_attention
    out: torch.Tensor = kernel(
        q, k, v, score_mod=score_mod, scale=1.0 / math.sqrt(head_dim) if scale is None else scale
    )
    empty = None
    if full_mask is not None:
        empty = ~full_mask.any(dim=-1, keepdim=True)  # (b, h, lq, 1)
    if causal and shift < 0:
        rows = torch.arange(num_queries, device=q.device)[:, None] + shift < 0  # (lq, 1)
        empty = rows if empty is None else empty | rows
    return out if empty is None else out.masked_fill(empty, 0.0)
