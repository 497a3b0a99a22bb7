"""Section 3 of the tour: FLOPs, dependency chains and path lengths, measured on real layers."""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.tour import comparison
from selfattn.tour._common import fit_exponent
from selfattn.tour.comparison import count_flops, max_path_length, sequential_ops

# The chapter's compute column as exponents: O(knd^2), O(nd^2), O(n^2 d) (attention matmuls).
CHAPTER_EXPONENTS = {"cnn": (1, 2), "rnn": (1, 2), "self_attention": (2, 1)}


@pytest.mark.parametrize("n, d, k", [(8, 4, 3), (16, 8, 5), (33, 6, 2)])
def test_flops_equal_the_multiply_add_count_of_each_layer(n, d, k):
    # Independent count: 2 FLOPs per multiply-add (biases and activations are not counted).
    assert count_flops("cnn", n, d, kernel_size=k) == {"total": 2 * k * n * d * d}
    assert count_flops("rnn", n, d) == {"total": 2 * 2 * n * d * d}  # input and hidden products per step
    attention = count_flops("self_attention", n, d)
    assert attention["attention"] == 2 * 2 * n * n * d  # q k^T and weights @ v
    assert attention["projections"] == 4 * 2 * n * d * d  # W_q, W_k, W_v, W_o
    assert attention["total"] == attention["attention"] + attention["projections"]


@pytest.mark.parametrize("kind", comparison.KINDS)
def test_fitted_flop_exponents_match_the_chapter(kind):
    ns, ds = [16, 32, 64, 128], [8, 16, 32, 64]
    core = "attention" if kind == "self_attention" else "total"
    exponent_n = fit_exponent(ns, [count_flops(kind, n, 16)[core] for n in ns])
    exponent_d = fit_exponent(ds, [count_flops(kind, 32, d)[core] for d in ds])
    want_n, want_d = CHAPTER_EXPONENTS[kind]
    assert abs(exponent_n - want_n) <= 0.1
    assert abs(exponent_d - want_d) <= 0.1


def test_whole_attention_layer_mixes_both_terms():
    # With the d x d projections the layer is O(n^2 d + n d^2): its d exponent lies strictly between 1 and 2.
    ds = [8, 16, 32, 64]
    exponent_d = fit_exponent(ds, [count_flops("self_attention", 32, d)["total"] for d in ds])
    assert 1.1 < exponent_d < 1.9


def test_fit_exponent_recovers_a_power_law():
    sizes = [3, 7, 20, 100]
    assert fit_exponent(sizes, [2.5 * s**1.7 for s in sizes]) == pytest.approx(1.7, abs=1e-12)
    assert fit_exponent([1, 2], [5, 5]) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "sizes, costs, match",
    [
        ([4], [1], "at least two"),
        ([1, 2], [1], "at least two"),
        ([0, 2], [1, 2], "positive"),
        ([1, 2], [-1, 2], "positive"),
    ],
)
def test_fit_exponent_rejects_bad_input(sizes, costs, match):
    with pytest.raises(ValueError, match=match):
        fit_exponent(sizes, costs)


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10, 17])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_cnn_path_length_is_ceil_n_minus_1_over_k_minus_1(n, k):
    assert max_path_length("cnn", n, kernel_size=k) == math.ceil((n - 1) / (k - 1))


@pytest.mark.parametrize("n", [2, 3, 5, 9, 16, 31])
def test_rnn_path_is_its_input_projection_then_one_product_per_step(n):
    assert max_path_length("rnn", n) == n


@pytest.mark.parametrize("n", [2, 5, 16, 64])
def test_self_attention_path_is_three_products_in_one_layer(n):
    # value projection, weighted sum, output projection
    assert comparison.path_lengths("self_attention", n) == {"layers": 1, "products": 3}


def test_long_paths_are_found_where_a_gradient_would_underflow():
    # 200 random layers, or 300 recurrent steps, shrink a gradient below float64's smallest number.
    assert max_path_length("cnn", 401, kernel_size=3) == 200
    assert comparison.path_lengths("rnn", 300) == {"layers": 1, "products": 300}


