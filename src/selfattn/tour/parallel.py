"""Do sequential operations prevent parallel computation? Wall-clock time as threads are added.

The chapter: "sequential operations prevent parallel computation"; the RNN's O(n) steps
"cannot be parallelized", while self-attention and the CNN "enjoy parallel computation". The
tour's section 3 counts the chains; this module times them: one forward pass of each layer
on one sequence, with torch's intra-op threads at 1 and at each larger count the machine has
(up to 4), and reports the speed-up ``time(1 thread) / time(t threads)``. A layer whose work
is one long chain of small products gains little from a second thread; a layer whose work is
a few large products gains up to t.

On a machine shared with other work the timings say nothing about parallelism: a second
thread waits for a core that someone else holds. Each point is the fastest of ``repeats``
runs (the one least disturbed), the rounds alternate thread counts so a burst of load hits
both, and the 1-minute load average before and after is recorded with the number of cores:
``quiet`` is False when other work held the cores the threads needed, and the tour's claims
then say the timing was not shown rather than report a slowdown caused by the load.

Shape legend: n positions, d model size.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from selfattn.tour._common import seeded
from selfattn.tour.comparison import KINDS, make_layer

__all__ = ["thread_speedup"]


def _thread_counts(limit: int = 4) -> list[int]:
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return list(range(1, min(available, limit) + 1))


def thread_speedup(
    *,
    num_steps: int = 1024,
    num_hiddens: int = 256,
    repeats: int = 3,
    rounds: int = 2,
    threads: tuple[int, ...] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Median forward time of each layer of section 3 at each thread count, and the speed-ups.

    Returns ``{"threads", "num_steps", "num_hiddens", "times": {kind: [seconds per count]},
    "speedup": {kind: [time(1) / time(t)]}, "cores", "load", "quiet"}``; with one core,
    ``threads`` is ``[1]`` and every speed-up is 1. ``load`` is the 1-minute load average before
    and after; ``quiet``: both below ``cores - 0.5`` (this process counts for about 1, so the
    other threads found idle cores).

    Raises:
        ValueError: a thread count below 1, or no count of 1 to compare with.
    """
    counts = list(threads) if threads is not None else _thread_counts()
    if not counts or min(counts) < 1 or counts[0] != 1:
        raise ValueError(f"threads must start at 1 and be positive, got {counts}")
    with seeded(seed):
        x = torch.randn(1, num_steps, num_hiddens)  # (1, n, d)
        layers = {kind: make_layer(kind, num_hiddens) for kind in KINDS}
    samples: dict[str, dict[int, list[float]]] = {kind: {t: [] for t in counts} for kind in KINDS}
    load = [os.getloadavg()[0]]
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            for _ in range(rounds):
                for t in counts:
                    torch.set_num_threads(t)
                    for kind, layer in layers.items():
                        layer(x)  # warm-up at this thread count
                        for _ in range(repeats):
                            start = time.perf_counter()
                            layer(x)
                            samples[kind][t].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    load.append(os.getloadavg()[0])
    cores = _thread_counts(limit=1 << 10)[-1]
    times = {kind: [min(samples[kind][t]) for t in counts] for kind in KINDS}
    return {
        "threads": counts,
        "num_steps": num_steps,
        "num_hiddens": num_hiddens,
        "times": times,
        "speedup": {kind: [times[kind][0] / value for value in times[kind]] for kind in KINDS},
        "cores": cores,
        "load": load,
        "quiet": max(load) < cores - 0.5,
    }
