"""Key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfattn._validation import require_positive_int

__all__ = ["CachedKeys", "KVCache"]


class CachedKeys(NamedTuple):
    """What the queries of one call may see: the stored keys plus the new ones.

    Attributes:
        keys: ``(b, hk, n, dh)``.
        values: ``(b, hk, n, dv)``.
        positions: int64 positions of those keys, ``(n,)`` when every sequence shares them,
            else ``(b, n)``.
        padding: bool ``(b, n)``, True for keys marked as padding; None when none ever was.
        first_index: index of ``keys[..., 0, :]`` in the whole sequence seen so far (0 unless
            a windowed cache has dropped older keys).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    padding: torch.Tensor | None
    first_index: int


class KVCache:
    """The keys and values one :class:`~selfattn.MultiHeadAttention` layer has seen so far.

    Pass the same cache to every call of one layer: ``mha(x_t, x_t, x_t, cache=cache,
    causal=True)``. Keys are stored after any query/key encoding (rotary) has been applied at
    their own positions, so earlier entries never need recomputing; their positions and any
    ``key_padding_mask`` are stored beside them. Storage is allocated once, at the first call,
    for ``max_len`` positions; the cache is meant for inference (wrap decoding in
    ``torch.no_grad()``).

    With ``window=w`` (for a ``MultiHeadAttention(..., window=w)`` layer) only the last
    ``w - 1`` keys are kept, the most a future query can see: memory is O(w) however long
    the decoding runs, and ``max_len`` may be left out.

    Args:
        max_len: the most positions the cache will hold (without a window).
        window: keep only what a sliding window of this size can still see.

    Attributes:
        length: positions seen so far; the default ``offset`` of the next call.
    """

    def __init__(self, max_len: int | None = None, *, window: int | None = None):
        self.window = None if window is None else require_positive_int("window", window)
        if max_len is None and self.window is None:
            raise ValueError("max_len must be a positive integer (or give window=...), got None")
        self.max_len = None if max_len is None else require_positive_int("max_len", max_len)
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # (b, capacity) int64
        self._padding: torch.Tensor | None = None  # (b, capacity) bool, allocated at the first padding seen
        self._shared_positions = True  # every append so far gave the same positions to every sequence

    @property
    def stored(self) -> int:
        """Keys held now (``length``, or at most ``window - 1`` for a windowed cache)."""
        return self.length if self.window is None else min(self.length, self.window - 1)

    def reset(self) -> None:
        """Forget everything stored (the storage itself is kept)."""
        self.length = 0
        self._padding = None
        self._shared_positions = True

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(b, h, l, dh)`` keys and ``(b, h, l, dv)`` values; return all the queries may see.

        Returns:
            ``(b, h, n, dh)`` keys and ``(b, h, n, dv)`` values.
        """
        seen = self.update(keys, values)
        return seen.keys, seen.values

    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> CachedKeys:
        """Store new keys, values, their positions ``(l,)``/``(b, l)`` and padding ``(b, l)``.

        Positions default to ``length .. length + l - 1``.
        """
        batch, new = keys.shape[0], keys.shape[-2]
        if self.window is None and self.max_len is not None and self.length + new > self.max_len:
            raise ValueError(
                f"cache overflow: {self.length} positions stored + {new} new > max_len={self.max_len}"
            )
        if positions is None:
            positions = torch.arange(self.length, self.length + new, device=keys.device)
        shared = positions.dim() == 1
        positions = positions.to(keys.device, torch.long).expand(batch, new)  # (b, l)
        if self._keys is not None and (
            keys.shape[:-2] != self._keys.shape[:-2] or keys.shape[-1] != self._keys.shape[-1]
        ):
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not fit a cache holding {tuple(self._keys.shape)}; "
                "use one cache per layer and per batch"
            )
        if padding is not None and self._padding is None:
            self._padding = torch.zeros(batch, self._capacity(new), dtype=torch.bool, device=keys.device)
        if self.window is not None:
            return self._update_window(keys, values, positions, padding, shared)
        if self._keys is None:
            assert self.max_len is not None
            self._keys = keys.new_empty(*keys.shape[:-2], self.max_len, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], self.max_len, values.shape[-1])
            self._positions = positions.new_empty(batch, self.max_len)
        assert self._values is not None and self._positions is not None
        end = self.length + new
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self._positions[:, self.length : end] = positions
        if self._padding is not None:
            self._padding[:, self.length : end] = False if padding is None else padding
        self.length = end
        self._shared_positions &= shared
        padding_seen = None if self._padding is None else self._padding[:, :end]
        return self._seen(self._keys[..., :end, :], self._values[..., :end, :], self._positions[:, :end], padding_seen, 0)

    def _capacity(self, new: int) -> int:
        if self.window is None:
            assert self.max_len is not None
            return self.max_len
        return self.stored + new

    def _update_window(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor | None,
        shared: bool,
    ) -> CachedKeys:
        assert self.window is not None
        old = self.stored
        if self._keys is None or old == 0:
            all_keys, all_values, all_positions = keys, values, positions
        else:
            assert self._values is not None and self._positions is not None
            all_keys = torch.cat((self._keys, keys), dim=-2)  # (b, hk, old + l, dh)
            all_values = torch.cat((self._values, values), dim=-2)
            all_positions = torch.cat((self._positions, positions), dim=-1)  # (b, old + l)
        all_padding = None
        if self._padding is not None:
            new_padding = torch.zeros_like(positions, dtype=torch.bool) if padding is None else padding.to(torch.bool)
            all_padding = torch.cat((self._padding[:, self._padding.shape[1] - old :], new_padding), dim=-1)
        first_index = self.length - old
        self.length += keys.shape[-2]
        self._shared_positions &= shared
        keep = self.window - 1
        # Copies, not views: the window slides, and nothing may keep the older keys alive.
        start = max(all_keys.shape[-2] - keep, 0)
        self._keys = all_keys[..., start:, :].clone()
        self._values = all_values[..., start:, :].clone()
        self._positions = all_positions[:, start:].clone()
        if all_padding is not None:
            self._padding = all_padding[:, start:].clone()
        return self._seen(all_keys, all_values, all_positions, all_padding, first_index)

    def _seen(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor | None,
        first_index: int,
    ) -> CachedKeys:
        return CachedKeys(keys, values, positions[0] if self._shared_positions else positions, padding, first_index)
