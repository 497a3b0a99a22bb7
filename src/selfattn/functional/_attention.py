"""Scaled dot-product attention, the pure function: it describes the call and lets the dispatcher choose.

A call with nothing but the heads, ``causal`` and ``scale`` is checked and described once per signature
(shapes, dtypes, devices, grad mode, threads: :func:`_signature`); later calls of that signature run the
route the dispatcher chose for it by the route's step form, when it has one and no rule hides a key
(decoding shapes: the per-call work a small call would otherwise spend describing itself).

Shape legend:
    b: batch size, h: number of heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

from typing import Any

import torch

import selfattn.core.dispatch as dispatch
from selfattn._validation import in_func_transform, require_bool, require_probability
from selfattn.core.call import AttentionCall
from selfattn.core.explanation import Explanation
from selfattn.core.route import Route, Step
from selfattn.functional._kernels import (
    _check_groups,
    _check_shapes,
    _scale,
    attention_weights,
    causal_mask,
    check_mask_and_bias,
    check_softcap_and_sinks,
    valid_lens_mask,
)
from selfattn.masks import Visibility, dense
from selfattn.masks import causal as causal_rule

__all__ = ["attention", "attention_weights", "causal_mask", "describe_attention", "explain", "valid_lens_mask"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention ``softmax(q k^T * scale + bias) v`` with masking.

    Without ``return_weights`` this calls ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels; O(lq
    + lk) memory with no dense mask or bias); with it, an explicit matmul-softmax-matmul that also returns the weights.
    Both give the same result (on CPU below 16 keys the fused path is written out too: docs/routes.md, NaN scores).

    A query that may attend to no key (every key masked by ``mask``, ``causal`` or a ``-inf`` bias) gets zeros, output
    and weights (not the textbook's even spread, nor NaN). NaN in a query or a key or value it sees, a +inf score or an
    infinite query make its row NaN (as the formula: a softcap keeps an infinite query's row finite, sinks zeros if
    every score is -inf), as does NaN in a value (0 * NaN) or, fused (CPU: from 16 keys), a key a ``mask`` hides; a -inf
    score of an infinite key weighs it 0 (NaN in CUDA's float32 kernel; a row of only such: zeros fused, NaN explicit).

    Second-order gradients (``create_graph=True``) work: such a backward pass goes through
    PyTorch's math kernel, whose ops are all differentiable (without dropout).

    With ``dropout_p > 0`` (and no ``bias``, 4-D inputs, eager mode) attention runs blockwise
    (:func:`~selfattn.functional.blockwise_attention`), in O(block) memory, where PyTorch's
    kernel would fall back to its O(lq * lk)-memory math path. The route is chosen by
    :mod:`selfattn.core.dispatch`, as for :class:`~selfattn.MultiHeadAttention`.

    Args:
        q: ``(b, h, lq, d)`` queries (any leading dimensions are allowed).
        k: ``(b, h, lk, d)`` keys.
        v: ``(b, h, lk, dv)`` values. Keys and values may have fewer heads ``hk`` (a divisor
            of ``h``: grouped-query attention, kv head ``j`` serving query heads
            ``j * h / hk ..``); the fused kernel then reads them without copying.
        mask: bool, True = attend, broadcastable to ``(b, h, lq, lk)``.
        bias: float, broadcastable to ``(b, h, lq, lk)``, added to the *scaled* scores.
        causal: query ``i`` attends keys ``j <= i + lk - lq`` (lower-right aligned, see
            :func:`causal_mask`).
        dropout_p: dropout on the attention weights; pass 0 in evaluation.
        scale: score scale, a positive finite number; default ``1 / sqrt(d)``.
        softcap: logit soft-capping (Gemma 2): each logit ``x`` (scaled score plus bias) becomes
            ``softcap * tanh(x / softcap)`` before the mask. A positive finite number, or None.
        sinks: ``(h,)`` attention-sink logits (gpt-oss): each head's sink joins the softmax's
            denominator and adds nothing to the output, so a query's weights sum to
            ``1 - sigmoid(sink - logsumexp(logits))``. Differentiable.
        return_weights: also return the ``(b, h, lq, lk)`` weights (before dropout).

    Returns:
        ``(b, h, lq, dv)`` output, or ``(output, weights)``.

    Raises:
        ValueError: q, k, v of mismatched shapes, dtypes or devices, a head size of 0, a mask
            or bias that does not broadcast to ``(b, h, lq, lk)``, a bad ``scale`` or ``dropout_p``,
            a ``causal`` or ``return_weights`` other than ``True`` or ``False``.
    """
    plain = (
        mask is None and bias is None and softcap is None and sinks is None and return_weights is False
        and dropout_p == 0.0 and type(causal) is bool and (scale is None or type(scale) is float)
        and not torch.compiler.is_compiling()
    )  # fmt: skip
    signature = _signature(q, k, v, causal, scale) if plain else None
    remembered = _PLAIN_CALLS.get(signature) if signature is not None else None
    if remembered is not None and dispatch.ROUTES is remembered[0]:
        if dispatch.VERIFY_REMEMBERED_CHOICES:  # tests: the routes asked again must choose the remembered one
            dispatch.check_remembered(describe_attention(q, k, v, causal=causal, scale=scale), *remembered[:2])
        return dispatch.run_step(remembered[1], remembered[2], q, k, v)
    call = describe_attention(
        q, k, v, mask=mask, bias=bias, causal=causal, dropout_p=dropout_p, scale=scale, softcap=softcap, sinks=sinks,
        return_weights=return_weights,
    )  # fmt: skip
    if signature is not None:
        _remember_plain_call(signature, call)
    result = dispatch.run(call)
    return (result.out, result.weights) if return_weights else result.out  # type: ignore[return-value]


