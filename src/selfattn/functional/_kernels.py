"""The kernels of scaled dot-product attention: a fused path and an explicit path that agree.

Which of them (or another route) serves a call is decided by :mod:`selfattn.core.dispatch`.

Shape legend:
    b: batch size, h: number of heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

import selfattn._validation as _validation
from selfattn._validation import (
    ArgumentTypeError,
    require_bool,
    require_floating,
    require_non_negative_int,
    require_positive_finite,
    require_tensor,
)
from selfattn.functional._few_keys import few_keys, few_keys_attention
from selfattn.masks import ValidLengths, Visibility
from selfattn.masks import causal as causal_rule

__all__ = ["attention_weights", "causal_mask", "fused_attention", "valid_lens_mask"]

# PyTorch's CPU flash kernel runs 3-7% faster on contiguous (b, h, l, d) heads than on the
# transposed views a head split produces, once its O(lq * lk) work outweighs the O(l * d) copy
# (measured crossover: lq = lk between 1536 and 2048 at d = 512, 8 heads).
_CONTIGUOUS_HEADS_MIN_PAIRS = 2048 * 2048

# Checks of values (a NaN query, a row with no visible key, -inf in a bias) run inside the graph, with no
# host read, up to this many elements (decoding's calls, any GPU call); past it, on CPU, one host check
# costs less than the extra pass over the output or the scores that the in-graph form takes.
_IN_GRAPH_CHECKS_MAX_ELEMENTS = 1 << 16

# The dtype the NaN-query guard sums a query in, per query dtype (torch.promote_types is an op of its own).
_SUM_DTYPES: dict[torch.dtype, torch.dtype] = {}
# scaled_dot_product_attention reads grouped kv heads itself from torch 2.5 on.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def causal_mask(num_queries: int, num_keys: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(lq, lk)`` mask, True where query ``i`` may attend key ``j``.

    The queries are taken to be the *last* ``lq`` positions of the ``lk`` keys (lower-right alignment), so query ``i``
    sees keys ``j <= i + lk - lq``. With ``lq == lk`` this is the usual lower-triangular mask; with fewer queries than
    keys (decoding against cached keys) the newest query sees every key.
    """
    num_queries = require_non_negative_int("num_queries", num_queries)
    num_keys = require_non_negative_int("num_keys", num_keys)
    return _causal_mask(num_queries, num_keys, device)


def _causal_mask(num_queries: int, num_keys: int, device: torch.device | str | None) -> torch.Tensor:
    mask = Visibility.lower_right(num_queries, num_keys, causal_rule()).dense(torch.device(device or "cpu"))
    assert mask is not None
    return mask  # (lq, lk)


