"""The tour's measurements that replace asserted claims: each recovers a known answer, and each
would give a different answer for a different input (a test that cannot fail is a defect)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from selfattn.tour import checks, claims, comparison, embedding, family, frameworks, qualities, taylor
from selfattn.tour.paths import product_path_length, stack_path_length
from selfattn.tour.report import format_number, format_ratio

# Measured periods ------------------------------------------------------------------------------


@pytest.mark.parametrize("period, phase", [(17.3, 0.4), (35.33, 0.0), (6.0, 1.3), (62.8, math.pi / 2)])
def test_zero_crossings_recover_a_known_period(period, phase):
    samples = 2 * int(period) + 10  # a little over two periods
    column = np.sin(2 * np.pi * np.arange(samples) / period + phase)
    assert checks.zero_crossing_period(column) == pytest.approx(period, rel=2e-3)


def test_fft_recovers_a_known_period_and_both_readings_disagree_with_a_wrong_one():
    column = np.cos(2 * np.pi * np.arange(1000) / 41.7)
    assert checks.fft_period(column) == pytest.approx(41.7, rel=2e-3)
    assert checks.zero_crossing_period(column) != pytest.approx(40.0, rel=2e-3)


def test_a_column_without_two_crossings_has_no_period():
    with pytest.raises(ValueError, match="two zero crossings"):
        checks.zero_crossing_period(np.cos(np.arange(20) / 100))  # never crosses zero
    with pytest.raises(ValueError, match="one column"):
        checks.zero_crossing_period(np.zeros((3, 3)))


def test_a_cosine_lags_its_sine_by_a_quarter_period():
    i = np.arange(200)
    assert checks.phase_offset(np.sin(i / 7), np.cos(i / 7)) == pytest.approx(0.25, abs=1e-3)
    assert checks.phase_offset(np.sin(i / 7), np.sin(i / 7 - 0.5)) == pytest.approx(0.5 / (2 * np.pi), abs=1e-3)


# Path lengths through the real operations -------------------------------------------------------


class SkipRecurrence(nn.Module):
    """h_t = tanh(W x_t + U h_{t-2}): a recurrence whose steps jump two positions."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.W, self.U = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states: list[torch.Tensor] = []
        for t in range(x.shape[1]):
            previous = states[t - 2] if t >= 2 else torch.zeros_like(x[:, 0])
            states.append(torch.tanh(self.W(x[:, t]) + self.U(previous)))
        return torch.stack(states, dim=1)


@pytest.mark.parametrize("n", [3, 9, 17])
def test_path_length_differs_for_a_different_architecture(n):
    torch.manual_seed(0)
    x = torch.randn(1, n, 4, dtype=torch.float64)
    rnn = comparison.make_layer("rnn", 4, dtype=torch.float64)
    two_layers = nn.RNN(4, 4, num_layers=2, batch_first=True).double()
    skip = SkipRecurrence(4).double()
    assert product_path_length(rnn, x) == n  # input projection + n - 1 recurrent products
    assert product_path_length(lambda h: two_layers(h)[0], x) == n + 1  # one more input projection
    assert product_path_length(skip, x) == 1 + (n - 1) // 2  # half the steps
    assert product_path_length(rnn, x, source=-1) == 1  # the last input reaches its output at once
    assert product_path_length(skip, x, source=1) == math.inf  # odd positions never reach an even one


def test_attention_and_convolution_paths_through_the_real_operations():
    torch.manual_seed(0)
    x = torch.randn(1, 10, 4, dtype=torch.float64)
    fused = comparison.make_layer("self_attention", 4, dtype=torch.float64)
    explicit = comparison.make_layer("self_attention", 4, explicit=True, dtype=torch.float64)
    assert product_path_length(fused, x) == product_path_length(explicit, x) == 3
    conv = comparison.make_layer("cnn", 4, kernel_size=3, dtype=torch.float64)
    assert product_path_length(conv, x) == math.inf  # one width-3 layer cannot see 9 positions back
    assert product_path_length(conv, x, source=-3) == 1
    assert stack_path_length(lambda _: conv, x, max_depth=9) == (5, 5.0)  # ceil(9 / 2)


