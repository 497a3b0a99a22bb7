"""Training runs: resume after an interruption gives the same numbers; the grid and its outputs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from study_settings import TINY

from selfattn.study.runner import Grid, run_study, summarize
from selfattn.study.tasks import BOS, PAD, get_task
from selfattn.study.training import RunSpec, train_run, training_batch

SHORT = replace(TINY, steps=12)


class _Stop(Exception):
    pass


def _stop_at(step_to_stop: int):  # type: ignore[no-untyped-def]
    def on_step(step: int, loss: float) -> None:
        if step == step_to_stop:
            raise _Stop

    return on_step


@pytest.mark.parametrize("encoding", ["learned", "shaw"])
def test_resumed_run_equals_uninterrupted(tmp_path: Path, encoding: str) -> None:
    spec = RunSpec("copy", encoding, 3)
    whole = train_run(spec, SHORT)
    checkpoint = tmp_path / "run.pt"
    with pytest.raises(_Stop):
        train_run(spec, SHORT, checkpoint=checkpoint, checkpoint_seconds=0.0, on_step=_stop_at(7))
    assert (
        torch.load(checkpoint, weights_only=True)["step"] == 6
    )  # saved after step 6, stopped during step 7's callback
    resumed = train_run(spec, SHORT, checkpoint=checkpoint, checkpoint_seconds=0.0)
    assert resumed["loss_curve"] == pytest.approx(whole["loss_curve"], rel=1e-6, abs=1e-9)
    for n, accuracy in whole["accuracy_by_length"].items():
        assert resumed["accuracy_by_length"][n] == pytest.approx(accuracy, abs=1e-6)
    # A finished checkpoint is not trained again.
    again = train_run(spec, SHORT, checkpoint=checkpoint, on_step=_stop_at(1))
    assert again["loss_curve"] == resumed["loss_curve"]


def test_randomized_positions_run_and_errors() -> None:
    run = train_run(RunSpec("copy", "rotary", 0, True), replace(TINY, steps=3))
    assert run["randomized_positions"] is True and len(run["accuracy_by_length"]) == 8
    with pytest.raises(ValueError, match="randomized positions apply to sinusoidal, learned, rotary, not 'alibi'"):
        train_run(RunSpec("copy", "alibi", 0, True), TINY)
    with pytest.raises(ValueError, match="encoding must be one of"):
        train_run(RunSpec("copy", "rotary2d", 0), TINY)
    with pytest.raises(ValueError, match="seeds must be a positive integer"):
        Grid(("copy",), ("none",), 0)
    with pytest.raises(ValueError, match="task must be one of"):
        Grid(("parity",), ("none",), 1)
    with pytest.raises(ValueError, match="randomized positions need one of"):
        Grid(("copy",), ("alibi",), 1, randomized_positions=True)


def test_summarize_means_spread_and_half_point() -> None:
    def run(seed: int, acc: list[float]) -> dict:
        return {
            "steps": 100 + 50 * seed,
            "task": "copy",
            "encoding": "rotary",
            "randomized_positions": False,
            "seed": seed,
            "train_max_len": 2,
            "accuracy_by_length": {str(i + 1): a for i, a in enumerate(acc)},
        }

    summary = summarize([run(0, [1.0, 1.0, 0.6, 0.2]), run(1, [1.0, 0.8, 0.2, 0.0])])["copy"]["rotary"]
    assert summary["in_distribution"] == pytest.approx(0.95)
    assert summary["beyond"] == pytest.approx(0.25)
    assert summary["spread"]["in_distribution"] == pytest.approx(0.0707106781, rel=1e-6)
    assert summary["below_half_at"] == 3 and summary["seeds"] == 2
    assert summary["steps"] == 125


def test_interrupted_grid_resumes_without_redoing_finished_runs(tmp_path: Path) -> None:
    grid = Grid(("copy",), ("none", "alibi"), 1)
    config = replace(TINY, steps=8)
    whole = run_study(tmp_path / "whole", grid, config, deep_stack=False, report=False)
    assert whole is not None

    class Bars:
        def __init__(self, specs, steps):  # type: ignore[no-untyped-def]
            self.runs = 0

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return False

        def start_run(self, spec, done):  # type: ignore[no-untyped-def]
            self.runs += 1
            self.done = done
            started.append((spec.key, done))

        def step(self, step, loss):  # type: ignore[no-untyped-def]
            if self.runs == 2 and step == 5:
                raise KeyboardInterrupt

        def end_run(self, finished_steps: int) -> None:
            assert finished_steps == 8 * self.runs

    out = tmp_path / "cut"
    started: list[tuple[str, int]] = []
    with pytest.raises(KeyboardInterrupt):
        run_study(out, grid, config, deep_stack=False, report=False, progress=Bars, checkpoint_seconds=0.0)
    assert not (out / "results.json").exists()
    first = (out / "runs" / "copy-none-s0.json").stat().st_mtime_ns
    resumed = run_study(out, grid, config, resume=True, deep_stack=False, report=False, progress=Bars)
    assert resumed is not None
    assert started[2:] == [("copy-alibi-s0", 4)]  # only the unfinished run, from its last checkpoint
    assert (out / "runs" / "copy-none-s0.json").stat().st_mtime_ns == first
    for a, b in zip(whole["runs"], resumed["runs"], strict=True):
        assert a["accuracy_by_length"] == pytest.approx(b["accuracy_by_length"], abs=1e-6)
    assert resumed["summary"] == whole["summary"]
    for key in ("copy-none-s0", "copy-alibi-s0"):  # accuracy is near 0 after 8 steps: compare the losses too
        cut_losses = json.loads((out / "runs" / f"{key}.json").read_text())["loss_curve"]
        whole_losses = json.loads((tmp_path / "whole" / "runs" / f"{key}.json").read_text())["loss_curve"]
        assert cut_losses == pytest.approx(whole_losses, rel=1e-6)
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) == {"config", "runs", "summary", "deep_stack"}
    assert set(saved["runs"][0]) >= {
        "task",
        "encoding",
        "seed",
        "randomized_positions",
        "steps",
        "train_max_len",
        "accuracy_by_length",
        "train_seconds",
    }
    # Resuming with other settings is refused.
    with pytest.raises(ValueError, match="steps differ"):
        run_study(out, grid, replace(config, steps=9), resume=True, deep_stack=False, report=False)


def test_loss_by_tenth_means_each_tenth() -> None:
    from selfattn.study.training import _loss_by_tenth

    assert _loss_by_tenth([float(i) for i in range(20)]) == [i * 2 + 0.5 for i in range(10)]
    assert _loss_by_tenth([4.0, 2.0, 0.0]) == [4.0, 2.0, 0.0]  # fewer than ten steps: one part per step
    assert _loss_by_tenth([]) == []


def test_report_explains_cells_below_95_percent(tmp_path: Path) -> None:
    """The shortfall table shows the measured numbers, and the why-sentences follow them."""
    from selfattn.study.report import write_report

    def run(encoding: str, seed: int, acc: list[float], tokens: list[float], tenths: list[float]) -> dict:
        return {
            "task": "copy",
            "encoding": encoding,
            "randomized_positions": False,
            "seed": seed,
            "train_max_len": 2,
            "steps": 10,
            "train_seconds": 1.0,
            "accuracy_by_length": {str(i + 1): a for i, a in enumerate(acc)},
            "token_accuracy_by_length": {str(i + 1): a for i, a in enumerate(tokens)},
            "loss_by_tenth": tenths,
        }

    runs = [
        run("none", 0, [1.0, 0.5, 0.0, 0.0], [1.0, 0.9, 0.5, 0.1], [2.0, 1.0, 0.80]),  # still falling, mostly right
        run("none", 1, [1.0, 0.3, 0.0, 0.0], [1.0, 0.7, 0.4, 0.1], [2.0, 1.0, 0.90]),
        run("alibi", 0, [0.9, 0.1, 0.0, 0.0], [0.95, 0.4, 0.1, 0.0], [2.0, 1.0, 0.99]),  # flat loss, mostly wrong
        run("rotary", 0, [1.0, 1.0, 0.5, 0.0], [1.0, 1.0, 0.8, 0.2], [2.0, 1.0, 1.0]),  # at 100%: no row
    ]
    results = {
        "config": {"train_len": 2, "eval_factor": 2, "eval_samples": 4, "tasks": ["copy"], "encodings": ["none"]}
        | dict.fromkeys(("seeds", "num_layers", "num_hiddens", "num_heads", "steps", "batch_size"), 1),
        "runs": runs,
        "summary": summarize(runs),
    }
    page = write_report(tmp_path, results).read_text()
    table = page[page.index("Below 95%") : page.index("Why, as far")]
    assert "copy / none" in table and "copy / alibi" in table and "copy / rotary" not in table
    assert "40.0%" in table and "80.0%" in table  # none at n=2: exact match mean(0.5, 0.3), tokens mean(0.9, 0.7)
    assert "1.000 / 0.850" in table and "1.000 / 0.990" in table  # loss over the last two tenths, mean over seeds
    assert "75.0%, 65.0%" in table  # none per seed over lengths 1..2: mean(1.0, 0.5), mean(1.0, 0.3)
    why = page[page.index("Why, as far") : page.index("<h2>Relative")]
    assert "In copy / none, at least 80%" in why
    assert "In copy / none, the training loss was still falling" in why


def test_report_page_is_the_template_file_beside_the_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """study.html comes from study/templates/study.html.j2 (shipped as package data), not from a string in the code."""
    import shutil

    from selfattn.study import report

    templates = tmp_path / "templates"
    shutil.copytree(report._TEMPLATES, templates)
    page = templates / "study.html.j2"
    page.write_text(page.read_text(encoding="utf-8").replace("<title>selfattn study</title>", "<title>edited</title>"))
    monkeypatch.setattr(report, "_TEMPLATES", templates)
    runs = [
        {
            "task": "copy",
            "encoding": "none",
            "randomized_positions": False,
            "seed": 0,
            "train_max_len": 1,
            "steps": 1,
            "train_seconds": 1.0,
            "accuracy_by_length": {"1": 1.0, "2": 0.0},
        }
    ]
    results = {
        "config": {"train_len": 1, "eval_factor": 2, "eval_samples": 1, "tasks": ["copy"], "encodings": ["none"]}
        | dict.fromkeys(("seeds", "num_layers", "num_hiddens", "num_heads", "steps", "batch_size"), 1),
        "runs": runs,
        "summary": summarize(runs),
    }
    html = report.write_report(tmp_path / "out", results).read_text()
    assert "<title>edited</title>" in html and "<h3>copy</h3>" in html


def _answer_lengths(targets: torch.Tensor) -> list[int]:
    return (targets != -100).sum(dim=1).tolist()


def test_training_batch_mixes_lengths_and_is_a_function_of_the_step() -> None:
    config = replace(TINY, batch_size=64, train_len=9, mixed_lengths=True)
    task = get_task("copy")
    spec = RunSpec("copy", "rotary", 5, randomized_positions=True)
    tokens, targets, positions = training_batch(task, spec, config, 3, 50)
    lengths = _answer_lengths(targets)  # copy: the answer is as long as the input
    assert len(lengths) == 64 and min(lengths) >= 1 and max(lengths) <= 9
    assert len(set(lengths)) > 4  # 64 draws from U(1, 9)
    # Right padding: every row starts with BOS and holds exactly 2 * length + 2 tokens.
    assert (tokens[:, 0] == BOS).all()
    assert ((tokens != PAD).sum(dim=1) == 2 * torch.tensor(lengths) + 2).all()
    assert positions is not None and positions.shape == tokens.shape
    assert (positions.diff(dim=1) > 0).all() and int(positions.min()) >= 0 and int(positions.max()) < 50
    # One draw per sequence, not one for the whole batch (Ruoss et al. draw per sample).
    assert len({tuple(row) for row in positions.tolist()}) == 64
    again = training_batch(task, spec, config, 3, 50)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], targets) and torch.equal(again[2], positions)
    assert not torch.equal(training_batch(task, spec, config, 4, 50)[1], targets)


def test_training_batch_with_one_length_per_step() -> None:
    config = replace(TINY, batch_size=8, train_len=9, mixed_lengths=False)
    task = get_task("reverse")
    seen = set()
    for step in range(6):
        tokens, targets, positions = training_batch(task, RunSpec("reverse", "none", 0), config, step, 50)
        lengths = set(_answer_lengths(targets))
        assert len(lengths) == 1 and positions is None and (tokens != PAD).all()
        seen |= lengths
    assert len(seen) > 1  # the length changes from step to step


def test_randomized_positions_are_drawn_per_evaluated_sample() -> None:
    """Each evaluated sample gets its own positions: a length's accuracy does not hang on one shared draw."""
    from selfattn.study.tasks import get_task
    from selfattn.study.training import build_model, evaluate_lengths

    spec = RunSpec("copy", "rotary", 0, randomized_positions=True)
    model = build_model(spec, TINY)
    seen: list[tuple[int, ...]] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.extend(tuple(row) for row in kwargs["positions"].reshape(args[0].shape).tolist())

    model.register_forward_pre_hook(record, with_kwargs=True)
    evaluate_lengths(model, get_task("copy"), spec, replace(TINY, eval_samples=6, eval_factor=1, train_len=3))
    by_length: dict[int, set[tuple[int, ...]]] = {}
    for positions in seen:
        by_length.setdefault(len(positions), set()).add(positions)
    assert len(seen) == 3 * 6  # one row of positions per sample
    assert all(len(draws) == 6 for draws in by_length.values())  # every sample of a length its own draw


def test_random_positions_refuse_more_positions_than_the_range() -> None:
    from selfattn.study.training import _random_positions

    with pytest.raises(ValueError, match=r"cannot draw 5 distinct positions from range\(4\)"):
        _random_positions(2, 5, 4, torch.Generator().manual_seed(0))
