"""benchmarks/op_counts.py: the operators of a row are counted, and a comparison names each count that moved."""

import importlib.util
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("benchmarks_op_counts", _DIR / "op_counts.py")
op_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_counts)


def test_a_row_runs_the_fused_kernel_forward_and_its_backward():
    counts = op_counts.op_counts("(no encoding)", None, {}, n=16)
    assert counts["aten::linear"] == 4  # W_q, W_k, W_v, W_o
    assert any(op.startswith("aten::_scaled_dot_product") for op in counts)
    assert any("backward" in op for op in counts)


def test_compare_names_each_count_that_moved_and_only_those():
    before = {"row": {"aten::mm": 3, "aten::add": 1}, "gone": {"aten::mm": 1}}
    after = {"row": {"aten::mm": 2, "aten::add": 1, "aten::exp": 4}}
    text = op_counts.compare(before, after)
    assert "row: 4 -> 7 calls; aten::exp 0 -> 4, aten::mm 3 -> 2" in text
    assert "aten::add" not in text
    assert "gone: only in the first file" in text
    same = op_counts.compare({"row": {"aten::mm": 1}}, {"row": {"aten::mm": 1}})
    assert same == "row: 1 -> 1 calls; the same operators, the same counts"
