"""Small transformers built from selfattn's own modules, for the study, the tour and today's layer recipes.

* :class:`TransformerBlock`: attention + MLP, pre- or post-LayerNorm, residuals optional.
* :class:`TransformerLM`: a causal language model with any encoding of
  :func:`selfattn.positional.build`, a tied output head, ``KVCache`` decoding, and one
  :class:`LayerRecipe` per layer (:func:`repeat_pattern`), layers of their own head counts and
  sizes, and layers that read an earlier layer's keys and values (:class:`SharedKVCache`,
  :class:`SharedKVView`: stored once).
"""

from selfattn.models.block import TransformerBlock
from selfattn.models.lm import TransformerLM
from selfattn.models.recipe import LayerRecipe, LayerSizes, repeat_pattern
from selfattn.shared_cache import SharedKVCache, SharedKVView

__all__ = [
    "LayerRecipe",
    "LayerSizes",
    "SharedKVCache",
    "SharedKVView",
    "TransformerBlock",
    "TransformerLM",
    "repeat_pattern",
]
