"""Small helpers shared by the tour's sections: seeded randomness and fitted exponents."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

__all__ = ["fit_exponent", "seeded", "single_threaded"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch's CPU generator seeded, leaving the caller's generator untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run a block of tiny operations on one intra-op thread, then restore the thread count.

    Kernels of a few microseconds spend far longer waking a second thread than computing,
    and on a busy machine a waiting thread can cost milliseconds per call.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit_exponent(sizes: Sequence[float], costs: Sequence[float]) -> float:
    """Least-squares slope of ``log(cost)`` against ``log(size)``: the measured power law exponent."""
    if len(sizes) != len(costs) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, cost) pairs, got {len(sizes)} sizes and {len(costs)} costs")
    if min(sizes) <= 0 or min(costs) <= 0:
        raise ValueError(f"sizes and costs must be positive to fit a power law, got {list(sizes)} and {list(costs)}")
    slope, _ = np.polyfit(np.log(np.asarray(sizes, dtype=float)), np.log(np.asarray(costs, dtype=float)), 1)
    return float(slope) if math.isfinite(slope) else float("nan")
