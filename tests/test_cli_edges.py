"""The command line at its edges: sizes that cannot fit, overflow, --version, Ctrl-C, atomic outputs."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy
import pytest

import selfattn
from selfattn.cli import compare, encode, plot, tour
from selfattn.cli._interrupt import interrupts_end_the_command
from selfattn.cli.main import main


def run_cli(argv: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    try:
        status: object = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: object, out: str, err: str, command: str, words: str) -> None:
    assert status not in (0, None), err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"selfattn {command}: ")
    assert words in lines[0], lines[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["encode", "-n", "100000000000", "-o", "{tmp}/P.npy"], "would need about"),
        (["encode", "-d", "100000000", "-o", "{tmp}/P.npy"], "would need about"),
        (["encode", "--kind", "alibi", "--heads", "100000000", "-d", "100000000", "-o", "{tmp}/P.npy"], "would need"),
        (["encode", "--kind", "rotary", "-n", "100000000000", "-o", "{tmp}/P.npy"], "would need about"),
        (["encode", "--offset", "9223372036854775807", "-o", "{tmp}/P.npy"], "--offset must be at most 2**53"),
        (
            ["encode", "--offset", "99999999999999999999", "-o", "{tmp}/P.npy"],
            "argument --offset: must be at most 2**63",
        ),
        # past int64 they failed later, naming no flag; -n past 2**53 blamed --offset with a negative bound
        (
            ["rotary", "--head-dim", "8", "--context", "9223372036854775808"],
            "argument --context: must be at most 2**63",
        ),
        (["study", "--quick", "--train-len", "99999999999999999999999", "--out", "{tmp}/s"], "argument --train-len"),
        (["encode", "-n", "9007199254740994", "-d", "4", "-o", "{tmp}/P.npy"], "shape (9007199254740994, 4)"),
        (["encode", "--kind", "alibi", "--offset", "99999999999999999999", "-o", "{tmp}/P.npy"], "--offset"),
        (["plot", "-n", "1000000", "-o", "{tmp}/p.png"], "would need about"),
        (["plot", "-n", "1000000000000", "--figure", "table", "-o", "{tmp}/p.png"], "would need about"),
        (["compare", "--fixed-d", "100000000"], "would need about"),
        (["compare", "--n", "8", "100000000"], "would need about"),
    ],
)
def test_sizes_that_cannot_fit_are_one_line_before_any_allocation(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert_one_line_error(status, out, err, argv[0], words)
    assert status == 2 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_version_comes_from_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["--version"], capsys)
    assert status == 0 and err == ""
    assert out.strip() == f"selfattn {selfattn.__version__}"


@pytest.mark.parametrize(
    "error, words",
    [
        (MemoryError(), "MemoryError"),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory\nmore"),
            "allocate",
        ),
        (RuntimeError("Overflow when unpacking long"), "Overflow"),
        (OverflowError("Python int too large to convert to C long"), "too large"),
    ],
)
def test_out_of_memory_and_overflow_are_one_line(
    error: BaseException,
    words: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(args: Any) -> int:
        raise error

    monkeypatch.setattr(encode, "run", fail)
    status, out, err = run_cli(["encode", "-o", tmp_path / "P.npy"], capsys)
    assert_one_line_error(status, out, err, "encode", words)


def test_other_runtime_errors_still_show_their_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(args: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(encode, "run", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["encode", "-o", str(tmp_path / "P.npy")])


@pytest.mark.parametrize(
    "module, argv",
    [
        (tour, ["tour", "--out", "{tmp}/report"]),
        (encode, ["encode", "-o", "{tmp}/P.npy"]),
        (plot, ["plot", "-o", "{tmp}/p.png"]),
        (compare, ["compare"]),
    ],
)
def test_ctrl_c_is_one_line_and_exit_130_for_every_subcommand(
    module: Any, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    status, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert status == 130 and out == ""
    assert err == f"selfattn {argv[0]}: interrupted\n"


def test_an_interrupted_encode_leaves_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "P.npy"
    target.write_bytes(b"the old table")

    def half_written(path: Any, array: Any) -> None:
        Path(path).write_bytes(b"\x93NUMPY half")
        raise KeyboardInterrupt

    monkeypatch.setattr(numpy, "save", half_written)  # encode imports numpy when it runs
    status, _, err = run_cli(["encode", "-o", target], capsys)
    assert status == 130 and err == "selfattn encode: interrupted\n"
    assert target.read_bytes() == b"the old table"
    assert os.listdir(tmp_path) == ["P.npy"]


def test_an_interrupted_plot_leaves_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "p.png"
    target.write_bytes(b"the old figure")

    class HalfFigure:
        def savefig(self, path: Any, **kwargs: Any) -> None:
            Path(path).write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt

    monkeypatch.setattr(plot, "_draw", lambda args: HalfFigure())
    status, _, err = run_cli(["plot", "-o", target], capsys)
    assert status == 130 and err == "selfattn plot: interrupted\n"
    assert target.read_bytes() == b"the old figure"
    assert os.listdir(tmp_path) == ["p.png"]


def test_a_failed_tour_leaves_the_old_report_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from selfattn.tour import runner

    report = tmp_path / "report"
    (report / "figures").mkdir(parents=True)
    for name, text in (("report.html", "old page"), ("results.json", "{}"), ("figures/a.png", "old png")):
        (report / name).write_text(text)

    def interrupted_tour(out_dir: Path, **kwargs: Any) -> dict[str, Any]:
        (Path(out_dir) / "figures").mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "figures" / "a.png").write_text("new, truncated")
        (Path(out_dir) / "results.json").write_text("new")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_tour", interrupted_tour)
    status, _, err = run_cli(["tour", "--out", report], capsys)
    assert status == 130 and err == "selfattn tour: interrupted\n"
    assert (report / "report.html").read_text() == "old page"
    assert (report / "results.json").read_text() == "{}"
    assert (report / "figures" / "a.png").read_text() == "old png"
    assert os.listdir(tmp_path) == ["report"]


def test_ctrl_c_during_a_real_tour_leaves_the_old_report(tmp_path: Path) -> None:
    """The installed entry point, a real SIGINT while the tour computes into its temporary folder."""
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.html").write_text("old page")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "selfattn", "tour", "--quick", "--no-progress", "--out", str(report)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A pytest-xdist worker may ignore SIGINT, and an ignored signal survives exec: restore it in the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".report.tmp-") for p in tmp_path.iterdir()):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # inside the computation
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err == "selfattn tour: interrupted\n" and out == ""
    assert os.listdir(report) == ["report.html"] and (report / "report.html").read_text() == "old page"
    assert os.listdir(tmp_path) == ["report"]


def poison(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> None:
    """Make the work a command would do fail loudly: a check that comes after it is a failed test."""

    def work_started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{module}.{name} ran before the outputs were checked")

    monkeypatch.setattr(importlib.import_module(module), name, work_started)


# (command line, the work it must not start first); {out} is a folder that takes no new file.
UNWRITABLE = [
    (["encode", "-o", "{out}/P.npy"], ("selfattn.tour.family", "encoding_table")),
    (["plot", "-o", "{out}/p.png"], ("selfattn.tour.family", "encoding_diagnostics")),
    (["compare", "--json", "{out}/c.json"], ("selfattn.tour.comparison", "compare")),
    (["compare", "--plot", "{out}/c.png"], ("selfattn.tour.comparison", "compare")),
    (["rotary", "--head-dim", "8", "--plot", "{out}/w.png"], ("selfattn.cli.rotary", "angle_errors")),
    (["tour", "--out", "{out}/report"], ("selfattn.tour.runner", "compute")),
]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a folder no one can create files in (/proc)")
@pytest.mark.parametrize("argv, work", UNWRITABLE)
def test_an_unwritable_output_is_one_line_naming_the_users_path_before_any_work(
    argv: list[str], work: tuple[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    poison(monkeypatch, *work)
    argv = [a.replace("{out}", "/proc") for a in argv]
    status, out, err = run_cli(argv, capsys)
    assert_one_line_error(status, out, err, argv[0], repr(argv[-1]))
    assert status == 2 and ".tmp-" not in err and "write-test" not in err


@pytest.mark.parametrize(
    "argv, work",
    [
        *UNWRITABLE,
        (["study", "--quick", "--no-deep-stack", "--out", "{out}/study"], ("selfattn.study.runner", "train_run")),
        (["study", "--quick", "--no-deep-stack", "--out", "{out}"], ("selfattn.study.runner", "train_run")),
        (["tour", "--out", "{out}"], ("selfattn.tour.runner", "compute")),
    ],
)
def test_a_file_where_a_folder_is_wanted_is_said_in_words(
    argv: list[str],
    work: tuple[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    poison(monkeypatch, *work)
    (tmp_path / "file").write_text("the user's")
    status, out, err = run_cli([a.replace("{out}", str(tmp_path / "file")) for a in argv], capsys)
    assert_one_line_error(status, out, err, argv[0], f"{str(tmp_path / 'file')!r}")
    assert "is a file, not a folder" in err or "exists and is not a folder" in err
    assert "File exists" not in err and "Not a directory" not in err
    assert os.listdir(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "the user's"


class _Finalizer:
    """Stands for a weakref callback or ``__del__`` in which a Ctrl-C lands (matplotlib runs many)."""

    def __del__(self) -> None:
        raise KeyboardInterrupt  # what Python's SIGINT handler raises wherever the program is


# Run in a child process: the dropped interrupt is raised again by a real SIGALRM timer, and a
# timer in the test process could go off in whatever runs next there (it once landed in
# hypothesis' gc callback, reported as an unraisable KeyboardInterrupt in another test).
_DROPPED_INTERRUPT = """
import sys, time
from selfattn.cli import tour
from selfattn.cli.main import main

