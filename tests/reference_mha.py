"""A float64 multi-head attention written from the formulas, for the real-model features.

Everything is explicit: per-token positions, a visibility array built by the caller from
loops, kv heads repeated by hand (query head i reads kv head i // g), and each positional
encoding's term computed entry by entry from the module's weights. Nothing is shared with
the library but the T5 bucket function (itself checked against the published code).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from selfattn.functional import t5_relative_bucket
from selfattn.positional import (
    ALiBiPositionalBias,
    RotaryPositionalEncoding,
    ShawRelativePositionEncoding,
    T5RelativePositionBias,
)


def _project(linear, x):
    y = x.detach().double().numpy() @ linear.weight.detach().double().numpy().T
    return y if linear.bias is None else y + linear.bias.detach().double().numpy()


def _rotate(x, positions, head_dim, base=10000.0):
    """Interleaved RoPE of x (l, dh) at integer positions (l,), one pair at a time."""
    out = x.copy()
    for t, p in enumerate(positions):
        for j in range(head_dim // 2):
            angle = p * base ** (-2 * j / head_dim)
            a, b = x[t, 2 * j], x[t, 2 * j + 1]
            out[t, 2 * j] = a * math.cos(angle) - b * math.sin(angle)
            out[t, 2 * j + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


def _alibi_slope(head, num_heads):
    assert num_heads & (num_heads - 1) == 0, "reference slopes only for a power-of-two head count"
    return 2.0 ** (-8.0 * (head + 1) / num_heads)


def naive_mha(mha, queries, keys, values, visible, q_positions, k_positions):
    """Output (b, lq, d) and weights (b, h, lq, lk) in float64.

    visible: bool (b, lq, lk) or (b, h, lq, lk); q_positions (b, lq), k_positions (b, lk) ints.
    A query with no visible key gets a zero row (before W_o), as selfattn does.
    """
    b, lq, _ = queries.shape
    lk = keys.shape[1]
    h, hk, dh = mha.num_heads, mha.num_kv_heads, mha.head_dim
    group = h // hk
    q = _project(mha.W_q, queries).reshape(b, lq, h, dh)
    k = _project(mha.W_k, keys).reshape(b, lk, hk, dh)
    v = _project(mha.W_v, values).reshape(b, lk, hk, dh)
    if getattr(mha, "q_norm", None) is not None:  # RMSNorm of every head's vector, before the rotation
        q, k = _rms_norm(q, mha.q_norm), _rms_norm(k, mha.k_norm)
    scale = 1 / math.sqrt(dh) if getattr(mha, "scale", None) is None else mha.scale
    softcap = getattr(mha, "softcap", None)
    sinks = None if getattr(mha, "sinks", None) is None else mha.sinks.detach().double().numpy()
    q_positions, k_positions = np.asarray(q_positions), np.asarray(k_positions)
    visible = np.asarray(visible)
    if visible.ndim == 3:
        visible = np.broadcast_to(visible[:, None], (b, h, lq, lk))
    enc = mha.position
    out = np.zeros((b, lq, h, dh))
    weights = np.zeros((b, h, lq, lk))
    for bi in range(b):
        for hi in range(h):
            kv = hi // group  # Llama's repeat_kv
            qh, kh, vh = q[bi, :, hi], k[bi, :, kv], v[bi, :, kv]
            if isinstance(enc, RotaryPositionalEncoding):
                qh = _rotate(qh, q_positions[bi], dh, enc.base)
                kh = _rotate(kh, k_positions[bi], dh, enc.base)
            for i in range(lq):
                cols = [j for j in range(lk) if visible[bi, hi, i, j]]
                if not cols:
                    continue
                scores = []
                for j in cols:
                    s = qh[i] @ kh[j] * scale
                    rel = int(k_positions[bi, j] - q_positions[bi, i])  # key - query
                    if isinstance(enc, ALiBiPositionalBias):
                        s += -_alibi_slope(hi, h) * (-rel if enc.causal else abs(rel))
                    elif isinstance(enc, T5RelativePositionBias):
                        bucket = int(t5_relative_bucket(torch.tensor(rel), **enc._bucket_options()))
                        s += float(enc.relative_attention_bias.weight.detach()[bucket, hi])
                    elif isinstance(enc, ShawRelativePositionEncoding) and enc.key_embeddings is not None:
                        row = max(-enc.max_distance, min(enc.max_distance, rel)) + enc.max_distance
                        s += qh[i] @ enc.key_embeddings[row].detach().double().numpy() / math.sqrt(dh)
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    scores.append(s)
                scores = np.array(scores)
                top = scores.max() if sinks is None else max(scores.max(), sinks[hi])
                w = np.exp(scores - top)
                w /= w.sum() + (0.0 if sinks is None else math.exp(sinks[hi] - top))
                weights[bi, hi, i, cols] = w
                out[bi, i, hi] = sum(wj * vh[j] for wj, j in zip(w, cols, strict=True))
                if isinstance(enc, ShawRelativePositionEncoding) and enc.value_embeddings is not None:
                    for wj, j in zip(w, cols, strict=True):
                        rel = int(k_positions[bi, j] - q_positions[bi, i])
                        row = max(-enc.max_distance, min(enc.max_distance, rel)) + enc.max_distance
                        out[bi, i, hi] += wj * enc.value_embeddings[row].detach().double().numpy()
    merged = out.reshape(b, lq, h * dh)
    if getattr(mha, "W_g", None) is not None:
        merged = merged / (1 + np.exp(-_project(mha.W_g, queries)))
    return torch.from_numpy(_project(mha.W_o, torch.from_numpy(merged))), torch.from_numpy(weights)


def _rms_norm(x, norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis."""
    weight = norm.weight.detach().double().numpy()
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + norm.eps) * weight


def visibility(b, lq, lk, *, causal=False, valid_lens=None, key_padding=None, documents=None, window=None, first=None):
    """Bool (b, lq, lk) from loops: query i (index first + i, default lk - lq + i) and key j."""
    first = lk - lq if first is None else first
    vis = np.ones((b, lq, lk), dtype=bool)
    for bi in range(b):
        for i in range(lq):
            qi = first + i
            for j in range(lk):
                ok = True
                if causal and j > qi:
                    ok = False
                if window is not None and (qi - j >= window or (not causal and j - qi >= window)):
                    ok = False
                if valid_lens is not None:
                    length = valid_lens[bi] if np.ndim(valid_lens[bi]) == 0 else valid_lens[bi][i]
                    ok = ok and j < length
                if key_padding is not None and key_padding[bi][j]:
                    ok = False
                if documents is not None and documents[bi][qi] != documents[bi][j]:
                    ok = False
                vis[bi, i, j] = ok
    return vis


def make_encoding(name, num_hiddens, num_heads, seed=0):
    """A score or query/key encoding with random (not default-zero) parameters."""
    torch.manual_seed(seed)
    dh = num_hiddens // num_heads
    if name == "none":
        return None
    if name == "rotary":
        return RotaryPositionalEncoding(dh)
    if name == "alibi":
        return ALiBiPositionalBias(num_heads, causal=False)
    if name == "alibi_causal":
        return ALiBiPositionalBias(num_heads, causal=True)
    if name == "t5":
        return T5RelativePositionBias(num_heads, num_buckets=8, max_distance=16)
    if name == "shaw":
        return ShawRelativePositionEncoding(dh, max_distance=3)
    raise ValueError(name)


ENCODINGS = ("none", "rotary", "alibi", "t5", "shaw")
