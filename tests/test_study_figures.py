"""The study's figures: perplexity against position (log scales) and context gain against position, drawn to files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from selfattn.study import figures
from selfattn.study.text_tables import summarize_context_gain, summarize_text, text_figures


def _run(encoding: str, seed: int, scale: float) -> dict[str, Any]:
    bands = [(0, 16), (16, 64), (64, 256)]
    by_position = [{"start": a, "stop": b, "perplexity": scale * (1 + i)} for i, (a, b) in enumerate(bands)]
    cells = {"64": {"perplexity": scale, "beyond": None, "by_position": by_position[:2]},
             "256": {"perplexity": scale, "beyond": scale, "by_position": by_position}}  # fmt: skip
    gain = [{"start": 64, "stop": 256, "gain": 0.01 * seed, "gain_se": 0.0, "windows": 4}]
    return {"encoding": encoding, "seed": seed, "skipped": {}, "perplexity_by_length": cells, "scalings": {},
            "context_gain": gain}  # fmt: skip


def _results() -> dict[str, Any]:
    runs = [_run(name, seed, scale) for name, scale in (("rotary", 4.0), ("alibi", 4.5)) for seed in range(3)]
    return {"config": {"train_len": 64}, "summary": summarize_text(runs), "context_gain": summarize_context_gain(runs)}


def test_text_figures_are_written_and_shown_in_the_report(tmp_path: Path) -> None:
    lines = text_figures(_results(), tmp_path / "figures")
    for stem in ("perplexity_by_position", "context_gain"):
        for suffix in (".png", ".svg"):
            assert (tmp_path / "figures" / f"{stem}{suffix}").stat().st_size > 1000
    assert "![Perplexity by position, log scales](figures/perplexity_by_position.png)" in lines
    assert "![Gain from context past L, by position](figures/context_gain.png)" in lines


def test_perplexity_plot_uses_log_scales_and_one_line_per_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: dict[str, Any] = {}

    def keep(fig: Any, folder: Path, stem: str) -> list[str]:
        drawn[stem] = fig.axes[0]
        return [f"{stem}.png"]

    monkeypatch.setattr(figures, "save_figure", keep)
    results = _results()
    figures.perplexity_by_position_figure(results["summary"], 64, tmp_path)
    figures.context_gain_figure(results["context_gain"], 64, tmp_path)
    axes = drawn["perplexity_by_position"]
    assert (axes.get_xscale(), axes.get_yscale()) == ("log", "log")
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["rotary", "alibi"]
    line = axes.get_lines()[0]
    assert list(line.get_ydata()) == pytest.approx([4.0, 8.0, 12.0])  # rotary's bands at the longest length, 256
    gain = drawn["context_gain"].get_lines()[0]
    assert list(gain.get_ydata()) == pytest.approx([0.01])  # mean of 0, 0.01, 0.02 over the seeds
    assert figures.context_gain_figure({}, 64, tmp_path) == []


def test_accuracy_past_l_over_training_is_drawn_from_the_checks(tmp_path: Path) -> None:
    def run(encoding: str, seed: int, checks: list[list[Any]]) -> dict[str, Any]:
        return {"task": "copy", "encoding": encoding, "seed": seed, "randomized_positions": False, "checks": checks}

    tracked = [run("alibi", s, [[250, 0.5, 0.1], [500, 0.9, 0.3 + 0.1 * s]]) for s in range(2)]
    older = [run("rotary", 0, [[250, 0.5]])]  # a run from before the reading past L: left out
    names = figures.training_checks_figure({"runs": tracked + older}, "copy", tmp_path)
    assert names == ["training_copy.png", "training_copy.svg"] and (tmp_path / names[0]).stat().st_size > 1000
    assert figures.training_checks_figure({"runs": older}, "copy", tmp_path / "none") == []


def test_lines_past_one_colour_cycle_still_look_apart() -> None:
    looks = [tuple(sorted(figures._line_look(index).items())) for index in range(60)]
    assert len(set(looks)) == 60