def test_receptive_field_reference_by_brute_force():
    # Independent reference: follow which inputs each position of a causal width-k stack sees.
    n, k = 12, 3
    seen = [{i} for i in range(n)]
    depth = 0
    while 0 not in seen[n - 1]:
        seen = [set().union(*(seen[j] for j in range(max(0, i - k + 1), i + 1))) for i in range(n)]
        depth += 1
    assert max_path_length("cnn", n, kernel_size=k) == depth


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: max_path_length("cnn", 1), "at least 2"),
        (lambda: max_path_length("cnn", 8, kernel_size=1), "kernel_size"),
        (lambda: max_path_length("transformer", 8), "kind must be one of"),
        (lambda: max_path_length("rnn", 0), "num_steps"),
        (lambda: count_flops("rnn", -3, 4), "num_steps"),
        (lambda: count_flops("cnn", 4, 0), "num_hiddens"),
        (lambda: comparison.make_layer("lstm", 4), "kind must be one of"),
        (lambda: comparison.compare([8], [4, 8], [2, 3]), "at least two different"),
        (lambda: comparison.compare([1, 8], [4, 8], [2, 3]), "at least 2"),
        (lambda: comparison.compare([4, 8], [4, 8], [1, 3]), "at least 2"),
        (lambda: comparison.compare([4, 8], [4, 8], [2, 3], fixed_kernel=1), "fixed_kernel"),
        (lambda: comparison.time_forward("cnn", 4, 4, repeats=0), "repeats"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rnn_chain_has_one_product_per_step_and_the_others_are_constant():
    for n in (4, 16, 40):
        assert sequential_ops("rnn", n) == n
        assert sequential_ops("cnn", n) == 1
        # W_q (or W_k, W_v in parallel) -> q k^T -> weights @ v -> W_o.
        assert sequential_ops("self_attention", n) == 4


def test_longest_product_chain_on_a_hand_built_graph():
    x = torch.randn(3, 3, requires_grad=True)
    a, b, c = (torch.randn(3, 3) for _ in range(3))
    deep = ((x @ a) @ b) @ c  # three products in a row
    shallow = x @ a + x @ b  # two products side by side
    assert comparison._longest_product_chain(deep + shallow) == 3
    assert comparison._longest_product_chain(torch.tanh(shallow)) == 1


def test_layers_map_sequences_to_sequences_of_the_same_shape():
    x = torch.randn(2, 9, 6)
    for kind in comparison.KINDS:
        assert comparison.make_layer(kind, 6, kernel_size=4)(x).shape == (2, 9, 6)


def test_causal_convolution_does_not_look_ahead():
    layer = comparison.CausalConv1d(4, 3)
    x = torch.randn(1, 10, 4)
    changed = x.clone()
    changed[:, 6:] += 1.0
    assert torch.equal(layer(x)[:, :6], layer(changed)[:, :6])
    assert not torch.equal(layer(x)[:, 6:], layer(changed)[:, 6:])


def test_compare_returns_every_number_the_report_needs():
    ns, ds, ks = [4, 8, 16], [4, 8], [2, 3]
    steps = []
    results = comparison.compare(ns, ds, ks, fixed_hiddens=8, fixed_steps=8, repeats=1, progress=steps.append)
    assert len(steps) == comparison.comparison_steps(ns, ds, ks)
    assert results["sweep"]["n"] == ns
    for kind in comparison.KINDS:
        entry = results[kind]
        for key in ("flops_exponent_n", "flops_exponent_d", "sequential_ops", "max_path_length", "n", "k"):
            assert key in entry
        assert entry["n"] == 16
        assert entry["path_length_by_n"] == entry["expected_path_length_by_n"]
        assert all(t > 0 for t in entry["seconds_by_n"])
        want_n, want_d = CHAPTER_EXPONENTS[kind]
        assert abs(entry["flops_exponent_n"] - want_n) <= 0.1
        assert abs(entry["flops_exponent_d"] - want_d) <= 0.1
    assert results["cnn"]["k"] == 3 and results["rnn"]["k"] is None
    assert results["cnn"]["path_length_by_k"] == [15, 8]
    assert results["cnn"]["flops_exponent_k"] == pytest.approx(1.0, abs=1e-9)
    assert results["rnn"]["sequential_ops_exponent_n"] == pytest.approx(1.0, abs=1e-9)
    assert results["cnn"]["sequential_ops_exponent_n"] == pytest.approx(0.0, abs=1e-9)
