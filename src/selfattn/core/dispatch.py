"""The one place that chooses how a call of attention is computed, and says why.

:data:`ROUTES` is tried in order; the first route that does not decline runs. A new route is one
file in :mod:`selfattn.core.routes` and one line here. :func:`explain` returns the choice and the
reason each earlier route declined, without computing attention (what the routes are: docs/routes.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import selfattn.functional._block_sliced as _block_sliced
from selfattn.core.call import AttentionCall
from selfattn.core.explanation import Explanation
from selfattn.core.route import Output, Route, Step
from selfattn.core.routes._blocks import block_for, reached_share
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
from selfattn.core.routes.sparse import SPARSE
from selfattn.core.routes.split_keys import SPLIT_KEYS, split_chunks

__all__ = [
    "BLOCKWISE_ROUTES",
    "ROUTES",
    "Explanation",
    "check_remembered",
    "explain",
    "few_scores",
    "remembered_route",
    "run",
    "run_route",
    "run_step",
]

#: Every route, fastest-when-it-applies first.
ROUTES: tuple[Route, ...] = (
    SPARSE,
    RAGGED_VALID_ROWS,
    RAGGED,
    BAND_ONLY,
    BANDED,
    CHUNKS,
    PREFIX,
    KEY_ROW,  # before FLEX: on CUDA it takes the decoding steps alone (on CPU FLEX declines whatever the order)
    FLEX,
    CAUSAL_KEY_ROWS,
    FUSED_SINKS,
    SLICED,
    BLOCKWISE_CLIPPED,
    BLOCKWISE_BAND,
    BLOCKWISE,
    EXPLICIT_VALUE_TERM,
    EXPLICIT,
    EXPLICIT_MODIFIERS,
    SPLIT_KEYS,
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


def _declined_modifiers(call: AttentionCall) -> str:
    given = [name for name, value in (("a softcap", call.softcap), ("sinks", call.sinks)) if value is not None]
    return f"{' and '.join(given)}: this route does not apply {'it' if given == ['a softcap'] else 'them'}"


def _choose(call: AttentionCall, routes: Sequence[Route]) -> tuple[Route, tuple[tuple[str, str], ...]]:
    declined: list[tuple[str, str]] = []
    modifies_scores = call.modifies_scores
    modifiers_reason = _declined_modifiers(call) if modifies_scores else ""  # one sentence for every such route
    for route in routes:
        if modifies_scores and not route.modifies_scores:
            declined.append((route.name, modifiers_reason))
            continue
        reason = route.declines(call)
        if reason is None:
            return route, tuple(declined)
        declined.append((route.name, reason))
    raise AssertionError(f"no route took the call: {declined}")  # the last route of each list takes any call


#: The route each kind of call took (:func:`_kind`), per list of routes: ``id(routes) -> (routes, {kind: route})``.
_CHOSEN: dict[int, tuple[Sequence[Route], dict[tuple[object, ...], Route]]] = {}

_MAX_ROUTE_LISTS = 16

#: Tests set this: every call whose kind was seen before is also chosen in full, and the two must agree.
VERIFY_REMEMBERED_CHOICES = False


def _kind(call: AttentionCall) -> tuple[object, ...] | None:
    """The facts that decide the route of a call with no score term and no rule but a causal one on a square.

    Such a call is what decoding makes at every step (one query after the keys sees them all, and
    :class:`AttentionCall` drops a causal rule that hides nothing). For it every route's test reads
    only these facts: each route that looks further declines first for the missing rule or term
    (a window, chunks, a prefix, a selection, valid lengths, a score term), the blockwise routes find
    no key range to skip, and of the sizes only the sliced route's least number of scores and the
    split-keys route's chunks (from the sizes, the thread count and grad mode) matter. None for any other call (chosen in full each time), and while compiling (a graph has no memory).
    """
    if call.term is not None or call.compiling:
        return None
    visibility = call.visibility
    if visibility.rules and not visibility.kernel_causal:
        return None
    return (
        bool(visibility.rules),
        call.softcap is None,
        call.sinks is None,
        call.dropout_p > 0,
        call.return_weights,
        call.bias is None,
        call.transformed,
        call.four_d,
        call.device.type,
        few_scores(call.num_queries, call.num_keys),
        split_chunks(call),  # sizes, threads and grad mode: whether (and how) the split-keys route cuts the keys
    )


def few_scores(num_queries: int, num_keys: int) -> bool:
    """The one fact of :func:`_kind` that a decoding step's sizes move: fewer scores than the sliced route wants."""
    return num_queries * num_keys < _block_sliced.SLICED_MIN_SCORES  # read now: tests lower it


def _route_for(call: AttentionCall, routes: Sequence[Route]) -> Route:
    """:func:`_choose`'s route, remembered per kind of call (:func:`_kind`): a decoding step asks no route again."""
    kind = _kind(call)
    if kind is None:
        return _choose(call, routes)[0]
    held = _CHOSEN.get(id(routes))
    if held is None or held[0] is not routes:  # a list of routes met for the first time (or a new one at its id)
        if len(_CHOSEN) >= _MAX_ROUTE_LISTS:
            _CHOSEN.clear()  # lists made on the fly (tests leave routes out): keep the memory bounded
        held = _CHOSEN[id(routes)] = (routes, {})
    route = held[1].get(kind)
    if route is None:
        route = held[1][kind] = _choose(call, routes)[0]
    elif VERIFY_REMEMBERED_CHOICES:
        check_remembered(call, routes, route)
    return route


