"""Exercise 1 (deep stacks): the probes and metrics on known hidden states, and a tiny measurement."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from selfattn.study import deep_stack
from selfattn.study.deep_stack import (
    METRICS,
    DeepStack,
    measure_deep_stack,
    order_accuracy,
    position_r2,
    rank_collapse,
    ridge_fit,
)


def _position_states(b: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Random content, plus one column that is the position itself."""
    h = torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    h[:, :, 0] = torch.arange(n, dtype=torch.float64)
    return h


# Ridge ------------------------------------------------------------------------------------------


def test_ridge_fit_matches_numpy_least_squares_and_ridge():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)) + 3.0
    y = x @ np.array([1.0, -2.0, 0.5, 0.0]) + 7.0 + 0.1 * rng.normal(size=50)
    new = rng.normal(size=(6, 4))
    # Plain least squares with an intercept.
    design = np.hstack([x, np.ones((50, 1))])
    coef = np.linalg.lstsq(design, y, rcond=None)[0]
    got = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), ridge=0.0)(torch.from_numpy(new)).numpy()
    np.testing.assert_allclose(got, np.hstack([new, np.ones((6, 1))]) @ coef, rtol=1e-10, atol=1e-10)
    # Ridge on centred data with lambda = ridge * N * mean(x^2).
    ridge = 0.05
    xc, yc = x - x.mean(0), y - y.mean()
    lam = ridge * 50 * np.mean(x**2)
    w = np.linalg.solve(xc.T @ xc + lam * np.eye(4), xc.T @ yc)
    want = (new - x.mean(0)) @ w + y.mean()
    got = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), ridge=ridge)(torch.from_numpy(new)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_ridge_shrinks_a_signal_below_sqrt_ridge_of_the_features_scale():
    tiny = _position_states(40, 16, 4, seed=1)
    tiny[:, :, 0] *= 1e-6 / 16  # position still there, at 1e-6 of the content's size
    assert position_r2(tiny[:30], tiny[30:], ridge=0.0) == pytest.approx(1.0, abs=1e-6)
    assert abs(position_r2(tiny[:30], tiny[30:], ridge=1e-6)) < 0.05
    tiny[:, :, 0] *= 1e4  # at 1e-2 it is kept
    assert position_r2(tiny[:30], tiny[30:], ridge=1e-6) > 0.99


# Probes -----------------------------------------------------------------------------------------


def test_position_probe_reads_exact_position():
    h = _position_states(10, 12, 6, seed=0)
    assert position_r2(h[:7], h[7:]) == pytest.approx(1.0, abs=1e-6)


def test_position_probe_on_identical_rows_is_zero():
    h = torch.randn(1, 1, 5, dtype=torch.float64).expand(10, 12, 5).clone()
    assert position_r2(h[:7], h[7:]) == pytest.approx(0.0, abs=1e-12)
    assert order_accuracy(h[:7], h[7:]) == 0.5


def test_position_probe_without_position_is_near_zero_on_held_out_data():
    h = torch.randn(40, 12, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert abs(position_r2(h[:30], h[30:])) < 0.1
    assert abs(order_accuracy(h[:30], h[30:]) - 0.5) < 0.1


def test_order_probe_reads_order_from_position():
    h = _position_states(10, 12, 6, seed=2)
    assert order_accuracy(h[:7], h[7:]) == 1.0


def test_order_probe_reads_order_that_is_not_a_linear_position():
    # Order is here, absolute position is not: the rows rise along each sequence from a random start.
    generator = torch.Generator().manual_seed(4)
    start = 100 * torch.randn(30, 1, dtype=torch.float64, generator=generator)
    h = torch.randn(30, 12, 3, dtype=torch.float64, generator=generator)
    h[:, :, 0] = start + torch.arange(12, dtype=torch.float64)
    assert position_r2(h[:20], h[20:]) < 0.2
    assert order_accuracy(h[:20], h[20:]) == 1.0


def test_probe_errors_name_the_argument():
    h = torch.randn(4, 6, 3)
    with pytest.raises(ValueError, match="train must be a"):
        position_r2(h[0], h)
    with pytest.raises(ValueError, match="test must be floating"):
        position_r2(h, torch.ones(4, 6, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        position_r2(h, torch.full((2, 6, 3), float("nan")))
    with pytest.raises(ValueError, match="share"):
        order_accuracy(h, torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="at least 2 positions"):
        position_r2(h[:, :1], h[:, :1])
    with pytest.raises(ValueError, match="at least 2 positions"):
        order_accuracy(h[:, :1], h[:, :1])
    with pytest.raises(ValueError, match="ridge"):
        position_r2(h, h, ridge=-1.0)
    with pytest.raises(ValueError, match="ridge"):
        ridge_fit(torch.randn(5, 2), torch.randn(5), ridge=float("nan"))
    with pytest.raises(ValueError, match="pairs_per_sequence"):
        order_accuracy(h, h, pairs_per_sequence=0)
    with pytest.raises(ValueError, match="must agree"):
        ridge_fit(torch.randn(5, 2), torch.randn(4))


# Rank collapse ----------------------------------------------------------------------------------


def test_rank_collapse_on_known_matrices():
    v = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    same = v.expand(1, 4, 3)
    assert rank_collapse(same) == {"mean_row_residual": 0.0, "rank_one_residual": pytest.approx(0.0, abs=1e-12)}
    plus_minus = torch.stack([v, -v, v, -v])[None]  # rank 1, mean row 0
    got = rank_collapse(plus_minus)
    assert got["mean_row_residual"] == pytest.approx(1.0)
    assert got["rank_one_residual"] == pytest.approx(0.0, abs=1e-12)
    eye = torch.eye(4, dtype=torch.float64)[None]  # orthogonal rows
    got = rank_collapse(eye)
    assert got["mean_row_residual"] == pytest.approx(math.sqrt(3 / 4))
    assert got["rank_one_residual"] == pytest.approx(math.sqrt(3 / 4))
    assert rank_collapse(torch.zeros(2, 3, 3)) == {"mean_row_residual": 0.0, "rank_one_residual": 0.0}


def test_rank_collapse_matches_numpy_and_averages_over_the_batch():
    rng = np.random.default_rng(5)
    h = rng.normal(size=(3, 7, 4))
    mean_row, rank_one = [], []
    for m in h:
        norm = np.linalg.norm(m)
        mean_row.append(np.linalg.norm(m - m.mean(0)) / norm)
        s = np.linalg.svd(m, compute_uv=False)
        rank_one.append(np.sqrt(np.sum(s[1:] ** 2)) / norm)
    got = rank_collapse(torch.from_numpy(h))
    assert got["mean_row_residual"] == pytest.approx(np.mean(mean_row), rel=1e-12)
    assert got["rank_one_residual"] == pytest.approx(np.mean(rank_one), rel=1e-12)


# The stacks and the measurement -----------------------------------------------------------------


def test_deep_stack_returns_every_layer_and_puts_input_encodings_at_the_bottom():
    torch.manual_seed(0)
    tokens = torch.randint(0, 5, (2, 6))
    for encoding, inside in (("sinusoidal", False), ("rotary", True), ("t5", True), ("none", False)):
        model = DeepStack(
            encoding=encoding, depth=3, num_hiddens=8, num_heads=2, ffn_hiddens=8, vocab_size=5, num_classes=6
        )
        states = model.hidden_states(tokens)
        assert len(states) == 4 and all(s.shape == (2, 6, 8) for s in states)
        assert model(tokens).shape == (2, 6, 6)
        assert (model.input_encoding is None) == inside
        positions = [block.attention.position for block in model.blocks]
        assert all((p is None) != inside for p in positions)
        if inside:
            assert len({id(p) for p in positions}) == 3  # one encoding per block
    with pytest.raises(ValueError, match="encoding must be one of"):
        DeepStack(encoding="nope", depth=1, num_hiddens=8, num_heads=2, ffn_hiddens=8, vocab_size=5, num_classes=6)
    with pytest.raises(ValueError, match="depth"):
        DeepStack(encoding="none", depth=0, num_hiddens=8, num_heads=2, ffn_hiddens=8, vocab_size=5, num_classes=6)


def test_previous_token_batch():
    tokens, targets = deep_stack.previous_token_batch(3, 5, 7, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (3, 5)
    assert (targets[:, 0] == 7).all() and torch.equal(targets[:, 1:], tokens[:, :-1])


TINY = {
    "depth": 4,
    "seeds": 2,
    "num_hiddens": 8,
    "num_heads": 2,
    "ffn_hiddens": 16,
    "num_steps": 8,
    "num_sequences": 14,
    "test_sequences": 4,
    "vocab_size": 5,
}


@pytest.fixture(scope="module")
def tiny():
    return measure_deep_stack(**TINY, variants=("residual", "no_residual"), train_steps=3, train_seeds=1)


def test_measurement_has_every_encoding_variant_metric_and_layer(tiny):
    json.dumps(tiny, allow_nan=False)  # JSON-ready, no NaN
    assert tiny["layers"] == list(range(5))
    assert tiny["metrics"] == list(METRICS)
    assert set(tiny["variants"]) == {"residual", "no_residual"}
    assert tiny["config"]["seeds"] == 2 and tiny["config"]["causal"] is False
    assert list(tiny["untrained"]) == list(deep_stack.ENCODINGS)
    for by_variant in tiny["untrained"].values():
        for metrics in by_variant.values():
            for metric in METRICS:
                entry = metrics[metric]
                assert len(entry["by_seed"]) == 2 and all(len(run) == 5 for run in entry["by_seed"])
                for layer in range(5):
                    values = [run[layer] for run in entry["by_seed"]]
                    assert entry["mean"][layer] == pytest.approx(np.mean(values))
                    assert entry["min"][layer] == min(values) and entry["max"][layer] == max(values)
    trained = tiny["trained"]["rotary"]["residual"]
    assert set(trained) == set(METRICS) | {"task_accuracy", "final_loss"}
    assert 0.0 <= trained["task_accuracy"]["mean"] <= 1.0 and len(trained["task_accuracy"]["by_seed"]) == 1


def test_measurement_sees_sinusoidal_position_at_the_input_and_its_collapse_without_residuals(tiny):
    sinusoidal = tiny["untrained"]["sinusoidal"]
    assert (
        min(
            sinusoidal["residual"]["position_r2"]["by_seed"][0][:1]
            + sinusoidal["no_residual"]["position_r2"]["min"][:1]
        )
        > 0.9
    )
    assert sinusoidal["no_residual"]["mean_row_residual"]["max"][-1] < 1e-6
    assert sinusoidal["no_residual"]["position_share"]["max"][-1] < 1e-6
    assert sinusoidal["residual"]["position_share"]["min"][-1] > 1e-3
    # NoPE, bidirectional: the input has no position and attention cannot create it.
    none = tiny["untrained"]["none"]["residual"]
    assert max(abs(v) for v in none["position_share"]["max"]) < 1e-9
    # Only encodings inside attention start from zero position share at layer 0.
    for encoding in ("rotary", "alibi", "t5", "shaw"):
        assert tiny["untrained"][encoding]["residual"]["position_share"]["max"][0] < 1e-12


def test_measurement_is_deterministic():
    small = {**TINY, "depth": 2, "seeds": 1}
    first = measure_deep_stack(**small, encodings=("shaw",), variants=("no_residual",), train_steps=0)
    second = measure_deep_stack(**small, encodings=("shaw",), variants=("no_residual",), train_steps=0)
    assert first["untrained"] == second["untrained"] and first["trained"] is None


def test_measurement_errors_name_the_argument():
    with pytest.raises(ValueError, match="encodings"):
        measure_deep_stack(encodings=("sinusoidal", "bogus"))
    with pytest.raises(ValueError, match="variants"):
        measure_deep_stack(variants=("residual", "bogus"))
    with pytest.raises(ValueError, match="train_variants"):
        measure_deep_stack(variants=("residual",), train_variants=("no_residual",), train_steps=1)
    with pytest.raises(ValueError, match="test_sequences"):
        measure_deep_stack(num_sequences=4, test_sequences=4)
    with pytest.raises(ValueError, match="num_steps"):
        measure_deep_stack(num_steps=1)
    with pytest.raises(ValueError, match="depth"):
        measure_deep_stack(depth=0)
    with pytest.raises(ValueError, match="train_steps"):
        measure_deep_stack(train_steps=-1)
    with pytest.raises(ValueError, match="ridge"):
        measure_deep_stack(ridge=-0.5)


def test_probe_penalty_is_chosen_on_held_out_training_sequences(monkeypatch):
    tried = []
    weights = deep_stack._ridge_weights

    def spy(features, targets, ridges):
        tried.append((features.shape[0], list(ridges)))
        return weights(features, targets, ridges)

    monkeypatch.setattr(deep_stack, "_ridge_weights", spy)
    h = _position_states(8, 5, 3, seed=6)
    position_r2(h[:8], h[:2], ridge=1e-6)
    # Four penalties fitted on 6 of the 8 sequences (30 rows), then the winner on all 40 rows.
    assert [rows for rows, _ in tried] == [30, 40]
    assert tried[0][1] == pytest.approx([1e-6, 1e-4, 1e-2, 1.0])
    assert tried[1][1] == pytest.approx([1e-6])  # exact position: the smallest penalty predicts best
    tried.clear()
    noise = torch.randn(
        8, 5, 20, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )  # 20 features, 30 rows
    position_r2(noise, noise[:2], ridge=1e-6)
    assert tried[1][1][0] > 1e-6  # nothing to read: a larger penalty predicts the held-out sequences better
    tried.clear()
    position_r2(h[:3], h[3:], ridge=1e-6)  # too few sequences to hold some out
    assert tried == [(15, [1e-6])]


TINY_DEPTH = {"num_hiddens": 16, "num_heads": 2, "ffn_hiddens": 16, "num_steps": 8, "num_sequences": 24,
              "test_sequences": 8, "vocab_size": 5}  # fmt: skip


def test_training_until_level_stops_when_the_accuracy_stops_rising():
    from selfattn.study.deep_stack import DeepStack, train_until_level

    def model(encoding):
        torch.manual_seed(0)
        return DeepStack(encoding=encoding, depth=1, num_hiddens=16, num_heads=2, ffn_hiddens=16, vocab_size=5,
                         num_classes=6)  # fmt: skip

    blind = train_until_level(model("none"), max_steps=600, num_steps=8, vocab_size=5, seed=0, check_every=25,
                              patience=3)  # fmt: skip
    assert blind["levelled_off"] and blind["steps"] < 600  # no position: it stalls well below the target
    assert blind["task_accuracy"] < 0.6
    accuracies = [accuracy for _, accuracy in blind["curve"]]
    assert max(accuracies[-3:]) < max(accuracies[:-3]) + 0.01  # the last `patience` checks gained nothing
    fixed = train_until_level(model("sinusoidal"), max_steps=30, num_steps=8, vocab_size=5, seed=0)
    assert fixed["steps"] == 30 and fixed["curve"] == [] and not fixed["levelled_off"]


def test_trained_by_depth_says_which_stacks_learn_the_task():
    from selfattn.study.deep_stack import trained_by_depth

    found = trained_by_depth(encodings=("none", "sinusoidal"), variants=("residual",), depths=(1,), max_steps=800,
                             check_every=50, patience=3, **TINY_DEPTH)  # fmt: skip
    sinusoidal = found["stacks"]["sinusoidal"]["residual"][0]
    none = found["stacks"]["none"]["residual"][0]
    assert sinusoidal["learnt"] and sinusoidal["task_accuracy"] >= 0.9 and sinusoidal["depth"] == 1
    assert not none["learnt"]  # without positions the previous token cannot be found
    assert found["chance"] == pytest.approx(0.2)
    assert set(sinusoidal) >= {"steps", "curve", "levelled_off", "trains", "position_r2", "order_accuracy"}
    with pytest.raises(ValueError, match="depths must be positive"):
        trained_by_depth(depths=(0,))
    with pytest.raises(ValueError, match="variants must be among"):
        trained_by_depth(variants=("deep",))
    with pytest.raises(ValueError, match="encodings must be names of"):
        trained_by_depth(encodings=("sine",))
