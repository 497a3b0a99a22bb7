"""The encoding that adds nothing, so "no positions" goes through the same code path."""

from __future__ import annotations

import torch

from selfattn._validation import require_floating, require_non_negative_int
from selfattn.positional.base import InputEncoding

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

    def forward(self, X: torch.Tensor, offset: int = 0) -> torch.Tensor:
        require_floating("X", X)
        require_non_negative_int("offset", offset)
        return X
