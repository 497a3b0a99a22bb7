"""``selfattn study`` end to end: --quick outputs, SIGKILL + --resume, Ctrl-C, bad options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfattn.cli.main import main
from selfattn.study.options import study_settings
from selfattn.study.runner import run_study
from selfattn.study.summary import load_study

SRC = Path(__file__).parent.parent / "src"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    cpu = time.process_time()
    assert main(["study", "--quick", "--out", str(out), "--no-progress", "--encodings", "sinusoidal", "learned"]) == 0
    cpu = time.process_time() - cpu
    # --quick stays a smoke test under a minute: these 4 runs and the deep stack, scaled to the default quick
    # grid's 6 runs of the same size, in CPU seconds (what other processes on the machine do not inflate).
    assert cpu * 6 / 4 < 60, f"--quick would take about {cpu * 6 / 4:.0f} s of CPU"
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"config", "runs", "summary", "deep_stack"}
    assert len(results["runs"]) == 4 and set(results["summary"]) == {"copy", "reverse"}
    run = results["runs"][0]
    assert {
        "task",
        "encoding",
        "seed",
        "randomized_positions",
        "steps",
        "train_max_len",
        "accuracy_by_length",
        "train_seconds",
    } <= set(run)
    assert list(run["accuracy_by_length"]) == [str(n) for n in range(1, 9)]
    assert set(results["summary"]["copy"]["learned"]) >= {"in_distribution", "beyond", "spread", "answer_use"}
    assert run["answer_use"]["window"] == 10 and len(run["answer_use"]["full"]) == 3  # answer positions 1-2, 3-4, 5-8
    html = (out / "study.html").read_text()
    assert "Does a model use its input past L?" in html and html.count("<th>far, window</th>") == 2 * 3
    assert "Relative vs absolute" in html and "Learned vs fixed" in html and "cannot extrapolate" in html
    assert "a smoke test of the pipeline, not a measurement" in html  # --quick settings
    assert "trained models answer the chapter's exercises" not in html
    for stem in ("accuracy_copy", "accuracy_reverse", "learned_vs_sinusoidal", "answer_use_copy", "answer_use_reverse"):
        assert (out / "figures" / f"{stem}.png").stat().st_size > 0
        assert (out / "figures" / f"{stem}.svg").read_text().lstrip().startswith("<?xml")
    assert "study: 4 runs" in capsys.readouterr().out
    summary = load_study(out)
    assert summary is not None and summary.runs == 4 and len(summary.figures) == 3
    assert load_study(tmp_path / "nothing") is None
    from selfattn.study.summary import study_section_html

    section = study_section_html(out)
    assert (
        "4 trained runs" in section and section.count("data:image/png;base64,") == 3 and "<td>learned</td>" in section
    )


def _study_argv(out: Path, *extra: str, steps: int) -> list[str]:
    """``selfattn study`` arguments for one small rotary copy run that checkpoints every 0.2 s of work."""
    return [
        "study",
        "--quick",
        "--tasks",
        "copy",
        "--encodings",
        "rotary",
        "--steps",
        str(steps),
        "--no-deep-stack",
        "--no-progress",
        "--checkpoint-seconds",
        "0.2",
        "--out",
        str(out),
        *extra,
    ]


def _start(out: Path, *extra: str, steps: int) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "selfattn", *_study_argv(out, *extra, steps=steps)]
    # Restore SIGINT in the child: a pytest-xdist worker ignores it, and ignored signals survive exec.
    return subprocess.Popen(
        command,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_checkpoint(out: Path, process: subprocess.Popen[str]) -> None:
    checkpoint = out / "checkpoints" / "copy-rotary-s0.pt"
    deadline = time.monotonic() + 180
    while not checkpoint.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)


# Enough steps that the run is far from done when its first checkpoint (0.2 s of work) appears and is killed.
KILLED_STEPS = 240


def test_killed_study_resumes_to_the_same_numbers(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    process = _start(out, steps=KILLED_STEPS)
    _wait_for_checkpoint(out, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "results.json").exists()
    # The resumed run needs no process of its own (a second interpreter and torch import cost more than the run).
    assert main(_study_argv(out, "--resume", steps=KILLED_STEPS)) == 0
    grid, config = study_settings(quick=True, tasks=["copy"], encodings=["rotary"], steps=KILLED_STEPS)
    whole = run_study(tmp_path / "whole", grid, config, deep_stack=False, report=False)
    assert whole is not None
    got = json.loads((out / "results.json").read_text())
    for n, accuracy in whole["runs"][0]["accuracy_by_length"].items():
        assert got["runs"][0]["accuracy_by_length"][n] == pytest.approx(accuracy, abs=1e-6)
    losses = json.loads((out / "runs" / "copy-rotary-s0.json").read_text())["loss_curve"]
    expected = json.loads((tmp_path / "whole" / "runs" / "copy-rotary-s0.json").read_text())["loss_curve"]
    assert len(losses) == KILLED_STEPS and losses == pytest.approx(expected, rel=1e-6)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    process = _start(out, steps=10**6)
    _wait_for_checkpoint(out, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "Traceback" not in stderr and stderr.strip().count("\n") == 0
    assert "interrupted; rerun with --resume" in stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "parity"], "invalid choice: 'parity'"),
        (["--encodings", "rotary2d"], "invalid choice: 'rotary2d'"),
        (["--seeds", "0"], "must be a positive integer"),
        (["--steps", "-3"], "must be a positive integer"),
    ],
)
def test_bad_options_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["study", "--out", str(tmp_path / "x"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_combination_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["study", "--quick", "--encodings", "alibi", "--randomized-positions", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "selfattn study: error: randomized positions need one of" in err and err.count("\n") == 1


def test_tour_section_shows_a_study_or_says_how_to_make_one(tmp_path: Path) -> None:
    from selfattn.study.summary import study_section_html

    missing = study_section_html(tmp_path / "none")
    assert "No study grid found" in missing and "selfattn study" in missing
    from selfattn.tour.report import render_report  # the tour report calls it

    assert "study_section_html" in render_report.__code__.co_names
