"""selfattn: self-attention and positional encodings for PyTorch.

The pure functions live in :mod:`selfattn.functional`, the encodings in
:mod:`selfattn.positional`; the most used names are re-exported here.
"""

from selfattn.attention import MultiHeadAttention
from selfattn.cache import KVCache
from selfattn.functional import attention, sinusoidal_table
from selfattn.positional import (
    ALiBiPositionalBias,
    LearnedPositionalEncoding,
    NoPositionalEncoding,
    RotaryPositionalEncoding,
    ShawRelativePositionEncoding,
    SinusoidalPositionalEncoding,
    SinusoidalPositionalEncoding2D,
    SinusoidalPositionalEncoding3D,
    T5RelativePositionBias,
)

__version__ = "0.1.0"

__all__ = [
    "ALiBiPositionalBias",
    "KVCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "NoPositionalEncoding",
    "RotaryPositionalEncoding",
    "ShawRelativePositionEncoding",
    "SinusoidalPositionalEncoding",
    "SinusoidalPositionalEncoding2D",
    "SinusoidalPositionalEncoding3D",
    "T5RelativePositionBias",
    "attention",
    "sinusoidal_table",
]
