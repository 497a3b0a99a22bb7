"""The command line: encode, plot, compare and tour, their help and their error messages."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import sinusoidal_numpy

from selfattn.cli.main import main


def run_cli(argv, capsys):
    """``(status, stdout, stderr)`` of ``selfattn ARGV``, whether it returns or exits."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("command", ["tour", "encode", "plot", "compare"])
def test_every_subcommand_has_help_with_examples(command, capsys):
    status, out, _ = run_cli([command, "--help"], capsys)
    assert status == 0
    assert "examples:" in out and f"selfattn {command}" in out


def test_no_command_is_a_usage_error_on_stderr(capsys):
    status, out, err = run_cli([], capsys)
    assert status == 2 and out == ""
    # one line, like every other usage error of the command line (it printed the usage line too)
    assert err.count("\n") == 1 and err.startswith("selfattn: error: choose a COMMAND: tour, encode")
    assert "selfattn --help" in err


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".pt"])
def test_encode_writes_the_chapter_table(tmp_path, suffix, capsys):
    path = tmp_path / f"P{suffix}"
    status, out, _ = run_cli(["encode", "--kind", "sinusoidal", "-n", 60, "-d", 32, "-o", path], capsys)
    assert status == 0 and str(path) in out
    if suffix == ".npy":
        table = np.load(path)
    elif suffix == ".csv":
        table = np.loadtxt(path, delimiter=",")
    else:
        table = torch.load(path).numpy()
    assert table.shape == (60, 32)
    np.testing.assert_allclose(table, sinusoidal_numpy(np.arange(60), 32), atol=1e-6)


def test_encode_offset_base_and_float64(tmp_path, capsys):
    path = tmp_path / "P.csv"
    argv = ["encode", "-n", 7, "-d", 5, "--offset", 1000, "--base", 100, "--dtype", "float64", "-o", path]
    assert run_cli(argv, capsys)[0] == 0
    np.testing.assert_allclose(
        np.loadtxt(path, delimiter=","), sinusoidal_numpy(np.arange(1000, 1007), 5, 100.0), atol=1e-15
    )


