"""``selfattn rotary``: the frequency table, the measured angle errors, the plot, the errors."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from selfattn.cli.main import main
from selfattn.cli.rotary import angle_errors
from selfattn.positional import RotaryPositionalEncoding

ROOT = Path(__file__).resolve().parents[1]
# The sample config the README's example uses: the rotary fields of Llama 3.1's config.json.
SAMPLE = ROOT / "examples" / "llama-3.1-rotary-config.json"
LLAMA31 = json.loads(SAMPLE.read_text(encoding="utf-8"))


def run_cli(argv, capsys):
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def pair_rows(out: str) -> dict[int, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 7 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_llama3_table_shows_which_pairs_are_scaled(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA31))
    status, out, err = run_cli(["rotary", "--config", config], capsys)
    assert status == 0, err
    rows = pair_rows(out)
    assert sorted(rows) == list(range(64))
    # Wavelength under 8192 / 4 = 2048 tokens: kept; over 8192: stretched 8 times; in between: blended.
    for cells in rows.values():
        wavelength, stretch, scaled = float(cells[1]), float(cells[3]), cells[4]
        if wavelength < 2048:
            assert (scaled, stretch) == ("no", 1.0), cells
        elif wavelength > 8192:
            assert scaled == "yes" and stretch == 8.0, cells
        else:
            assert scaled == "yes" and 1.0 < stretch < 8.0, cells
    assert [j for j, c in rows.items() if c[4] == "yes"] == list(range(29, 64))
    # Turns within the 131072-token context; the slowest pairs never complete one.
    assert float(rows[0][5]) == pytest.approx(131071 / (2 * math.pi), rel=1e-3)
    assert rows[63][6] == "part:" and rows[0][6] == "yes"
    assert "context=131072" in " ".join(out.split())


def test_compact_and_json_scaling_agree(capsys):
    compact = [
        "rotary",
        "--head-dim",
        16,
        "--context",
        2048,
        "--scaling",
        "yarn:factor=4,original_max_position_embeddings=512",
    ]
    as_json = [
        "rotary",
        "--head-dim",
        16,
        "--context",
        2048,
        "--scaling",
        json.dumps({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512}),
    ]
    first, second = run_cli(compact, capsys), run_cli(as_json, capsys)
    assert first[0] == second[0] == 0
    assert pair_rows(first[1]) == pair_rows(second[1])
    assert pair_rows(first[1])[0][4] == "no" and pair_rows(first[1])[7][4] == "yes"


def test_angle_errors_are_measured():
    rope = RotaryPositionalEncoding.from_config(LLAMA31)
    errors = {e["dtype"]: e for e in angle_errors(rope, 131072)}
    # float32 angles at 131072: off by ~position * eps; selfattn's float64 angles rounded once: ~1e-7.
    assert errors["float32"]["in_dtype"] > 1e-3
    assert errors["float32"]["selfattn"] < 1e-6
    assert errors["bfloat16"]["in_dtype"] > 1.0  # positions themselves round in bf16
    assert errors["bfloat16"]["selfattn"] < 2**-7
    assert math.isnan(errors["float16"]["in_dtype"])  # positions past 65504 overflow
    assert errors["float16"]["selfattn"] < 2**-9
    small = {e["dtype"]: e for e in angle_errors(RotaryPositionalEncoding(8), 64)}
    assert small["float32"]["in_dtype"] < 1e-5  # short contexts: float32 angles are fine


def test_plot_is_written(tmp_path, capsys):
    path = tmp_path / "wavelengths.png"
    status, out, err = run_cli(["rotary", "--head-dim", 32, "--scaling", "linear:factor=4", "--plot", path], capsys)
    assert status == 0, err
    assert path.stat().st_size > 1000 and str(path) in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--scaling", "{not json"], "--scaling is not valid JSON"),
        (["--scaling", "linear:factor"], "--scaling entries must be KEY=VALUE, got 'factor'"),
        (["--scaling", "rope:factor=2"], "unknown rope_type 'rope'"),
        (["--scaling", "llama3:factor=8"], "needs low_freq_factor"),
        (["--config", "{tmp}/missing.json"], "No such file"),
        (["--config", "{tmp}/c.json", "--head-dim", "8"], "--config gives the sizes"),
        (["--plot", "{tmp}/x.txt"], "--plot must end in .png or .svg"),
    ],
)
def test_errors_are_one_line(argv, match, tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(LLAMA31))
    status, _, err = run_cli(["rotary", *[a.replace("{tmp}", str(tmp_path)) for a in argv]], capsys)
    assert status == 2
    assert match in err and len(err.strip().splitlines()) == 1


def test_help_has_examples(capsys):
    status, out, _ = run_cli(["rotary", "--help"], capsys)
    assert status == 0 and "examples:" in out and "selfattn rotary" in out


def test_the_sample_config_is_llama_3_1s_rotary_setup():
    rope = RotaryPositionalEncoding.from_config(LLAMA31)
    assert (rope.head_dim, rope.base, LLAMA31["max_position_embeddings"]) == (128, 500000.0, 131072)
    assert rope.scaling_config is not None and rope.scaling_config.as_dict()["rope_type"] == "llama3"


def test_the_readme_example_runs_and_measures_what_the_readme_says(tmp_path, capsys, monkeypatch):
    readme = (ROOT / "docs" / "guides" / "positional.md").read_text(encoding="utf-8")  # moved from README.md
    (line,) = [line for line in readme.splitlines() if line.startswith("selfattn rotary --config")]
    argv = shlex.split(line, comments=True)[1:]
    plot = argv.index("--plot") + 1
    argv[plot] = str(tmp_path / argv[plot])
    monkeypatch.chdir(ROOT)  # the page's path is relative to the repository
    status, out, err = run_cli(argv, capsys)
    assert status == 0, err
    assert (tmp_path / "wavelengths.png").stat().st_size > 1000
    measured = {
        cells[0]: cells[1:]
        for cells in map(str.split, out.splitlines())
        if cells[:1] in (["float32"], ["bfloat16"], ["float16"])
    }
    prose = " ".join(readme.split())
    claim = re.search(
        r"angles formed in float32 off by (\S+) rad, in bf16 by up to pi, float16 positions overflow; selfattn's "
        r"float64 angles rounded once: (\S+) \(float32\), (\S+) \(bf16\), (\S+) \(float16\)",
        prose,
    )
    assert claim is not None, "the README's sentence on the measured angle errors changed; update this test"
    float32_formed, float32_ours, bf16_ours, float16_ours = (float(value) for value in claim.groups())
    assert float(measured["float32"][0]) == pytest.approx(float32_formed, rel=0.01)
    assert float(measured["bfloat16"][0]) == pytest.approx(math.pi, rel=0.01)
    assert measured["float16"][0] == "overflow"
    for dtype, said in (("float32", float32_ours), ("bfloat16", bf16_ours), ("float16", float16_ours)):
        assert float(measured[dtype][1]) == pytest.approx(said, rel=0.02), dtype


def test_angle_errors_at_far_positions_are_selfattn_s_not_the_reference_s():
    """The reference was position * frequency in float64, itself 1e-4 rad off at 2**40 and 0.7 rad at 2**53: the
    table showed its error (9.5e-5 and 0.98 for float32). Checked here against 50-digit mpmath angles."""
    import mpmath
    import torch

    from selfattn.functional._rotary import _rotate_by_positions

    rope = RotaryPositionalEncoding(4, interleaved=False)
    frequencies, _ = rope.frequencies_at(2**40)
    sampled = torch.arange(2**40 - 4096, 2**40, 512)  # (8,)
    unit = torch.tensor([[1.0, 1.0, 0.0, 0.0]]).expand(sampled.shape[0], 4)
    rotated = _rotate_by_positions(unit.float(), sampled, frequencies, interleaved=False, rotary_dim=4).double()
    read_back = torch.atan2(rotated[:, 2:], rotated[:, :2])  # (8, 2)
    mpmath.mp.dps = 50
    worst = 0.0
    for i, position in enumerate(sampled.tolist()):
        for j, frequency in enumerate(frequencies.tolist()):
            exact = mpmath.mpf(position) * mpmath.mpf(frequency)  # the float64 frequency, exactly
            difference = (mpmath.mpf(read_back[i, j].item()) - exact + mpmath.pi) % (2 * mpmath.pi) - mpmath.pi
            worst = max(worst, abs(float(difference)))
    measured = {e["dtype"]: e for e in angle_errors(rope, 2**40)}["float32"]["selfattn"]
    assert worst <= measured < 5e-6  # the table's largest over 4,096 positions covers the sampled ones