def test_path_measurement_errors():
    x = torch.randn(1, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="source and target"):
        product_path_length(lambda h: h, x, source=4)
    with pytest.raises(ValueError, match="batch, positions, features"):
        product_path_length(lambda h: h, x[0])
    with pytest.raises(ValueError, match="within max_depth=2"):
        stack_path_length(lambda _: lambda h: h * 2, x, max_depth=2)
    with pytest.raises(NotImplementedError, match="no dependency rule"):
        product_path_length(lambda h: torch.linalg.qr(h[0])[0][None], x)


def test_crossing_interpolates_on_log_axes():
    assert comparison.crossing([16, 32, 64], [0.5, 1.0, 2.0]) == 32
    assert comparison.crossing([10, 100], [0.1, 10.0]) == pytest.approx(math.sqrt(1000))
    assert comparison.crossing([1, 2, 4], [2.0, 3.0, 4.0]) is None


def test_compare_repeats_the_timing_and_checks_the_whole_layer_formula():
    results = comparison.compare([4, 8, 16], [4, 8], [2, 3], fixed_hiddens=8, fixed_steps=8, repeats=1, rounds=2)
    sa = results["self_attention"]
    assert len(sa["time_exponents"]) == 2 and len(sa["seconds_by_n_rounds"]) == 2
    assert sa["time_exponent_spread"] == [min(sa["time_exponents"]), max(sa["time_exponents"])]
    assert isinstance(sa["fixed_costs_dominate"], bool)
    crossings = results["crossings"]
    assert crossings["layer_formula_error"] == 0 and crossings["rnn_formula_error"] == 0
    assert crossings["core_equals_rnn_at_n"] == pytest.approx(8)  # n = d
    assert crossings["layer_equals_rnn_at_n"] is None and crossings["layer_over_rnn_min"] > 2
    assert results["rnn"]["parallelism_by_n"] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="rounds"):
        comparison.compare([4, 8], [4, 8], [2, 3], rounds=0)


# The rotation fitted without assuming it ------------------------------------------------------------


def test_least_squares_map_is_the_rotation_for_every_window():
    fit = checks.fitted_rotation(8, deltas=(1, 3), windows=((0, 400), (5000, 5400)), samples=100)
    assert fit["rotation_error_max"] < 1e-9 and fit["window_spread_max"] < 1e-9 and fit["residual_max"] < 1e-9


def test_the_fit_sees_a_map_that_depends_on_i():
    # A chirp has no fixed map from i to i + delta: the windows disagree.
    from selfattn.tour import checks as module

    original = module.sinusoidal_table

    def chirp(n, d, dtype=torch.float64):
        i = torch.arange(n, dtype=dtype)[:, None]
        return torch.sin(i * (1 + i / 5000) * torch.arange(1, d + 1, dtype=dtype) / 50)

    module.sinusoidal_table = chirp
    try:
        fit = checks.fitted_rotation(4, deltas=(1,), windows=((0, 400), (5000, 5400)), samples=100)
    finally:
        module.sinusoidal_table = original
    assert fit["window_spread_max"] > 1e-3


# The note ---------------------------------------------------------------------------------------


def test_distance_across_lengths_holds_for_p_and_fails_for_a_fraction_encoding():
    data = qualities.distance_across_lengths(16, lengths=(12, 40), pairs=((0, 1), (4, 9)))
    assert data["spread"] == 0
    assert data["fraction_spread"] > 0.1
    assert data["distances"]["0-1"][0] == pytest.approx(
        np.linalg.norm(qualities.sinusoidal_table(2, 16)[1].double() - qualities.sinusoidal_table(1, 16)[0].double()),
        abs=1e-6,
    )
    with pytest.raises(ValueError, match="two lengths"):
        qualities.distance_across_lengths(16, lengths=(5, 40), pairs=((0, 9),))


