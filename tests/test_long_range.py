"""``selfattn study --exercises``: the long-range experiment finds what it should and can fail; the runner resumes.

The control: a CNN whose receptive field stops short of distance n cannot see the answer and
stays at chance, while one self-attention layer (path 1) learns it in the same steps.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfattn.study import exercises, long_range
from selfattn.tour import claims

TINY = {"num_hiddens": 16, "budget": 100, "max_steps": 200, "check_every": 50, "eval_samples": 256}


def test_the_answer_is_the_token_at_distance_n():
    tokens, answers = long_range.distance_batch(5, 7, 10, torch.Generator().manual_seed(0))
    assert tokens.shape == (5, 8)
    assert torch.equal(answers, tokens[:, -1 - 7])
    assert [long_range.cnn_depth(n, 3) for n in (1, 2, 3, 8, 32)] == [1, 1, 2, 4, 16]
    assert long_range.cnn_depth(8, 5) == 2


def test_a_cnn_that_cannot_see_that_far_stays_at_chance_where_attention_learns():
    blind = long_range.train_at_distance("cnn", 6, cnn_layers=1, **TINY)  # receptive field 3 < 7
    attention = long_range.train_at_distance("self_attention", 6, **TINY)
    assert blind["receptive_field"] == 3 and blind["steps_to_target"] is None
    assert blind["accuracy"] < 0.25  # chance is 0.1
    assert attention["steps_to_target"] is not None and attention["accuracy"] > 0.9
    assert attention["layers"] == 1 and attention["receptive_field"] is None
    assert [step for step, _ in attention["curve"]] == [50, 100]  # stops once the target is met and the budget spent


def test_long_range_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind must be one of cnn, rnn, self_attention, got 'mlp'"):
        long_range.train_at_distance("mlp", 4)
    with pytest.raises(ValueError, match="distance"):
        long_range.train_at_distance("rnn", 0)
    with pytest.raises(ValueError, match="budget=120 must be a multiple of check_every=50"):
        long_range.train_at_distance("rnn", 4, budget=120)
    with pytest.raises(ValueError, match="kernel_size must be at least 2, got 1"):
        long_range.train_at_distance("cnn", 4, kernel_size=1)
    with pytest.raises(ValueError, match="kind must be one of"):
        long_range.LongRangeModel("mlp", vocab_size=4, num_hiddens=8, max_len=4)


def _run(kind, distance, seed, steps, layers=1):
    return {"kind": kind, "distance": distance, "seed": seed, "steps_to_target": steps, "accuracy_at_budget": 0.5,
            "parameters": 10, "layers": layers}  # fmt: skip


def test_summary_and_claim_follow_the_steps_and_can_say_the_claim_fails():
    runs = [_run("self_attention", 8, 0, 50), _run("self_attention", 8, 1, 100), _run("self_attention", 8, 2, 50),
            _run("rnn", 8, 0, None), _run("rnn", 8, 1, 400), _run("rnn", 8, 2, None),
            _run("cnn", 8, 0, 300, layers=4), _run("cnn", 8, 1, 300, layers=4), _run("cnn", 8, 2, 350, layers=4)]  # fmt: skip
    summary = long_range.summarize_by_distance(runs)
    assert summary["self_attention"]["8"]["steps_to_target"] == pytest.approx(200 / 3)
    assert summary["rnn"]["8"]["reached"] == 1
    settings = {"budget": 100, "target": 0.9, "check_every": 50, "max_steps": 500}
    found = claims.long_range_claim({"settings": settings, "by_distance": summary})
    assert found["evidence"] == "measured" and found["holds"] is True
    slow = [*runs[3:], *(_run("self_attention", 8, seed, 500) for seed in range(3))]
    found = claims.long_range_claim({"settings": settings, "by_distance": long_range.summarize_by_distance(slow)})
    assert (
        found["holds"] is False
        and "n=8: self_attention (path 1) slower than cnn (path 4)" in found["number"]["exceptions"]
    )
    # Slower by more than a check, but inside the seeds' spread: no exception is claimed, nor any pair decided.
    spread = [*runs[3:], *(_run("self_attention", 8, seed, steps) for seed, steps in enumerate((50, 700, 900)))]
    found = claims.long_range_claim({"settings": settings, "by_distance": long_range.summarize_by_distance(spread)})
    assert found["holds"] is False and "exceptions" not in found["number"]
    smoke = claims.long_range_claim({"settings": settings, "by_distance": summary, "quick": True})
    assert smoke["evidence"] == "not shown" and "smoke test" in smoke["basis"]
    absent = claims.long_range_claim(None)
    assert absent["evidence"] == "not shown" and "selfattn study --exercises" in absent["basis"]


TINY_EXERCISES = exercises.ExerciseConfig(
    distances=(2,), seeds=1, long_range={**TINY, "budget": 50, "max_steps": 50},
    depth_encodings=("sinusoidal",), depth_variants=("residual",), depths=(1,),
    by_depth={"max_steps": 50, "check_every": 50, "num_hiddens": 8, "num_heads": 2, "ffn_hiddens": 8, "num_steps": 8},
)  # fmt: skip


def test_exercises_write_each_run_resume_and_refuse_other_settings(tmp_path, monkeypatch):
    results = exercises.run_exercises(tmp_path, TINY_EXERCISES)
    saved = json.loads((tmp_path / "exercises.json").read_text())
    assert saved == json.loads(json.dumps(results))
    assert sorted(p.name for p in (tmp_path / "exercises" / "long_range").iterdir()) == [
        "cnn-n2-s0.json", "rnn-n2-s0.json", "self_attention-n2-s0.json"
    ]  # fmt: skip
    assert results["deep_stack_by_depth"]["stacks"]["sinusoidal"]["residual"][0]["depth"] == 1
    assert results["long_range"]["settings"]["budget"] == 50 and results["long_range"]["chance"] == 0.1
    assert results["quick"] is False
    version = exercises.code_version()
    assert results["code_versions"] == [version]
    assert all(
        json.loads(f.read_text())["code_version"] == version for f in (tmp_path / "exercises").rglob("*-s0.json")
    )
    assert exercises.load_exercises(tmp_path) == saved and exercises.load_exercises(tmp_path / "nothing") is None
    assert any(
        line.startswith("deep stacks (50 steps, patience 4): 3 of 3 train")
        for line in exercises.exercise_lines(results)
    )

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(exercises, "train_at_distance", no_training)
    monkeypatch.setattr(exercises, "trained_by_depth", no_training)
    resumed = exercises.run_exercises(tmp_path, TINY_EXERCISES, resume=True)
    assert resumed["long_range"]["runs"] == results["long_range"]["runs"]
    assert not any(line.startswith("WARNING") for line in exercises.exercise_lines(resumed))
    older = tmp_path / "exercises" / "long_range" / "cnn-n2-s0.json"
    older.write_text(json.dumps({**json.loads(older.read_text()), "code_version": "0000000"}))
    mixed = exercises.run_exercises(tmp_path, TINY_EXERCISES, resume=True)
    assert mixed["code_versions"] == sorted(["0000000", version])
    assert exercises.exercise_lines(mixed)[-1].startswith("WARNING: these runs come from 2 code versions")
    with pytest.raises(ValueError, match=r"--resume: .* other settings \(distances differ\)"):
        exercises.run_exercises(tmp_path, dataclasses.replace(TINY_EXERCISES, distances=(3,)), resume=True)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="cannot write the exercises to"):
        exercises.run_exercises(tmp_path / "a-file" / "x", TINY_EXERCISES)


def test_the_command_line_runs_the_exercises(tmp_path, monkeypatch, capsys):
    from selfattn.cli.main import main

    monkeypatch.setattr(exercises, "QUICK_EXERCISES", TINY_EXERCISES)
    assert main(["study", "--exercises", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "long-range dependency" in capsys.readouterr().out
    assert json.loads((tmp_path / "exercises.json").read_text())["quick"] is True
    assert main(["study", "--exercises", "--tasks", "copy", "--seeds", "2", "--out", str(tmp_path)]) == 2
    assert "--tasks, --seeds apply to the grid only" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()  # the grid's results are not touched


def test_the_cnn_sees_past_the_answer_by_default_so_it_is_not_at_the_edge_of_its_field():
    cnn = long_range.train_at_distance("cnn", 4, **{**TINY, "budget": 50, "max_steps": 50})
    assert cnn["layers"] == long_range.cnn_depth(8, 3) == 4 and cnn["receptive_field"] == 9 > 4 + 1
    edge = long_range.train_at_distance("cnn", 4, cnn_reach=1, **{**TINY, "budget": 50, "max_steps": 50})
    assert edge["receptive_field"] == 5  # the old design: the answer at the field's edge
    with pytest.raises(ValueError, match="cnn_reach must be a positive integer, got 0"):
        long_range.train_at_distance("cnn", 4, cnn_reach=0)


def test_steps_interval_only_when_every_seed_reached_the_target():
    runs = [_run("rnn", 6, 0, 100), _run("rnn", 6, 1, 150), _run("rnn", 6, 2, 125), _run("cnn", 6, 0, 250),
            _run("cnn", 6, 1, None)]  # fmt: skip
    summary = long_range.summarize_by_distance(runs)
    interval = summary["rnn"]["6"]["steps_interval"]
    assert interval["mean"] == 125 and interval["half_width"] == pytest.approx(4.303 * 25 / 3**0.5, rel=1e-3)
    assert summary["cnn"]["6"]["steps_interval"] is None  # a seed never reached it: no interval


def test_exercise_defaults_have_seeds_finer_checks_and_no_plateau_stop():
    config = exercises.ExerciseConfig()
    assert config.seeds == 5 and config.long_range["check_every"] == 25
    assert config.depth_seeds == 3 and config.by_depth["patience"] is None
    keys = [key for key, _ in exercises._by_depth_jobs(config)]
    assert "by_depth/none-residual-d1-s2" in keys and len(keys) == 6 * 2 * 8 * 3


def test_a_stack_on_a_plateau_trains_to_the_step_limit_without_patience(monkeypatch):
    from selfattn.study import deep_stack

    monkeypatch.setattr(deep_stack, "_held_out_accuracy", lambda *args: 0.2)  # a flat curve

    def fit(patience):
        sizes = {"num_hiddens": 8, "num_heads": 2, "ffn_hiddens": 8}
        model = deep_stack._make_stack("none", "residual", 0, depth=1, sizes=sizes, vocab_size=4, causal=False,
                                       num_steps=6)  # fmt: skip
        return deep_stack.train_until_level(model, max_steps=12, num_steps=6, vocab_size=4, seed=0, batch_size=4,
                                            check_every=2, patience=patience, target=1.01)  # fmt: skip

    stopped, full = fit(2), fit(None)
    assert stopped["steps"] == 6 and stopped["levelled_off"]  # the patience rule stops on the plateau
    assert full["steps"] == 12 and not full["levelled_off"]
