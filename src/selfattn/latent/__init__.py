"""Multi-head latent attention (DeepSeek's MLA): the layer, its functional form, its cache and its loader."""

from selfattn.latent.cache import CachedLatents, LatentCache
from selfattn.latent.functional import LatentExplanation, choose_computation, explain_latent, latent_attention
from selfattn.latent.mla import MultiHeadLatentAttention

__all__ = [
    "CachedLatents",
    "LatentCache",
    "LatentExplanation",
    "MultiHeadLatentAttention",
    "choose_computation",
    "explain_latent",
    "latent_attention",
]
