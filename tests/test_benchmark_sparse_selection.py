"""benchmarks/sparse_selection.py runs end to end at a tiny size and reports every target (its speed is not tested)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "sparse_selection.py"


def test_the_quick_run_reports_every_target(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("benchmarks_sparse_selection", _PATH)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    output = tmp_path / "BENCHMARKS.md"
    assert script.main(["--quick", "--n", "48", "--top-k", "6", "--output", str(output)]) == 0
    report = capsys.readouterr().out
    assert report.count("DSA prefill forward") == 2 and report.count("DSA decoding after 48 tokens") == 2
    text = output.read_text()
    assert "<!-- begin: latent-sparse-cpu-dsa -->" in text and "<!-- end: latent-sparse-cpu-dsa -->" in text
