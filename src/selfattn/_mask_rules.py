"""The rules of :mod:`selfattn.masks`: predicates on (query, key) index tensors, and how each fits a call.

Each rule renders itself for the routes (:meth:`Rule.allows` on index tensors, :meth:`Rule.block`
for a block of queries, :meth:`Rule.scalar` for FlexAttention), bounds the keys a block of
queries may reach (:meth:`Rule.key_bounds`), and checks its tensors against the call it is
placed on (:meth:`Rule.check`). Build them with the functions of :mod:`selfattn.masks`, which
check their values.

Shape legend: b batch, h heads, lq queries, lk keys of the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from selfattn._mask_checks import CallSizes, require_fits

__all__ = [
    "All",
    "Any",
    "Causal",
    "Chunks",
    "Dense",
    "Documents",
    "Indices",
    "KeyPadding",
    "PositionChunks",
    "Prefix",
    "Rule",
    "Spans",
    "ValidLengths",
    "Window",
    "parts",
]


@dataclass(frozen=True)
class Indices:
    """Where a rule is evaluated: global and local indices of queries and keys, broadcastable to one shape ``S``.

    All four have the same number of dimensions, so a tensor indexed by them (``t[:, q_local]``,
    ``(b, *shape)``) broadcasts against another.
    """

    q: torch.Tensor  # global query index
    k: torch.Tensor  # global key index
    q_local: torch.Tensor
    k_local: torch.Tensor

    @classmethod
    def at(cls, q_local: torch.Tensor, k_local: torch.Tensor, q_first: int, k_first: int) -> Indices:
        dims = max(q_local.dim(), k_local.dim())
        q_local = q_local.reshape((1,) * (dims - q_local.dim()) + tuple(q_local.shape))
        k_local = k_local.reshape((1,) * (dims - k_local.dim()) + tuple(k_local.shape))
        return cls(q_local + q_first, k_local + k_first, q_local, k_local)


class Rule:
    """A predicate on (query, key) pairs. Subclasses implement :meth:`allows`."""

    def allows(self, at: Indices) -> torch.Tensor:
        """Bool, True = visible, broadcastable to ``(b, h, *S)`` (``S``: the broadcast shape of the indices)."""
        raise NotImplementedError

    def block(self, at: Indices, start: int, end: int, keys: slice) -> torch.Tensor:
        """The rule on queries ``[start, end)`` and the call's keys ``keys`` (``at`` holds those aranges)."""
        return self.allows(at)

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The rule for one (batch, head, query, key) given as scalar tensors (FlexAttention's ``mask_mod``)."""
        return self.allows(at)

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        """Global keys ``[low, high)`` that queries ``[q_low, q_high)`` may reach (None: no bound known)."""
        return None, None

    def check(self, call: CallSizes) -> None:
        """Raise ``ValueError`` unless the rule's tensors fit the call (sequences, queries, keys, heads)."""

    def first_keys(self, count: int) -> Rule:
        """The rule on the call's first ``count`` keys (its tensors indexed by the call's keys cut to them)."""
        return self

    def __and__(self, other: Rule) -> Rule:
        return All((*parts(self, All), *parts(other, All)))

    def __or__(self, other: Rule) -> Rule:
        return Any((*parts(self, Any), *parts(other, Any)))


def parts(rule: Rule, kind: type[All] | type[Any]) -> tuple[Rule, ...]:
    return rule.rules if isinstance(rule, kind) else (rule,)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``(b, *S)`` -> ``(b, 1, *S)``: a per-sequence result broadcast over the heads."""
    return t.unsqueeze(1)


@dataclass(frozen=True, eq=False)
class _Joined(Rule):
    """Rules joined by a logical operation (:attr:`join`)."""

    rules: tuple[Rule, ...]
    join: ClassVar[Callable[..., torch.Tensor]]

    def allows(self, at: Indices) -> torch.Tensor:
        return functools.reduce(type(self).join, (rule.allows(at) for rule in self.rules))

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return functools.reduce(type(self).join, (rule.scalar(at, b, h) for rule in self.rules))

    def check(self, call: CallSizes) -> None:
        for rule in self.rules:
            rule.check(call)

    def first_keys(self, count: int) -> Rule:
        return type(self)(tuple(rule.first_keys(count) for rule in self.rules))


@dataclass(frozen=True, eq=False)
class All(_Joined):
    """Every rule must allow the pair."""

    join = staticmethod(torch.logical_and)

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        low: int | None = None
        high: int | None = None
        for rule in self.rules:
            a, b = rule.key_bounds(q_low, q_high)
            low = a if low is None else (low if a is None else max(low, a))
            high = b if high is None else (high if b is None else min(high, b))
        return low, high


@dataclass(frozen=True, eq=False)
class Any(_Joined):
    """One rule allowing the pair is enough."""

    join = staticmethod(torch.logical_or)

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        bounds = [rule.key_bounds(q_low, q_high) for rule in self.rules]
        lows, highs = [b[0] for b in bounds], [b[1] for b in bounds]
        low = None if None in lows else min(x for x in lows if x is not None)
        high = None if None in highs else max(x for x in highs if x is not None)
        return low, high


@dataclass(frozen=True)
class Causal(Rule):
    """Key ``j`` is visible to query ``i`` iff ``j <= i``."""

    def allows(self, at: Indices) -> torch.Tensor:
        return at.k <= at.q

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        return None, q_high


@dataclass(frozen=True)
class Window(Rule):
    """``|i - j| < size``; with :class:`Causal` this is the sliding window ``i - size < j <= i``."""

    size: int

    def allows(self, at: Indices) -> torch.Tensor:
        return (at.q - at.k).abs() < self.size

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        return q_low - self.size + 1, q_high + self.size - 1


@dataclass(frozen=True)
class Chunks(Rule):
    """Query ``i`` sees only keys of its own chunk: ``i // size == j // size``."""

    size: int

    def allows(self, at: Indices) -> torch.Tensor:
        return torch.div(at.q, self.size, rounding_mode="floor") == torch.div(at.k, self.size, rounding_mode="floor")

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        return q_low // self.size * self.size, ((q_high - 1) // self.size + 1) * self.size


@dataclass(frozen=True, eq=False)
class PositionChunks(Rule):
    """Chunks counted by position: ``q_pos // size == k_pos // size`` (Llama 4 under left padding).

    Positions ``(lq,)``/``(b, lq)`` and ``(lk,)``/``(b, lk)`` belong to the call's own queries
    and the keys it sees.
    """

    size: int
    query_positions: torch.Tensor
    key_positions: torch.Tensor

    def _chunk(self, positions: torch.Tensor, local: torch.Tensor, batch: torch.Tensor | None = None) -> torch.Tensor:
        index = local.clamp(0, positions.shape[-1] - 1)  # sizes fit the call (check); a route's padding reads any
        if positions.dim() == 1:
            picked = positions[index]
        else:
            picked = positions[:, index] if batch is None else positions[batch, index]
        return torch.div(picked, self.size, rounding_mode="floor")

    def allows(self, at: Indices) -> torch.Tensor:
        same = self._chunk(self.query_positions, at.q_local) == self._chunk(self.key_positions, at.k_local)
        per_sequence = self.query_positions.dim() == 2 or self.key_positions.dim() == 2
        return _batched(same) if per_sequence else same

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self._chunk(self.query_positions, at.q_local, b) == self._chunk(self.key_positions, at.k_local, b)

    def check(self, call: CallSizes) -> None:
        shared = self.key_positions is self.query_positions
        for name, positions, count, what in (
            ("query_positions", self.query_positions, call.num_queries, "queries"),
            ("key_positions (by default query_positions)" if shared else "key_positions", self.key_positions,
             call.num_keys, "keys"),
        ):  # fmt: skip
            require_fits("chunks", name, positions, -1, count, what)
            if positions.dim() == 2:
                require_fits("chunks", name, positions, 0, call.batch, "sequences")

    def first_keys(self, count: int) -> Rule:
        return replace(self, key_positions=self.key_positions[..., :count])


@dataclass(frozen=True, eq=False)
class ValidLengths(Rule):
    """The chapter's ``valid_lens``: ``j < lengths[s]`` (``(b,)``) or ``j < lengths[s, i]`` (``(b, lq)``)."""

    lengths: torch.Tensor

    def allows(self, at: Indices) -> torch.Tensor:
        if self.lengths.dim() == 1:
            lengths = self.lengths.view(-1, *([1] * at.k.dim()))  # (b, 1, ..)
            return _batched(at.k < lengths)
        # Sizes fit the call (check); the clamp serves indices of a route's padding, whose result it drops.
        per_query = self.lengths[:, at.q_local.clamp(0, self.lengths.shape[1] - 1)]  # (b, *q shape)
        return _batched(at.k < per_query)

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return at.k < (self.lengths[b] if self.lengths.dim() == 1 else self.lengths[b, at.q_local])

    def check(self, call: CallSizes) -> None:
        require_fits("valid_lengths", "lengths", self.lengths, 0, call.batch, "sequences")
        if self.lengths.dim() == 2:
            require_fits("valid_lengths", "lengths", self.lengths, 1, call.num_queries, "queries")

    @property
    def per_query(self) -> bool:
        return self.lengths.dim() == 2


@dataclass(frozen=True, eq=False)
class KeyPadding(Rule):
    """``padding`` ``(b, lk)``, True = the key is padding and seen by nobody."""

    padding: torch.Tensor

    def allows(self, at: Indices) -> torch.Tensor:
        # Sizes fit the call (check); the clamp serves indices of a route's padding, whose result it drops.
        return _batched(~self.padding[:, at.k_local.clamp(0, self.padding.shape[1] - 1)])

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return ~self.padding[b, at.k_local]

    def check(self, call: CallSizes) -> None:
        require_fits("key_padding", "padding", self.padding, 0, call.batch, "sequences")
        require_fits("key_padding", "padding", self.padding, 1, call.num_keys, "keys")

    def first_keys(self, count: int) -> Rule:
        return KeyPadding(self.padding[:, :count])


@dataclass(frozen=True, eq=False)
class Documents(Rule):
    """Packed documents: a token sees only tokens with its own id (``(b, lq)`` and ``(b, lk)`` ids)."""

    query_ids: torch.Tensor
    key_ids: torch.Tensor

    def allows(self, at: Indices) -> torch.Tensor:
        # Sizes fit the call (check); the clamps serve indices of a route's padding, whose result it drops.
        q_ids = self.query_ids[:, at.q_local.clamp(0, self.query_ids.shape[1] - 1)]
        k_ids = self.key_ids[:, at.k_local.clamp(0, self.key_ids.shape[1] - 1)]
        return _batched(q_ids == k_ids)

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.query_ids[b, at.q_local] == self.key_ids[b, at.k_local]

    def check(self, call: CallSizes) -> None:
        for name, ids, count, what in (
            ("query_ids", self.query_ids, call.num_queries, "queries"),
            ("key_ids", self.key_ids, call.num_keys, "keys"),
        ):
            require_fits("documents", name, ids, 0, call.batch, "sequences")
            require_fits("documents", name, ids, 1, count, what)

    def first_keys(self, count: int) -> Rule:
        return Documents(self.query_ids, self.key_ids[:, :count])


@dataclass(frozen=True, eq=False)
class Dense(Rule):
    """A given bool mask ``(1 or b, 1 or h, lq, lk)``, True = attend, indexed by the call's own queries and keys."""

    mask: torch.Tensor

    def allows(self, at: Indices) -> torch.Tensor:
        # Sizes fit the call (check); the clamps serve indices of a route's padding, whose result it drops.
        q_local = at.q_local.clamp(0, self.mask.shape[-2] - 1)
        k_local = at.k_local.clamp(0, self.mask.shape[-1] - 1)
        return self.mask[:, :, q_local, k_local]

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        mask = self.mask
        q_local = at.q_local if mask.shape[-2] > 1 else 0
        k_local = at.k_local if mask.shape[-1] > 1 else 0
        return mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, q_local, k_local]

    def block(self, at: Indices, start: int, end: int, keys: slice) -> torch.Tensor:
        rows = slice(None) if self.mask.shape[-2] == 1 else slice(start, end)
        columns = slice(None) if self.mask.shape[-1] == 1 else keys
        return self.mask[..., rows, columns]  # a view: no gather

    def check(self, call: CallSizes) -> None:
        sizes: tuple[tuple[int, int | None, str], ...] = (
            (-1, call.num_keys, "keys"),
            (-2, call.num_queries, "queries"),
        )
        if self.mask.dim() >= 4:  # leading dimensions of other calls are checked by the functional API
            sizes += ((-4, call.batch, "sequences"), (-3, call.heads, "heads"))
        if call.batch is not None and any(n != 1 for n in self.mask.shape[:-4]):
            raise ValueError(
                f"masks.dense: mask of shape {tuple(self.mask.shape)} has more dimensions than the call's (b, h, lq, "
                f"lk) = ({call.batch}, {call.heads}, {call.num_queries}, {call.num_keys}); those before them must be 1"
            )
        for dim, size, what in sizes:
            require_fits("dense", "mask", self.mask, dim, size, what, broadcast=True)

    def first_keys(self, count: int) -> Rule:
        return self if self.mask.shape[-1] == 1 else Dense(self.mask[..., :count])


