"""A learned absolute position embedding added to the input (the chapter's exercise 2)."""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_floating, require_non_negative_int, require_positive_int, require_probability
from selfattn.positional.base import InputEncoding, require_positions

__all__ = ["LearnedPositionalEncoding"]


class LearnedPositionalEncoding(InputEncoding):
    """``dropout(X + P[offset : offset + l])`` with ``P`` a learned ``(max_len, d)`` parameter.

    Vaswani et al. (2017, Table 3 row E) found it as good as the sinusoids on translation,
    but it cannot extrapolate: no position at or past ``max_len`` has an embedding, and asking
    for one raises ``ValueError`` rather than inventing a row.

    Args:
        num_hiddens: model size ``d``.
        max_len: number of positions with an embedding.
        dropout: dropout probability on the sum.
        device: where ``P`` is created.
        dtype: dtype of ``P``.

    Shape:
        X ``(..., l, d)`` -> ``(..., l, d)``.
    """

    def __init__(
        self,
        num_hiddens: int,
        max_len: int,
        dropout: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.max_len = require_positive_int("max_len", max_len)
        self.dropout = nn.Dropout(require_probability("dropout", dropout))
        self.weight = nn.Parameter(torch.empty(self.max_len, self.num_hiddens, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``P`` from N(0, 0.02^2), small next to unit-scale token embeddings (as GPT-2 does)."""
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, X: torch.Tensor, offset: int = 0, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Add ``P[offset : offset + l]``, or ``P[positions]`` for integer ``positions`` ``(l,)`` or ``(b, l)``."""
        require_floating("X", X)
        if X.dim() < 2 or X.shape[-1] != self.num_hiddens:
            raise ValueError(f"X must have shape (..., length, {self.num_hiddens}), got {tuple(X.shape)}")
        if positions is not None:
            positions = require_positions(positions, X, offset)
            if not torch.compiler.is_compiling() and positions.numel() and int(positions.max()) >= self.max_len:
                raise ValueError(
                    f"positions reach {int(positions.max())}, past max_len={self.max_len}: a learned positional "
                    "encoding cannot extrapolate to positions it has no embedding for"
                )
            rows: torch.Tensor = self.dropout(X + self.weight[positions].to(X.dtype))
            return rows
        offset = require_non_negative_int("offset", offset)
        end = offset + X.shape[-2]
        if end > self.max_len:
            raise ValueError(
                f"positions {offset}..{end - 1} reach past max_len={self.max_len}: a learned positional "
                "encoding cannot extrapolate to positions it has no embedding for (build it with a larger "
                "max_len, or use sinusoidal, rotary or a relative bias)"
            )
        encoded: torch.Tensor = self.dropout(X + self.weight[offset:end].to(X.dtype))
        return encoded

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, max_len={self.max_len}"
