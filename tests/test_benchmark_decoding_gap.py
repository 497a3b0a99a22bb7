"""benchmarks/decoding_gap.py: its five attention functions generate the same tokens, and only decoding steps are timed."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))  # the benchmarks import their helpers as `_common` and `decoding`
_spec = importlib.util.spec_from_file_location("benchmarks_decoding_gap", _DIR / "decoding_gap.py")
gap = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(gap)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_every_function_generates_sdpas_tokens_and_the_decoding_steps_alone_are_timed():
    rows, counted = gap.rows(batch=1, rounds=1)
    assert [row[1] for row in rows] == list(gap.NAMES)
    assert all(row[-1] == "yes" for row in rows), rows  # the references compute what sdpa computes
    assert counted.startswith("batch 1: 252 timed calls")  # 4 layers x 63 steps: not the 4 prefill calls
    prefill, masks = gap.HEADER.index("prefill us"), gap.HEADER.index("masks us")
    assert all(float(row[prefill]) > 0 and float(row[masks]) > 0 for row in rows), rows  # each timed apart
