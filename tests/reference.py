"""Independent references for the tests: float64 NumPy formulas and naive loops.

Written from the formulas, not from the library, so a shared mistake cannot hide.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


def sinusoidal_numpy(positions: np.ndarray, num_hiddens: int, base: float = 10000.0) -> np.ndarray:
    """P[i, 2j] = sin(i / base^(2j/d)), P[i, 2j+1] = cos(i / base^(2j/d)), float64, one entry at a time."""
    table = np.zeros((len(positions), num_hiddens), dtype=np.float64)
    for col in range(num_hiddens):
        pair = col // 2
        angle = positions.astype(np.float64) / base ** (2 * pair / num_hiddens)
        table[:, col] = np.sin(angle) if col % 2 == 0 else np.cos(angle)
    return table


def naive_attention(q, k, v, visible, bias=None, scale=None):
    """Per-query loop in float64: softmax over the visible keys only; no visible key -> zeros.

    q (b, h, lq, d), k (b, h, lk, d), v (b, h, lk, dv), visible bool (b, h, lq, lk) NumPy arrays.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    b, h, lq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, h, lq, v.shape[-1]))
    weights = np.zeros((b, h, lq, k.shape[2]))
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                keys = np.nonzero(visible[bi, hi, i])[0]
                if len(keys) == 0:
                    continue
                scores = np.array([q[bi, hi, i] @ k[bi, hi, j] * scale for j in keys])
                if bias is not None:
                    scores = scores + np.array([bias[bi, hi, i, j] for j in keys])
                w = np.exp(scores - scores.max())
                w /= w.sum()
                weights[bi, hi, i, keys] = w
                out[bi, hi, i] = sum(wj * v[bi, hi, j] for wj, j in zip(w, keys, strict=True))
    return out, weights


class TextbookMultiHeadAttention(nn.Module):
    """The chapter's algorithm: heads folded into the batch, masked softmax filling -1e6.

    Same parameter names as the textbook's class, so its state_dict is the textbook's.
    """

    def __init__(self, num_hiddens, num_heads, query_size=None, key_size=None, value_size=None):
        super().__init__()
        self.num_heads = num_heads
        self.W_q = nn.Linear(query_size or num_hiddens, num_hiddens, bias=False)
        self.W_k = nn.Linear(key_size or num_hiddens, num_hiddens, bias=False)
        self.W_v = nn.Linear(value_size or num_hiddens, num_hiddens, bias=False)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=False)

    def _fold(self, x):
        b, l, _ = x.shape
        x = x.reshape(b, l, self.num_heads, -1).permute(0, 2, 1, 3)  # (b, h, l, dh)
        return x.reshape(b * self.num_heads, l, -1)  # (b*h, l, dh)

    def forward(self, queries, keys, values, valid_lens=None):
        q, k, v = self._fold(self.W_q(queries)), self._fold(self.W_k(keys)), self._fold(self.W_v(values))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # (b*h, lq, lk)
        if valid_lens is not None:
            lens = torch.repeat_interleave(valid_lens, self.num_heads, dim=0)
            if lens.dim() == 1:
                lens = lens[:, None].expand(-1, scores.shape[1])
            keep = torch.arange(scores.shape[-1])[None, None, :] < lens[..., None]
            scores = scores.masked_fill(~keep, -1e6)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)  # (b*h, lq, dh)
        b = queries.shape[0]
        out = out.reshape(b, self.num_heads, out.shape[1], -1).permute(0, 2, 1, 3)  # (b, lq, h, dh)
        return self.W_o(out.reshape(b, out.shape[1], -1))


def torch_multihead_copy(mha) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` (batch first, eval) holding the weights of a module with W_q/W_k/W_v/W_o."""
    has_bias = mha.W_q.bias is not None
    ref = nn.MultiheadAttention(mha.W_o.out_features, mha.num_heads, bias=has_bias, batch_first=True)
    ref = ref.to(mha.W_q.weight.dtype).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.W_q.weight, mha.W_k.weight, mha.W_v.weight]))
        ref.out_proj.weight.copy_(mha.W_o.weight)
        if has_bias:
            ref.in_proj_bias.copy_(torch.cat([mha.W_q.bias, mha.W_k.bias, mha.W_v.bias]))
            ref.out_proj.bias.copy_(mha.W_o.bias)
    return ref
