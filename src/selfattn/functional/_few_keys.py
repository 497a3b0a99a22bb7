"""Calls with fewer keys than one vector of PyTorch's CPU kernel: the formula written out.

Below one vector of keys (16 float32 keys with AVX-512, 8 float64; its half-precision paths count in float32)
the CPU kernel's row maximum passes over a NaN score, so a row whose every visible score is NaN gets zeros where
the formula gives NaN: the first query of a causal square whose first key holds NaN, a row that a mask leaves
one such key, a decoding step whose every cached key holds NaN (what a NaN in a prompt leaves in the keys of the
layers after it). From one vector on the kernel spreads the NaN itself. A call this small costs little written
out (at most one vector of scores per query), so selfattn computes it so, in the kernel's conventions. A call
of one key is written out on every device: the CUDA backends give a single key whose score is -inf zeros.

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["KERNEL_SPREADS_NAN_FROM_KEYS", "few_keys", "few_keys_attention", "few_keys_forward"]

#: Bytes of the vectors PyTorch's CPU kernels use, by the capability it reports (measured with
#: ``ATEN_CPU_CAPABILITY``): 16 float32 or 8 float64 keys with AVX-512, 8 or 4 with AVX2.
_VECTOR_BYTES = {"AVX512": 64, "AVX2": 32}
_CAPABILITY = torch.backends.cpu.get_cpu_capability()

#: Fewest keys, by dtype, from which the CPU kernel gives a row with a NaN score a row of NaN itself: one vector
#: of the dtype's lanes, and 32 keys (two vectors of AVX-512's float32 lanes) where the capability is another.
#: tests/test_decoding_step.py pins the kernel's behaviour from there on.
KERNEL_SPREADS_NAN_FROM_KEYS = {
    dtype: _VECTOR_BYTES[_CAPABILITY] // dtype.itemsize if _CAPABILITY in _VECTOR_BYTES else 32
    for dtype in (torch.float32, torch.float64)
}


#: Dtypes whose scores are computed as they are (a half's in float32).
_AS_IS = (torch.float32, torch.float64)


def few_keys(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call of these heads has fewer keys than one vector of the CPU kernel (half precision: float32's).

    False for a symbolic number of keys (dynamic shapes): a graph for every length calls the kernel.
    """
    fewest = KERNEL_SPREADS_NAN_FROM_KEYS.get(q.dtype) or KERNEL_SPREADS_NAN_FROM_KEYS[torch.float32]
    num_keys = k.shape[-2]
    return type(num_keys) is int and num_keys < fewest and q.device.type == "cpu"


