"""Key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfattn._validation import require_positive_int, require_tensor

__all__ = ["KVCache"]


class KVCache:
    """The keys and values one :class:`~selfattn.MultiHeadAttention` layer has seen so far.

    Pass the same cache to every call of one layer: ``mha(x_t, x_t, x_t, cache=cache,
    causal=True)``. Keys are stored after any query/key encoding (rotary) has been applied at
    their own positions, so earlier entries never need recomputing. Storage is allocated once,
    at the first call, for ``max_len`` positions; the cache is meant for inference (wrap
    decoding in ``torch.no_grad()``).

    A call that fails leaves the cache as it was: :meth:`append` checks everything before it
    writes, and :class:`~selfattn.MultiHeadAttention` appends with ``commit=False`` and commits
    only once attention has succeeded.

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
        self._pending = 0
        self.encoding_state: dict[str, object] = {}  # what a query/key encoding notes about the stored keys

    def reset(self) -> None:
        """Forget everything stored, the batch size, shapes, dtype and device included."""
        self.length = 0
        self._pending = 0
        self._keys = self._values = None
        self.encoding_state = {}

    def update_keys(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the stored keys ``(b, h, length, dh)`` by ``transform(keys)``, in place (re-rotation).

        A query/key encoding that does this notes how the keys are now encoded in
        :attr:`encoding_state`, so a later call stays consistent even if the current one fails.
        """
        if self._keys is not None and self.length:
            self._keys[..., : self.length, :] = transform(self._keys[..., : self.length, :])

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, *, commit: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(b, h, l, dh)`` keys and ``(b, h, l, dv)`` values; return all stored so far.

        Args:
            keys: ``(b, h, l, dh)``, of the dtype and device of the keys already stored.
            values: ``(b, h, l, dv)``, the same ``l`` as ``keys``.
            commit: with False, the new entries are written past ``length`` and returned with
                the stored ones, but ``length`` advances only at :meth:`commit`; a caller whose
                later work fails leaves the cache as it was (the next append overwrites them).

        Returns:
            ``(b, h, length, dh)`` keys and ``(b, h, length, dv)`` values (views of the storage).

        Raises:
            ValueError: past ``max_len``, or keys/values that do not fit each other or what is
                stored (shape, dtype, device); nothing is written then.
        """
        self._check(keys, values)
        new = keys.shape[-2]
        if self.length + new > self.max_len:
            raise ValueError(
                f"cache overflow: {self.length} positions stored + {new} new > max_len={self.max_len}"
            )
        if self.length == 0 and not self._fits(keys, values):
            # Nothing stored yet (or only the entries of a call that failed): size the storage now.
            self._keys = keys.new_empty(*keys.shape[:-2], self.max_len, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], self.max_len, values.shape[-1])
        assert self._keys is not None and self._values is not None
        end = self.length + new
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self._pending = new
        if commit:
            self.commit()
        return self._keys[..., :end, :], self._values[..., :end, :]

    def commit(self) -> None:
        """Count the entries of the last ``append(..., commit=False)`` as stored."""
        self.length += self._pending
        self._pending = 0

    def _fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        stored_keys, stored_values = self._keys, self._values
        if stored_keys is None or stored_values is None:
            return False
        return (
            keys.shape[:-2] == stored_keys.shape[:-2]
            and keys.shape[-1] == stored_keys.shape[-1]
            and values.shape[-1] == stored_values.shape[-1]
            and keys.dtype == stored_keys.dtype
            and values.dtype == stored_values.dtype
            and keys.device == stored_keys.device
        )

    def _check(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, t in (("keys", keys), ("values", values)):
            require_tensor(name, t)
            if t.dim() < 2:
                raise ValueError(f"{name} must have shape (b, h, l, features), got {tuple(t.shape)}")
        if values.shape[:-1] != keys.shape[:-1]:
            raise ValueError(
                f"values of shape {tuple(values.shape)} do not match keys of shape {tuple(keys.shape)} "
                "(same batch, heads and length expected)"
            )
        if values.dtype != keys.dtype or values.device != keys.device:
            raise ValueError(
                f"keys and values must share dtype and device, got keys {keys.dtype} on {keys.device} "
                f"and values {values.dtype} on {values.device}"
            )
        stored_keys, stored_values = self._keys, self._values
        if self.length == 0 or stored_keys is None or stored_values is None:
            return
        if keys.dtype != stored_keys.dtype or keys.device != stored_keys.device:
            raise ValueError(
                f"keys of dtype {keys.dtype} on {keys.device} do not fit a cache holding {stored_keys.dtype} "
                f"on {stored_keys.device}; call reset() to start over"
            )
        if keys.shape[:-2] != stored_keys.shape[:-2] or keys.shape[-1] != stored_keys.shape[-1]:
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not fit a cache holding {tuple(stored_keys.shape)}; "
                "use one cache per layer and per batch"
            )
        if values.shape[-1] != stored_values.shape[-1]:
            raise ValueError(
                f"values of shape {tuple(values.shape)} do not fit a cache holding {tuple(stored_values.shape)}"
            )
