"""The cache of multi-head latent attention: per token only the latent ``c`` and the rotated key ``k_rope``.

Shape legend:
    b: batch, n: keys stored plus new, l: new tokens, r: latent size (kv_lora_rank),
    dr: rotary features (qk_rope_head_dim).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from selfattn._validation import require_tensor
from selfattn.cache import KVCache

__all__ = ["CachedLatents", "LatentCache"]


class CachedLatents(NamedTuple):
    """What the queries of one call may see: the stored latents plus the new ones.

    Attributes:
        latent_key: ``(b, 1, n, r + dr)``: ``c`` then ``k_rope`` of each key, side by side.
        positions: int64 positions of those keys, ``(n,)`` when every sequence shares them, else ``(b, n)``.
        padding: bool ``(b, n)``, True for keys marked as padding; None when none ever was.
        first_index: index of the first of them in the whole sequence (0 unless a window dropped older keys).
    """

    latent_key: torch.Tensor
    positions: torch.Tensor
    padding: torch.Tensor | None
    first_index: int


class LatentCache:
    """What one :class:`~selfattn.latent.MultiHeadLatentAttention` layer has seen: ``r + dr`` numbers per token.

    Where a :class:`~selfattn.KVCache` of DeepSeek-V3's attention would hold ``2 x 128 x 128`` numbers
    per token (keys and values of every head), this holds the normalized latent ``c`` (512) and the
    rotated shared key ``k_rope`` (64), side by side in one ``(b, 1, max_len, r + dr)`` tensor: 57x less.
    Keys are stored after their rotation at their own positions, with those positions and any
    ``key_padding_mask``. Pass the same cache to every call of one layer.

    It behaves as :class:`~selfattn.KVCache` does (it keeps one inside): storage allocated at the
    first call for ``max_len`` tokens; ``window=w`` keeps only the last ``w - 1`` tokens (for a layer
    with ``window=w``), ``sink_tokens=k`` also the first ``k``; a call that fails leaves the cache
    as it was (the layer updates with ``commit=False`` and commits once attention has succeeded).

    It is not a :class:`~selfattn.KVCache`: handed to a :class:`~selfattn.MultiHeadAttention` it is
    refused with a ``ValueError`` that names it, as a ``KVCache`` handed to the latent layer is.

    Args:
        max_len: the most tokens the cache will hold (without a window).
        window: keep only what a sliding window of this size can still see.
        sink_tokens: with ``window``, also keep the sequence's first ``sink_tokens`` tokens.

    Attributes:
        length: tokens seen so far; the position of the next token by default.
    """

    def __init__(self, max_len: int | None = None, *, window: int | None = None, sink_tokens: int = 0):
        self._store = KVCache(max_len, window=window, sink_tokens=sink_tokens)
        self.rank: int | None = None  # r, fixed by the first update

    @property
    def length(self) -> int:
        return self._store.length

    @property
    def stored(self) -> int:
        """Tokens held now (``length``, or fewer for a windowed cache)."""
        return self._store.stored

    @property
    def max_len(self) -> int | None:
        return self._store.max_len

    @property
    def window(self) -> int | None:
        return self._store.window

    @property
    def sink_tokens(self) -> int:
        return self._store.sink_tokens

    @property
    def positions(self) -> torch.Tensor | None:
        """Positions of the stored tokens, ``(stored,)`` or ``(b, stored)``; None when empty."""
        return self._store.positions

    @property
    def nbytes(self) -> int:
        """Bytes of the storage allocated now (``b x capacity x (r + dr)`` elements), positions and padding aside."""
        keys = self._store._keys
        return 0 if keys is None else keys.numel() * keys.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes: ``(r + dr) x`` the element size; 0 before the first call."""
        keys = self._store._keys
        return 0 if keys is None else keys.shape[-1] * keys.element_size()

    def reset(self) -> None:
        """Forget everything stored, sizes, dtype and device included."""
        self._store.reset()
        self.rank = None

    def copy(self) -> LatentCache:
        """A copy whose storage is its own: what a dry run (``explain``) may change without touching this cache."""
        twin = copy.copy(self)
        twin._store = self._store.copy()
        return twin

    def commit(self) -> None:
        """Count the tokens of the last ``update(..., commit=False)`` as stored."""
        self._store.commit()

    def update(
        self,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
        commit: bool = True,
    ) -> CachedLatents:
        """Store new tokens' ``latent`` ``(b, 1, l, r)`` and ``k_rope`` ``(b, 1, l, dr)``; return all a query may see.

        Args:
            latent: the normalized latent ``c`` of the new tokens.
            k_rope: their rotated shared key (``dr`` may be 0: a layer without rotary).
            positions: ``(l,)`` or ``(b, l)``, default ``length .. length + l - 1``.
            padding: bool ``(b, l)``, True = padding.
            commit: with False, ``length`` advances only at :meth:`commit`.

        Raises:
            ValueError: shapes that do not fit each other or what is stored (another ``r``), past
                ``max_len``; nothing is written then.
        """
        for name, t in (("latent", latent), ("k_rope", k_rope)):
            require_tensor(name, t)
            if t.dim() != 4 or t.shape[1] != 1:
                raise ValueError(f"{name} must have shape (b, 1, l, features), got {tuple(t.shape)}")
        if k_rope.shape[:3] != latent.shape[:3] or k_rope.dtype != latent.dtype:
            raise ValueError(
                f"k_rope {tuple(k_rope.shape)} {k_rope.dtype} does not fit latent {tuple(latent.shape)} {latent.dtype}"
            )
        rank = latent.shape[-1]
        if self.length and self.rank is not None and rank != self.rank:
            raise ValueError(f"latent of {rank} features does not fit a cache holding latents of {self.rank}")
        joined = torch.cat((latent, k_rope), dim=-1)  # (b, 1, l, r + dr)
        seen = self._store.update(
            joined, joined[..., :0], positions=positions, padding=padding, commit=commit
        )  # no values: they are the latent itself
        self.rank = rank
        return CachedLatents(seen.keys, seen.positions, seen.padding, seen.first_index)

    def __repr__(self) -> str:
        return (
            f"LatentCache(max_len={self.max_len}, window={self.window}, sink_tokens={self.sink_tokens}, "
            f"length={self.length}, bytes_per_token={self.bytes_per_token})"
        )
