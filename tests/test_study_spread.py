"""Spreads over seeds: the 95% interval, the rule that claims a difference, the defaults and the code version."""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

import pytest

from selfattn.study.options import study_settings, text_settings
from selfattn.study.provenance import code_version, code_versions, mixed_versions_warning
from selfattn.study.runner import summarize
from selfattn.study.spread import best_and_ties, differs, interval95, prediction95, t_quantile_975
from selfattn.study.summary import summary_lines
from selfattn.study.text_tables import summarize_text, text_table


def test_interval_is_t_times_the_standard_error() -> None:
    values = [0.2, 0.5, 0.3, 0.4, 0.9]
    sd = math.sqrt(sum((v - 0.46) ** 2 for v in values) / 4)  # sample sd, written out
    found = interval95(values)
    assert found["mean"] == pytest.approx(0.46) and found["sd"] == pytest.approx(sd)
    assert found["half_width"] == pytest.approx(2.776 * sd / math.sqrt(5))
    assert interval95([0.7])["half_width"] is None  # one seed: no interval


def test_a_new_runs_interval_is_wider_than_the_means_by_sqrt_of_n_plus_one() -> None:
    values = [0.2, 0.5, 0.3, 0.4, 0.9]
    sd = math.sqrt(sum((v - 0.46) ** 2 for v in values) / 4)
    found = prediction95(values)
    assert found is not None
    assert found["high"] == pytest.approx(0.46 + 2.776 * sd * math.sqrt(1.2))
    assert found["low"] == pytest.approx(0.46 - 2.776 * sd * math.sqrt(1.2))
    assert prediction95([0.7]) is None  # one seed predicts no spread


def test_t_quantile_past_the_table_is_close_to_the_true_value() -> None:
    assert t_quantile_975(40) == pytest.approx(2.021, abs=2e-3)  # tables: 2.021 at 40, 1.984 at 100
    assert t_quantile_975(100) == pytest.approx(1.984, abs=2e-3)
    with pytest.raises(ValueError, match="degrees_of_freedom must be a positive integer, got 0"):
        t_quantile_975(0)


def test_differs_only_outside_the_spread() -> None:
    low, high = [4.30, 4.31, 4.32], [4.40, 4.41, 4.42]
    assert differs(low, high) and differs(high, low)
    # Means 0.02 apart, seeds spread over 0.1: inside the spread, no difference claimed.
    assert not differs([4.30, 4.35, 4.40], [4.32, 4.37, 4.42])
    # One seed per side: however far apart, there is no spread to compare with.
    assert not differs([1.0], [9.0])
    with pytest.raises(ValueError, match="values must be finite numbers"):
        differs([float("nan"), 1.0], [1.0, 2.0])


def test_best_and_ties() -> None:
    cells = {"a": [4.30, 4.31, 4.32], "b": [4.29, 4.36, 4.31], "c": [4.60, 4.61, 4.62]}
    assert best_and_ties(cells, higher_is_better=False) == ("a", ["b"])
    assert best_and_ties(cells, higher_is_better=True) == ("c", [])


def test_default_seeds_are_five_synthetic_and_three_text() -> None:
    grid, _ = study_settings()
    _, text_seeds, _ = text_settings()
    assert (grid.seeds, text_seeds) == (5, 3)
    assert study_settings(quick=True)[0].seeds == 1


def _synthetic_runs(beyond: dict[str, list[float]], versions: list[str]) -> list[dict[str, object]]:
    runs: list[dict[str, object]] = []
    for encoding, values in beyond.items():
        for seed, value in enumerate(values):
            accuracy = {"1": 1.0, "2": 1.0, "3": value, "4": value}
            runs.append({"task": "copy", "encoding": encoding, "seed": seed, "randomized_positions": False,
                         "train_max_len": 2, "accuracy_by_length": accuracy, "steps": 10,
                         "code_version": versions[seed % len(versions)]})  # fmt: skip
    return runs


def test_summary_lines_print_intervals_and_claim_no_tie_breaks(tmp_path: Path) -> None:
    runs = _synthetic_runs({"alibi": [0.50, 0.52, 0.48], "kerple": [0.47, 0.55, 0.45], "rotary": [0.0, 0.01, 0.02]},
                           ["abc"])  # fmt: skip
    results = {"config": {"train_len": 2, "code_versions": code_versions(runs)}, "runs": runs,
               "summary": summarize(runs)}  # fmt: skip
    text = "\n".join(summary_lines(results, tmp_path))
    half = 4.303 * statistics.stdev([0.50, 0.52, 0.48]) / math.sqrt(3)
    assert f"alibi 100.0 ± 0.0% / 50.0 ± {100 * half:.1f}%" in text
    assert "best beyond the training lengths: alibi; not told apart from it by the seeds: kerple" in text
    assert "WARNING" not in text