def _size(count: int, dtype: torch.dtype) -> str:
    """``count`` elements of ``dtype`` in bytes, KiB, MiB or GiB."""
    size, unit = float(count * dtype.itemsize), "bytes"
    for larger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:,.0f} bytes" if unit == "bytes" else f"{size:,.1f} {unit}"


def _cost(route: Route, call: AttentionCall) -> str:
    """What ``route`` computes and holds for ``call``, in words (empty while compiling: sizes may be symbolic)."""
    if call.compiling:
        return ""
    pairs = call.num_queries * call.num_keys
    weights = call.batch * call.heads * pairs
    if route.name.startswith("explicit"):
        shape = f"({call.batch}, {call.heads}, {call.num_queries}, {call.num_keys})"
        return f"all {pairs:,} (query, key) pairs per head; holds the {shape} weights, {_size(weights, call.dtype)}"
    if route.name in ("blockwise", "blockwise band", "blockwise clipped"):
        block = block_for(call)
        share = reached_share(call, block)
        return (
            f"blocks of {block} queries compute {share:.0%} of the {pairs:,} (query, key) pairs per head; "
            f"scores exist for one block at a time, never the whole {call.num_queries} x {call.num_keys}"
        )
    return f"{call.batch} x {call.heads} heads of {call.num_queries} queries and {call.num_keys} keys"


def explain(call: AttentionCall, routes: Sequence[Route] | None = None, *, verbose: bool = False) -> Explanation:
    """Which route :func:`run` would take for ``call`` (among ``routes``, default :data:`ROUTES`), and why.

    ``verbose``: ``str()`` of the result also lists each route tried before it and why it declined.
    """
    route, declined = _choose(call, ROUTES if routes is None else routes)
    return Explanation(route.name, declined, cost=_cost(route, call), verbose=verbose)


def remembered_route(call: AttentionCall) -> tuple[Sequence[Route], Route] | None:
    """:data:`ROUTES` and the route :func:`run` takes for ``call``'s kind (:func:`_kind`), from this memory; None
    for a call whose route is chosen in full each time. A layer's decoding plan replays it (``selfattn._decode_plan``)."""
    if _kind(call) is None:
        return _key_row_step(call)
    routes = ROUTES
    return routes, _route_for(call, routes)


def _key_row_step(call: AttentionCall) -> tuple[Sequence[Route], Route] | None:
    """A decoding step with a key-only score term (ALiBi's causal one): :data:`ROUTES` and the key-row route
    when the full choice takes it, else None.

    The choice holds for later steps of a layer's kind: with no rule, every route before the key-row route
    declines for the missing rule (a selection, valid lengths, a band, chunks, a prefix), whatever the sizes;
    the key-row route's own test reads the term (fixed by the layer), the call's fixed facts and grad mode
    (off: no parameter of the term wants a gradient), and off the CPU whether the query has more keys than
    itself (a decoding step): the plan replays no step onto an empty cache.
    """
    if call.term is None or call.visibility.rules or call.compiling or torch.is_grad_enabled():
        return None
    route = _choose(call, ROUTES)[0]
    return (ROUTES, route) if route.name == KEY_ROW.name else None  # by name: tests wrap the routes


def check_remembered(call: AttentionCall, routes: Sequence[Route], route: Route) -> None:
    """Raise ``AssertionError`` unless ``route`` is what :func:`_choose` makes of ``call`` (for tests'
    :data:`VERIFY_REMEMBERED_CHOICES`, which a replayed decoding plan honours too)."""
    chosen = _choose(call, routes)[0]
    assert chosen is route, f"remembered route {route.name!r} for a call that takes {chosen.name!r}"


def run(call: AttentionCall, routes: Sequence[Route] | None = None) -> Output:
    """Compute ``call`` by the first route of ``routes`` (default :data:`ROUTES`) that takes it."""
    return run_route(_route_for(call, ROUTES if routes is None else routes), call)


def run_route(route: Route, call: AttentionCall) -> Output:
    """Compute ``call`` by ``route``, chosen by :func:`run` or remembered from it (:func:`remembered_route`)."""
    if call.compiling or not torch.autograd.profiler._is_profiler_enabled:
        return route.run(call)  # a range costs a dispatcher call or two even when no profiler listens
    with torch.profiler.record_function(_profile_name(route)):
        return route.run(call)


def run_step(route: Route, step: Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``step(q, k, v)``, made by ``route.step_for`` (see :class:`~selfattn.core.route.Route`), in the profiler
    range :func:`run_route` opens: a decoding plan's step of a route remembered from :func:`run`."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return step(q, k, v)
    with torch.profiler.record_function(_profile_name(route)):
        return step(q, k, v)


def _profile_name(route: Route) -> str:
    """The profiler range of ``route``: the names benchmarks read (blockwise_attention for every blocks route)."""
    blocks = route.name.startswith(("blockwise", "causal key", "sliced"))
    return f"selfattn::{'blockwise_attention' if blocks else route.name}"
