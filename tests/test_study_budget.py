"""The training budget: early stops on a check of the training lengths, and the averaged weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from study_settings import TINY
from torch import nn

from selfattn.study import training
from selfattn.study.tasks import VOCAB_SIZE, get_task
from selfattn.study.training import (
    RunSpec,
    StudyConfig,
    check_accuracy,
    evaluate,
    evaluated_weights,
    shaw_max_distance,
    train_run,
)


class _Oracle(nn.Module):
    """Teacher-forced "model" that reads the next token off its input: right everywhere, or wrong everywhere."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift
        self.anchor = nn.Parameter(torch.zeros(()))  # the check asks the parameters for the device

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        following = torch.roll(tokens, -1, dims=1)  # (b, l): the token after each position
        return F.one_hot((following + self.shift) % VOCAB_SIZE, VOCAB_SIZE).float()  # (b, l, v)


@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_check_accuracy_of_an_always_right_and_an_always_wrong_model(task: str) -> None:
    spec = RunSpec(task, "none", 0)
    assert check_accuracy(_Oracle(0), get_task(task), spec, TINY) == 1.0
    assert check_accuracy(_Oracle(1), get_task(task), spec, TINY) == 0.0


def test_run_stops_at_the_first_check_that_reaches_stop_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scripted = iter([0.5, 0.995, 1.0])
    monkeypatch.setattr(training, "check_accuracy", lambda *args: next(scripted))
    monkeypatch.setattr(training, "check_beyond", lambda *args: 0.25)
    spec, config = RunSpec("copy", "rotary", 0), replace(TINY, steps=50, check_every=5, stop_at=0.99)
    checkpoint = tmp_path / "run.pt"
    run = train_run(spec, config, checkpoint=checkpoint)
    assert (run["steps"], run["scheduled_steps"]) == (10, 50)
    assert run["checks"] == [[5, 0.5, 0.25], [10, 0.995, 0.25]]
    assert len(run["loss_curve"]) == 10

    def never(step: int, loss: float) -> None:
        raise AssertionError(f"a stopped run trained again (step {step})")

    again = train_run(spec, config, checkpoint=checkpoint, on_step=never)
    assert again["steps"] == 10 and again["accuracy_by_length"] == run["accuracy_by_length"]


def test_compute_matched_by_default_every_step_runs_and_checks_only_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early stop by default: a run that learned at the first check still trains every step, and the
    checks record accuracy in range and past L over training, with the early-stopping reading beside."""
    assert StudyConfig().stop_at is None
    scripted = iter([0.5, 0.995, 1.0])
    monkeypatch.setattr(training, "check_accuracy", lambda *args: next(scripted))
    monkeypatch.setattr(training, "check_beyond", lambda *args: 0.125)
    run = train_run(RunSpec("copy", "none", 0), replace(TINY, steps=17, check_every=5))
    assert run["steps"] == 17 and len(run["loss_curve"]) == 17
    assert run["checks"] == [[5, 0.5, 0.125], [10, 0.995, 0.125], [15, 1.0, 0.125]]
    assert run["steps_to_learn"] == 10  # what an early stop at 0.99 would have taken


def test_check_beyond_measures_lengths_past_l_spread_to_eval_len() -> None:
    config = replace(TINY, train_len=4, eval_factor=5, check_beyond_lengths=4)
    assert training.check_lengths_beyond(config) == [5, 10, 15, 20]
    assert training.check_lengths_beyond(replace(config, check_beyond_lengths=40)) == list(range(5, 21))
    spec = RunSpec("copy", "none", 0)
    assert training.check_beyond(_Oracle(0), get_task("copy"), spec, config) == 1.0
    assert training.check_beyond(_Oracle(1), get_task("copy"), spec, config) == 0.0
    assert training.check_beyond(_Oracle(0), get_task("copy"), spec, replace(config, eval_factor=1)) is None


def test_no_check_on_the_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "check_accuracy", lambda *args: 0.0)
    run = train_run(RunSpec("copy", "none", 0), replace(TINY, steps=10, check_every=5))
    assert [check[0] for check in run["checks"]] == [5]


def test_evaluated_model_is_the_exponential_average_of_the_trained_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: dict[str, nn.Module] = {}
    build = training.build_model

    def build_and_keep(spec: RunSpec, config: StudyConfig, position_options: Any = None) -> Any:
        built["model"] = build(spec, config, position_options)
        return built["model"]

    monkeypatch.setattr(training, "build_model", build_and_keep)
    trajectory: list[dict[str, torch.Tensor]] = []

    def record(step: int, loss: float) -> None:
        trajectory.append({k: p.detach().clone() for k, p in built["model"].named_parameters()})

    spec, config = RunSpec("reverse", "t5", 1), replace(TINY, steps=7, ema_decay=0.7, stop_at=None)
    checkpoint = tmp_path / "run.pt"
    run = train_run(spec, config, checkpoint=checkpoint, on_step=record)
    # Independent reference: start at the weights after the first step, then mix 30% of each later step in.
    expected = dict(trajectory[0])
    for weights in trajectory[1:]:
        expected = {k: 0.7 * expected[k] + 0.3 * weights[k] for k in expected}
    averaged = evaluated_weights(checkpoint)
    assert set(averaged) >= set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(averaged[key], value, rtol=1e-5, atol=1e-7)
    assert not torch.equal(averaged["embedding.weight"], trajectory[-1]["embedding.weight"])
    model = build(spec, config)
    model.load_state_dict(averaged)
    assert evaluate(model, get_task("reverse"), spec, config) == run["accuracy_by_length"]


def test_a_checkpoint_from_another_averaging_setting_is_refused(tmp_path: Path) -> None:
    spec, checkpoint = RunSpec("copy", "none", 0), tmp_path / "run.pt"
    train_run(spec, replace(TINY, steps=3, ema_decay=None), checkpoint=checkpoint)
    assert evaluated_weights(checkpoint).keys() == torch.load(checkpoint, weights_only=True)["model"].keys()
    with pytest.raises(ValueError, match="another ema_decay setting"):
        train_run(spec, replace(TINY, steps=3, ema_decay=0.9), checkpoint=checkpoint)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop_at", 0.0, r"stop_at must be in \(0, 1\] or None, got 0.0"),
        ("stop_at", 1.5, r"stop_at must be in \(0, 1\] or None, got 1.5"),
        ("ema_decay", 1.0, r"ema_decay must be in \[0, 1\) or None, got 1.0"),
        ("ema_decay", -0.1, r"ema_decay must be in \[0, 1\) or None, got -0.1"),
        ("check_every", 0, "check_every must be a positive integer, got 0"),
        ("check_samples", 2.5, "check_samples must be a positive integer, got 2.5"),
        ("learned_at", 1.5, r"learned_at must be in \(0, 1\], got 1.5"),
        ("check_beyond_lengths", 0, "check_beyond_lengths must be a positive integer, got 0"),
    ],
)
def test_bad_budget_settings_are_errors(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(TINY, **{field: value})


def test_shaw_clip_covers_every_offset_a_scored_query_sees_in_training() -> None:
    config = StudyConfig()
    assert shaw_max_distance("copy", config) == 40  # BOS, 20 inputs, SEP, 20 answers: the last answer is not scored
    model = training.build_model(RunSpec("reverse", "shaw", 0), config)
    assert model.encoding.max_distance == 40  # type: ignore[union-attr]
    assert training.build_model(RunSpec("reverse", "shaw", 0), replace(config, train_len=5)).encoding.max_distance == 10  # type: ignore[union-attr]
