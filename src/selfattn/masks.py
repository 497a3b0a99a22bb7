"""Which keys each query may see, written once: small rules that compose, and the call's visibility.

A *rule* answers "may query ``i`` see key ``j``" for index tensors: :func:`causal`, :func:`window`,
:func:`chunks`, :func:`prefix`, :func:`spans`, :func:`valid_lengths`, :func:`key_padding`,
:func:`documents`, :func:`dense`, :func:`selected` (sparse attention's picked keys).
Rules compose with ``&`` (a key must pass both) and ``|`` (either is enough). A
:class:`Visibility` puts a rule on the queries and keys of one call: where they sit in the
whole sequence (a cache or lower-right alignment shifts them), and renders it in every form a
route of attention needs: a dense mask for a block of queries, the keys a block can reach, one
row shared by every query, a FlexAttention-style predicate.

Indices ``i`` and ``j`` count tokens in the whole sequence (cache included); tensors that belong
to the call (lengths, padding, document ids, a dense mask) are indexed by the call's own
queries and keys.

Shape legend: b batch, h heads, lq queries, lk keys of the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfattn._mask_checks import CallSizes, require_index_tensor, require_non_negative
from selfattn._mask_rules import All as All
from selfattn._mask_rules import Any as Any
from selfattn._mask_rules import Causal as Causal
from selfattn._mask_rules import Chunks as Chunks
from selfattn._mask_rules import Dense as Dense
from selfattn._mask_rules import Documents as Documents
from selfattn._mask_rules import Indices as Indices
from selfattn._mask_rules import KeyPadding as KeyPadding
from selfattn._mask_rules import PositionChunks as PositionChunks
from selfattn._mask_rules import Prefix as Prefix
from selfattn._mask_rules import Rule as Rule
from selfattn._mask_rules import Spans as Spans
from selfattn._mask_rules import ValidLengths as ValidLengths
from selfattn._mask_rules import Window as Window
from selfattn._mask_rules import parts as _parts
from selfattn._mask_selection import Selected as Selected

__all__ = [
    "Rule",
    "Visibility",
    "causal",
    "chunks",
    "dense",
    "documents",
    "key_padding",
    "prefix",
    "selected",
    "spans",
    "valid_lengths",
    "window",
]


def causal() -> Rule:
    """Query ``i`` sees keys ``j <= i`` (indices in the whole sequence: lower-right aligned)."""
    return Causal()


def window(size: int) -> Rule:
    """Keys with ``|i - j| < size`` (``causal() & window(w)``: keys ``i - w < j <= i``)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"masks.window: window size must be a positive integer, got {size!r}")
    return Window(size)


def chunks(
    size: int, *, query_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None
) -> Rule:
    """Query ``i`` sees only keys in its own chunk of ``size`` tokens (Llama 4's chunked attention).

    Chunks count token indices from 0; with ``query_positions`` (``(lq,)`` or ``(b, lq)``) and
    ``key_positions`` (default the same) they count those positions instead, so a left-padded
    row's chunks start at its first real token.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"masks.chunks: chunk size must be a positive integer, got {size!r}")
    if query_positions is None:
        if key_positions is not None:
            raise ValueError("masks.chunks: key_positions need query_positions")
        return Chunks(size)
    shapes = {1: "(l,)", 2: "(b, l)"}
    query_positions = require_index_tensor("chunks", "query_positions", query_positions, shapes, kind="integer")
    if key_positions is not None:
        require_index_tensor("chunks", "key_positions", key_positions, shapes, kind="integer")
    return PositionChunks(size, query_positions, query_positions if key_positions is None else key_positions)


def prefix(lengths: int | torch.Tensor) -> Rule:
    """Keys ``j < lengths`` (an int, or integer ``(b,)``): the bidirectional prefix of a prefix-LM.

    ``causal() | prefix(n)``: the first ``n`` tokens see each other, the rest see everything
    before them (PaliGemma). Indices count tokens in the whole sequence, cache included.
    """
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(
                "masks.prefix: prefix lengths must be an int or an integer (b,) tensor, "
                f"got {lengths.dtype} {tuple(lengths.shape)}"
            )
        require_non_negative("prefix", "lengths", lengths)
        longest = None if torch.compiler.is_compiling() else int(lengths.max()) if lengths.numel() else 0
        return Prefix(lengths, longest)
    if isinstance(lengths, bool) or not isinstance(lengths, int) or lengths < 0:
        raise ValueError(
            f"masks.prefix: prefix lengths must be a non-negative int or an integer (b,) tensor, got {lengths!r}"
        )
    return Prefix(lengths, lengths)


def spans(ids: torch.Tensor) -> Rule:
    """Bidirectional spans: tokens with the same nonzero id see each other; id 0 is in no span.

    ``causal() | spans(ids)`` lets an image's tokens see each other inside a causal sequence
    (Gemma 3). ``ids`` are ``(b, l)`` integers by token index in the whole sequence (cache
    included); indices past ``l`` are in no span.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        shown = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"masks.spans: span ids must be an integer (b, l) tensor, got {shown}")
    return Spans(ids)