def test_embedding_survival_against_a_naive_loop():
    data = embedding.embedding_survival(sizes=(4, 64), vocabulary=20, num_positions=5, seed=3)
    torch.manual_seed(3)
    for index, d in enumerate((4, 64)):
        E = torch.randn(20, d, dtype=torch.float64)
        P = qualities.sinusoidal_table(5, d, dtype=torch.float64)
        hits = sum(
            int(min(range(20), key=lambda u: float((E[t] + P[i] - E[u]).norm())) == t)
            for t in range(20)
            for i in range(5)
        )
        assert data["recovered"][index] == pytest.approx(hits / 100)
        E.div_(E.norm(dim=-1, keepdim=True))  # the unit-norm draw reuses the same directions
    assert data["recovered"][1] > data["recovered"][0]


def test_score_terms_add_up_and_identity_makes_the_position_term_relative():
    data = taylor.score_terms(16, num_heads=2, num_steps=20, embedding_scales=(1.0, 0.01))
    for entry in data["scales"]:
        assert entry["sum_error"] < 1e-9
        assert entry["content_content"] + entry["content_position"] + entry["position_position"] == pytest.approx(1)
    assert data["scales"][1]["position_position"] > data["scales"][0]["position_position"]
    assert data["identity_spread"] < 1e-9 < data["position_position_spread"]
    # Moving every position: A = I sees offsets only; the layer's A and the content-position term see more.
    assert data["identity_shift_change"] < 1e-9
    assert data["position_position_shift_change"] > 1e-3 and data["content_position_shift_change"] > 1e-3


def test_framework_recipes_float32_drift_and_odd_width():
    precision = frameworks.framework_precision(16, lengths=(10, 5000))
    for name, errors in precision["errors"].items():
        assert errors[0] < 1e-5 < errors[1], name
    assert max(precision["selfattn"]) < 1e-7
    odd = frameworks.odd_width(17, 30)
    # Only the English summary page slices X[:, :d // 2]; the frameworks page's MXNet tab fails like the rest.
    assert odd["summary page (mxnet)"]["builds"] and odd["summary page (mxnet)"]["max_error"] < 1e-5
    assert [odd[n]["builds"] for n in frameworks.FRAMEWORKS_PAGE] == [False, False, False, False]
    tabs = frameworks.tabs_agree(16, lengths=(10, 5000))
    assert tabs["max_difference"][0] < 1e-6 and tabs["max_difference"][1] < 1e-4
    with pytest.raises(ValueError, match="odd"):
        frameworks.odd_width(16)


# Family: the form of ALiBi matches the attention -----------------------------------------------------


def test_alibi_panel_uses_the_form_of_its_attention():
    both = family.encoding_diagnostics("alibi", num_steps=10, num_heads=2, num_hiddens=8)
    assert both["form"] == "bidirectional"
    # Bidirectional: the last query does not pile onto its own neighbourhood only; weights spread both ways.
    first_row = both["attention"][0]
    assert first_row[1:].sum() > 0.3
    causal = family.encoding_diagnostics("alibi", num_steps=10, num_heads=2, num_hiddens=8, causal=True)
    assert causal["form"] == "causal"
    assert np.isnan(causal["position_scores"][0, 1]) and causal["attention"][0, 1:].sum() == 0
    assert max(causal["deltas"]) == 0


def test_none_is_measured_as_carrying_no_position():
    none = family.encoding_diagnostics("none", num_steps=8)
    assert none["position_aware"] is False and none["permutation_change"] < 1e-12
    alibi = family.encoding_diagnostics("alibi", num_steps=8)
    assert alibi["position_aware"] is True  # a cyclic shift, not a reversal, which ALiBi cannot see


# Report formatting -----------------------------------------------------------------------------------


def test_numbers_have_thousands_separators_and_ratios_say_so():
    assert format_number(1234567) == "1,234,567"
    assert format_number(2048.0) == "2,048"
    assert format_number(1.5e-16) == "1.50e-16"
    assert format_number(35.33294) == "35.33"
    assert format_number(32.0, 1) == "32.0"
    assert format_ratio(2.5) == "2.50\u00d7 (ratio)"


