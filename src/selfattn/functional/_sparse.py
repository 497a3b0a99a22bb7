"""Sparse attention over selected keys, the pure function: :func:`attention` with ``masks.selected(indices)`` "and"-ed in.

Shape legend:
    b: batch size, h: heads, hk: key/value heads, lq: queries, lk: keys, t: picks per query,
    d: head size, dv: value size.
"""

from __future__ import annotations

from typing import Any

import torch

import selfattn.core.dispatch as dispatch
from selfattn.core.call import AttentionCall
from selfattn.functional._attention import describe_attention
from selfattn.masks import selected

__all__ = ["describe_sparse_attention", "sparse_attention"]


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~selfattn.functional.attention` where query ``r`` of sequence ``s`` sees only the keys ``indices[s, r]``.

    The selection (DeepSeek sparse attention's top-k, :class:`~selfattn.sparse.LightningIndexer`)
    is "and"-ed with ``mask`` and ``causal``: a pick past the query or on padding is not seen, so
    a query with fewer than ``t`` earlier keys sees those it picked. Where the picks are a small
    share of the keys the dispatcher's "sparse selection" route computes only them (gathered per
    block of queries); the answer and its gradients are the dense masked pass's either way.

    Args:
        q: ``(b, h, lq, d)`` queries.
        k: ``(b, hk, lk, d)`` keys (``hk`` divides ``h``).
        v: ``(b, hk, lk, dv)`` values.
        indices: integer ``(b or 1, lq, t)`` key indices per query, ``-1`` = an unused slot.
        **options: :func:`~selfattn.functional.attention`'s keywords (``mask``, ``causal``,
            ``scale``, ``bias``, ``dropout_p``, ``softcap``, ``sinks``, ``return_weights``).

    Returns:
        ``(b, h, lq, dv)`` output, or ``(output, weights)`` with ``return_weights=True``.

    Raises:
        ValueError: what :func:`~selfattn.functional.attention` refuses; ``q`` not ``(b, h, lq, d)``;
            ``indices`` not an integer ``(b, lq, t)`` tensor, of another batch or number of queries,
            or with an entry below -1 or not below ``lk``.
    """
    call = describe_sparse_attention(q, k, v, indices, **options)
    result = dispatch.run(call)
    return (result.out, result.weights) if call.return_weights else result.out  # type: ignore[return-value]


def describe_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, **options: Any
) -> AttentionCall:
    """The checked call of :func:`sparse_attention` (``dispatch.explain(describe_sparse_attention(...))`` names its route)."""
    plain = describe_attention(q, k, v, **options)
    if q.dim() != 4:
        raise ValueError(f"sparse_attention: q must be (b, h, lq, d), got shape {tuple(q.shape)}")
    return AttentionCall.of_heads(
        q, k, v, plain.visibility & selected(indices), bias=plain.bias, dropout_p=plain.dropout_p, scale=plain.scale,
        softcap=plain.softcap, sinks=plain.sinks, return_weights=plain.return_weights,
    )  # fmt: skip