def valid_lens_mask(valid_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean mask from the chapter's ``valid_lens``: key ``j`` is visible iff ``j < valid_len``.

    Args:
        valid_lens: ``(b,)`` one length per sequence, or ``(b, lq)`` one per query.
        num_keys: ``lk``.

    Returns:
        ``(b, 1, 1, lk)`` for ``(b,)`` lengths, ``(b, 1, lq, lk)`` for ``(b, lq)`` lengths.

    Raises:
        ValueError: lengths that are negative, fractional, not integers or not 1-D/2-D.
    """
    _check_valid_lens(valid_lens)
    num_keys = require_non_negative_int("num_keys", num_keys)
    return _valid_lens_mask(valid_lens.clamp(max=num_keys).long(), num_keys)  # whole floats, past int64's range too


def _check_valid_lens(valid_lens: torch.Tensor) -> None:
    require_tensor("valid_lens", valid_lens)
    if valid_lens.dim() not in (1, 2):
        raise ValueError(f"valid_lens must have shape (b,) or (b, lq), got {tuple(valid_lens.shape)}")
    if valid_lens.dtype == torch.bool or valid_lens.is_complex():
        raise ArgumentTypeError(f"valid_lens must hold integer lengths, got dtype {valid_lens.dtype}")
    if _validation.is_compiling():
        return  # values are not read in a graph (a host read each), as the layer's own lengths
    if valid_lens.is_floating_point() and not bool(((valid_lens == valid_lens.round()) & valid_lens.isfinite()).all()):
        raise ValueError(f"valid_lens must hold whole numbers, got {valid_lens.tolist()}")
    if bool((valid_lens < 0).any()):
        raise ValueError(f"valid_lens must not be negative, got {valid_lens.tolist()}")


def _valid_lens_mask(valid_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    num_queries = 1 if valid_lens.dim() == 1 else valid_lens.shape[1]
    mask = Visibility(num_queries, num_keys, 0).with_rules(ValidLengths(valid_lens)).dense(valid_lens.device)
    assert mask is not None
    return mask  # (b, 1, 1, lk) for (b,) lengths, (b, 1, lq, lk) for (b, lq)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name} must be a tensor of shape (..., length, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dimension, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a head size of at least 1, got q {tuple(q.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not _leading_dims_fit(q, k, v):
        raise ValueError(
            "q, k and v must have the same leading (batch, head) dimensions (k and v may have a divisor "
            "of q's heads: grouped-query attention), "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype} and v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device} and v {v.device}")


def _leading_dims_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Equal (batch, head) dimensions, except that k and v may have a divisor of q's heads (grouped-query)."""
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        return True
    if q.dim() < 3 or not q.dim() == k.dim() == v.dim() or not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        return False
    return k.shape[-3] == v.shape[-3] and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0


def _check_scores_term(name: str, term: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``mask`` or ``bias`` must broadcast to the scores ``(..., lq, lk)`` and live on q's device.

    Returns it with at least two dimensions (the fused kernel wants a query axis).
    """
    scores_shape = (*q.shape[:-1], k.shape[-2])  # (b, h, lq, lk)
    fits = term.dim() <= len(scores_shape) and all(
        size in (1, target) for size, target in zip(reversed(term.shape), reversed(scores_shape), strict=False)
    )
    if not fits:
        raise ValueError(f"{name} of shape {tuple(term.shape)} does not broadcast to the scores' shape {scores_shape}")
    if term.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {term.device}")
    return term if term.dim() >= 2 else term.reshape(*([1] * (2 - term.dim())), *term.shape)  # (.., lq, lk)


def check_softcap_and_sinks(
    softcap: object, sinks: object, q: torch.Tensor
) -> tuple[float | None, torch.Tensor | None]:
    """A positive finite ``softcap`` or None; ``sinks`` a float ``(h,)`` tensor for the ``h`` heads of ``q``, or None."""
    cap = None if softcap is None else require_positive_finite("softcap", softcap)
    if sinks is None:
        return cap, None
    sink_logits = require_tensor("sinks", sinks)
    require_floating("sinks", sink_logits)
    heads = q.shape[-3] if q.dim() >= 3 else 1
    if tuple(sink_logits.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},), one logit per query head; got {tuple(sink_logits.shape)}")
    if sink_logits.device != q.device:
        raise ValueError(f"sinks are on {sink_logits.device}, q on {q.device}")
    return cap, sink_logits


def check_mask_and_bias(
    mask: object, bias: object, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``mask`` bool and ``bias`` float, each broadcastable to the scores ``(.., lq, lk)`` (at least 2-D)."""
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}"
            )
        mask = _check_scores_term("mask", mask, q, k)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
        bias = _check_scores_term("bias", bias, q, k)
    return mask, bias


def _scale(scale: object, head_size: int) -> float:
    return 1.0 / math.sqrt(head_size) if scale is None else require_positive_finite("scale", scale)


def _repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Grouped-query heads: kv head ``j`` serves query heads ``j * g .. j * g + g - 1``."""
    if kv.dim() < 3 or q.dim() != kv.dim() or kv.shape[-3] == q.shape[-3]:
        return kv
    return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3)  # (..., h, lk, d)


def _check_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k/v have fewer heads than q (grouped-query attention); raise if they do not divide."""
    if q.dim() < 3 or k.dim() != q.dim() or v.dim() != q.dim():
        return False
    if k.shape[-3] == q.shape[-3] and v.shape[-3] == q.shape[-3]:
        return False
    if k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"k and v must have the heads of q, or a divisor of them (grouped-query attention), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return True