class Finalizer:
    def __del__(self):
        raise KeyboardInterrupt

steps = []

def long_tour(args):
    Finalizer()  # collected at once: the interrupt is dropped here
    for step in range(200):  # ten seconds of work unless the interrupt comes back
        steps.append(step)
        time.sleep(0.05)
    return 0

def finished_after_a_dropped_interrupt(args):
    Finalizer()
    return 0

tour.run = long_tour if sys.argv[1] == "long" else finished_after_a_dropped_interrupt
status = main(["tour", "--out", sys.argv[2]])
print(len(steps))
sys.exit(status)
"""


def _run_dropped_interrupt(kind: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", _DROPPED_INTERRUPT, kind, str(out)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_ctrl_c_that_lands_in_a_finalizer_still_ends_the_command(tmp_path: Path) -> None:
    """Python drops an exception raised in a finalizer ("Exception ignored in ..."); the command must not run on."""
    done = _run_dropped_interrupt("long", tmp_path / "report")
    assert done.returncode == 130
    assert done.stderr == "selfattn tour: interrupted\n"  # no "Exception ignored" report, no traceback
    assert int(done.stdout) < 40  # raised again within a step or two (50 ms), not after the whole run


def test_a_dropped_ctrl_c_at_the_very_end_still_exits_130(tmp_path: Path) -> None:
    done = _run_dropped_interrupt("short", tmp_path / "report")
    assert (done.returncode, done.stdout, done.stderr) == (130, "0\n", "selfattn tour: interrupted\n")


def test_a_timer_going_off_as_it_is_stopped_leaves_no_hook_behind(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The retry timer may go off just as the command ends: the hook and SIGALRM handler are restored even then.

    No real timer runs here: ``setitimer`` is replaced, and stopping the timer raises as its interrupt would.
    """
    alarm_before = signal.getsignal(signal.SIGALRM)
    request.addfinalizer(lambda: signal.signal(signal.SIGALRM, alarm_before))  # even when this test fails
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored at teardown, whatever happens
    hook_before = sys.unraisablehook
    armed: list[float] = []

    def setitimer(which: int, seconds: float, interval: float = 0.0) -> tuple[float, float]:
        armed.append(seconds)
        if seconds == 0 and len(armed) > 1:
            raise KeyboardInterrupt  # the timer went off just before it was stopped
        return 0.0, 0.0

    monkeypatch.setattr(signal, "setitimer", setitimer)
    with pytest.raises(KeyboardInterrupt), interrupts_end_the_command() as seen:
        _Finalizer()
    assert seen.dropped and armed == [0.05, 0]
    assert sys.unraisablehook is hook_before
    assert signal.getsignal(signal.SIGALRM) == alarm_before