def valid_lengths(lengths: torch.Tensor) -> Rule:
    """The chapter's ``valid_lens``: ``(b,)`` or ``(b, lq)`` non-negative integer lengths.

    Raises:
        ValueError: lengths that are not an integer tensor of one of those shapes, or negative;
            placed on a call, a batch or number of queries other than the call's.
    """
    shapes = {1: "(b,)", 2: "(b, lq)"}
    require_non_negative("valid_lengths", "lengths", require_index_tensor(
        "valid_lengths", "lengths", lengths, shapes, kind="integer"
    ))  # fmt: skip
    return ValidLengths(lengths)


def key_padding(padding: torch.Tensor) -> Rule:
    """Bool ``(b, lk)``, True = padding (torch's ``key_padding_mask``).

    Raises:
        ValueError: anything but a bool ``(b, lk)`` tensor; placed on a call, another batch or number of keys.
    """
    return KeyPadding(require_index_tensor("key_padding", "padding", padding, {2: "(b, lk)"}, kind="bool"))


def documents(query_ids: torch.Tensor, key_ids: torch.Tensor | None = None) -> Rule:
    """Packed documents: ``(b, lq)`` ids of the queries and ``(b, lk)`` of the keys (default the same).

    Raises:
        ValueError: ids that are not integer ``(b, l)`` tensors; placed on a call, ids of another
            batch, or query ids (key ids) for another number of queries (keys).
    """
    query_ids = require_index_tensor("documents", "query_ids", query_ids, {2: "(b, lq)"}, kind="integer")
    if key_ids is not None:
        require_index_tensor("documents", "key_ids", key_ids, {2: "(b, lk)"}, kind="integer")
    return Documents(query_ids, query_ids if key_ids is None else key_ids)


def dense(mask: torch.Tensor) -> Rule:
    """A bool mask, True = attend, broadcastable to ``(b, h, lq, lk)`` (each dimension the call's size or 1).

    Raises:
        ValueError: anything but a bool tensor; placed on a call, a dimension that is neither 1
            nor the call's.
    """
    shapes = dict.fromkeys(range(9), "(.., lq, lk)")
    mask = require_index_tensor("dense", "mask", mask, shapes, kind="bool")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return Dense(mask)


def selected(indices: torch.Tensor) -> Rule:
    """Each query sees only the keys it picked: integer ``(b or 1, lq, t)`` key indices, ``-1`` = an unused slot.

    DeepSeek sparse attention's top-k selection (:class:`~selfattn.sparse.LightningIndexer`);
    ``causal() & selected(indices)`` also hides picks past the query, so a query with fewer than
    ``t`` earlier keys sees all of them when its picks name them. Indices count the call's own keys.

    Raises:
        ValueError: anything but an integer ``(b, lq, t)`` tensor, ``t = 0`` (a top-k of 0: no slot to
            pick a key in); placed on a call, another batch or number of queries, or an entry below
            -1 or not below the call's number of keys.
    """
    indices = require_index_tensor("selected", "indices", indices, {3: "(b, lq, t)"}, kind="integer")
    if indices.shape[-1] == 0:
        raise ValueError(
            f"masks.selected: indices of shape {tuple(indices.shape)} have no slot per query (t = 0, a top-k of 0); "
            "give at least one, -1 marking a slot that picks nothing"
        )
    return Selected(indices)


