"""The fused kernel on a call where every key is visible to every query: what a decoding step computes.

:func:`fused_unmasked` serves any such call of checked heads. :func:`unmasked_step` is the same computation
made for a *kind* of call (device, dtypes, head counts and sizes, batch, queries, grad mode: everything but the
number of keys): the facts that hold for the kind are read once, when a decoding plan is made, and a step of
that kind then pays for the kernel and the one fact that moves, the number of keys.

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import selfattn._validation as _validation
from selfattn.core.route import Step
from selfattn.functional._few_keys import KERNEL_SPREADS_NAN_FROM_KEYS as _KERNEL_SPREADS_NAN_FROM_KEYS
from selfattn.functional._few_keys import few_keys_attention
from selfattn.functional._kernels import (
    _CONTIGUOUS_HEADS_MIN_PAIRS,
    _IN_GRAPH_CHECKS_MAX_ELEMENTS,
    _SDPA_HAS_GQA,
    _fused_kernel,
    _kernel_layout,
)

__all__ = ["causal_square_step", "fused_unmasked", "unmasked_step"]

#: Fewest keys for which :func:`fused_unmasked` lays grouped query heads out as rows of their key/value head
#: through the general kernel call (gradients wanted, half precision).
_ROWS_MIN_KEYS = 512

#: Least ``b * h * lk * d`` from which a direct call (:func:`_direct_step`) of one query lays grouped query heads out
#: as rows of their key/value head: measured on CPU (benchmarks/grouped_decoding.py), the rows took 0.45x-0.86x of the
#: kernel's grouped call's time from there on, 0.88x-1.03x at half of it, up to 1.3x on the smallest calls.
_ROWS_MIN_WORK = 1 << 16

#: Query dtypes the NaN-query guard sums in as they are (a half would be summed in float32).
_SUMMED_AS_IS = (torch.float32, torch.float64)


def fused_unmasked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """:func:`~selfattn.functional._kernels.fused_attention` of checked heads with no mask, bias or causal rule,
    ``(b, h, lq, dv)``: the fused route's call with no rule or bias.

    Every key is visible to every query, so no row is empty and nothing is prepared: a decoding
    step's call (its causal rule hides nothing), and what a decoding plan replays without describing it.

    On CPU, grouped-query heads go to the kernel as ``g * lq`` query rows of each key/value head (a view
    of ``q``, ``g = h / hk``): with no mask every row sees the same keys, so the answer is the same, and
    the kernel reads each key once instead of once per query head. A direct call (no gradient wanted, float32
    or float64) of one query does so from :data:`_ROWS_MIN_WORK` (``b * h * lk * d``) or :data:`_ROWS_MIN_KEYS`
    keys, any other call from :data:`_ROWS_MIN_KEYS` keys; below them the reshapes cost what they save.
    """
    if not q.is_cpu or q.dim() != 4 or k.dim() != 4 or _validation.is_compiling():
        q, k, v = _kernel_layout(q, k, v)
        return _fused_kernel(q, k, v, None, dropout_p=dropout_p, is_causal=False, scale=scale)
    (batch, heads, num_queries, head_dim), kv_heads, num_keys = q.shape, k.shape[1], k.shape[2]
    if num_queries * num_keys >= _CONTIGUOUS_HEADS_MIN_PAIRS:  # _kernel_layout's CPU case, its checks made once
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if dropout_p == 0.0 and _direct(q, k, v):
        return _direct_step(q, k, v, scale, kv_heads != heads)
    if kv_heads != heads and num_keys >= _ROWS_MIN_KEYS:
        rows = q.reshape(batch, kv_heads, heads // kv_heads * num_queries, head_dim)  # (b, hk, g * lq, d)
        out = _fused_kernel(rows, k, v, None, dropout_p=dropout_p, is_causal=False, scale=scale)
        return out.reshape(batch, heads, num_queries, v.shape[-1])  # (b, h, lq, dv)
    return _fused_kernel(q, k, v, None, dropout_p=dropout_p, is_causal=False, scale=scale)


def unmasked_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Step:
    """``step(q, k, v)`` computing ``fused_unmasked(q, k, v, scale=scale)`` for calls of the kind of these heads.

    A kind: the same device, dtypes, batch, heads, queries, head and value sizes and grad mode (a decoding plan's
    kind holds each); only the number of keys may differ. Where the kernel can be called directly (CPU, float32 or
    float64, a small output, no gradient wanted) the step checks the number of keys and, in grad mode, whether a
    tensor wants a gradient (a kind need not hold that); otherwise it is :func:`fused_unmasked`.
    """
    grouped = k.shape[1] != q.shape[1]
    direct = q.is_cpu and q.dim() == 4 and k.dim() == 4 and _direct_kind(q, v)
    if not direct or _validation.is_compiling():
        return lambda q, k, v: fused_unmasked(q, k, v, scale=scale)
    # keys from which the heads are made contiguous (no queries: none), and from which grouped heads go as rows
    contiguous_from = -(-_CONTIGUOUS_HEADS_MIN_PAIRS // q.shape[2]) if q.shape[2] else 0
    rows_from = _rows_from_keys(q) if grouped else math.inf

    grad_mode = torch.is_grad_enabled()
    written_out_below = _KERNEL_SPREADS_NAN_FROM_KEYS[q.dtype]
    # The kernel's own default scale, computed as it computes it (so the same number), is left to it: each keyword
    # the kernel's binding parses costs a decoding step a few hundred nanoseconds.
    as_is = not grouped and scale == 1.0 / math.sqrt(q.shape[-1])

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_keys = k.shape[2]
        if num_keys >= contiguous_from or (grad_mode and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return fused_unmasked(q, k, v, scale=scale)  # contiguous heads, or the autograd path
        if num_keys < written_out_below:
            return few_keys_attention(q, k, v, None, is_causal=False, scale=scale, dropout_p=0.0)
        if num_keys >= rows_from:
            return _grouped_rows(q, k, v, scale)
        # _direct_step's guard for these keys, inline: a decoding step's one call less
        q = q.add(q, alpha=0)
        if as_is:
            return F.scaled_dot_product_attention(q, k, v)  # (b, h, lq, dv)
        return F.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=scale, enable_gqa=grouped)

    return step


def causal_square_step(scale: float) -> Step:
    """``step(q, k, v)``: :func:`~selfattn.functional._kernels.fused_attention` of checked heads under the causal
    rule alone on a square (``lq == lk``), which the kernel's own ``is_causal`` states, so nothing is prepared
    and no row is empty (a prefill with no padding)."""

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = _kernel_layout(q, k, v)
        return _fused_kernel(q, k, v, None, dropout_p=0.0, is_causal=True, scale=scale)

    return step


def _direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel may be called as it is, its NaN-query guard alone added (a decoding step's call)."""
    return _direct_kind(q, v) and not (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    )


