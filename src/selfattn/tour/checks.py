"""Numerical checks of the chapter's claims; each returns plain numbers for the report.

Shape legend: n positions, d columns of P.
"""

from __future__ import annotations

import math

import torch

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_frequencies, sinusoidal_table

__all__ = ["binary_representations", "rotation_max_error", "self_attention_shape", "table_columns"]


def self_attention_shape(
    num_hiddens: int = 100, num_heads: int = 5, batch_size: int = 2, num_queries: int = 4
) -> dict[str, object]:
    """The chapter's first cell: self-attention keeps the input's shape."""
    mha = MultiHeadAttention(num_hiddens, num_heads, 0.5).eval()
    X = torch.ones(batch_size, num_queries, num_hiddens)
    valid_lens = torch.tensor([3, 2])
    with torch.no_grad():
        shape = tuple(mha(X, X, X, valid_lens).shape)
    expected = (batch_size, num_queries, num_hiddens)
    return {"shape": list(shape), "expected": list(expected), "ok": shape == expected}


def table_columns(num_positions: int = 60, num_hiddens: int = 32, columns: tuple[int, ...] = (6, 7, 8, 9)):
    """Columns of P as in the chapter's plot: ``(n, len(columns))``."""
    return sinusoidal_table(num_positions, num_hiddens)[:, list(columns)]


def binary_representations(count: int = 8) -> list[str]:
    """``i`` in binary for ``i < count``, padded to a common width."""
    width = max(1, math.ceil(math.log2(count)))
    return [f"{i:0{width}b}" for i in range(count)]


def rotation_max_error(num_positions: int = 60, num_hiddens: int = 32, max_delta: int = 60) -> float:
    """Largest ``|M_delta P[i] - P[i + delta]|`` over positions i, offsets delta and pairs j.

    ``M_delta = [[cos(delta w_j), sin(delta w_j)], [-sin(delta w_j), cos(delta w_j)]]`` acts on
    ``(P[i, 2j], P[i, 2j+1])``; it does not depend on i. Computed in float64.
    """
    table = sinusoidal_table(num_positions + max_delta, num_hiddens, dtype=torch.float64)  # (n + D, d)
    pairs = num_hiddens // 2
    sines, cosines = table[:, 0 : 2 * pairs : 2], table[:, 1 : 2 * pairs : 2]  # (n + D, pairs)
    freqs = sinusoidal_frequencies(num_hiddens)[:pairs]  # (pairs,)
    deltas = torch.arange(max_delta + 1, dtype=torch.float64)  # (D + 1,)
    cos_d, sin_d = torch.cos(torch.outer(deltas, freqs)), torch.sin(torch.outer(deltas, freqs))  # (D + 1, pairs)
    i = torch.arange(num_positions)
    worst = 0.0
    for delta in range(max_delta + 1):
        rotated_sin = cos_d[delta] * sines[i] + sin_d[delta] * cosines[i]  # (n, pairs)
        rotated_cos = -sin_d[delta] * sines[i] + cos_d[delta] * cosines[i]
        err = torch.maximum((rotated_sin - sines[i + delta]).abs(), (rotated_cos - cosines[i + delta]).abs())
        worst = max(worst, float(err.max()))
    return worst
