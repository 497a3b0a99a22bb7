"""Keys and values one layer stores and later layers read: Gemma 3n's and Gemma 4's KV sharing.

In those models the last layers project no keys or values of their own: each reads what an
earlier layer of its type attended to (rotated, cache included). :class:`SharedKVCache` is that
earlier layer's :class:`~selfattn.KVCache`, which also remembers what its layer's latest call
saw; :class:`SharedKVView` is what a sharing layer (``MultiHeadAttention(..., shared_kv=True)``)
takes as its ``cache``: a read-only view of it. The keys are stored once, in the source's cache.

Run the source layer first on each new stretch of tokens, then its sharers on the same tokens::

    source_cache = SharedKVCache(max_len)
    view = SharedKVView(source_cache)
    y = source(x, x, x, causal=True, cache=source_cache)
    z = sharer(y, y, y, causal=True, cache=view)

Shape legend: b batch, hk key/value heads, n keys stored plus new, dh / dv key / value head size.
"""

from __future__ import annotations

import torch

from selfattn.cache import CachedKeys, KVCache

__all__ = ["SharedKVCache", "SharedKVView"]


class SharedKVCache(KVCache):
    """A :class:`~selfattn.KVCache` whose keys and values later layers read too.

    It stores and behaves exactly as a ``KVCache`` (same arguments); besides, each
    :meth:`update` keeps what it returned (the stored keys plus the new ones, as views of its
    storage, no copy) as :attr:`latest`, for the :class:`SharedKVView` of the sharing layers.

    Attributes:
        latest: what the latest call of the source layer attended to, or None before the first.
        latest_new: how many new keys that call brought.
    """

    def __init__(self, max_len: int | None = None, *, window: int | None = None, sink_tokens: int = 0):
        super().__init__(max_len, window=window, sink_tokens=sink_tokens)
        self.latest: CachedKeys | None = None
        self.latest_new = 0

    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        commit: bool = True,
    ) -> CachedKeys:
        """:meth:`~selfattn.KVCache.update`, remembering what it returns as :attr:`latest`."""
        seen = super().update(keys, values, positions=positions, padding=padding, documents=documents, commit=commit)
        self.latest, self.latest_new = seen, keys.shape[-2]
        return seen

    def reset(self) -> None:
        super().reset()
        self.latest, self.latest_new = None, 0


class SharedKVView(KVCache):
    """The ``cache`` of a layer that reads another layer's keys and values (``shared_kv=True``).

    It stores nothing (:attr:`~selfattn.KVCache.nbytes` 0): each call of the sharing layer reads
    the keys and values the source layer's latest call attended to, from ``source``. Its
    :attr:`~selfattn.KVCache.length` counts the tokens the sharing layer has seen, so a call
    must bring as many new tokens as the source's latest call did, and the two must then have
    seen the same number of tokens: the source runs first on each stretch of tokens.

    Args:
        source: the source layer's :class:`SharedKVCache`; its ``max_len``, ``window`` and
            ``sink_tokens`` are the view's (a sharing layer sees only what the source keeps).

    Raises:
        ValueError: for a ``source`` that is not a :class:`SharedKVCache`.
    """

    def __init__(self, source: SharedKVCache):
        if not isinstance(source, SharedKVCache):
            raise ValueError(f"source must be a SharedKVCache, got {type(source).__name__} {source!r}")
        super().__init__(source.max_len, window=source.window, sink_tokens=source.sink_tokens)
        self.source = source
        self._new = 0

    def update(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        commit: bool = True,
    ) -> CachedKeys:
        """Refused: a view is read by a ``shared_kv=True`` layer, never written (only its source's layer stores)."""
        raise ValueError(
            "this SharedKVView is read-only: give it to a layer with shared_kv=True, and the source's "
            "SharedKVCache to the layer that projects the keys"
        )

    def read(self, num_new: int, kv_heads: int, head_dim: int, value_head_dim: int) -> CachedKeys:
        """What the source layer's latest call attended to, for a sharing layer's call of ``num_new`` tokens.

        Args:
            num_new: tokens of the sharing layer's call.
            kv_heads: the sharing layer's key/value heads ``hk``.
            head_dim: its key head size ``dh``.
            value_head_dim: its value head size ``dv``.

        Returns:
            keys ``(b, hk, n, dh)``, values ``(b, hk, n, dv)``, their positions, padding and first index.

        Raises:
            ValueError: when the source has not run on these tokens yet (or ran ahead), or its heads
                are not of the sharing layer's number and sizes.
        """
        source, latest = self.source, self.source.latest
        if latest is None or source.latest_new != num_new or source.length != self.length + num_new:
            raise ValueError(
                f"the sharing layer's call brings {num_new} tokens after {self.length}, but the source layer's "
                f"latest call brought {source.latest_new} and its cache holds {source.length}: run the source "
                "layer first, on the same tokens"
            )
        _, heads, _, size = latest.keys.shape
        if (heads, size, latest.values.shape[-1]) != (kv_heads, head_dim, value_head_dim):
            raise ValueError(
                f"the source layer's keys have {heads} heads of size {size} and values of size "
                f"{latest.values.shape[-1]}; the sharing layer has num_kv_heads={kv_heads}, head size {head_dim} "
                f"and value head size {value_head_dim}"
            )
        if latest.documents is not None:
            raise ValueError("a SharedKVView does not serve packed sequences (document_ids) yet")
        self._new = num_new
        return latest

    def commit(self) -> None:
        """Count the tokens of the latest :meth:`read` as seen."""
        self.length += self._new
        self._new = 0

    def reset(self) -> None:
        super().reset()
        self._new = 0
