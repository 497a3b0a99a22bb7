"""Score terms through FlexAttention (``torch.nn.attention.flex_attention``), for CUDA.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from selfattn._validation import require_bool
from selfattn.core.call import AttentionCall
from selfattn.masks import Visibility, dense
from selfattn.masks import causal as causal_rule

__all__ = ["flex_attention_with", "flex_score_attention"]

#: FlexAttention's compiled CUDA kernel rejects smaller head sizes ("NYI: embedding dimension of
#: the query, key, and value must be at least 16", seen with torch 2.11 on an H100).
FLEX_MIN_HEAD_SIZE = 16
#: Compiled variants of the FlexAttention frame kept before dynamo falls back to eager.
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled_flex_attention() -> Any:
    """FlexAttention compiled once per process.

    Compiling inside every call handed dynamo a new function each time: every forward
    recompiled (T5 ran 224x slower than flash attention, fwd+bwd, on an H100). Compiled once,
    a new ``score_mod`` closure with the same code and tensors of the same shapes reuses the
    kernel.
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, scale: float) -> torch.Tensor:
    """One FlexAttention call: the compiled kernel on CUDA, the eager reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda":
        # Every encoding type, grad mode and mask layout is one more compiled entry of the one
        # flex_attention frame; past dynamo's default limit of 8 it silently ran the unfused
        # eager reference instead (T5 220x slower than flash attention on an H100).
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
            out: torch.Tensor = _compiled_flex_attention()(q, k, v, score_mod=score_mod, scale=scale)
    else:
        out = flex_attention(q, k, v, score_mod=score_mod, scale=scale)
    return out


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
    causal = require_bool("causal", causal)
    visibility = Visibility.lower_right(q.shape[-2], k.shape[-2], causal_rule() if causal else None)
    if mask is not None:
        visibility = visibility & dense(mask)
    options = {"q_positions": q_positions, "k_positions": k_positions, "term": term, "scale": scale}
    return flex_attention_with(AttentionCall.of_heads(q, k, v, visibility, **options), q, k, v)


def flex_attention_with(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`flex_score_attention` for a described call (its term, positions, visibility, scale), ``(b, h, lq, dv)``."""
    term, visibility = call.term, call.visibility
    assert term is not None and call.q_positions is not None and call.k_positions is not None
    q_positions, k_positions, scale = call.q_positions, call.k_positions, call.scale
    term_mod, _ = term.to_score_mod(q_positions=q_positions, k_positions=k_positions, q=q)
    allowed = visibility.predicate()

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        score = term_mod(score, b, h, q_idx, kv_idx)
        if allowed is not None:
            score = torch.where(allowed(b, h, q_idx, kv_idx), score, float("-inf"))
        return score

    with torch.profiler.record_function("selfattn::flex_attention"):  # tells profilers (and benchmarks) the route
        out = _flex_call(q, k, v, score_mod, scale)
    visible = visibility.dense(q.device)
    if visible is None:
        return out
    empty = ~visible.any(dim=-1, keepdim=True)  # (.., lq, 1)
    return out.masked_fill(empty, 0.0)