def _host_check_pays(t: torch.Tensor) -> bool:
    """Whether a check of ``t``'s values reads it back to the host (a large CPU tensor, eager) rather than
    staying in the graph (see :data:`_IN_GRAPH_CHECKS_MAX_ELEMENTS`)."""
    if torch.compiler.is_compiling():
        return False  # first: a test of the size would guard a dynamic one
    return t.device.type == "cpu" and t.numel() > _IN_GRAPH_CHECKS_MAX_ELEMENTS


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    fused: bool,
    checked: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, bool, float]:
    """Validate (unless ``checked``: the caller did), fold ``causal`` into ``mask`` unless the fused kernel
    can take it, and free empty rows.

    Returns ``(mask, bias, empty_rows, use_is_causal, scale)``; ``empty_rows`` is a bool
    ``(..., lq, 1)`` of the queries that see no key, or None when there are none (or, where
    the check stays in the graph, a tensor that may be all False). A ``-inf`` in ``bias`` hides
    its key just as the mask does, so a row blocked by the bias alone is an empty row too.
    """
    if not checked:
        _check_shapes(q, k, v)
        mask, bias = check_mask_and_bias(mask, bias, q, k)
    # A route's call holds its scale checked (AttentionCall's float): checking it again costs a decoding step.
    scale = scale if checked and scale is not None else _scale(scale, q.shape[-1])
    if mask is None and bias is None and not causal:
        return None, None, None, False, scale  # nothing to fold in, no row without keys
    num_queries, num_keys = q.shape[-2], k.shape[-2]

    # An if, not an expression: under dynamic shapes the comparison is symbolic, a branch makes it a
    # guard, and the kernel's is_causal takes a Python bool only.
    use_is_causal = False
    if fused and causal and mask is None and bias is None and num_queries == num_keys:
        use_is_causal = True
    if causal and not use_is_causal:
        lower_right = _causal_mask(num_queries, num_keys, q.device)  # (lq, lk)
        mask = lower_right if mask is None else mask & lower_right
    # -inf in the bias is a mask: move it there. (amin finds one 10x faster than isneginf().any().)
    # In the graph (compiling, small or GPU biases) the test would read the tensor back: always move it there.
    if bias is not None and bias.numel() and (not _host_check_pays(bias) or bool(bias.amin() == float("-inf"))):
        blocked = torch.isneginf(bias)
        bias = bias.masked_fill(blocked, 0.0)
        mask = ~blocked if mask is None else mask & ~blocked

    # Rows with no visible key: let them see every key (so softmax stays finite in the forward
    # and the backward pass), and zero their output and weights afterwards.
    empty_rows = None
    if mask is not None:
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (..., lq, 1)
        if not _host_check_pays(mask):
            mask = mask | empty_rows  # no data-dependent branch: the graph stays free of host reads
        elif bool(empty_rows.any()):
            mask = mask | empty_rows
        else:
            empty_rows = None
    return mask, bias, empty_rows, use_is_causal, scale


