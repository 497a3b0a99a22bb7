"""The sinusoidal table and module against the float64 NumPy formula, and the textbook's faults."""

import numpy as np
import pytest
import torch
from reference import sinusoidal_numpy

from selfattn import SinusoidalPositionalEncoding, sinusoidal_table
from selfattn.functional import sinusoidal_frequencies


@pytest.mark.parametrize("num_hiddens", [1, 2, 7, 32, 33])
def test_table_matches_float64_formula(num_hiddens):
    table = sinusoidal_table(60, num_hiddens, dtype=torch.float64)
    np.testing.assert_allclose(table.numpy(), sinusoidal_numpy(np.arange(60), num_hiddens), atol=1e-14)


def test_odd_width_has_ceil_sines_and_floor_cosines():
    table = sinusoidal_table(5, 5, dtype=torch.float64)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("offset", [0, 9_999, 999_936])
def test_float32_table_within_1e6_up_to_a_million(offset):
    table = sinusoidal_table(64, 64, offset=offset)
    expected = sinusoidal_numpy(np.arange(offset, offset + 64), 64)
    assert np.abs(table.numpy().astype(np.float64) - expected).max() < 1e-6


def test_float32_angles_would_drift():
    # Guard that the test above can fail: the textbook's float32 angle is far off at 10^4.
    i = torch.arange(10_000, 10_001, dtype=torch.float32)[:, None]
    textbook = torch.sin(i / torch.pow(10000, torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert np.abs(textbook.numpy() - sinusoidal_numpy(np.array([10_000]), 32)[:, 0::2]).max() > 1e-4


def test_offset_and_base():
    full = sinusoidal_table(30, 16, base=100.0)
    torch.testing.assert_close(sinusoidal_table(10, 16, base=100.0, offset=20), full[20:])
    np.testing.assert_allclose(
        sinusoidal_table(8, 6, base=100.0, dtype=torch.float64).numpy(), sinusoidal_numpy(np.arange(8), 6, 100.0)
    )


def test_frequencies():
    freqs = sinusoidal_frequencies(8)
    np.testing.assert_allclose(freqs.numpy(), [10000 ** (-2 * j / 8) for j in range(4)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_positions=0, num_hiddens=4), "num_positions must be a positive integer, got 0"),
        (dict(num_positions=3, num_hiddens=-2), "num_hiddens must be a positive integer, got -2"),
        (dict(num_positions=3, num_hiddens=4, offset=-1), "offset must be a non-negative integer, got -1"),
        (dict(num_positions=3, num_hiddens=4, base=1.0), "base must be a finite number greater than 1, got 1.0"),
        (dict(num_positions=3, num_hiddens=4, dtype=torch.int64), "dtype must be a floating-point dtype"),
        (dict(num_positions=2.5, num_hiddens=4), "num_positions must be a positive integer, got 2.5"),
    ],
)
def test_table_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sinusoidal_table(**kwargs)


def test_module_adds_table_and_keeps_input_dtype():
    pe = SinusoidalPositionalEncoding(32, 0.0, max_len=100)
    X = torch.randn(2, 60, 32)
    torch.testing.assert_close(pe(X) - X, sinusoidal_table(60, 32).expand(2, -1, -1))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        out = pe(X.to(dtype))
        assert out.dtype == dtype
    np.testing.assert_allclose(
        (pe(torch.zeros(1, 60, 32, dtype=torch.float64))[0]).numpy(), sinusoidal_numpy(np.arange(60), 32), atol=1e-7
    )


def test_module_past_max_len_and_any_offset():
    pe = SinusoidalPositionalEncoding(33, max_len=10)
    out = pe(torch.zeros(1, 25, 33))  # longer than max_len: the table grows
    np.testing.assert_allclose(out[0].numpy(), sinusoidal_numpy(np.arange(25), 33), atol=1e-6)
    assert pe.P.shape[1] >= 25
    far = pe(torch.zeros(3, 33), offset=500_000)  # far away: computed on demand, unbatched input
    np.testing.assert_allclose(far.numpy(), sinusoidal_numpy(np.arange(500_000, 500_003), 33), atol=1e-6)
    assert pe.P.shape[1] < 1000, "a far offset must not build a half-million-row table"
    torch.testing.assert_close(pe(torch.zeros(1, 5, 33), offset=7)[0], sinusoidal_table(12, 33)[7:])


def test_module_buffer_is_non_persistent_and_moves():
    pe = SinusoidalPositionalEncoding(8, max_len=16)
    assert "P" in dict(pe.named_buffers())
    assert pe.state_dict() == {}
    pe.to(torch.float64)
    assert pe.P.dtype == torch.float64
    # Rebuilt in float64, not the float32 table upcast (which is ~1e-8 off).
    np.testing.assert_allclose(pe.P[0].numpy(), sinusoidal_numpy(np.arange(16), 8), atol=1e-15)
    pe(torch.zeros(1, 40, 8, dtype=torch.float64))  # growth keeps the moved dtype
    assert pe.P.dtype == torch.float64 and pe.P.shape[1] >= 40


def test_module_chapter_usage():
    # The chapter's cell: P[0, :, 6:10] of a d=32 encoding over 60 steps.
    pe = SinusoidalPositionalEncoding(32, 0)
    X = pe(torch.zeros((1, 60, 32)))
    P = pe.P[:, : X.shape[1], :]
    assert P.shape == (1, 60, 32)
    np.testing.assert_allclose(P[0, :, 6:10].numpy(), sinusoidal_numpy(np.arange(60), 32)[:, 6:10], atol=1e-6)


def test_module_dropout_in_training_only():
    torch.manual_seed(0)
    pe = SinusoidalPositionalEncoding(16, dropout=0.5)
    X = torch.randn(4, 10, 16)
    assert (pe(X) == 0).any()
    pe.eval()
    torch.testing.assert_close(pe(X), X + sinusoidal_table(10, 16))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SinusoidalPositionalEncoding(0), "num_hiddens must be a positive integer, got 0"),
        (lambda: SinusoidalPositionalEncoding(8, dropout=1.0), "dropout must be a probability"),
        (lambda: SinusoidalPositionalEncoding(8, max_len=-5), "max_len must be a positive integer, got -5"),
        (lambda: SinusoidalPositionalEncoding(8, base=0.5), "base must be a finite number greater than 1"),
        (
            lambda: SinusoidalPositionalEncoding(8)(torch.zeros(1, 4, 8), offset=-3),
            "offset must be a non-negative integer, got -3",
        ),
        (lambda: SinusoidalPositionalEncoding(8)(torch.zeros(1, 4, 9)), r"X must have shape \(\.\.\., length, 8\)"),
        (
            lambda: SinusoidalPositionalEncoding(8)(torch.zeros(1, 4, 8, dtype=torch.long)),
            "X must be a floating-point tensor",
        ),
    ],
)
def test_module_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()
