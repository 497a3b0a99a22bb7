"""What a route of attention is: a name, a pure test that says why it declines, and how it runs.

Shape legend: b batch, h heads, lq queries, dv value size, d model size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from selfattn.core.call import AttentionCall

__all__ = ["Output", "Route", "Step"]

#: A route's step form for one kind of call (:attr:`Route.step_for`): ``(b, h, lq, dv)`` from ``q, k, v``.
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Output(NamedTuple):
    """A route's result (a named tuple: every call makes one, and a frozen dataclass costs a decoding step more).

    Attributes:
        out: ``(b, h, lq, dv)`` heads (``stage="heads"``), ``(b, lq, h * dv)`` merged heads before
            ``W_o`` (``"merged"``), or the module's ``(b, lq, d)`` output after ``W_o`` (``"projected"``).
        weights: ``(b, h, lq, lk)`` attention weights when the call asked for them.
        stage: how far the route went.
    """

    out: torch.Tensor
    weights: torch.Tensor | None = None
    stage: Literal["heads", "merged", "projected"] = "heads"


@dataclass(frozen=True)
class Route:
    """One way of computing attention.

    Attributes:
        name: what :func:`~selfattn.core.dispatch.explain` and the profiler call it.
        declines: ``declines(call)`` is None when the route can take the call, else the reason
            it cannot (it reads only what the call knows without computing attention).
        run: ``run(call)`` computes it.
        modifies_scores: whether it applies a call's softcap and sinks; the dispatcher passes
            over the routes that do not when a call has either.
        step_for: ``step_for(call, causal)`` makes ``step(q, k, v)``, ``(b, h, lq, dv)``: what ``run`` computes,
            from the heads alone, for every call of the kind of ``call`` (the same device, dtypes, sizes but the
            number of keys, grad mode, scale, softcap and sinks), where ``call`` has no bias, score term, dropout
            or weights wanted and no rule (or, ``causal``, the causal rule alone on a square); None where the
            route has no such form for that kind (the field None: for no call). A plan that remembered the route
            makes its step once and runs it without describing each call (:mod:`selfattn._decode_plan`).
    """

    name: str
    declines: Callable[[AttentionCall], str | None]
    run: Callable[[AttentionCall], Output]
    modifies_scores: bool = False
    step_for: Callable[[AttentionCall, bool], Step | None] | None = None