def test_encode_score_encodings_write_one_bias_per_head(tmp_path, capsys):
    path = tmp_path / "alibi.pt"
    assert run_cli(["encode", "--kind", "alibi", "-n", 6, "-d", 16, "--heads", 4, "-o", path], capsys)[0] == 0
    bias = torch.load(path)
    assert bias.shape == (4, 6, 6)
    assert torch.all(bias.diagonal(dim1=-2, dim2=-1) == 0)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["encode", "--kind", "bogus", "-o", "{tmp}/P.npy"], "invalid choice: 'bogus'"),
        (["plot", "--kind", "bogus", "-o", "{tmp}/p.png"], "invalid choice: 'bogus'"),
        (["plot", "--figure", "bogus", "-o", "{tmp}/p.png"], "invalid choice: 'bogus'"),
        (["encode", "-n", "-5", "-o", "{tmp}/P.npy"], "positive integer, got '-5'"),
        (["encode", "-d", "-3", "-o", "{tmp}/P.npy"], "positive integer, got '-3'"),
        (["encode", "-n", "0", "-o", "{tmp}/P.npy"], "positive integer, got '0'"),
        (["encode", "--offset", "-1", "-o", "{tmp}/P.npy"], "non-negative integer, got '-1'"),
        (["encode", "--base", "-2", "-o", "{tmp}/P.npy"], "number greater than 1, got '-2'"),
        (["encode", "-n", "ten", "-o", "{tmp}/P.npy"], "positive integer, got 'ten'"),
        (["plot", "-n", "-4", "-o", "{tmp}/p.png"], "positive integer, got '-4'"),
        (["compare", "--n", "-4", "8"], "positive integer, got '-4'"),
        (["compare", "--d", "0", "8"], "positive integer, got '0'"),
        (["compare", "--n", "8"], "at least two different values"),
        (["compare", "--k", "1", "3"], "at least 2"),
        (["encode", "-o", "{tmp}/missing/P.npy"], "does not exist"),
        (["encode", "-o", "{tmp}/file/P.pt"], "file' is a file, not a folder"),
        (["encode", "-o", "{tmp}/P.txt"], "must end in .npy or .csv or .pt"),
        (["encode", "-o", "{tmp}"], "must end in"),
        (["encode", "--kind", "alibi", "--heads", "2", "-d", "8", "-o", "{tmp}/b.csv"], "CSV holds 2-D tables"),
        (["encode", "--kind", "alibi", "--base", "3", "-o", "{tmp}/b.npy"], "not accepted by 'alibi'"),
        (["encode", "--kind", "rotary", "-d", "10", "--heads", "3", "-o", "{tmp}/r.npy"], "not divisible"),
        (["encode", "--kind", "learned", "--offset", "5000", "-o", "{tmp}/l.npy"], "max_len"),
        (["plot", "-o", "{tmp}/missing/p.png"], "does not exist"),
        (["plot", "-o", "{tmp}/p.jpg"], "must end in .png or .svg"),
        (["plot", "--kind", "alibi", "--figure", "columns", "-o", "{tmp}/p.png"], "added to the input"),
        (["plot", "--figure", "columns", "--columns", "40", "-o", "{tmp}/p.png"], "--columns must lie in"),
        (["plot", "-d", "30", "--heads", "4", "-o", "{tmp}/p.png"], "not divisible"),
        (["compare", "--json", "{tmp}/missing/c.json"], "does not exist"),
        (["compare", "--plot", "{tmp}/c.gif"], "must end in .png or .svg"),
        (["tour", "--quick", "--out", "{tmp}/file/report"], "file' is a file, not a folder"),
    ],
)
def test_errors_are_one_clear_line(argv, words, tmp_path, capsys):
    (tmp_path / "file").write_text("a file where a folder should be")
    status, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert status != 0
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"selfattn {argv[0]}: error: ")
    assert words in lines[0]
    assert "Traceback" not in err


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    import selfattn.tour

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import matplotlib.figure` now fails
    monkeypatch.delitem(sys.modules, "selfattn.tour.figures", raising=False)
    monkeypatch.delattr(selfattn.tour, "figures", raising=False)
    status, _, err = run_cli(["plot", "-o", tmp_path / "p.png"], capsys)
    assert status == 2
    assert err.count("\n") == 1 and "pip install 'selfattn[plot]'" in err


def test_installed_entry_point_reports_errors_without_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "selfattn", "encode", "--kind", "bogus", "-o", str(tmp_path / "P.npy")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "kind, figure, suffix",
    [
        ("sinusoidal", "columns", ".png"),
        ("sinusoidal", "table", ".svg"),
        ("rotary", "panel", ".png"),
        ("alibi", "table", ".png"),
        ("t5", "scores", ".png"),
        ("shaw", "similarity", ".svg"),
        ("learned", "attention", ".png"),
    ],
)
def test_plot_writes_each_figure(kind, figure, suffix, tmp_path, capsys):
    path = tmp_path / f"figure{suffix}"
    argv = ["plot", "--kind", kind, "--figure", figure, "-n", 12, "-d", 16, "--heads", 2, "-o", path]
    status, out, _ = run_cli(argv, capsys)
    assert status == 0 and str(path) in out
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert len(data) > 3000


def test_compare_prints_the_table_and_saves_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "c.json", tmp_path / "c.png"
    argv = [
        "compare",
        "--n",
        4,
        8,
        16,
        "--d",
        4,
        8,
        "--k",
        2,
        3,
        "--fixed-n",
        8,
        "--fixed-d",
        8,
        "--repeats",
        1,
        "--json",
        json_path,
        "--plot",
        plot_path,
        "--no-progress",
    ]
    status, out, err = run_cli(argv, capsys)
    assert status == 0 and err == ""
    assert "Self-attention" in out and "O(n^2 d)" in out
    results = json.loads(json_path.read_text())
    assert results["rnn"]["max_path_length"] == 16  # input projection, then 15 recurrent products
    assert results["cnn"]["max_path_length"] == 8  # ceil(15 / 2)
    assert results["self_attention"]["max_path_length"] == 3
    assert abs(results["self_attention"]["flops_exponent_n"] - 2) <= 0.1
    assert plot_path.read_bytes().startswith(b"\x89PNG")
