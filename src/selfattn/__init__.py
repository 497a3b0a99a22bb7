"""selfattn: self-attention and positional encodings for PyTorch.

The pure functions live in :mod:`selfattn.functional`, the encodings in
:mod:`selfattn.positional`; the most used names are re-exported here.
"""

from selfattn.attention import MultiHeadAttention
from selfattn.cache import KVCache
from selfattn.functional import attention, sinusoidal_table
from selfattn.positional import SinusoidalPositionalEncoding

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "attention",
    "sinusoidal_table",
]
