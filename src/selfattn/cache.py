"""Key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from selfattn._cache_checks import check_entries
from selfattn._validation import require_non_negative_int, require_positive_int

__all__ = ["CachedKeys", "KVCache"]


class CachedKeys(NamedTuple):
    """What the queries of one call may see: the stored keys plus the new ones.

    Attributes:
        keys: ``(b, hk, n, dh)``.
        values: ``(b, hk, n, dv)``.
        positions: int64 positions of those keys, ``(n,)`` when every sequence shares them, else ``(b, n)``.
        padding: bool ``(b, n)``, True for keys marked as padding; None when none ever was.
        first_index: index of ``keys[..., 0, :]`` in the whole sequence seen so far (0 unless a windowed cache
            has dropped older keys).
        documents: int64 document ids ``(b, n)`` of packed sequences; None when none were given.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    padding: torch.Tensor | None
    first_index: int
    documents: torch.Tensor | None = None


class KVCache:
    """The keys and values one :class:`~selfattn.MultiHeadAttention` layer has seen so far.

    Pass the same cache to every call of one layer: ``mha(x_t, x_t, x_t, cache=cache, causal=True)`` (another layer's
    call is refused while it holds keys). Keys are stored after any query/key encoding (rotary) has been applied at
    their own positions, so earlier entries never need recomputing; their positions, any ``key_padding_mask`` and any
    ``document_ids`` (packed sequences) are stored beside them. Storage is allocated once, at the first call, for
    ``max_len`` positions; the cache is meant for inference (wrap decoding in ``torch.no_grad()``).

    With ``window=w`` (for a ``MultiHeadAttention(..., window=w)`` layer) only the last ``w - 1`` keys are kept, the
    most a future query can see: memory is O(w) however long the decoding runs, and ``max_len`` may be left out.

    With ``sink_tokens=k`` as well, the first ``k`` keys of the sequence are kept forever beside the last ``w - 1``
    (StreamingLLM's attention sinks): a layer *without* a window then attends to those ``k + w - 1`` keys and the new
    ones (causally among themselves), in O(k + w) memory: decoding one token at a time, token ``t`` sees keys ``j < k``
    and ``t - w < j <= t``. The kept keys keep their own positions (rotary keys stay rotated at them); the keys dropped
    in between are gone, so a layer with a window, chunks, or a call with a ``mask`` rule, ``valid_lens`` or
    ``attn_mask`` (which read where keys sit in the sequence) refuses such a cache.

    A call that fails leaves the cache as it was: :meth:`update` checks everything before it writes, and
    :class:`~selfattn.MultiHeadAttention` updates with ``commit=False`` and commits only once attention has succeeded.

    Args:
        max_len: the most positions the cache will hold (without a window).
        window: keep only what a sliding window of this size can still see.
        sink_tokens: with ``window``, also keep the sequence's first ``sink_tokens`` keys.

    Attributes:
        length: positions seen so far; the default ``offset`` of the next call.
    """

    def __init__(self, max_len: int | None = None, *, window: int | None = None, sink_tokens: int = 0):
        self.window = None if window is None else require_positive_int("window", window)
        if max_len is None and self.window is None:
            raise ValueError("max_len must be a positive integer (or give window=...), got None")
        self.sink_tokens = require_non_negative_int("sink_tokens", sink_tokens)
        if self.sink_tokens and self.window is None:
            raise ValueError(f"sink_tokens={sink_tokens} needs a window: KVCache(window=w, sink_tokens=k)")
        self.max_len = None if max_len is None else require_positive_int("max_len", max_len)
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # (b, capacity) int64
        self._padding: torch.Tensor | None = None  # (b, capacity) bool, allocated at the first padding seen
        self._documents: torch.Tensor | None = None  # (b, capacity) int64, when the keys carry document ids
        # Document id and position of each sequence's newest key, (b,) each: where a new token continues.
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._shared_positions = True  # every append so far gave the same positions to every sequence
        self._pending, self._pending_shared = 0, True
        # Stored entries from this index on hold their own index as position, not yet written (decoding
        # steps at consecutive positions write none: see write_step); None when every position is written.
        self._deferred_from: int | None = None
        self._pending_deferred = False
        self._pending_window: (
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None
        ) = None
        self.encoding_state: dict[str, object] = {}  # what a query/key encoding notes about the stored keys
        self._writer: weakref.ref[object] | None = None  # the layer whose keys these are (_cache_checks.claim)

    def __getstate__(self) -> dict[str, object]:
        """Pickled or deep-copied: no layer's until one writes to it, as :meth:`copy` (a weak reference won't
        pickle)."""
        return {**self.__dict__, "_writer": None}

    @property
    def stored(self) -> int:
        """Keys held now (``length``, or at most ``sink_tokens + window - 1`` for a windowed cache)."""
        return self.length if self.window is None else min(self.length, self.sink_tokens + self.window - 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the storage this cache holds now: keys, values, positions, and padding and document ids
        where kept (allocated for ``max_len`` positions at the first call; O(window) for a windowed cache)."""
        held = (self._keys, self._values, self._positions, self._padding, self._documents)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def reset(self) -> None:
        """Forget everything stored, the batch size, shapes, dtype and device included."""
        self.length = 0
        self._pending = 0
        self._keys = self._values = self._positions = self._padding = self._documents = None
        self._last = self._pending_last = None
        self._shared_positions = self._pending_shared = True
        self._deferred_from, self._pending_deferred = None, False
        self._pending_window = self._writer = None
        self.encoding_state = {}

    @property
    def positions(self) -> torch.Tensor | None:
        """Positions of the stored keys, ``(stored,)`` when shared by every sequence, else ``(b, stored)``."""
        if self._positions is None or not self.stored:
            return None
        self._write_deferred()
        stored = self._positions[:, : self.stored]
        return stored[0] if self._shared_positions else stored

    @property
    def has_documents(self) -> bool:
        """Whether the stored keys carry document ids (a packed sequence is being decoded)."""
        return self.length > 0 and self._last is not None

    @property
    def last_documents(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Document id and position of each sequence's newest stored key, ``(b,)`` each.

        None unless the stored keys carry document ids. Kept even when a windowed cache has dropped the key itself,
        so a new token knows whether it continues that document.
        """
        return self._last if self.has_documents else None

    def copy(self) -> KVCache:
        """A copy whose storage is its own (detached): what a dry run may change without touching this cache."""
        self._write_deferred()
        twin = copy.copy(self)
        for name in ("_keys", "_values", "_positions", "_padding", "_documents"):
            stored = getattr(self, name)
            setattr(twin, name, None if stored is None else stored.detach().clone())
        twin.encoding_state, twin._writer = dict(self.encoding_state), None  # the next layer to write claims it
        return twin

    def update_keys(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the stored keys ``(b, h, stored, dh)`` by ``transform(keys)``, in place (re-rotation).

        A query/key encoding that does this notes how the keys are now encoded in :attr:`encoding_state`, so a
        later call stays consistent even if the current one fails.
        """
        if self._keys is not None and self.stored:
            self._keys[..., : self.stored, :] = transform(self._keys[..., : self.stored, :])

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, *, commit: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(b, h, l, dh)`` keys and ``(b, h, l, dv)`` values; return all the queries may see.

        Args:
            keys: ``(b, h, l, dh)``, of the dtype and device of the keys already stored.
            values: ``(b, h, l, dv)``, the same ``l`` as ``keys``.
            commit: with False, the new entries are returned with the stored ones, but ``length`` advances only
                at :meth:`commit`; a caller whose later work fails leaves the cache as it was (the next append
                overwrites them).

        Returns:
            ``(b, h, n, dh)`` keys and ``(b, h, n, dv)`` values.

        Raises:
            ValueError: past ``max_len``, or keys/values that do not fit each other or what is stored (shape,
                dtype, device); nothing is written then.
        """
        seen = self.update(keys, values, commit=commit)
        return seen.keys, seen.values

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
        """:meth:`append` that also stores positions ``(l,)``/``(b, l)``, padding ``(b, l)`` and documents ``(b, l)``.

        Positions default to ``length .. length + l - 1``. Document ids must be given on every call of a cache
        that holds them, and on none of one that does not.
        """
        check_entries(keys, values, self._keys if self.length else None, self._values if self.length else None)
        self._write_deferred()
        self._pending_deferred = False
        batch, new = keys.shape[0], keys.shape[-2]
        if self.window is None and self.max_len is not None and self.length + new > self.max_len:
            raise ValueError(f"cache overflow: {self.length} positions stored + {new} new > max_len={self.max_len}")
        if positions is None:
            positions = torch.arange(self.length, self.length + new, device=keys.device)
        if positions.shape not in ((new,), (batch, new)):
            raise ValueError(f"positions must have shape ({new},) or ({batch}, {new}), got {tuple(positions.shape)}")
        if padding is not None and tuple(padding.shape) != (batch, new):
            raise ValueError(f"padding must have shape ({batch}, {new}), got {tuple(padding.shape)}")
        if documents is not None and tuple(documents.shape) != (batch, new):
            raise ValueError(f"documents must have shape ({batch}, {new}), got {tuple(documents.shape)}")
        if self.length and (documents is None) == self.has_documents:
            if self.has_documents:
                raise ValueError("this cache holds document ids: give documents for the new keys too, or reset() it")
            raise ValueError("this cache holds keys without document ids: give none for the new keys, or reset() it")
        self._pending_shared = self._shared_positions and positions.dim() == 1
        if positions.dtype != torch.long or positions.device != keys.device:
            positions = positions.to(keys.device, torch.long)
        if self.window is not None or documents is not None:
            positions = positions.expand(batch, new)  # (b, l); a decoding step's (l,) broadcasts as it is written
        if documents is not None:
            documents = documents.to(keys.device, torch.long)
            self._pending_last = (documents[:, -1], positions[:, -1]) if new else self._last
        else:
            self._pending_last = None
        if self.window is not None:
            return self._update_window(keys, values, positions, padding, documents, commit)
        return self._update_stored(keys, values, positions, padding, documents, commit)

    def _update_stored(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor | None,
        documents: torch.Tensor | None,
        commit: bool,
    ) -> CachedKeys:
        """:meth:`update` of a cache without a window: writes into the storage, then returns views of it.

        ``positions``: int64 ``(l,)`` or ``(b, l)`` on the keys' device; ``documents`` int64 ``(b, l)``.
        """
        batch, new = keys.shape[0], keys.shape[-2]
        if self.length == 0 and not self._fits(keys, values):
            # Nothing stored yet (or only the entries of a call that failed): size the storage now.
            assert self.max_len is not None
            self._keys = keys.new_empty(*keys.shape[:-2], self.max_len, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], self.max_len, values.shape[-1])
            self._positions = positions.new_empty(batch, self.max_len)
        stored_keys, stored_values, stored_positions = self._keys, self._values, self._positions
        assert stored_keys is not None and stored_values is not None and stored_positions is not None
        if self.length == 0:
            self._padding = None  # padding of a call that failed, or of a reset cache, is forgotten
            self._documents = None
        if padding is not None and self._padding is None:
            self._padding = torch.zeros(stored_positions.shape, dtype=torch.bool, device=keys.device)
        if documents is not None and self._documents is None:
            self._documents = torch.zeros(stored_positions.shape, dtype=torch.long, device=keys.device)
        start, end = self.length, self.length + new
        # narrow, not [..., start:end, :]: an index with an Ellipsis costs several times a plain view per step.
        stored_keys.narrow(-2, start, new).copy_(keys)
        stored_values.narrow(-2, start, new).copy_(values)
        stored_positions.narrow(1, start, new).copy_(positions)
        if self._padding is not None:
            self._padding[:, start:end] = False if padding is None else padding
        if self._documents is not None and documents is not None:
            self._documents[:, start:end] = documents
        self._pending = new
        seen = CachedKeys(
            stored_keys.narrow(-2, 0, end),
            stored_values.narrow(-2, 0, end),
            stored_positions[0, :end] if self._pending_shared else stored_positions[:, :end],
            None if self._padding is None else self._padding[:, :end],
            0,
            None if documents is None or self._documents is None else self._documents[:, :end],
        )
        if commit:
            self.commit()
        return seen

    @property
    def holds_marks(self) -> bool:
        """Whether the stored keys carry padding or document ids (then a query's visibility reads them)."""
        return self._padding is not None or self.has_documents

    def write_step(
        self, keys: torch.Tensor, values: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``update(keys, values, positions=arange(first, first + l), commit=False)``'s keys and values, for a cache
        without a window that holds keys of this shape, dtype and device, no padding nor documents, and room for
        ``l`` more (what the queries see starts at index 0 then, and the positions are not returned).

        A layer's decoding plan writes each step here: the checks :meth:`update` makes on every call hold
        by those conditions, and the positions are filled in without a tensor of them; a step whose positions are
        its indices (decoding from position 0 on) writes none until something reads them. None where any
        condition fails (nothing is written): :meth:`update` then writes, or raises.
        """
        written = self._write_step(keys, values, first, defer=True)
        return None if written is None else written[:2]

    def write_positioned_step(
        self, keys: torch.Tensor, values: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`write_step` that also returns the positions :meth:`update` returns, ``(lk,)`` (``(b, lk)`` where
        the sequences' positions differ): for a step whose score term reads the keys' positions."""
        written = self._write_step(keys, values, first, defer=False)
        if written is None:
            return None
        stored_keys, stored_values, positions = written
        assert positions is not None  # written, with every deferred one before them
        return stored_keys, stored_values, positions

    def write_window_step(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> CachedKeys | None:
        """``update(keys, values, positions=arange(first, first + 1), commit=False)`` of one entry ``(b, hk, 1, dh)``
        for a windowed cache holding entries of this shape, dtype and device, no padding nor documents: what a
        layer's decoding plan writes each step of such a cache, without the checks those conditions hold by.
        None where any fails (nothing is written): :meth:`update` then writes, or raises."""
        stored_keys, stored_values, stored_positions = self._keys, self._values, self._positions
        if (
            self.window is None
            or keys.shape[-2] != 1
            or self.length == 0
            or stored_positions is None
            or stored_keys is None
            or stored_values is None
            or self.holds_marks
            or self._pending_window is not None
            or values.shape[:-1] != keys.shape[:-1]
            or values.device != keys.device
            or not self._fits(keys, values)
        ):
            return None
        new_positions = stored_positions.new_full((keys.shape[0], 1), first)  # (b, 1), made on the device
        all_keys = torch.cat((stored_keys, keys), dim=-2)  # (b, hk, old + 1, dh)
        all_values = torch.cat((stored_values, values), dim=-2)
        all_positions = torch.cat((stored_positions, new_positions), dim=-1)  # (b, old + 1)
        self._pending_shared, self._pending_last = self._shared_positions, None
        return self._slide(all_keys, all_values, all_positions, None, None, self.stored, 1)

    def _write_step(
        self, keys: torch.Tensor, values: torch.Tensor, first: int, *, defer: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """:meth:`write_step`, the new positions left unwritten where ``defer`` and each is its index (then the
        positions are not returned)."""
        stored_keys, stored_values, stored_positions = self._keys, self._values, self._positions
        start, new = self.length, keys.shape[-2]
        if (
            self.window is not None
            or start == 0
            or stored_positions is None
            or stored_keys is None
            or stored_values is None
            or self.holds_marks
            or self.max_len is None
            or start + new > self.max_len
            or values.shape[:-1] != keys.shape[:-1]
            or not self._fits(keys, values)
        ):
            return None
        stored_keys.narrow(-2, start, new).copy_(keys)
        stored_values.narrow(-2, start, new).copy_(values)
        self._pending_deferred = defer and first == start  # each position its index: written when someone reads them
        if not self._pending_deferred:
            self._write_deferred()
            written = stored_positions.narrow(1, start, new)
            if new == 1:
                written.fill_(first)
            else:
                written.copy_(torch.arange(first, first + new, device=written.device))
        self._pending, self._pending_shared, self._pending_last = new, self._shared_positions, None
        end = start + new
        positions = (
            None if defer else stored_positions[0, :end] if self._shared_positions else stored_positions[:, :end]
        )
        return stored_keys.narrow(-2, 0, end), stored_values.narrow(-2, 0, end), positions

    def _write_deferred(self) -> None:
        """Write the positions :meth:`write_step` left out (each its index) before anything reads or follows them."""
        first = self._deferred_from
        if first is None:
            return
        self._deferred_from = None
        stored = self._positions
        if stored is not None and self.length > first:
            stored.narrow(1, first, self.length - first).copy_(torch.arange(first, self.length, device=stored.device))

    def commit(self) -> None:
        """Count the entries of the last ``update(..., commit=False)`` as stored."""
        if self._pending_deferred and self._deferred_from is None:
            self._deferred_from = self.length
        self._pending_deferred = False
        self.length += self._pending
        self._pending = 0
        self._shared_positions = self._pending_shared
        self._last = self._pending_last
        if self._pending_window is not None:
            self._keys, self._values, self._positions, self._padding, self._documents = self._pending_window
            self._pending_window = None

    def _update_window(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor | None,
        documents: torch.Tensor | None,
        commit: bool,
    ) -> CachedKeys:
        assert self.window is not None
        old = self.stored
        all_documents = documents
        if old == 0:
            all_keys, all_values, all_positions = keys, values, positions
        else:
            assert self._keys is not None and self._values is not None and self._positions is not None
            all_keys = torch.cat((self._keys, keys), dim=-2)  # (b, hk, old + l, dh)
            all_values = torch.cat((self._values, values), dim=-2)
            all_positions = torch.cat((self._positions, positions), dim=-1)  # (b, old + l)
            if documents is not None and self._documents is not None:
                all_documents = torch.cat((self._documents, documents), dim=-1)  # (b, old + l)
        all_padding = None
        if padding is not None or (old and self._padding is not None):
            old_padding = self._padding if old and self._padding is not None else None
            if old_padding is None:
                old_padding = torch.zeros(positions.shape[0], old, dtype=torch.bool, device=positions.device)
            new_padding = torch.zeros_like(positions, dtype=torch.bool) if padding is None else padding.to(torch.bool)
            all_padding = torch.cat((old_padding, new_padding), dim=-1)  # (b, old + l)
        seen = self._slide(all_keys, all_values, all_positions, all_padding, all_documents, old, keys.shape[-2])
        if commit:
            self.commit()
        return seen

    def _slide(
        self,
        all_keys: torch.Tensor,
        all_values: torch.Tensor,
        all_positions: torch.Tensor,
        all_padding: torch.Tensor | None,
        all_documents: torch.Tensor | None,
        old: int,
        new: int,
    ) -> CachedKeys:
        """What a windowed cache's queries see (its ``old`` stored entries and the ``new`` ones), with what it keeps
        after them pending until :meth:`commit`."""
        assert self.window is not None
        # The stored keys count as the ones just before the new: exact for a window, and for sink
        # tokens the causal mask still lets every query see them (no other rule is allowed then).
        first_index = self.length - old
        total = all_keys.shape[-2]
        sinks = min(self.sink_tokens, total)
        recent = max(total - (self.window - 1), sinks)  # kept: the first `sinks` entries and those from `recent` on

        def pick(x: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            # Copies, not views: the window slides, and nothing may keep the older keys alive (a view of a long
            # prompt's keys would). With nothing dropped, the tensor cat made above is already a copy.
            if x is None or (recent == sinks and old):
                return x
            kept = x.narrow(dim, recent, total - recent)
            return torch.cat((x.narrow(dim, 0, sinks), kept), dim) if sinks else kept.clone()

        self._pending_window = (
            pick(all_keys, -2), pick(all_values, -2), pick(all_positions, -1), pick(all_padding, -1),
            pick(all_documents, -1),
        )  # type: ignore[assignment]  # fmt: skip
        self._pending = new
        return self._seen(all_keys, all_values, all_positions, all_padding, first_index, all_documents)

    def _seen(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        padding: torch.Tensor | None,
        first_index: int,
        documents: torch.Tensor | None = None,
    ) -> CachedKeys:
        shared = positions[0] if self._pending_shared else positions
        return CachedKeys(keys, values, shared, padding, first_index, documents)

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
