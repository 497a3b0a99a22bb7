"""Rotary position embedding: the formula, both pair conventions, precision, scaling, the module."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfattn.functional import apply_rotary, rotary_frequencies, sinusoidal_table
from selfattn.positional import RotaryPositionalEncoding
from selfattn.positional.rotary import MAX_ANGLE_TABLE_VALUES, ROWS_PAST_CAP


def rotary_reference(x: np.ndarray, positions, *, base=10000.0, interleaved=True, rotary_dim=None, freqs=None):
    """RoFormer's rotation written pair by pair in float64, straight from the paper."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    out = x.copy()
    for row, p in enumerate(positions):
        for j in range(r // 2):
            w = base ** (-2.0 * j / r) if freqs is None else freqs[j]
            t = float(p) * w
            a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + r // 2)
            xa, xb = x[..., row, a], x[..., row, b]
            out[..., row, a] = xa * math.cos(t) - xb * math.sin(t)
            out[..., row, b] = xa * math.sin(t) + xb * math.cos(t)
    return out


def rotary_reference_fast(x: np.ndarray, positions: np.ndarray, base=10000.0) -> np.ndarray:
    """Vectorized float64 interleaved rotation (for long inputs); checked against the loop below."""
    d = x.shape[-1]
    t = positions[:, None] * base ** (-np.arange(0, d, 2) / d)  # (l, d/2)
    xa, xb = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = xa * np.cos(t) - xb * np.sin(t)
    out[..., 1::2] = xa * np.sin(t) + xb * np.cos(t)
    return out


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_matches_pairwise_formula(interleaved, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    positions = torch.tensor([0, 1, 7, 300, -4])
    got = apply_rotary(x, positions, interleaved=interleaved, rotary_dim=rotary_dim, base=500.0)
    expected = rotary_reference(
        x.numpy(), positions.tolist(), base=500.0, interleaved=interleaved, rotary_dim=rotary_dim
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    if rotary_dim is not None:
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_half_split_is_interleaved_on_permuted_features():
    torch.manual_seed(1)
    d = 6
    x = torch.randn(4, d, dtype=torch.float64)
    positions = torch.arange(4) * 11
    # Feature j and j + d/2 of the half-split layout are pair j: interleave them.
    order = torch.tensor([j + half for j in range(d // 2) for half in (0, d // 2)])
    split = apply_rotary(x, positions, interleaved=False)
    interleaved = apply_rotary(x[:, order], positions, interleaved=True)
    torch.testing.assert_close(split[:, order], interleaved, rtol=0, atol=1e-14)


def test_rotating_the_sinusoid_table_moves_it_along():
    # The chapter: P's rows are (sin, cos) pairs, and a rotation by delta * w_j maps row i + delta to row i.
    d, delta = 16, 9
    table = sinusoidal_table(40, d, dtype=torch.float64)
    moved = apply_rotary(table[delta:], torch.full((40 - delta,), delta))
    torch.testing.assert_close(moved, table[: 40 - delta], rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(-5000, 5000),
    n=st.integers(-5000, 5000),
    shift=st.integers(-100_000, 100_000),
    interleaved=st.booleans(),
)
def test_score_depends_only_on_distance(m, n, shift, interleaved):
    generator = torch.Generator().manual_seed(m * 7 + n)
    q, k = torch.randn(2, 1, 8, dtype=torch.float64, generator=generator)

    def score(mq, nk):
        rq = apply_rotary(q, torch.tensor([mq]), interleaved=interleaved)
        rk = apply_rotary(k, torch.tensor([nk]), interleaved=interleaved)
        return float((rq * rk).sum())

    assert math.isclose(score(m, n), score(m + shift, n + shift), rel_tol=1e-9, abs_tol=1e-9)
    # ... and on the distance itself: one step apart scores differently from zero apart.
    assert not math.isclose(score(m, m + 1), score(m, m), rel_tol=1e-6)


def test_bf16_matches_float64_formula_to_bf16_rounding():
    torch.manual_seed(2)
    x = torch.randn(3, 2000, 16).to(torch.bfloat16)
    positions = torch.arange(3000, 5000)  # far past 256, where bf16 cannot hold integers
    got = apply_rotary(x, positions)
    assert got.dtype == torch.bfloat16
    exact = torch.from_numpy(rotary_reference_fast(x.double().numpy(), positions.numpy()))
    bound = 2.0**-8 * exact.abs() + 1e-6  # one bf16 rounding
    assert bool(((got.double() - exact).abs() <= bound).all())

    # The bound can fail: rounding the positions through bf16 (a common bug) breaks it.
    wrong = rotary_reference_fast(x.double().numpy(), positions.to(torch.bfloat16).double().numpy())
    assert not bool(((torch.from_numpy(wrong) - exact).abs() <= bound).all())


def test_fast_reference_agrees_with_loop_reference():
    x = np.random.default_rng(0).standard_normal((2, 6, 8))
    positions = np.array([0, 3, 99, 1000, 2, 5])
    np.testing.assert_allclose(rotary_reference_fast(x, positions), rotary_reference(x, positions), atol=1e-13)


def test_float32_stays_exact_at_large_positions():
    torch.manual_seed(3)
    x = torch.randn(4, 32)
    positions = torch.arange(10**6, 10**6 + 4)
    got = apply_rotary(x, positions)
    exact = rotary_reference_fast(x.double().numpy(), positions.double().numpy())
    np.testing.assert_allclose(got.numpy(), exact, rtol=0, atol=1e-5)


def test_linear_scaling_divides_positions():
    torch.manual_seed(4)
    x = torch.randn(5, 8, dtype=torch.float64)
    positions = torch.arange(5)
    scaled = apply_rotary(x, 4 * positions, scaling="linear", scaling_factor=4.0)
    torch.testing.assert_close(scaled, apply_rotary(x, positions), rtol=0, atol=1e-13)


def test_ntk_scaling_raises_the_base():
    r, s, base = 8, 4.0, 10000.0
    ntk = rotary_frequencies(r, base=base, scaling="ntk", scaling_factor=s)
    plain = rotary_frequencies(r, base=base)
    expected = (base * s ** (r / (r - 2))) ** (-np.arange(0, r, 2) / r)
    np.testing.assert_allclose(ntk.numpy(), expected, rtol=1e-14)
    assert float(ntk[0]) == 1.0  # the fastest pair keeps its frequency
    assert math.isclose(float(ntk[-1]), float(plain[-1]) / s, rel_tol=1e-12)  # the slowest is stretched by s
    x = torch.randn(3, r, dtype=torch.float64)
    positions = torch.tensor([5, 50, 500])
    got = apply_rotary(x, positions, scaling="ntk", scaling_factor=s)
    np.testing.assert_allclose(
        got.numpy(), rotary_reference(x.numpy(), positions.tolist(), freqs=expected.tolist()), atol=1e-12
    )


def test_module_matches_function_and_keeps_exact_frequencies_under_casts():
    rope = RotaryPositionalEncoding(
        8, base=1000.0, interleaved=False, rotary_dim=6, scaling="linear", scaling_factor=2.0
    )
    x = torch.randn(2, 2, 5, 8)
    positions = torch.arange(10, 15)
    expected = apply_rotary(
        x, positions, base=1000.0, interleaved=False, rotary_dim=6, scaling="linear", scaling_factor=2.0
    )
    torch.testing.assert_close(rope(x, positions), expected, rtol=0, atol=0)
    assert rope.state_dict() == {}
    assert "inv_freq" in rope._non_persistent_buffers_set
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float64
    got = rope(x.to(torch.bfloat16), positions)
    torch.testing.assert_close(
        got,
        apply_rotary(
            x.to(torch.bfloat16),
            positions,
            base=1000.0,
            interleaved=False,
            rotary_dim=6,
            scaling="linear",
            scaling_factor=2.0,
        ),
        rtol=0,
        atol=0,
    )
    assert "rotary_dim=6" in repr(rope) and "linear" in repr(rope)


def test_gradients_flow_through_the_rotation():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, torch.tensor([0, 3, 8, 100])), (x,))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rotary_dim": 3}, "rotary_dim must be even"),
        ({"rotary_dim": 10}, "rotary_dim must be at most"),
        ({"rotary_dim": 0}, "rotary_dim must be a positive integer"),
        ({"base": 1.0}, "base must be a finite number greater than 1"),
        ({"scaling": "rope"}, "scaling must be None, one of default, linear, ntk, dynamic, yarn"),
        ({"scaling": "yarn"}, "scaling 'yarn' needs original_max_position_embeddings"),
        ({"scaling": "linear", "scaling_factor": 0.5}, "scaling_factor must be a number >= 1"),
        ({"scaling_factor": 2.0}, "needs scaling="),
        ({"frequencies": torch.ones(3)}, r"frequencies must be a tensor of shape \(4,\)"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(torch.randn(3, 8), torch.arange(3), **kwargs)


@pytest.mark.parametrize(
    ("x", "positions", "match"),
    [
        (torch.randn(3, 8), torch.arange(3.0), "positions must be an integer tensor"),
        (torch.randn(3, 8), torch.arange(3).to(torch.bfloat16), "positions must be an integer tensor"),
        (torch.randn(3, 8), torch.arange(4), r"positions must be integers of shape \(3,\)"),
        (torch.randn(3, 8), torch.ones(3, dtype=torch.bool), "positions must be integers"),
        (torch.arange(24).view(3, 8), torch.arange(3), "x must be a floating-point tensor"),
        (torch.randn(8), torch.arange(1), "x must be a floating-point tensor"),
    ],
)
def test_bad_inputs(x, positions, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(x, positions)


def test_module_errors():
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        RotaryPositionalEncoding(0)
    with pytest.raises(ValueError, match="rotary_dim must be at most head_dim=8"):
        RotaryPositionalEncoding(8, rotary_dim=10)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryPositionalEncoding(8, rotary_dim=5)
    with pytest.raises(ValueError, match="base must be a finite number greater than 1"):
        RotaryPositionalEncoding(8, base=0.5)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., length, 8\)"):
        RotaryPositionalEncoding(8)(torch.randn(1, 1, 3, 6), torch.arange(3))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"interleaved": False},
        {"rotary_dim": 8},
        {"p": 0.5},
        {"scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
        {"scaling": "linear", "scaling_factor": 2.0},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_angle_table_rotates_bit_for_bit_as_forward(options, dtype):
    rope = RotaryPositionalEncoding(16, **options)
    gen = torch.Generator().manual_seed(0)
    # Steps that grow the table twice (past 256, then past 512), one at a large first position, and two past
    # the table's size cap (MAX_ANGLE_TABLE_VALUES: 65,536 positions of 16 features), whose rows are formed per call.
    for first, length in ((0, 5), (3, 1), (4, 0), (250, 20), (700, 3), (5000, 2), (10**6, 3), (65535, 2)):
        x = torch.randn(2, 3, length, 16, generator=gen).to(dtype)
        table = rope.rotate_consecutive(x, first)
        assert table is not None
        computed = rope(x, torch.arange(first, first + length))
        assert torch.equal(table, computed), (first, length)
        keys = torch.randn(2, 1, length, 16, generator=gen).to(dtype)  # fewer heads, as grouped keys have
        pair = rope.rotate_consecutive_pair(x, keys, first)
        assert pair is not None
        assert torch.equal(pair[0], computed) and torch.equal(pair[1], rope(keys, torch.arange(first, first + length)))
    assert rope.angle_table.dtype == torch.float64 and rope.angle_table.shape[0] >= 5002
    assert rope.angle_table.numel() <= MAX_ANGLE_TABLE_VALUES  # the rows past the cap were not kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_past_the_table_cap_form_their_rows_once_a_block(monkeypatch, dtype):
    """Decoding one position at a time past the cap: every step's rotation equals ``forward``'s bit for bit, and the
    rows are formed once per block of ROWS_PAST_CAP positions (and again where a step jumps back), not per step."""
    rope = RotaryPositionalEncoding(16)
    formed = []
    form = rope._angle_rows
    monkeypatch.setattr(rope, "_angle_rows", lambda positions: formed.append(positions.numel()) or form(positions))
    gen = torch.Generator().manual_seed(3)
    first = MAX_ANGLE_TABLE_VALUES // 32  # the cap's first position for 16 features
    steps = [*range(first, first + ROWS_PAST_CAP + 5), first + 2]
    for position in steps:
        x, keys = torch.randn(1, 2, 1, 16, generator=gen).to(dtype), torch.randn(1, 1, 1, 16, generator=gen).to(dtype)
        pair = rope.rotate_consecutive_pair(x, keys, position)
        assert pair is not None
        at = torch.tensor([position])
        assert torch.equal(pair[0], rope(x, at)) and torch.equal(pair[1], rope(keys, at)), position
    assert formed == [ROWS_PAST_CAP] * 3


def test_angle_table_declines_what_it_cannot_serve():
    x = torch.randn(1, 1, 2, 16)
    assert (
        RotaryPositionalEncoding(
            16, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
        ).rotate_consecutive(x, 0)
        is None
    )
    assert RotaryPositionalEncoding(16).rotate_consecutive(x, -1) is None
    assert RotaryPositionalEncoding(16).rotate_consecutive_pair(x, x, -1) is None
    assert RotaryPositionalEncoding(16).rotate_consecutive_pair(x, x[..., :1, :], 0) is None  # other positions
    assert RotaryPositionalEncoding(16).rotate_consecutive_pair(x, x.double(), 0) is None  # another rotation dtype
    rope = RotaryPositionalEncoding(16)
    rope.rotate_consecutive(x, 0)
    rope.reset_parameters()
    assert rope.angle_table.numel() == 0  # rebuilt from the (new) frequencies on next use


def test_angle_table_is_not_a_buffer_that_models_of_one_shape_copy():
    """An EMA copy made before decoding grew the table still averages the model (it copies buffers)."""
    from torch.optim.swa_utils import AveragedModel

    rope = RotaryPositionalEncoding(16)
    average = AveragedModel(rope, use_buffers=True)
    rope.rotate_consecutive(torch.randn(1, 1, 3, 16), 0)
    assert rope.angle_table.shape[0] >= 3 and "angle_table" not in dict(rope.named_buffers())
    average.update_parameters(rope)
    meta = RotaryPositionalEncoding(16, device="meta")
    meta.to_empty(device="cpu").reset_parameters()
    x = torch.randn(1, 1, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(meta.rotate_consecutive(x, 4), rope(x, torch.arange(4, 7)), rtol=0, atol=0)
