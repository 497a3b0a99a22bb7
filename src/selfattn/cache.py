"""Key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfattn._validation import require_positive_int

__all__ = ["KVCache"]


class KVCache:
    """The keys and values one :class:`~selfattn.MultiHeadAttention` layer has seen so far.

    Pass the same cache to every call of one layer: ``mha(x_t, x_t, x_t, cache=cache,
    causal=True)``. Keys are stored after any query/key encoding (rotary) has been applied at
    their own positions, so earlier entries never need recomputing. Storage is allocated once,
    at the first call, for ``max_len`` positions; the cache is meant for inference (wrap
    decoding in ``torch.no_grad()``).

    Args:
        max_len: the most positions the cache will hold.

    Attributes:
        length: positions stored so far; the default ``offset`` of the next call.
    """

    def __init__(self, max_len: int):
        self.max_len = require_positive_int("max_len", max_len)
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget everything stored (the storage itself is kept)."""
        self.length = 0

    def update_keys(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the stored keys ``(b, h, length, dh)`` by ``transform(keys)``, in place (re-rotation)."""
        if self._keys is not None and self.length:
            self._keys[..., : self.length, :] = transform(self._keys[..., : self.length, :])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(b, h, l, dh)`` keys and ``(b, h, l, dv)`` values; return all stored so far.

        Returns:
            ``(b, h, length, dh)`` keys and ``(b, h, length, dv)`` values (views of the storage).
        """
        new = keys.shape[-2]
        if self.length + new > self.max_len:
            raise ValueError(
                f"cache overflow: {self.length} positions stored + {new} new > max_len={self.max_len}"
            )
        if self._keys is None:
            self._keys = keys.new_empty(*keys.shape[:-2], self.max_len, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], self.max_len, values.shape[-1])
        assert self._values is not None
        if keys.shape[:-2] != self._keys.shape[:-2] or keys.shape[-1] != self._keys.shape[-1]:
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not fit a cache holding {tuple(self._keys.shape)}; "
                "use one cache per layer and per batch"
            )
        end = self.length + new
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self.length = end
        return self._keys[..., :end, :], self._values[..., :end, :]