def on_first_keys(rule: Rule, batch: int, num_queries: int, num_keys: int, count: int) -> Rule:
    """``rule`` checked against a ``(batch, lq, lk)`` call, then cut to its first ``count`` keys (seen by no query past them)."""
    rule.check(CallSizes(batch, None, num_queries, num_keys))
    return rule.first_keys(count)


@dataclass(frozen=True, eq=False)
class Visibility:
    """A rule placed on one call: local query ``r`` is global index ``q_first + r``, local key ``c`` is ``k_first + c``.

    Attributes:
        num_queries: ``lq``.
        num_keys: ``lk``.
        q_first: global index of the first query.
        k_first: global index of the first key.
        rules: the conjuncts (a key must pass every one); an ``|`` composition is one conjunct.
    """

    num_queries: int
    num_keys: int
    q_first: int
    k_first: int = 0
    rules: tuple[Rule, ...] = field(default=())

    @classmethod
    def lower_right(cls, num_queries: int, num_keys: int, *rules: Rule | None) -> Visibility:
        """The queries are the last ``lq`` of the ``lk`` keys (self-attention, or decoding after them)."""
        return cls(num_queries, num_keys, num_keys - num_queries, 0).with_rules(*rules)

    def with_rules(self, *rules: Rule | None) -> Visibility:
        parts = [part for rule in rules if rule is not None for part in _parts(rule, All)]
        return self._with((*self.rules, *parts)) if parts else self

    def _with(self, rules: tuple[Rule, ...]) -> Visibility:
        """This placement with ``rules`` instead (the constructor: ``dataclasses.replace`` costs a decoding step more)."""
        return Visibility(self.num_queries, self.num_keys, self.q_first, self.k_first, rules)

    def __and__(self, other: Rule | Visibility) -> Visibility:
        return self.with_rules(*(other.rules if isinstance(other, Visibility) else (other,)))

    def __or__(self, other: Rule) -> Visibility:
        joined = All(self.rules) | other if self.rules else None
        return self._with(()) if joined is None else self._with((joined,))

    def check(self, batch: int | None, heads: int | None) -> Visibility:
        """Raise ``ValueError`` unless every rule's tensors fit this call (``batch``/``heads`` None: not known).

        The one place a rule meets the call's sizes: each rule's :meth:`Rule.check` names itself,
        the argument and the size it got, so no rendering ever clamps an index to make it fit.
        """
        sizes = CallSizes(batch, heads, self.num_queries, self.num_keys)
        for rule in self.rules:
            rule.check(sizes)
        return self

    # ------------------------------------------------------------------ what the routes read

    def find(self, kind: type[Rule]) -> Rule | None:
        """The first conjunct of ``kind``; a route that applies it alone sees to the others of its kind (declines
        them, or keeps them as rules: :meth:`count`, :meth:`excluding`)."""
        return next((rule for rule in self.rules if isinstance(rule, kind)), None)

    def count(self, kind: type[Rule]) -> int:
        """How many conjuncts are of ``kind`` (``valid_lens`` and a ``valid_lengths`` rule make two)."""
        return sum(isinstance(rule, kind) for rule in self.rules)

    def excluding(self, rule: Rule) -> Visibility:
        """This placement without the conjunct ``rule`` (that object; others of its kind stay)."""
        return self._with(tuple(kept for kept in self.rules if kept is not rule))

    @property
    def causal(self) -> bool:
        return self.find(Causal) is not None

    @property
    def window(self) -> int | None:
        """The narrowest window's size: its band holds every key the others allow too (the routes apply them all)."""
        sizes = [rule.size for rule in self.rules if isinstance(rule, Window)]
        return min(sizes) if sizes else None  # (min's default keyword breaks a dynamo graph)

    @property
    def valid_lens(self) -> torch.Tensor | None:
        """The lengths of the one :class:`ValidLengths` conjunct; None when there is none or several (a route
        reading one set of lengths would drop the others)."""
        found = self.find(ValidLengths)
        return found.lengths if isinstance(found, ValidLengths) and self.count(ValidLengths) == 1 else None

    def only(self, *kinds: type[Rule]) -> bool:
        """Whether every conjunct is one of ``kinds``."""
        return all(isinstance(rule, kinds) for rule in self.rules)

    def without(self, *kinds: type[Rule]) -> Visibility:
        kept = tuple(rule for rule in self.rules if not isinstance(rule, kinds))
        return self if len(kept) == len(self.rules) else self._with(kept)

    @property
    def square(self) -> bool:
        """Query ``r`` and key ``r`` are the same token, and there are as many queries as keys."""
        if self.num_queries == self.num_keys and self.q_first == self.k_first:  # noqa: SIM103
            return True  # a branch: under dynamic shapes a guard, and a Python bool either way
        return False

    @property
    def kernel_causal(self) -> bool:
        """Causal alone, on a square: the fused kernel's own ``is_causal`` says it all."""
        return self.square and self.only(Causal) and self.causal

    @property
    def same_for_every_query(self) -> bool:
        """No conjunct depends on the query (so one row of keys serves them all)."""
        dense_rows = [rule.mask.shape[-2] for rule in self.rules if isinstance(rule, Dense)]
        per_query = [rule for rule in self.rules if isinstance(rule, ValidLengths) and rule.per_query]
        return self.only(ValidLengths, KeyPadding, Dense) and not per_query and all(r == 1 for r in dense_rows)

    # ------------------------------------------------------------------ renderings

    def at(self, q_local: torch.Tensor, k_local: torch.Tensor) -> torch.Tensor | None:
        """The rules at local index tensors (broadcastable to ``S``): bool broadcastable to ``(b, h, *S)``."""
        if not self.rules:
            return None
        where = Indices.at(q_local, k_local, self.q_first, self.k_first)
        return functools.reduce(torch.logical_and, (rule.allows(where) for rule in self.rules))

    def block(
        self,
        start: int,
        end: int,
        keys: int | slice | None = None,
        *,
        device: torch.device,
        skip_causal: bool = False,
    ) -> torch.Tensor | None:
        """Bool ``(.., end - start, keys)``, True = attend, for queries ``[start, end)`` and keys ``keys``.

        ``keys``: the call's keys ``[0, keys)`` for an int, a ``slice`` of them, or all. None when
        every key is visible. ``skip_causal`` leaves the causal rule out (a route that applies it itself).
        """
        vis = self.without(Causal) if skip_causal else self
        if not vis.rules:
            return None
        if not isinstance(keys, slice):
            keys = slice(0, self.num_keys if keys is None else keys)
        rows = torch.arange(start, end, device=device)[:, None]  # (block, 1)
        columns = torch.arange(keys.start, keys.stop, device=device)  # (keys,)
        where = Indices.at(rows, columns, self.q_first, self.k_first)
        return functools.reduce(torch.logical_and, (rule.block(where, start, end, keys) for rule in vis.rules))

    def dense(self, device: torch.device, *, skip_causal: bool = False) -> torch.Tensor | None:
        """Bool ``(.., lq, lk)`` for the whole call, or None when every key is visible."""
        return self.block(0, self.num_queries, device=device, skip_causal=skip_causal)

    def key_row(self, device: torch.device) -> torch.Tensor | None:
        """Bool ``(1 or b, 1 or h, 1, lk)`` shared by every query (needs :attr:`same_for_every_query`)."""
        assert self.same_for_every_query
        return self.block(0, 1, device=device)

    def key_limit(self, start: int, end: int) -> int:
        """How many keys (from the first) queries ``[start, end)`` may reach; at least 1."""
        _, high = All(self.rules).key_bounds(start + self.q_first, end + self.q_first)
        if high is None:
            return self.num_keys
        return min(self.num_keys, max(high - self.k_first, 1))

    def key_range(self, start: int, end: int) -> tuple[int, int]:
        """The call's keys ``[low, high)`` that queries ``[start, end)`` may reach (at least one key)."""
        low, high = All(self.rules).key_bounds(start + self.q_first, end + self.q_first)
        high_local = self.num_keys if high is None else min(self.num_keys, max(high - self.k_first, 1))
        low_local = 0 if low is None else min(max(low - self.k_first, 0), high_local - 1)
        return low_local, high_local

    def predicate(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """``allowed(b, h, q_idx, kv_idx)`` on scalar index tensors (FlexAttention's ``mask_mod``), or None."""
        if not self.rules:
            return None

        def allowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            where = Indices(q_idx + self.q_first, kv_idx + self.k_first, q_idx, kv_idx)
            return functools.reduce(torch.logical_and, (rule.scalar(where, b, h) for rule in self.rules))

        return allowed
