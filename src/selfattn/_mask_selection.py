"""The selection rule of :mod:`selfattn.masks`: each query sees only the keys it selected (sparse attention).

DeepSeek sparse attention's indexer picks, for every query, the ``t`` keys it will attend to;
:class:`Selected` holds those picks as a rule like the others, so it is "and"-ed with causality
and padding and checked against the call at :meth:`~selfattn.masks.Visibility.check`. The
sparse route (:mod:`selfattn.core.routes.sparse`) reads :attr:`Selected.indices` to gather only
the picked keys; every other route renders the rule as a bool mask.

Shape legend: b batch, lq queries, lk keys of the call, t selected entries per query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import selfattn._validation as _validation
from selfattn._mask_checks import CallSizes, require_fits
from selfattn._mask_rules import Indices, Rule

__all__ = ["Selected"]


def _batched(t: torch.Tensor) -> torch.Tensor:
    """``(b, *S)`` -> ``(b, 1, *S)``: a per-sequence result broadcast over the heads."""
    return t.unsqueeze(1)


@dataclass(frozen=True, eq=False)
class Selected(Rule):
    """Query ``r`` of sequence ``s`` sees key ``c`` iff ``c`` is one of ``indices[s, r, :]``.

    ``indices`` ``(b or 1, lq, t)`` are integer indices of the call's own keys (``0 .. lk - 1``);
    ``-1`` marks an unused slot. A key picked twice is seen once.
    """

    indices: torch.Tensor

    def _rows(self, q_local: torch.Tensor) -> torch.Tensor:
        # Sizes fit the call (check); the clamp serves indices of a route's padding, whose result it drops.
        return self.indices[:, q_local.clamp(0, self.indices.shape[1] - 1)]  # (b, *q shape, t)

    def allows(self, at: Indices) -> torch.Tensor:
        # Any broadcast of indices: compare each pair with the query's t picks, (b, *S, t) at most.
        picks = self._rows(at.q_local)
        return _batched((picks == at.k_local.unsqueeze(-1)).any(dim=-1))

    def block(self, at: Indices, start: int, end: int, keys: slice) -> torch.Tensor:
        # A block of queries: scatter its picks into a (b, block, keys.stop) row, O(block * lk) not O(block * lk * t).
        picks = self.indices[:, start:end].long()
        width = keys.stop
        slots = picks.masked_fill((picks < 0) | (picks >= width), width)  # unused (or cut-off) -> a throwaway column
        chosen = torch.zeros((*picks.shape[:-1], width + 1), dtype=torch.bool, device=picks.device)
        chosen = chosen.scatter(-1, slots, True)[..., keys.start : width]
        return _batched(chosen)

    def scalar(self, at: Indices, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        row = self.indices[b if self.indices.shape[0] > 1 else 0, at.q_local]  # (.., t)
        return (row == at.k_local.unsqueeze(-1)).any(dim=-1)

    def check(self, call: CallSizes) -> None:
        require_fits("selected", "indices", self.indices, 0, call.batch, "sequences", broadcast=True)
        require_fits("selected", "indices", self.indices, 1, call.num_queries, "queries")
        if _validation.is_compiling() or not self.indices.numel():
            return
        low, high = int(self.indices.min()), int(self.indices.max())
        if low < -1 or high >= call.num_keys:
            raise ValueError(
                f"masks.selected: indices of shape {tuple(self.indices.shape)} must lie in [-1, {call.num_keys}) "
                f"(the call has {call.num_keys} keys; -1 = an unused slot), got values in [{low}, {high}]"
            )

    def first_keys(self, count: int) -> Rule:
        return Selected(self.indices.masked_fill(self.indices >= count, -1))