class _TwiceDifferentiable(torch.autograd.Function):
    """The fused kernel forward and backward, and a math-kernel backward when a graph of the grads is wanted.

    PyTorch's fused attention backward has no derivative of its own, so ``create_graph=True`` (gradient penalties,
    meta-learning, Hessian-vector products) would fail. Here the fused kernel's own graph serves ordinary backward
    passes; a backward run with grad mode on recomputes through the math kernel, whose every op is differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        options: dict[str, Any],
    ) -> torch.Tensor:
        q_, k_, v_ = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
        mask_ = None if attn_mask is None else attn_mask.detach().requires_grad_(attn_mask.requires_grad)
        inner = [q_, k_, v_, mask_]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask_, **options)
        ctx.inner, ctx.inner_out, ctx.options = inner, out, options
        ctx.save_for_backward(q, k, v, attn_mask)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wanted = [t is not None and t.requires_grad for t in ctx.inner]
        if torch.is_grad_enabled():  # create_graph=True
            inputs = ctx.saved_tensors
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(
                    inputs[0], inputs[1], inputs[2], attn_mask=inputs[3], **ctx.options
                )
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad, create_graph=True))
        else:
            sources = [t for t, w in zip(ctx.inner, wanted, strict=True) if w]
            # Retained: the outer graph may be run again (retain_graph=True); both die together.
            grads = iter(torch.autograd.grad(ctx.inner_out, sources, grad, retain_graph=True))
        return (*(next(grads) if w else None for w in wanted), None)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, options: dict[str, Any]
) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (attn_mask is not None and attn_mask.requires_grad)
    )  # written out, not any() over a generator: a decoding step's microseconds
    if (
        needs_grad
        and options["dropout_p"] == 0.0
        and not (torch.compiler.is_compiling() or _validation.in_func_transform())  # plain ops only there
    ):
        out: torch.Tensor = _TwiceDifferentiable.apply(q, k, v, attn_mask, options)  # type: ignore[no-untyped-call]
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask, **options)


def _nan_guard(q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(..., h, lq, 1)``, each query's sum: not finite exactly where the query holds NaN or an infinity, to which
    PyTorch's kernel may give a finite row (the formula: NaN). Added to the output times 0. (Below one vector of
    keys the CPU calls, and calls of one key, are written out instead: :mod:`._few_keys`.)"""
    return q.sum(dim=-1, keepdim=True, dtype=dtype)


#: Dtypes in which PyTorch's CPU kernel gives zeros to a row whose greatest score is +inf (an infinite key), from one
#: vector of keys on; in float32 it gives the formula's NaN (tests/test_where_options_meet.py pins both).
_ZEROS_INFINITE_SCORES = (torch.bfloat16, torch.float16)


def _redo_zero_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    options: dict[str, Any],
    out: torch.Tensor,
) -> torch.Tensor:
    """``out`` ``(b, h, lq, dv)`` with each row of zeros computed again in float32 (see :data:`_ZEROS_INFINITE_SCORES`).

    No row that sees no key reaches the kernel, so a row of zeros is rare: one host check of the output
    (a reduction, small beside the kernel's work) finds none, and only a call that has one is run twice.
    """
    if _validation.in_func_transform():
        return out  # a transform's tensors cannot be read back
    zero_rows = (out == 0).all(dim=-1, keepdim=True)  # (b, h, lq, 1)
    if not bool(zero_rows.any()):
        return out
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    redone = _sdpa(q.float(), k.float(), v.float(), mask, options).to(out.dtype)
    return torch.where(zero_rows, redone, out)


