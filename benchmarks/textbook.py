"""The textbook's multi-head attention algorithm, kept as the benchmarks' baseline.

This follows the chapter's algorithm step by step (written fresh, not copied): the heads are
folded into the batch, the scores come from one ``bmm``, masked keys are overwritten with
``-1e6`` before a plain softmax, and a second ``bmm`` mixes the values. It materializes the
``(b * h, lq, lk)`` scores and weights, which is what the benchmarks measure against.

It is a baseline, not part of selfattn: it keeps the textbook's behaviour on purpose,
including the uniform average a query gets when its valid length is 0.

Shape legend: b batch, h heads, lq queries, lk keys, dh head size, d num_hiddens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TextbookMultiHeadAttention", "masked_softmax"]


def masked_softmax(scores: torch.Tensor, valid_lens: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis after setting keys at or past ``valid_lens`` to ``-1e6``.

    Args:
        scores: ``(m, lq, lk)``.
        valid_lens: None, ``(m,)`` or ``(m, lq)``.
    """
    if valid_lens is None:
        return torch.softmax(scores, dim=-1)
    shape = scores.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])  # (m * lq,)
    else:
        valid_lens = valid_lens.reshape(-1)  # (m * lq,)
    rows = scores.reshape(-1, shape[-1])  # (m * lq, lk), a view: the fill below writes into scores
    visible = torch.arange(shape[-1], device=scores.device)[None, :] < valid_lens[:, None]
    rows[~visible] = -1e6
    return torch.softmax(rows.reshape(shape), dim=-1)


class _DotProductAttention(nn.Module):
    """Scaled dot product on ``(b * h, l, dh)`` tensors, weights through dropout."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        head_dim = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(head_dim)  # (b * h, lq, lk)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)  # (b * h, lq, dh)


class TextbookMultiHeadAttention(nn.Module):
    """The chapter's ``MultiHeadAttention`` algorithm with ``W_q, W_k, W_v, W_o`` linears.

    Its ``state_dict`` has the same keys as :class:`selfattn.MultiHeadAttention`, so the two
    load each other's weights.
    """

    def __init__(self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = _DotProductAttention(dropout)
        self.W_q = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_k = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_v = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def _fold_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        x = x.reshape(b, length, self.num_heads, -1).permute(0, 2, 1, 3)  # (b, h, l, dh)
        return x.reshape(-1, length, x.shape[-1])  # (b * h, l, dh), a copy as in the chapter

    def _unfold_heads(self, x: torch.Tensor) -> torch.Tensor:
        _, length, head_dim = x.shape
        x = x.reshape(-1, self.num_heads, length, head_dim).permute(0, 2, 1, 3)  # (b, l, h, dh)
        return x.reshape(x.shape[0], length, -1)  # (b, l, d)

    def forward(self, queries, keys, values, valid_lens=None):
        q = self._fold_heads(self.W_q(queries))
        k = self._fold_heads(self.W_k(keys))
        v = self._fold_heads(self.W_v(values))
        if valid_lens is not None:
            # Every head of sequence i uses valid_lens[i]: (b,) -> (b * h,), (b, lq) -> (b * h, lq).
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(q, k, v, valid_lens)  # (b * h, lq, dh)
        return self.W_o(self._unfold_heads(output))
