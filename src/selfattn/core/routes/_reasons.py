"""Reasons a route declines, worded precisely: of several conditions that each decline, the ones that hold."""

from __future__ import annotations

from selfattn.core.call import AttentionCall

__all__ = ["holding", "not_simple_term", "not_fused_alone"]


def holding(*conditions: tuple[str, object]) -> str:
    """``"a, b"`` for the conditions ``(name, holds)`` that hold (each route checked that one does)."""
    return ", ".join(name for name, holds in conditions if holds)


def not_simple_term(call: AttentionCall) -> str:
    """Why the call's score term is not a plain float mask (:attr:`AttentionCall.simple_term` is False)."""
    return holding(
        ("the term reads the queries", call.term_reads_queries),
        ("the term has parameters that want gradients", call.term_parameters),
        ("the term adds to the values", call.value_term),
        ("there is dropout", call.dropout_p > 0),
    )


def not_fused_alone(call: AttentionCall) -> str:
    """Why a call cannot be handed to the fused kernel as it is (chunks, prefix)."""
    return holding(
        ("a score term", call.term is not None),
        ("a float bias (attn_mask)", call.bias is not None),
        ("the weights were asked for", call.return_weights),
        ("heads not (b, h, l, d)", not call.four_d),
    )
