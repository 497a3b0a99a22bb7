"""A decoding step of the routes that compute scores themselves, without repeating the keys per query head.

The blockwise and sink routes hand every query head its own copy of the keys and values
(:func:`~selfattn.core.routes._blocks.heads`): with grouped-query attention that copies the
whole cache at every decoded token, which costs more than attention itself. A decoding step has
a few queries (its causal rule hides nothing and was dropped), so its scores and mask are small:
here the ``g`` query heads of each key/value head are laid side by side as ``g * lq`` rows of one
head, and a single matmul with the keys as they are gives every score. The rest is the formula:
the term's bias, the softcap, the sinks' column in the softmax, the weighted sum of the values.

Shape legend: b batch, h heads, hk key/value heads, g = h / hk, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Step
from selfattn.functional._block_common import _compute_dtype

__all__ = ["DECODE_MAX_QUERIES", "decode_step", "decode_step_for", "takes_decode_step"]

#: At most this many queries make a decoding step (speculative decoding checks a few tokens at once).
DECODE_MAX_QUERIES = 8


def takes_decode_step(call: AttentionCall) -> bool:
    """Whether :func:`decode_step` computes ``call``: a few queries after more keys (a cache's), no dropout, no
    value term, eager, and nothing that wants a gradient (training keeps the routes' own autograd Functions)."""
    if (
        call.num_queries > DECODE_MAX_QUERIES
        or call.num_keys <= call.num_queries  # a short prompt's own pass stays on the route's blocks
        or call.dropout_p > 0
        or call.value_term
        or not call.four_d
        or call.compiling
    ):
        return False
    if not torch.is_grad_enabled():
        return True
    sinks_grad = call.sinks is not None and call.sinks.requires_grad
    return not (
        sinks_grad or call.term_parameters or call.q.requires_grad or call.k.requires_grad or call.v.requires_grad
    )


def decode_step(call: AttentionCall, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(softcap(q k^T * scale + bias), sinks) v`` for a call :func:`takes_decode_step` accepts, ``(b, h, lq, dv)``.

    ``bias``: float, broadcastable to ``(b, h, lq, lk)`` (a score term's). The call's rules (a window,
    padding, a mask) hide keys as in the blockwise routes: a query that sees no key gets zeros.
    Scores and softmax in float32 (float64 for float64 heads), as the blockwise routes compute them.
    """
    visible = call.dense_mask() if call.visibility.rules else None  # bool (.., lq, lk): a few rows
    return _decode(call.q, call.k, call.v, call.scale, call.softcap, call.sinks, bias, visible)


def decode_step_for(call: AttentionCall, causal: bool) -> Step | None:
    """The step form (:attr:`~selfattn.core.route.Route.step_for`) of a route that computes its decoding steps by
    :func:`decode_step`: for a kind of call that :func:`takes_decode_step` accepts whatever its number of keys
    beyond the queries' (no gradient: grad mode off), with no rule, term or bias; None for any other kind. With
    no more keys than queries the route runs its blocks (the same formula, within rounding): such a call has no
    step form, and a plan's kind tells it from a step's (a replay must give the full path's bits)."""
    if (
        causal
        or call.num_keys <= call.num_queries
        or call.visibility.rules
        or call.term is not None
        or call.bias is not None
        or call.num_queries > DECODE_MAX_QUERIES
        or call.dropout_p > 0
        or not call.four_d
        or call.compiling
        or torch.is_grad_enabled()
    ):
        return None
    scale, softcap, sinks = call.scale, call.softcap, call.sinks  # a layer's sinks: the parameter itself

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _decode(q, k, v, scale, softcap, sinks, None, None)

    return step


def _decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`decode_step` of these heads and options; ``visible``: bool ``(.., lq, lk)``, True = seen, or None."""
    batch, heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[-3], k.shape[-2]
    group = heads // kv_heads
    compute = _compute_dtype(q.dtype)
    rows = q.reshape(batch, kv_heads, group * num_queries, head_dim).to(compute)  # a view for one query
    # The scale on the few query rows, not on the lk-wide scores: one pass over the cache's scores fewer.
    scores = torch.matmul(rows * scale, k.to(compute).transpose(-2, -1))  # (b, hk, g * lq, lk)
    scores = scores.view(batch, heads, num_queries, num_keys)
    if bias is not None:
        scores = scores + bias.to(compute)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink_column = sinks.to(compute).reshape(1, heads, 1, 1).expand(batch, heads, num_queries, 1)
        weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
    if visible is not None:  # a row of -inf is NaN after the softmax (without sinks): such a query gets zeros
        weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)
    weights = weights.to(v.dtype).reshape(batch, kv_heads, group * num_queries, num_keys)
    out = torch.matmul(weights, v)  # (b, hk, g * lq, dv)
    return out.view(batch, heads, num_queries, v.shape[-1])
