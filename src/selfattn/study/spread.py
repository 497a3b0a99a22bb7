"""Mean, spread and 95% interval over seeds, and the one rule by which the study claims that two cells differ.

A study table gives every cell as a mean over seeds with its spread; a difference between two
cells is claimed only when their 95% intervals (Student's t over the seeds) do not overlap.
One seed has no spread, so nothing is claimed from it. Non-overlapping intervals are a stricter
test than a two-sample t-test at 5%: a difference this rule misses may still be real, but one
it claims is not a seed's luck at the usual level.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

__all__ = ["best_and_ties", "differs", "interval95", "prediction95", "t_quantile_975"]

# Student's t at 0.975 for 1..30 degrees of freedom (the seeds minus one).
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(degrees_of_freedom: int) -> float:
    """Student's t quantile at 0.975: a table to 30 degrees of freedom, then z plus its first correction."""
    if isinstance(degrees_of_freedom, bool) or not isinstance(degrees_of_freedom, int) or degrees_of_freedom < 1:
        raise ValueError(f"degrees_of_freedom must be a positive integer, got {degrees_of_freedom!r}")
    if degrees_of_freedom <= len(_T_975):
        return _T_975[degrees_of_freedom - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * degrees_of_freedom)


def interval95(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"mean", "sd", "half_width", "low", "high", "seeds"}`` of ``values`` (one per seed).

    ``half_width`` is ``t(0.975, n - 1) * sd / sqrt(n)``; with one value ``sd`` is 0 and the
    interval (``half_width``, ``low``, ``high``) is None: one seed says nothing about the spread.
    """
    if not values:
        raise ValueError("values must hold at least one number, got none")
    if any(not math.isfinite(float(v)) for v in values):
        raise ValueError(f"values must be finite numbers, got {list(values)!r}")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return {"mean": mean, "sd": 0.0, "half_width": None, "low": None, "high": None, "seeds": 1}
    sd = statistics.stdev(values)
    half = t_quantile_975(len(values) - 1) * sd / math.sqrt(len(values))
    return {"mean": mean, "sd": sd, "half_width": half, "low": mean - half, "high": mean + half, "seeds": len(values)}


def prediction95(values: Sequence[float]) -> dict[str, float] | None:
    """``{"low", "high"}``: where one more run, with a seed not among ``values``, lands 95% of the time.

    ``mean ± t(0.975, n - 1) * sd * sqrt(1 + 1 / n)``, for runs whose readings scatter normally
    around the cell's mean: wider than :func:`interval95`, which bounds the mean, not a run. A
    rerun of a single run is checked against this. None for one value (no spread to predict from).
    """
    interval = interval95(values)
    if interval["half_width"] is None:
        return None
    n = len(values)
    half = t_quantile_975(n - 1) * float(interval["sd"] or 0.0) * math.sqrt(1 + 1 / n)
    mean = float(interval["mean"] or 0.0)
    return {"low": mean - half, "high": mean + half}


def differs(first: Sequence[float], second: Sequence[float]) -> bool:
    """True only when the 95% intervals over seeds of ``first`` and ``second`` do not overlap.

    False when they overlap (a difference inside the spread is not claimed) and when either
    side has a single seed (no spread to compare with).
    """
    a, b = interval95(first), interval95(second)
    if a["low"] is None or b["low"] is None:
        return False
    assert a["high"] is not None and b["high"] is not None
    return bool(a["high"] < b["low"] or b["high"] < a["low"])


def best_and_ties(cells: Mapping[str, Sequence[float]], *, higher_is_better: bool) -> tuple[str, list[str]]:
    """The cell with the best mean, and the others that do not differ from it (:func:`differs`).

    Args:
        cells: ``{name: per-seed values}``.
        higher_is_better: accuracy (True) or perplexity (False).

    Returns:
        ``(best, ties)``: ``ties`` in the order of ``cells``.
    """
    if not cells:
        raise ValueError("cells must hold at least one cell, got none")
    sign = 1.0 if higher_is_better else -1.0
    best = max(cells, key=lambda name: sign * statistics.fmean(cells[name]))
    return best, [name for name in cells if name != best and not differs(cells[best], cells[name])]
