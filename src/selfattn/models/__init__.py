"""Small transformers built from selfattn's own modules, for the study and the tour.

* :class:`TransformerBlock`: attention + MLP, pre- or post-LayerNorm, residuals optional.
* :class:`TransformerLM`: a causal language model with any encoding of
  :func:`selfattn.positional.build`, a tied output head, ``KVCache`` decoding.
"""

from selfattn.models.block import TransformerBlock
from selfattn.models.lm import TransformerLM

__all__ = ["TransformerBlock", "TransformerLM"]
