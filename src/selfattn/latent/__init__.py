"""Multi-head latent attention (DeepSeek's MLA): the layer, its functional form, its cache and its loader."""

from selfattn.latent.cache import CachedLatents, LatentCache
from selfattn.latent.functional import LatentExplanation, choose_computation, explain_latent, latent_attention
from selfattn.latent.mla import MultiHeadLatentAttention
from selfattn.latent.rotary import ScaledFrequencyRotary
from selfattn.latent.scaling import HeadLogScaling

__all__ = [
    "CachedLatents",
    "HeadLogScaling",
    "LatentCache",
    "LatentExplanation",
    "MultiHeadLatentAttention",
    "ScaledFrequencyRotary",
    "choose_computation",
    "explain_latent",
    "latent_attention",
]