def test_a_summary_whose_encodings_the_seeds_do_not_tell_apart_names_no_best(tmp_path: Path) -> None:
    """With every encoding at 0% (a quick run) the first label stood as best: "best ...: none" read as no best."""
    runs = _synthetic_runs({"none": [0.0, 0.0], "alibi": [0.0, 0.0]}, ["abc"])
    results = {"config": {"train_len": 2, "code_versions": ["abc"]}, "runs": runs, "summary": summarize(runs)}
    text = "\n".join(summary_lines(results, tmp_path))
    assert "the seeds tell no encoding apart from the others" in text and "best beyond" not in text


def test_runs_from_two_code_versions_are_named_in_a_warning(tmp_path: Path) -> None:
    runs = _synthetic_runs({"alibi": [0.5, 0.5]}, ["abc", "def"])
    versions = code_versions(runs)
    assert versions == ["abc", "def"] and mixed_versions_warning(["abc"]) is None
    results = {"config": {"train_len": 2, "code_versions": versions}, "runs": runs, "summary": summarize(runs)}
    assert "WARNING: these runs come from 2 code versions (abc, def)" in "\n".join(summary_lines(results, tmp_path))
    assert code_versions([{}]) == ["unrecorded"]


def test_code_version_is_the_checkouts_commit() -> None:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert code_version().split("+")[0] == head.stdout.strip()


def _text_run(encoding: str, seed: int, perplexity: float) -> dict[str, object]:
    cell = {"perplexity": perplexity, "beyond": None}
    return {"encoding": encoding, "seed": seed, "skipped": {}, "perplexity_by_length": {"64": cell}, "scalings": {}}


def test_text_table_prints_intervals_and_ties() -> None:
    values = {"rotary": [4.33, 4.32, 4.34], "t5": [4.30, 4.31, 4.32], "alibi": [4.73, 4.73, 4.74]}
    runs = [_text_run(name, seed, v) for name, seeds in values.items() for seed, v in enumerate(seeds)]
    results = {"config": {"train_len": 64, "eval_factors": [1], "code_versions": ["abc"]}, "runs": runs,
               "summary": summarize_text(runs)}  # fmt: skip
    table = "\n".join(text_table(results))
    half = 4.303 * statistics.stdev(values["t5"]) / math.sqrt(3)
    assert f"| t5 | 4.310 ± {half:.3f} |" in table
    assert "Lowest at 64: t5; its 95% interval overlaps rotary (no difference claimed)." in table


def test_text_table_names_encodings_with_more_seeds_than_the_grid() -> None:
    values = {"rotary": [4.33, 4.32, 4.34], "alibi": [4.41, 4.41, 4.41, 4.40, 4.38]}
    runs = [_text_run(name, seed, v) for name, seeds in values.items() for seed, v in enumerate(seeds)]
    config = {"train_len": 64, "eval_factors": [1], "code_versions": ["abc"]}
    uneven = {"config": {**config, "seeds_by_encoding": {"rotary": 3, "alibi": 5}}, "runs": runs,
              "summary": summarize_text(runs)}  # fmt: skip
    assert "Seeds: 3 per encoding, except alibi 5." in text_table(uneven)
    even = {**uneven, "config": {**config, "seeds_by_encoding": {"rotary": 3, "alibi": 3}}}
    assert not any(line.startswith("Seeds:") for line in text_table(even))


def test_the_report_names_no_best_where_the_summary_names_none(tmp_path: Path) -> None:
    """study.html said "Best beyond the training lengths: none; not told apart from it by the seeds: alibi" (the
    first label) where the terminal's summary, from the same results, names no best."""
    from selfattn.study.report import _cell_texts

    tied = _synthetic_runs({"none": [0.0, 0.0], "alibi": [0.0, 0.0]}, ["abc"])
    _, ties = _cell_texts(summarize(tied))
    assert set(ties.values()) == {"Beyond the training lengths the seeds tell no encoding apart from the others."}
    apart = _synthetic_runs({"alibi": [0.50, 0.52, 0.48], "rotary": [0.0, 0.01, 0.02]}, ["abc"])
    _, ties = _cell_texts(summarize(apart))
    assert set(ties.values()) == {"Best beyond the training lengths: alibi; every other differs."}
