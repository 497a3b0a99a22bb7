"""What :class:`~selfattn.KVCache` checks of the keys and values it is given, before it writes any.

Shape legend: b batch, hk key/value heads, l new entries, dh key size, dv value size.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from selfattn._validation import require_tensor

if TYPE_CHECKING:
    from selfattn.cache import KVCache

__all__ = ["check_entries", "claim", "copy_for_dry_run"]


def claim(cache: KVCache, layer: Any) -> None:
    """Note ``layer`` as the one whose keys ``cache`` holds, or refuse a call of another layer while it holds some:
    that layer would read them as its own (one cache per layer; a sharing layer reads a ``SharedKVView``)."""
    owner = None if cache._writer is None else cache._writer()  # None too where that layer is gone
    if owner is layer:
        return
    if owner is not None and cache.length:
        raise ValueError(
            f"cache holds another layer's keys ({cache.length} positions seen): give each layer its own KVCache "
            "(TransformerLM.make_caches does), or reset() it first"
        )
    cache._writer = weakref.ref(layer)


def copy_for_dry_run(cache: Any) -> Any:
    """``cache.copy()`` that still names the layer whose keys it holds: a dry run (``explain``) refuses another
    layer's cache where the call does (a plain copy is no layer's until one writes to it)."""
    twin = cache.copy()
    twin._writer = getattr(cache, "_writer", None)
    return twin


def check_entries(
    keys: torch.Tensor, values: torch.Tensor, stored_keys: torch.Tensor | None, stored_values: torch.Tensor | None
) -> None:
    """Raise ``ValueError`` unless ``keys`` ``(b, hk, l, dh)`` and ``values`` ``(b, hk, l, dv)`` agree with each other
    and, where the cache holds entries (``stored_keys`` and ``stored_values``, else None), with what it holds."""
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
    if stored_keys is None or stored_values is None:
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
