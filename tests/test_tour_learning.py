"""The tour's trained and timed experiments: each finds what it should, and each can fail.

A test that cannot fail is a defect: the offset experiment is run with P's rows shuffled (no
position to attend by) and with P a twentieth of its size (the claims that read it then fail), the
"not harmful" experiment with a P thirty times too large.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from selfattn.functional import sinusoidal_table
from selfattn.tour import checks, harmless, offset, parallel
from selfattn.tour.claims import positions


@pytest.fixture(scope="module")
def offset_runs():
    return offset.attend_by_offset(max_train_steps=150, eval_samples=256)


def test_one_layer_with_p_learns_to_attend_by_offset(offset_runs):
    run = offset_runs["variants"]["sinusoidal"]
    assert run["steps_to_target"] is not None and run["steps_to_target"] <= 150
    assert run["accuracy"] > 0.85
    assert run["weight_on_offset"] > 0.3  # most of its attention sits on key i - delta
    assert run["position_r2"] > 0.5  # a probe reads each token's position off the trained layer's output


def test_without_p_or_with_shuffled_rows_it_cannot(offset_runs):
    for name in ("none", "shuffled"):
        run = offset_runs["variants"][name]
        assert run["steps_to_target"] is None, name
        assert run["accuracy"] < 0.5, name
        # Spread over the keys as if position did not exist: about 1/n on key i - delta.
        assert run["weight_on_offset"] < 2 / offset_runs["config"]["num_steps"], name
        assert run["position_r2"] < 0.1, name  # nothing in the output says where a token sits


def _by_id(found):
    return {c["id"]: c for c in found}


def _offset_claims(runs, with_pe_change):
    results = {
        "permutation": {"with_pe_change": with_pe_change},
        "relative": {"fitted_rotation": {"residual_max": 0.0}},  # the identity of P the shift claim also cites
        "learning": {"offset": runs},
    }
    return _by_id(positions._offset_claims(results))


def test_the_offset_claims_fail_when_p_is_scaled_down_to_a_twentieth(offset_runs):
    base = offset_runs
    # The same layer, task and steps, with P / 20: the tokens keep almost no position to attend by.
    faint = offset.attend_by_offset(
        max_train_steps=150, eval_samples=256, position_scale=0.05, variants=("sinusoidal",)
    )
    changed = copy.deepcopy(base)
    changed["variants"]["sinusoidal"] = faint["variants"]["sinusoidal"]
    with_p = checks.permutation_check()["with_pe_change"]
    faint_rows = checks.permutation_check(position_rows=0.05 * sinusoidal_table(10, 32, dtype=torch.float64))
    before = _offset_claims(base, with_p)
    after = _offset_claims(changed, faint_rows["with_pe_change"])
    for name in ("attend-by-relative", "shift-by-five", "remember-position", "inject-position"):
        assert before[name]["evidence"] == after[name]["evidence"] == "measured", name
        assert before[name]["holds"] is True and after[name]["holds"] is False, (name, after[name]["number"])
    assert faint["variants"]["sinusoidal"]["position_r2"] < 0.5 <= base["variants"]["sinusoidal"]["position_r2"]


def test_offset_experiment_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"delta must be in 1\.\.num_steps - 1 = 15, got 16"):
        offset.attend_by_offset(delta=16)
    with pytest.raises(ValueError, match="variants must be among"):
        offset.attend_by_offset(variants=("learned",))


def test_majority_task_labels_the_unique_most_frequent_token():
    tokens, labels = harmless.majority_task(50, 16, 8, torch.Generator().manual_seed(3))
    assert tokens.shape == (50, 16) and labels.shape == (50,)
    for row, label in zip(tokens.tolist(), labels.tolist(), strict=True):
        (top, count), (_, second) = collections.Counter(row).most_common(2)
        assert top == label and count > second
    with pytest.raises(ValueError, match="vocab_size=2 is too small"):
        harmless.majority_task(4, 16, 2, torch.Generator())


def test_adding_p_costs_nothing_on_a_task_without_position_unless_p_drowns_the_tokens():
    fair = harmless.with_and_without_p(train_steps=60, eval_samples=256)
    assert fair["without_p"]["accuracy"] > 0.9
    assert fair["with_p"]["accuracy"] >= fair["without_p"]["accuracy"] - 0.02
    drowned = harmless.with_and_without_p(train_steps=60, eval_samples=256, position_scale=30.0)
    assert drowned["with_p"]["accuracy"] < drowned["without_p"]["accuracy"] - 0.2  # the measurement can say harm


def test_thread_timing_reports_every_layer_and_checks_its_counts():
    # No timing is asserted (speed is measured by benchmarks/, never by tests): only the bookkeeping.
    data = parallel.thread_speedup(num_steps=32, num_hiddens=8, repeats=1, rounds=1, threads=(1,), wait=lambda s: None)
    assert data["threads"] == [1]
    assert set(data["speedup"]) == {"cnn", "rnn", "self_attention"}
    assert all(values == [1.0] for values in data["speedup"].values())
    assert len(data["load"]) == 2 and isinstance(data["quiet"], bool)
    with pytest.raises(ValueError, match="threads must start at 1"):
        parallel.thread_speedup(threads=(2,))
