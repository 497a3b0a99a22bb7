"""The one place that chooses how a call of attention is computed, and says why.

:data:`ROUTES` is tried in order; the first route that does not decline runs. A new route is one
file in :mod:`selfattn.core.routes` and one line here. :func:`explain` returns the choice and the
reason each earlier route declined, without computing attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes.band_only import BAND_ONLY
from selfattn.core.routes.banded import BANDED
from selfattn.core.routes.blockwise import BLOCKWISE, BLOCKWISE_ANY, BLOCKWISE_BAND, BLOCKWISE_CLIPPED
from selfattn.core.routes.causal_key_rows import CAUSAL_KEY_ROWS
from selfattn.core.routes.chunks import CHUNKS
from selfattn.core.routes.explicit import EXPLICIT, EXPLICIT_MODIFIERS, EXPLICIT_VALUE_TERM
from selfattn.core.routes.flex import FLEX
from selfattn.core.routes.fused import FUSED
from selfattn.core.routes.fused_sinks import FUSED_SINKS
from selfattn.core.routes.key_row import KEY_ROW
from selfattn.core.routes.prefix import PREFIX
from selfattn.core.routes.ragged import RAGGED
from selfattn.core.routes.ragged_valid_rows import RAGGED_VALID_ROWS
from selfattn.core.routes.sliced import SLICED

__all__ = ["BLOCKWISE_ROUTES", "ROUTES", "Explanation", "explain", "run"]

#: Every route, fastest-when-it-applies first.
ROUTES: tuple[Route, ...] = (
    RAGGED_VALID_ROWS,
    RAGGED,
    BAND_ONLY,
    BANDED,
    CHUNKS,
    PREFIX,
    FLEX,
    CAUSAL_KEY_ROWS,
    KEY_ROW,
    FUSED_SINKS,
    SLICED,
    BLOCKWISE_CLIPPED,
    BLOCKWISE_BAND,
    BLOCKWISE,
    EXPLICIT_VALUE_TERM,
    EXPLICIT,
    EXPLICIT_MODIFIERS,
    FUSED,
)

#: What :func:`~selfattn.functional.blockwise_attention` chooses among: always blocks.
BLOCKWISE_ROUTES: tuple[Route, ...] = (
    CAUSAL_KEY_ROWS,
    KEY_ROW,
    SLICED,
    BLOCKWISE_CLIPPED,
    BLOCKWISE_BAND,
    BLOCKWISE_ANY,
)


@dataclass(frozen=True)
class Explanation:
    """The route a call takes, and why each route before it declined.

    Attributes:
        route: the chosen route's name.
        declined: ``(route name, reason)`` for each route tried before it.
    """

    route: str
    declined: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"route: {self.route}"]
        lines += [f"  not {name}: {reason}" for name, reason in self.declined]
        return "\n".join(lines)


def _choose(call: AttentionCall, routes: Sequence[Route]) -> tuple[Route, Explanation]:
    declined: list[tuple[str, str]] = []
    for route in routes:
        if call.modifies_scores and not route.modifies_scores:
            declined.append((route.name, "softcap or sinks: this route does not apply them"))
            continue
        reason = route.declines(call)
        if reason is None:
            return route, Explanation(route.name, tuple(declined))
        declined.append((route.name, reason))
    raise AssertionError(f"no route took the call: {declined}")  # the last route of each list takes any call


def explain(call: AttentionCall, routes: Sequence[Route] | None = None) -> Explanation:
    """Which route :func:`run` would take for ``call`` (among ``routes``, default :data:`ROUTES`), and why."""
    return _choose(call, ROUTES if routes is None else routes)[1]


def run(call: AttentionCall, routes: Sequence[Route] | None = None) -> Output:
    """Compute ``call`` by the first route of ``routes`` (default :data:`ROUTES`) that takes it."""
    route, _ = _choose(call, ROUTES if routes is None else routes)
    if call.compiling:
        return route.run(call)
    # The profiler ranges keep the names benchmarks read (blockwise_attention for every blocks route).
    profile_name = "blockwise_attention" if route.name.startswith(("blockwise", "causal key", "sliced")) else route.name
    with torch.profiler.record_function(f"selfattn::{profile_name}"):
        return route.run(call)
