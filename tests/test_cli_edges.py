"""The command line at its edges: sizes that cannot fit, overflow, --version, Ctrl-C, atomic outputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import selfattn
from selfattn.cli import compare, encode, plot, tour
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
        (["encode", "--offset", "99999999999999999999", "-o", "{tmp}/P.npy"], "--offset must be at most 2**53"),
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

    monkeypatch.setattr(encode.np, "save", half_written)
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