@dataclass(frozen=True, eq=False)
class Prefix(Rule):
    """Key ``j`` is in the bidirectional prefix: ``j < lengths`` (an int, or ``(b,)`` per sequence).

    Alone it lets every query see the prefix; ``causal() | prefix(n)`` is the prefix-LM mask.
    """

    lengths: torch.Tensor | int
    longest: int | None  # the largest length, when known without reading a tensor under compile

    def allows(self, at: Indices) -> torch.Tensor:
        if isinstance(self.lengths, int):
            return at.k < self.lengths
        lengths = self.lengths.to(at.k.device).view(-1, *([1] * at.k.dim()))  # (b, 1, ..)
        return _batched(at.k < lengths)

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lengths, int):
            return at.k < self.lengths
        return at.k < self.lengths[b if self.lengths.shape[0] > 1 else 0]

    def key_bounds(self, q_low: int, q_high: int) -> tuple[int | None, int | None]:
        return 0, self.longest

    def check(self, call: CallSizes) -> None:
        if isinstance(self.lengths, torch.Tensor):
            require_fits("prefix", "lengths", self.lengths, 0, call.batch, "sequences", broadcast=True)


@dataclass(frozen=True, eq=False)
class Spans(Rule):
    """Tokens of one span see each other: ``ids[i] == ids[j] != 0`` (``(b, l)`` ids by index in the whole sequence)."""

    ids: torch.Tensor

    def _ids(self, index: torch.Tensor, batch: torch.Tensor | None = None) -> torch.Tensor:
        # Indices before the sequence (queries of a cross-attention with more queries than keys) and past
        # the ids are in no span; the clamp only keeps the lookup in range, its value is then replaced.
        inside = (index >= 0) & (index < self.ids.shape[-1])
        clamped = index.clamp(0, self.ids.shape[-1] - 1)
        if batch is None:
            ids = self.ids[:, clamped]
        else:
            ids = self.ids[batch if self.ids.shape[0] > 1 else 0, clamped]
        return torch.where(inside, ids, 0)

    def allows(self, at: Indices) -> torch.Tensor:
        q_ids, k_ids = self._ids(at.q), self._ids(at.k)
        return _batched((q_ids == k_ids) & (q_ids != 0))

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        q_ids, k_ids = self._ids(at.q, b), self._ids(at.k, b)
        return (q_ids == k_ids) & (q_ids != 0)

    def check(self, call: CallSizes) -> None:
        require_fits("spans", "ids", self.ids, 0, call.batch, "sequences", broadcast=True)
