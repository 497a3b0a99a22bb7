"""The rotary benchmark's float32-angle baseline is a real rotary (its speed is not tested here)."""

import importlib.util
from pathlib import Path

import torch

from selfattn.functional import apply_rotary, rotary_frequencies

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "rotary.py"
_spec = importlib.util.spec_from_file_location("benchmarks_rotary", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_float32_angle_baseline_is_rotary_and_drifts_far_out():
    x = torch.randn(1, 2, 16, 64)
    inv_freq32 = rotary_frequencies(64).float()
    near = torch.arange(16)
    torch.testing.assert_close(
        bench.float32_angle_rotary(x, near, inv_freq32), apply_rotary(x, near), rtol=0, atol=1e-5
    )
    far = torch.arange(10**6, 10**6 + 16)
    assert bench.exact_error(bench.float32_angle_rotary(x, far, inv_freq32), x, far) > 1e-2
    assert bench.exact_error(apply_rotary(x, far), x, far) < 1e-5
