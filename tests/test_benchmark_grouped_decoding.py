"""benchmarks/grouped_decoding.py runs end to end at a tiny size (its speed is not tested)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "grouped_decoding.py"


def test_a_tiny_run_writes_a_row_per_layout_and_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("benchmarks_grouped_decoding", _PATH)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # one layout on each side of the rows' threshold at 64 keys (b h lk d: 8,192 and 131,072)
    monkeypatch.setattr(script, "LAYOUTS", ((1, 4, 2, 32), (4, 8, 2, 64)))
    rows = script.rows(1, (64,), budget_s=0.0)  # each row checks selfattn's answer against the kernel's
    assert [row[1:4] for row in rows] == [["1, 4, 2, 32", "64", "8,192"], ["4, 8, 2, 64", "64", "131,072"]]
    assert all(row[-1].endswith(")") and float(row[-1].split("x")[0]) > 0 for row in rows)