def test_compare_labels_its_progress_bar_for_compare(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from selfattn.tour import runner

    labels = []
    real_bar = runner.progress_bar

    def recording_bar(total: int, enabled: bool, label: str = "(none given)") -> Any:
        labels.append(label)
        return real_bar(total, enabled, label)

    monkeypatch.setattr(runner, "progress_bar", recording_bar)
    argv = ["compare", "--n", "2", "3", "--d", "2", "3", "--k", "2", "3", "--repeats", "1", "--rounds", "1"]
    status, _, err = run_cli(argv, capsys)
    assert status == 0, err
    assert labels == ["selfattn compare"]


def test_a_ctrl_c_that_python_wraps_in_a_runtime_error_ends_as_interrupted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python 3.11 wraps an exception raised by ``__set_name__`` (a class body of a lazy import that a Ctrl-C lands
    in: torch's, early in a tour) in ``RuntimeError("Error calling __set_name__ ...")``: still an interrupt."""

    class Field:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    def handler(args: Any) -> int:
        type("Owner", (), {"field": Field()})
        return 0

    monkeypatch.setattr(encode, "run", handler)
    assert main(["encode", "--kind", "sinusoidal", "-n", "4", "-d", "4", "-o", str(tmp_path / "P.npy")]) == 130
    assert capsys.readouterr().err == "selfattn encode: interrupted\n"


@pytest.mark.parametrize(
    "command", [["encode", "--kind", "sinusoidal", "-n", "4", "-d", "6"], ["rotary", "--head-dim", "8"]]
)
@pytest.mark.parametrize("base", ["0.5", "1", "inf"])
def test_a_base_of_one_or_less_is_refused_naming_the_flag(
    command: list[str], base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It passed the command's check (a positive number) and failed in the library naming ``base``, not ``--base``."""
    output = ["-o", tmp_path / "P.csv"] if command[0] == "encode" else []
    status, out, err = run_cli([*command, "--base", base, *output], capsys)
    assert_one_line_error(status, out, err, command[0], "argument --base: must be a number greater than 1")


def test_data_parallel_outside_torchrun_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ran as one process, the flag silently ignored."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status, out, err = run_cli(["study", "--quick", "--data-parallel", "--out", tmp_path / "study"], capsys)
    assert_one_line_error(status, out, err, "study", "--data-parallel trains each run on all ranks: start the study")
