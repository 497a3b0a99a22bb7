"""The lightning indexer's own key cache: its single-head index keys and their padding, one layer's worth.

Shape legend: b batch, n new tokens, T tokens seen so far (new ones included), D index head size.
"""

from __future__ import annotations

import torch

from selfattn._validation import require_positive_int

__all__ = ["IndexerKeyCache"]


class IndexerKeyCache:
    """The index keys (already rotated at their positions) one :class:`~selfattn.sparse.LightningIndexer` has seen.

    Pass the same cache to every call of one layer's indexer, beside the attention's own cache.
    Storage is allocated once, at the first call, for ``max_len`` tokens. As with
    :class:`~selfattn.KVCache`, a call that fails leaves the cache as it was: :meth:`extend`
    checks everything and writes past the stored tokens only, and :meth:`commit` (which the
    indexer calls once its selection succeeded) makes them part of it.

    Args:
        max_len: the most tokens the cache will hold.

    Attributes:
        length: tokens stored (committed) so far.
    """

    def __init__(self, max_len: int):
        self.max_len = require_positive_int("max_len", max_len)
        self.length = 0
        self._pending = 0
        self._keys: torch.Tensor | None = None  # (b, max_len, D)
        self._padding: torch.Tensor | None = None  # (b, max_len) bool, allocated at the first padding seen

    def reset(self) -> None:
        """Forget everything stored, the batch size, dtype and device included."""
        self.length = self._pending = 0
        self._keys = self._padding = None

    def nbytes(self) -> int:
        """Bytes of the stored keys (and padding), ``length x D x element size`` per sequence."""
        if self._keys is None:
            return 0
        per_token = self._keys.shape[-1] * self._keys.element_size() + (0 if self._padding is None else 1)
        return self._keys.shape[0] * self.length * per_token

    def extend(self, keys: torch.Tensor, padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored keys with ``keys (b, n, D)`` after them, ``(b, T, D)``, and their padding ``(b, T)`` or None.

        Nothing is stored until :meth:`commit`.

        Raises:
            ValueError: keys of another batch, size, dtype or device than the stored ones, or more
                tokens than ``max_len`` holds.
        """
        b, n, size = keys.shape
        if self.length + n > self.max_len:
            raise ValueError(
                f"IndexerKeyCache(max_len={self.max_len}) holds {self.length} tokens and cannot take {n} more"
            )
        if self._keys is None:
            self._keys = keys.new_zeros(b, self.max_len, size)
        stored = self._keys
        if (stored.shape[0], stored.shape[2], stored.dtype, stored.device) != (b, size, keys.dtype, keys.device):
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} ({keys.dtype}, {keys.device}) do not continue the cache's "
                f"(b={stored.shape[0]}, D={stored.shape[2]}, {stored.dtype}, {stored.device})"
            )
        end = self.length + n
        stored[:, self.length : end] = keys.detach()
        if padding is not None and self._padding is None:
            self._padding = torch.zeros(b, self.max_len, dtype=torch.bool, device=keys.device)
        if self._padding is not None:
            self._padding[:, self.length : end] = False if padding is None else padding
        self._pending = n
        return stored[:, :end], None if self._padding is None else self._padding[:, :end]

    def commit(self) -> None:
        """Keep the keys of the last :meth:`extend`."""
        self.length += self._pending
        self._pending = 0
