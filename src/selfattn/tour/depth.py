"""Section 8, exercise 1: what happens to the position signal in a deep self-attention stack.

Attention outputs are convex combinations of the values, so a stack of attention layers pulls
the token representations towards each other; without residual connections the positions,
which the input carried only through P, become indistinguishable within a few layers.

Shape legend: b batch, n positions, d model size.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table
from selfattn.tour._common import seeded

__all__ = ["position_signal", "position_signal_by_depth"]


def position_signal(h: torch.Tensor) -> float:
    """How much the rows of ``h`` ``(b, n, d)`` still differ: ``|h - mean over positions| / |h|``.

    0 when every position holds the same vector (nothing can tell positions apart).
    """
    centred = h - h.mean(dim=-2, keepdim=True)  # (b, n, d)
    return float(centred.norm() / h.norm())


def position_signal_by_depth(
    depth: int = 12, num_hiddens: int = 32, num_heads: int = 4, num_steps: int = 32, seed: int = 0
) -> dict[str, object]:
    """The position signal after each layer of a random post-norm attention stack.

    The input is the same token at every position plus P, so any difference between rows is
    position. Each layer is ``LayerNorm(attention(h))`` without a residual connection or
    ``LayerNorm(h + attention(h))`` with one. Computed in float64.
    """
    depth = require_positive_int("depth", depth)
    with seeded(seed):
        token = torch.randn(num_hiddens, dtype=torch.float64)  # (d,)
        layers = [MultiHeadAttention(num_hiddens, num_heads).double().eval() for _ in range(depth)]
        norms = [nn.LayerNorm(num_hiddens).double() for _ in range(depth)]
    x = (token + sinusoidal_table(num_steps, num_hiddens, dtype=torch.float64))[None]  # (1, n, d)
    result: dict[str, object] = {"depth": list(range(depth + 1))}
    with torch.no_grad():
        for residual in (False, True):
            h, signal = x, [position_signal(x)]
            for attention, norm in zip(layers, norms):
                update = attention(h, h, h)
                h = norm(h + update if residual else update)
                signal.append(position_signal(h))
            result["with_residual" if residual else "without_residual"] = signal
    return result