def _fused_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """PyTorch's fused kernel on checked inputs, ``(b, h, lq, dv)``; a NaN or inf query gives a NaN row.

    ``attn_mask`` is passed as it is (bool, True = attend, or float added to the scores), so a broadcast float mask
    reaches the kernel without being converted or copied. No row may be empty: :func:`attention` frees them first.
    """
    grouped = _check_groups(q, k, v)
    if grouped and not _SDPA_HAS_GQA:
        k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    options: dict[str, Any] = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    if grouped and _SDPA_HAS_GQA:
        options["enable_gqa"] = True
    if q.is_cuda and k.shape[-2] > 1:
        # Each CUDA backend gives a query holding NaN a row of NaN, but one holding an infinity that makes every
        # score of its row -inf a row of zeros (tests/test_cuda_nan_rows.py): q + 0 * q turns each infinity into
        # NaN and leaves finite numbers as they are, one launch where the guard below takes two.
        return _sdpa(q.add(q, alpha=0), k, v, attn_mask, options)
    if few_keys(q, k) or k.shape[-2] == 1:
        # The CPU kernel passes over a NaN score below one vector of keys; the CUDA backends give a single key
        # whose score is -inf zeros (tests/test_cuda_nan_rows.py), where the formula's softmax of it is NaN.
        return few_keys_attention(q, k, v, attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    out = _sdpa(q, k, v, attn_mask, options)
    if q.dtype in _ZEROS_INFINITE_SCORES and q.is_cpu and not dropout_p and not _validation.is_compiling():
        out = _redo_zero_rows(q, k, v, attn_mask, options, out)
    # PyTorch's CPU kernel returns a zero row for a query holding NaN or inf; the formula says NaN.
    # Adding 0 * (the query's sum) gives NaN exactly there, for one reduction and no host sync (an
    # isfinite().all() mask costs 20x more on CPU); summing in at least float32 keeps large
    # finite half-precision queries from overflowing into a NaN nobody asked for.
    sum_dtype = _SUM_DTYPES.get(q.dtype) or _SUM_DTYPES.setdefault(q.dtype, torch.promote_types(q.dtype, torch.float32))
    query_sums = _nan_guard(q, sum_dtype)  # (b, h, lq, 1)
    if _host_check_pays(out) and bool(query_sums.isfinite().all()):
        return out  # on CPU a host check of the sums costs less than one more pass over a large output
    if sum_dtype == out.dtype:
        return out.add_(query_sums, alpha=0) if not out.requires_grad else out.add(query_sums, alpha=0)
    return out + query_sums.mul(0).to(out.dtype)  # multiply first: the sum may not fit a half


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weights ``softmax(q k^T * scale + bias)``, ``(b, h, lq, lk)``; see :func:`attention`.

    Rows whose keys are all masked are zeros. The scores and the softmax are computed in at least float32 (as the fused
    kernels do), and the weights returned in the dtype of ``q``. With ``softcap`` each logit becomes ``softcap *
    tanh(logit / softcap)`` before the mask; with ``sinks`` (``(h,)``) each head's sink logit joins the softmax's
    denominator, so a row sums to less than 1.
    """
    causal = require_bool("causal", causal)  # as attention checks them: a softcap of 0 gave even weights
    softcap, sinks = check_softcap_and_sinks(softcap, sinks, q)
    mask, bias, empty_rows, _, scale = _prepare(q, k, k, mask, bias, causal, scale, fused=False)
    k = _repeat_kv(q, k)
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1)) * scale  # (b, h, lq, lk)
    if bias is not None:
        scores = scores + bias.to(compute_dtype)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        per_head = (-1, 1, 1) if scores.dim() >= 3 else (1, 1)  # 2-D heads: the one head's sink
        sink_column = sinks.to(compute_dtype).reshape(per_head).expand(*scores.shape[:-1], 1)  # (b, h, lq, 1)
        weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
    weights = weights.to(q.dtype)
    return weights if empty_rows is None else weights.masked_fill(empty_rows, 0.0)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    dropout_p: float,
    scale: float | None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """PyTorch's fused kernel with the bias folded into a float mask and empty rows zeroed, ``(b, h, lq, dv)``.

    ``checked``: the shapes, mask and bias were checked already (a route's call), so not again.
    """
    mask, bias, empty_rows, use_is_causal, scale = _prepare(q, k, v, mask, bias, causal, scale, True, checked)
    q, k, v = _kernel_layout(q, k, v)
    attn_mask = mask
    if bias is not None:
        bias = bias.to(q.dtype)
        attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    out = _fused_kernel(q, k, v, attn_mask, dropout_p=dropout_p, is_causal=use_is_causal, scale=scale)
    return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)


def _kernel_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heads as the CPU kernel reads them fastest: contiguous when the call is large enough to pay for the copy.

    Compiled graphs leave the layout to the compiler (a test on the length would guard a dynamic one).
    """
    if (
        q.device.type == "cpu"
        and not _validation.is_compiling()
        and q.shape[-2] * k.shape[-2] >= _CONTIGUOUS_HEADS_MIN_PAIRS
    ):
        return q.contiguous(), k.contiguous(), v.contiguous()
    return q, k, v