def few_keys_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v``, ``(.., h, lq, dv)``, as the kernel takes a call: ``k`` and ``v`` may
    have fewer heads (grouped-query attention, read without copies), ``attn_mask`` is bool (True = attend) or
    float (added), ``is_causal`` hides key ``j > i`` (the kernel's top-left rule). Scores and softmax in at least
    float32."""
    if attn_mask is None and not dropout_p and q.dim() == 4 and q.dtype in _AS_IS:
        return _as_rows(q, k, v, scale, is_causal)  # a decoding step's call, or a short prefill's
    scores = _scores(q, k, attn_mask, is_causal, scale)
    weights = torch.softmax(scores, dim=-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return _weighted_values(weights, v).to(q.dtype)  # (.., h, lq, dv)


def few_keys_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's ``(out (.., h, lq, dv), log-sum-exp (.., h, lq))`` by the formula, in its conventions
    (a row whose scores are all -inf: zeros and a log-sum-exp of 0), but NaN where a row's scores hold NaN."""
    scores = _scores(q, k, attn_mask, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (.., h, lq): -inf where every score is, NaN where one is
    unseen = lse == -math.inf
    # The softmax, normalised as the kernel normalises its output: exp(scores - lse) would carry lse's rounding
    # (5e-4 at scores of 1e4 in float32) into every weight, a row summing to 1 - 5e-4.
    weights = torch.softmax(scores, dim=-1).masked_fill(unseen.unsqueeze(-1), 0.0)  # 0 in a row that sees no key
    return _weighted_values(weights, v).to(q.dtype), lse.masked_fill(unseen, 0.0)


#: Dtypes whose scores are computed as they are (a half's in float32).
_AS_IS = (torch.float32, torch.float64)


def _as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """:func:`few_keys_attention` of 4-D heads with no mask, in as few operations as the formula takes: each
    key/value head's ``g`` query heads as ``g * lq`` rows of it, one batched product each way (the causal rule
    an addend of the first)."""
    batch, heads, num_queries, head_dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    pairs, group = batch * kv_heads, heads // kv_heads
    rows = q.reshape(pairs, group * num_queries, head_dim)  # (b * hk, g * lq, d)
    keys = k.reshape(pairs, num_keys, head_dim).transpose(1, 2)  # (b * hk, d, lk)
    addend = _addend(group if causal else 0, num_queries, num_keys, q.dtype, q.device)
    scores = torch.baddbmm(addend, rows, keys, beta=1.0 if causal else 0.0, alpha=scale)  # (b * hk, g * lq, lk)
    out = torch.bmm(scores.softmax(dim=-1), v.reshape(pairs, num_keys, v.shape[-1]))  # (b * hk, g * lq, dv)
    return out.view(batch, heads, num_queries, v.shape[-1])


def _addend(group: int, num_queries: int, num_keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``baddbmm``'s first term: for ``group`` query heads per key/value head, the causal rule (-inf where key
    ``j > i``) for each of the ``group * lq`` rows ``(g * lq, lk)``; with ``group`` 0, an ignored zero (``beta=0``).
    Kept in :data:`_ADDENDS` (few: fewer than one vector of keys), in eager mode outside a CUDA graph's capture: a
    graph builds its own."""
    key = (group, num_queries, num_keys, dtype, device)
    # A graph reading the dictionary is compiled again at each new entry; one made in a CUDA graph's capture
    # would live in that graph's memory.
    compiling = torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    addend = None if compiling else _ADDENDS.get(key)
    if addend is None:
        if not group:
            addend = torch.zeros(1, 1, 1, dtype=dtype, device=device)
        else:
            later = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).triu(1)  # (lq, lk): j > i
            rule = torch.zeros(num_queries, num_keys, dtype=dtype, device=device).masked_fill_(later, -math.inf)
            addend = rule.repeat(group, 1)  # (g * lq, lk)
        if not compiling:
            _ADDENDS[key] = addend
    return addend


_ADDENDS: dict[tuple[int, int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _scores(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, scale: float
) -> torch.Tensor:
    """``(.., h, lq, lk)`` scores in at least float32, the mask applied; each key/value head's ``g`` query heads
    as ``g * lq`` rows of it."""
    compute = torch.promote_types(q.dtype, torch.float32)
    rows = q
    if q.dim() >= 3:
        *lead, heads, num_queries, head_dim = q.shape
        rows = q.reshape(*lead, k.shape[-3], heads // k.shape[-3] * num_queries, head_dim)  # (.., hk, g * lq, d)
    scores = torch.matmul(rows.to(compute), k.to(compute).transpose(-2, -1)) * scale  # (.., hk, g * lq, lk)
    scores = scores.reshape(*q.shape[:-1], k.shape[-2])  # (.., h, lq, lk)
    if is_causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)  # (lq, lk): j > i
        scores = scores.masked_fill(later, -math.inf)
    if attn_mask is not None:
        bool_mask = attn_mask.dtype == torch.bool
        scores = scores.masked_fill(~attn_mask, -math.inf) if bool_mask else scores + attn_mask.to(compute)
    return scores


def _weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``weights (.., h, lq, lk) @ v (.., hk, lk, dv)``, ``(.., h, lq, dv)``, in the weights' dtype."""
    if weights.dim() < 3:
        return torch.matmul(weights, v.to(weights.dtype))
    *lead, heads, num_queries, num_keys = weights.shape
    kv_heads = v.shape[-3]
    rows = weights.reshape(*lead, kv_heads, heads // kv_heads * num_queries, num_keys)  # (.., hk, g * lq, lk)
    return torch.matmul(rows, v.to(weights.dtype)).reshape(*lead, heads, num_queries, v.shape[-1])
