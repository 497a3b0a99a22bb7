"""Learned absolute encoding and N-D sinusoidal encodings for grids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import sinusoidal_numpy

from selfattn.positional import (
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding2D,
    SinusoidalPositionalEncoding3D,
    SinusoidalPositionalEncodingND,
)


def test_learned_adds_its_rows_at_the_offset():
    torch.manual_seed(0)
    learned = LearnedPositionalEncoding(6, max_len=10)
    x = torch.randn(2, 4, 6)
    torch.testing.assert_close(learned(x), x + learned.weight[:4], rtol=0, atol=0)
    torch.testing.assert_close(learned(x, offset=6), x + learned.weight[6:10], rtol=0, atol=0)
    assert list(learned.state_dict()) == ["weight"] and learned.weight.shape == (10, 6)
    learned(x, offset=3).sum().backward()
    grad = learned.weight.grad
    assert torch.equal(grad[3:7], torch.full((4, 6), 2.0)) and float(grad[:3].abs().sum() + grad[7:].abs().sum()) == 0.0


def test_learned_refuses_to_extrapolate():
    learned = LearnedPositionalEncoding(4, max_len=8)
    with pytest.raises(ValueError, match=r"positions 5\.\.8 reach past max_len=8: .*cannot extrapolate"):
        learned(torch.randn(1, 4, 4), offset=5)
    with pytest.raises(ValueError, match=r"max_len=8.*cannot extrapolate"):
        learned(torch.randn(9, 4))


def test_learned_keeps_the_input_dtype_and_applies_dropout():
    learned = LearnedPositionalEncoding(4, max_len=8, dropout=0.5)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    learned.eval()
    assert learned(x).dtype == torch.bfloat16
    learned.train()
    torch.manual_seed(1)
    dropped = learned(torch.ones(8, 4) * 10)
    assert bool((dropped == 0).any()) and bool((dropped != 0).any())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: LearnedPositionalEncoding(0, 4), "num_hiddens must be a positive integer, got 0"),
        (lambda: LearnedPositionalEncoding(4, 0), "max_len must be a positive integer, got 0"),
        (lambda: LearnedPositionalEncoding(4, 4, dropout=1.0), r"dropout must be a probability in \[0, 1\), got 1.0"),
        (lambda: LearnedPositionalEncoding(4, 4)(torch.randn(2, 5)), r"X must have shape \(\.\.\., length, 4\)"),
        (
            lambda: LearnedPositionalEncoding(4, 4)(torch.ones(2, 4, dtype=torch.long)),
            "X must be a floating-point tensor",
        ),
        (
            lambda: LearnedPositionalEncoding(4, 4)(torch.randn(2, 4), offset=-1),
            "offset must be a non-negative integer, got -1",
        ),
    ],
)
def test_learned_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def sinusoid_row(position: int, width: int) -> list[float]:
    """The chapter's 1-D formula for one position and a table of ``width`` columns."""
    return sinusoidal_numpy(np.array([position]), width)[0].tolist()


@pytest.mark.parametrize(("num_hiddens", "widths"), [(8, [4, 4]), (7, [4, 3]), (5, [3, 2])])
def test_2d_is_two_1d_tables_side_by_side(num_hiddens, widths):
    encoding = SinusoidalPositionalEncoding2D(num_hiddens)
    x = torch.zeros(1, 3, 4, num_hiddens, dtype=torch.float64)
    table = encoding(x, offset=(2, 5))[0]
    for i in range(3):
        for j in range(4):
            expected = sinusoid_row(2 + i, widths[0]) + sinusoid_row(5 + j, widths[1])
            np.testing.assert_allclose(table[i, j].numpy(), expected, rtol=0, atol=1e-6)  # a float32 table


def test_3d_odd_channels_and_single_offset():
    encoding = SinusoidalPositionalEncoding3D(11, max_len=2)  # the tables grow past max_len
    x = torch.randn(2, 3, 2, 5, 11, dtype=torch.float64)
    out = encoding(x, offset=1)
    assert out.shape == x.shape and out.dtype == torch.float64
    for t, i, j in [(0, 0, 0), (2, 1, 4), (1, 0, 3)]:
        expected = sinusoid_row(1 + t, 4) + sinusoid_row(1 + i, 4) + sinusoid_row(1 + j, 3)
        np.testing.assert_allclose((out - x)[1, t, i, j].numpy(), expected, rtol=0, atol=1e-6)


def test_nd_crop_equals_offset_encoding():
    # Encoding a window at its offset gives the same as cropping the encoded grid.
    encoding = SinusoidalPositionalEncodingND(9, 2)
    x = torch.randn(6, 7, 9)
    full = encoding(x)
    window = encoding(x[2:5, 3:7], offset=(2, 3))
    torch.testing.assert_close(window, full[2:5, 3:7], rtol=0, atol=1e-6)


def test_nd_tables_are_non_persistent_buffers():
    encoding = SinusoidalPositionalEncoding2D(6)
    assert encoding.state_dict() == {}
    assert all(name.endswith("P") for name, _ in encoding.named_buffers())
    assert len(list(encoding.named_buffers())) == 2
    out = encoding.to(torch.bfloat16)(torch.randn(2, 2, 6, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: SinusoidalPositionalEncodingND(2, 3), "num_hiddens must give each of the 3 axes a channel, got 2"),
        (lambda: SinusoidalPositionalEncodingND(4, 0), "num_axes must be a positive integer, got 0"),
        (lambda: SinusoidalPositionalEncoding2D(4, dropout=-0.1), "dropout must be a probability"),
        (lambda: SinusoidalPositionalEncoding2D(4)(torch.randn(3, 4)), r"X must have shape \(\.\.\., n_1, n_2, 4\)"),
        (lambda: SinusoidalPositionalEncoding2D(4)(torch.randn(2, 3, 5)), r"X must have shape \(\.\.\., n_1, n_2, 4\)"),
        (
            lambda: SinusoidalPositionalEncoding2D(4)(torch.randn(2, 3, 4), offset=(1, 2, 3)),
            "offset must be an int or a tuple of 2 ints",
        ),
        (
            lambda: SinusoidalPositionalEncoding2D(4)(torch.randn(2, 3, 4), offset=(1, -2)),
            "offset must be a non-negative integer, got -2",
        ),
        (
            lambda: SinusoidalPositionalEncoding2D(4)(torch.randn(2, 3, 4), offset=True),
            "offset must be a non-negative integer, got True",
        ),
        (lambda: SinusoidalPositionalEncoding2D(4).table((2,)), r"grid must have 2 sizes, got \(2,\)"),
        (lambda: SinusoidalPositionalEncoding3D(4, base=1.0), "base must be a finite number greater than 1"),
    ],
)
def test_nd_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