def test_claims_need_a_known_page_evidence_and_basis():
    with pytest.raises(ValueError, match="page must be one of"):
        claims._base._claim("x", "blog", "q", "s", "measured", 1, "e", True)
    with pytest.raises(ValueError, match="page must be one of"):
        claims._base._claim("x", "note", "q", "s", "measured", 1, "e", True, also_on=("tour",))
    with pytest.raises(ValueError, match="evidence must be one of"):
        claims._base._claim("x", "note", "q", "s", "guessed", 1, "e", True)
    with pytest.raises(ValueError, match="needs a basis"):
        claims._base._claim("x", "note", "q", "s", "derived", 1, "e", True)
    with pytest.raises(ValueError, match="holds must be None when evidence is 'not shown'"):
        claims._base._claim("x", "note", "q", "s", "not shown", None, "e", False, basis="b")
    with pytest.raises(ValueError, match="undecided measured claim needs a basis"):
        claims._base._claim("x", "note", "q", "s", "measured", 1, "e", None)
    with pytest.raises(ValueError, match="a identity claim is decided"):
        claims._base._claim("x", "note", "q", "s", "identity", 1, "e", None, basis="b")


# The binary analogy, the phase of the columns, the note's equation ---------------------------------------


def test_bits_flip_every_power_of_two_and_periods_give_their_ratio():
    assert checks.bit_alternation(3) == [1.0, 2.0, 4.0]
    assert checks.bit_alternation(5) == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert checks.period_ratios([2.0, 3.0, 6.0]) == [1.5, 2.0]
    with pytest.raises(ValueError, match="two or more positive periods"):
        checks.period_ratios([2.0])


def test_phase_lead_tells_which_column_comes_first():
    i = np.arange(120)
    assert checks.phase_lead(np.sin(i / 5), np.cos(i / 5)) == pytest.approx(0.25, abs=1e-3)
    assert checks.phase_lead(np.cos(i / 5), np.sin(i / 5)) == pytest.approx(-0.25, abs=1e-3)
    assert checks.phase_lead(np.sin(i / 5), np.sin(i / 5 + 0.6)) == pytest.approx(0.6 / (2 * np.pi), abs=1e-3)
    columns = checks.table_columns(60, 32, (6, 7)).double().T.numpy()
    assert checks.phase_lead(*columns) == pytest.approx(0.25, abs=1e-3)  # column 7 (cosine) leads column 6


def test_swapping_two_tokens_swaps_the_outputs_instead_of_leaving_them_equal():
    data = checks.permutation_check()
    assert data["swap_equivariance_error"] < 1e-12
    assert data["swap_equality_error"] > 1e-3  # the note's equality, as written, does not hold


def test_only_self_attention_ignores_the_order_of_its_input():
    data = checks.order_sensitivity()
    assert data["self_attention"] < 1e-12
    assert data["cnn"] > 1e-3 and data["rnn"] > 1e-3


def test_plot_causal_draws_the_causal_form(tmp_path, capsys):
    from selfattn.cli.main import main

    for flag, name in (([], "bi.png"), (["--causal"], "causal.png")):
        argv = ["plot", "--kind", "alibi", "--figure", "table", "-n", "8", "-d", "8", "--heads", "2"]
        assert main([*argv, *flag, "-o", str(tmp_path / name)]) == 0
    assert (tmp_path / "bi.png").read_bytes() != (tmp_path / "causal.png").read_bytes()
    table = family.encoding_table("alibi", num_steps=4, num_hiddens=8, num_heads=2, causal=False).numpy()
    np.testing.assert_allclose(table[0], table[0].T)  # -m |i - j| is symmetric
    causal = family.encoding_table("alibi", num_steps=4, num_hiddens=8, num_heads=2, causal=True).numpy()
    assert not np.allclose(causal[0], causal[0].T)


def test_compare_rounds_flag(tmp_path, capsys):
    import json

    from selfattn.cli.main import main

    path = tmp_path / "c.json"
    argv = ["compare", "--n", "4", "8", "--d", "4", "8", "--k", "2", "3", "--fixed-n", "8", "--fixed-d", "4"]
    assert main([*argv, "--repeats", "1", "--rounds", "2", "--json", str(path), "--no-progress"]) == 0
    results = json.loads(path.read_text())
    assert all(len(results[kind]["time_exponents"]) == 2 for kind in ("cnn", "rnn", "self_attention"))
    assert "products" in capsys.readouterr().out
