"""Drop-in replacements for ``torch.nn`` modules: ``import selfattn.nn as nn`` where torch's were used."""

from selfattn.nn.multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]
