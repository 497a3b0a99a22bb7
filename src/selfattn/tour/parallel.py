"""Do sequential operations prevent parallel computation? Wall-clock time as threads are added.

The chapter: "sequential operations prevent parallel computation"; the RNN's O(n) steps
"cannot be parallelized", while self-attention and the CNN "enjoy parallel computation". The
tour's section 3 counts the chains; this module times them: one forward pass of each layer
on one sequence, with torch's intra-op threads at 1 and at each larger count the machine has
(up to 4), and reports the speed-up ``time(1 thread) / time(t threads)``. A layer whose work
is one long chain of small products gains little from a second thread; a layer whose work is
a few large products gains up to t.

On a machine shared with other work the timings say nothing about parallelism: a second
thread waits for a core that someone else holds. The rounds interleave thread counts and
layers so a burst of load hits every point, each point of a round is the fastest of
``repeats`` runs, and the speed-up is computed round by round: a layer counts as parallel
only when every round puts it above the cut, as not parallel only when every round puts it
below, and as "undecided (noise)" otherwise, one decision that every claim reads. The
1-minute load average is read before and after (two readings at least 5.5 s apart, since the
kernel recomputes it every 5 s) with the number of cores: ``quiet`` is False when other work
held the cores the threads needed, and the tour's claims then say the timing was not shown
rather than report a slowdown caused by the load.

Shape legend: n positions, d model size.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from selfattn.tour._common import seeded
from selfattn.tour.comparison import KINDS, make_layer

__all__ = ["PARALLEL_CUT", "UNDECIDED", "decide_above", "thread_speedup"]


def _thread_counts(limit: int = 4) -> list[int]:
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return list(range(1, min(available, limit) + 1))


UNDECIDED = "undecided (noise)"
"""The verdict of a timing whose spread over the rounds straddles the cut."""

PARALLEL_CUT = 1.2
"""A layer counts as parallel when a second thread speeds it up by more than this (time ratio)."""

_LOAD_INTERVAL = 5.5
"""Seconds between the two load readings: the kernel recomputes its load average every 5 s."""


def decide_above(low: float, high: float, cut: float) -> str:
    """``"above"`` or ``"below"`` when the whole spread ``[low, high]`` lies on one side of ``cut``, else undecided.

    A verdict that rests on a timing is decided only when every repeat agrees; when the
    spread straddles the cut, the timing is noise for that question: ``"undecided (noise)"``.
    """
    if low > cut:
        return "above"
    if high < cut:
        return "below"
    return UNDECIDED


def _load_readings(
    first: float, started: float, clock: Callable[[], float], wait: Callable[[float], None]
) -> list[float]:
    """The load average before and after: the second read once the kernel has recomputed it (two real samples)."""
    elapsed = clock() - started
    if elapsed < _LOAD_INTERVAL:
        wait(_LOAD_INTERVAL - elapsed)
    return [first, os.getloadavg()[0]]


def thread_speedup(
    *,
    num_steps: int = 1024,
    num_hiddens: int = 256,
    repeats: int = 3,
    rounds: int = 5,
    threads: tuple[int, ...] | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    wait: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Forward time of each layer of section 3 at each thread count, round by round, and the speed-ups.

    The rounds interleave the thread counts and the layers, so a burst of other work hits
    every point; within a round each point is the fastest of ``repeats`` runs. The speed-up
    ``time(1) / time(t)`` is computed round by round: ``speedup`` is its median,
    ``speedup_spread`` its ``[min, max]`` over the rounds, and ``parallel`` the one decision
    every claim reads: ``"above"`` the cut :data:`PARALLEL_CUT` in every round (the layer runs
    in parallel), ``"below"`` it in every round, or ``"undecided (noise)"``.

    ``clock`` and ``wait`` are the timer and the sleep (tests pass fakes).

    Returns ``{"threads", "num_steps", "num_hiddens", "rounds", "times": {kind: [seconds per
    count]}, "speedup": {kind: [median per count]}, "speedup_rounds": {kind: [[per round] per
    count]}, "speedup_spread": {kind: [min, max] at the largest count}, "parallel": {kind:
    decision}, "cut", "cores", "load", "quiet"}``; with one core ``threads`` is ``[1]`` and every
    speed-up is 1. ``load`` is the 1-minute load average before and after (read at least
    5.5 s apart); ``quiet``: both below ``cores - 0.5`` (this process counts for about 1, so
    the other threads found idle cores).

    Raises:
        ValueError: a thread count below 1, no count of 1 to compare with, or ``rounds`` or
            ``repeats`` below 1.
    """
    counts = list(threads) if threads is not None else _thread_counts()
    if not counts or min(counts) < 1 or counts[0] != 1:
        raise ValueError(f"threads must start at 1 and be positive, got {counts}")
    if rounds < 1 or repeats < 1:
        raise ValueError(f"rounds and repeats must be at least 1, got rounds={rounds}, repeats={repeats}")
    with seeded(seed):
        x = torch.randn(1, num_steps, num_hiddens)  # (1, n, d)
        layers = {kind: make_layer(kind, num_hiddens) for kind in KINDS}
    # best[kind][t][r]: the fastest of the repeats of round r.
    best: dict[str, dict[int, list[float]]] = {kind: {t: [] for t in counts} for kind in KINDS}
    started, first_load = clock(), os.getloadavg()[0]
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            for _ in range(rounds):
                for t in counts:
                    torch.set_num_threads(t)
                    for kind, layer in layers.items():
                        layer(x)  # warm-up at this thread count
                        runs = []
                        for _ in range(repeats):
                            start = clock()
                            layer(x)
                            runs.append(clock() - start)
                        best[kind][t].append(min(runs))
    finally:
        torch.set_num_threads(before)
    load = _load_readings(first_load, started, clock, wait)
    cores = _thread_counts(limit=1 << 10)[-1]
    return _summarize(best, counts, load, cores) | {"num_steps": num_steps, "num_hiddens": num_hiddens}


def _summarize(
    best: dict[str, dict[int, list[float]]], counts: list[int], load: list[float], cores: int
) -> dict[str, Any]:
    """Speed-ups round by round, their median and spread, and the shared decision (see :func:`thread_speedup`)."""
    by_round = {
        kind: [[one / many for one, many in zip(best[kind][1], best[kind][t], strict=True)] for t in counts]
        for kind in KINDS
    }
    spread = {kind: [min(by_round[kind][-1]), max(by_round[kind][-1])] for kind in KINDS}
    decided = {
        kind: UNDECIDED if len(counts) == 1 else decide_above(spread[kind][0], spread[kind][1], PARALLEL_CUT)
        for kind in KINDS
    }
    return {
        "threads": counts,
        "rounds": len(best[KINDS[0]][1]),
        "times": {kind: [statistics.median(best[kind][t]) for t in counts] for kind in KINDS},
        "speedup": {kind: [statistics.median(values) for values in by_round[kind]] for kind in KINDS},
        "speedup_rounds": by_round,
        "speedup_spread": spread,
        "parallel": decided,
        "cut": PARALLEL_CUT,
        "cores": cores,
        "load": load,
        "quiet": max(load) < cores - 0.5,
    }
