"""The encoding that adds nothing, so "no positions" goes through the same code path."""

from __future__ import annotations

import torch

from selfattn._validation import require_floating, require_non_negative_int
from selfattn.positional.base import InputEncoding, require_positions

__all__ = ["NoPositionalEncoding"]


class NoPositionalEncoding(InputEncoding):
    """Returns its input unchanged: attention without positions is permutation-equivariant.

    It is relative in the sense of :attr:`~selfattn.positional.PositionalEncoding.is_relative`
    (shifting every position changes nothing), and it validates its input like every other
    input encoding, so swapping it in or out never changes what errors a caller sees.

    Shape:
        X ``(..., l, d)`` -> ``(..., l, d)``.
    """

    is_relative = True

    def __init__(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()  # nothing to create: device and dtype are accepted so every encoding takes them

    def reset_parameters(self) -> None:
        """Nothing to reset."""

    def forward(self, X: torch.Tensor, offset: int = 0, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        require_floating("X", X)
        if positions is not None:
            require_positions(positions, X, offset)
            return X
        require_non_negative_int("offset", offset)
        return X
