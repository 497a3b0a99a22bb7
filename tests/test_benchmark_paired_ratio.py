"""benchmarks/_common.py's paired ratio: the median of per-round ratios and its distribution-free 95% interval."""

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))  # the benchmarks import their helpers as `_common`
_spec = importlib.util.spec_from_file_location("benchmarks_common", _DIR / "_common.py")
common = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(common)


@pytest.mark.parametrize(
    ("rounds", "ranks"),
    # The ranks of the order statistics that bound a median's 95% interval, from published tables (sign test).
    [(6, (1, 6)), (11, (2, 10)), (20, (6, 15)), (40, (14, 27))],
)
def test_the_interval_is_bounded_by_the_tabled_order_statistics(rounds, ranks):
    times = [float(rank) for rank in range(rounds, 0, -1)]  # ratios 1..n, given in reverse: they must be sorted
    median, low, high = common.paired_ratio(times, [1.0] * rounds)
    assert (low, high) == ranks
    assert median == (rounds + 1) / 2


def test_each_round_is_paired_with_its_own_round():
    median, low, high = common.paired_ratio([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])  # twice as long in every round
    assert (median, low, high) == (2.0, 2.0, 2.0)  # a ratio of medians taken apart would read the same here,
    median, _, _ = common.paired_ratio([2.0, 4.0, 8.0], [4.0, 8.0, 1.0])  # but not when the rounds are shuffled
    assert median == 0.5


def test_rounds_of_unequal_counts_are_refused():
    with pytest.raises(ValueError, match="zip"):
        common.paired_ratio([1.0, 2.0], [1.0])