#: Calls of :func:`attention` with nothing but ``q, k, v``, ``causal`` and ``scale`` whose route has a step form:
#: their signature (:func:`_signature`) -> (the route list, the route the dispatcher chose, its step for the kind).
_PLAIN_CALLS: dict[tuple[object, ...], tuple[tuple[Route, ...], Route, Step]] = {}

_MAX_PLAIN_CALLS = 64


def _signature(q: Any, k: Any, v: Any, causal: bool, scale: float | None) -> tuple[object, ...] | None:
    """What decides a plain call's checks and its route: every fact :func:`describe_attention` checks and
    :func:`~selfattn.core.dispatch.remembered_route` reads is a function of it (the thread count for the
    split-keys route, grad mode and the tensors' wanting a gradient for the autograd paths). None for non-tensors."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        q.requires_grad, k.requires_grad, v.requires_grad, causal, scale, torch.is_grad_enabled(),
        in_func_transform(), torch.get_num_threads(),
    )  # fmt: skip


def _remember_plain_call(signature: tuple[object, ...], call: AttentionCall) -> None:
    """Keep the route of a plain call whose checks passed, if it is remembered and runs from the heads alone."""
    chosen = dispatch.remembered_route(call)
    step_for = None if chosen is None else chosen[1].step_for
    causal = bool(call.visibility.rules)
    if chosen is None or step_for is None or (causal and not call.visibility.kernel_causal):
        return  # a rule a step form does not compute (the causal one with more keys than queries)
    if not isinstance(chosen[0], tuple):
        return
    step = step_for(call, causal)
    if step is None:
        return
    if len(_PLAIN_CALLS) >= _MAX_PLAIN_CALLS:
        _PLAIN_CALLS.clear()
    _PLAIN_CALLS[signature] = (chosen[0], chosen[1], step)


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, verbose: bool = False, **options: Any) -> Explanation:
    """How :func:`attention` would compute ``attention(q, k, v, **options)``, without computing it.

    Takes :func:`attention`'s keyword arguments. ``str()`` of the result names the route in words,
    why it was chosen and what it costs; with ``verbose=True`` it also lists each route tried
    before it and why it declined (``.route`` is the route's name; the routes: docs/routes.md).

    Example::

        q = torch.randn(1, 8, 4096, 64)
        print(selfattn.functional.explain(q, q, q, causal=True))
        # route: fused: PyTorch's fused kernel, scaled_dot_product_attention ...
    """
    return dispatch.explain(describe_attention(q, k, v, **options), verbose=verbose)


def describe_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> AttentionCall:
    """The checked :class:`~selfattn.core.call.AttentionCall` of :func:`attention` with these keyword arguments.

    ``selfattn.core.dispatch.explain(describe_attention(q, k, v, causal=True))`` says which
    route that call takes.
    """
    known = {"mask", "bias", "causal", "dropout_p", "scale", "softcap", "sinks", "return_weights"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"attention() got unexpected keyword arguments {', '.join(unknown)}")
    dropout_p = require_probability("dropout_p", options.get("dropout_p", 0.0))
    _check_shapes(q, k, v)
    _check_groups(q, k, v)  # raises for heads that do not divide
    mask, bias = check_mask_and_bias(options.get("mask"), options.get("bias"), q, k)
    softcap, sinks = check_softcap_and_sinks(options.get("softcap"), options.get("sinks"), q)
    causal = require_bool("causal", options.get("causal", False))
    return_weights = require_bool("return_weights", options.get("return_weights", False))
    rules = (causal_rule() if causal else None, None if mask is None else dense(mask))
    return AttentionCall.of_heads(
        q, k, v, Visibility.lower_right(q.shape[-2], k.shape[-2], *rules), bias=bias, dropout_p=dropout_p,
        scale=_scale(options.get("scale"), q.shape[-1]), softcap=softcap, sinks=sinks,
        return_weights=return_weights,
    )  # fmt: skip