def _direct_kind(q: torch.Tensor, v: torch.Tensor) -> bool:
    """:func:`_direct`'s facts that a kind of call holds: the kernel's grouped heads, the dtype, the output's size."""
    return (
        _SDPA_HAS_GQA
        and q.dtype in _SUMMED_AS_IS
        and q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] <= _IN_GRAPH_CHECKS_MAX_ELEMENTS
    )


def _direct_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, grouped: bool) -> torch.Tensor:
    """The kernel with :func:`_fused_kernel`'s NaN guard (none of its general cases): a query holding NaN or an
    infinity gets a row of NaN; below one vector of keys, the formula written out (see :mod:`._few_keys`)."""
    if k.shape[2] < _KERNEL_SPREADS_NAN_FROM_KEYS[q.dtype]:
        return few_keys_attention(q, k, v, None, is_causal=False, scale=scale, dropout_p=0.0)
    if grouped and k.shape[2] >= _rows_from_keys(q):
        return _grouped_rows(q, k, v, scale)
    # From one vector of keys the kernel spreads a NaN query's NaN itself, but an infinite one can make every
    # score of its row -inf (each key of the opposite sign there), which the kernel reads as a row that sees no
    # key: zeros. q + 0 * q turns each infinity into NaN (and leaves finite numbers as they are): one operation.
    q = q.add(q, alpha=0)
    return F.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=scale, enable_gqa=grouped)  # (b, h, lq, dv)


def _rows_from_keys(q: torch.Tensor) -> int:
    """Fewest keys from which :func:`_direct_step` lays grouped heads of ``q``'s batch, heads, queries and size out
    as rows: :data:`_ROWS_MIN_WORK` for one query (measured), :data:`_ROWS_MIN_KEYS` for several (whose reshape
    may copy ``q``; at 3 queries the rows were slower below 512 keys)."""
    batch, heads, num_queries, head_dim = q.shape
    if num_queries != 1:
        return _ROWS_MIN_KEYS
    return min(_ROWS_MIN_KEYS, -(-_ROWS_MIN_WORK // max(batch * heads * head_dim, 1)))


def _grouped_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`_direct_step`'s call for grouped heads of at least one vector of keys, ``(b, h, lq, dv)``: each
    key/value head's ``g`` query heads as ``g * lq`` rows of it (no mask: every row sees every key, so the answer is
    the kernel's grouped call's), which the kernel reads each key for once, not once per query head; the same
    guard on the rows as on the heads."""
    batch, heads, num_queries, head_dim = q.shape
    kv_heads = k.shape[1]
    rows = q.reshape(batch, kv_heads, heads // kv_heads * num_queries, head_dim)  # (b, hk, g * lq, d)
    out = F.scaled_dot_product_attention(rows.add(rows, alpha=0), k, v, None, 0.0, False, scale=scale)
    return out.reshape(batch, heads, num_queries, v.shape[-1])  # (b, h, lq, dv)
