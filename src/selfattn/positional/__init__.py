"""Positional encodings, grouped by where they act (see :mod:`selfattn.positional.base`)."""

from selfattn.positional.base import InputEncoding, PositionalEncoding, QueryKeyEncoding, ScoreEncoding
from selfattn.positional.sinusoidal import SinusoidalPositionalEncoding

__all__ = [
    "InputEncoding",
    "PositionalEncoding",
    "QueryKeyEncoding",
    "ScoreEncoding",
    "SinusoidalPositionalEncoding",
]
