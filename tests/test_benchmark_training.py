"""benchmarks/training.py runs (--quick) and reports every encoding; it never writes BENCHMARKS.md in quick mode."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "training.py"


def test_training_benchmark_quick(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("benchmarks_training", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = (_PATH.parent.parent / "BENCHMARKS.md").read_text()
    assert module.main(["--quick", "--lengths", "3"]) == 0
    out = capsys.readouterr().out
    for encoding in ("none", "sinusoidal", "learned", "rotary", "alibi", "t5", "shaw"):
        assert f"| {encoding} |" in out
    assert "tokens/s n=3" in out
    assert (_PATH.parent.parent / "BENCHMARKS.md").read_text() == before
