"""Position-dependent query scalings of latent attention layers (Mistral Large 4's per-head softmax scaling).

The part itself lives in :mod:`selfattn.parts.query_scaling`, shared with :class:`~selfattn.MultiHeadAttention`.
"""

from selfattn.parts.query_scaling import HeadLogScaling

__all__ = ["HeadLogScaling"]
