"""The helpers of selfattn.functional take what attention takes, or refuse it naming the argument: each of these
was computed silently (or raised another error) before."""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.functional import (
    apply_axial_rotary,
    apply_rotary,
    attention,
    attention_weights,
    blockwise_attention,
    relative_distances,
    t5_relative_bucket,
    valid_lens_mask,
)
from selfattn.functional._dropout_masks import dropout_keep_probability


def test_valid_lengths_past_int64_see_every_key_and_an_infinite_one_is_refused() -> None:
    """inf, 1e20 and 2.0**63 became int64's lowest through .long(): every key hidden, blockwise's output zeros."""
    with pytest.raises(ValueError, match=r"valid_lens must hold whole numbers, got \[inf\]"):
        valid_lens_mask(torch.tensor([math.inf]), 4)
    assert valid_lens_mask(torch.tensor([1e20, 2.0**63]), 4).all()
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(
        blockwise_attention(q, q, q, valid_lens=torch.tensor([1e20, 2.0**63])), attention(q, q, q)
    )
    with pytest.raises(ValueError, match="whole numbers"):
        blockwise_attention(q, q, q, valid_lens=torch.tensor([math.inf, 3.0]))


def test_attention_weights_checks_its_options_as_attention_does() -> None:
    """A softcap of 0 gave even weights, nan or inf NaN weights, a negative one was taken; causal="no" meant True."""
    q = torch.randn(1, 2, 5, 4)
    for softcap in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            attention_weights(q, q, softcap=softcap)
    with pytest.raises(ValueError, match="causal must be True or False, got str 'no'"):
        attention_weights(q, q, causal="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\)"):
        attention_weights(q, q, sinks=torch.zeros(3))


def test_blockwise_attention_checks_scale_dtypes_and_heads_as_attention_does() -> None:
    """scale 0 and -1 were taken, a float64 q with float32 k and v was cast down (a float32 answer), and heads or a
    batch that do not fit raised RuntimeError from a reshape."""
    q, k = torch.randn(2, 4, 3, 8, dtype=torch.float64), torch.randn(2, 4, 3, 8)
    for scale in (0.0, -1.0):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            blockwise_attention(q, q, q, scale=scale)
    with pytest.raises(ValueError, match="q, k and v must share one dtype"):
        blockwise_attention(q, k, k)
    with pytest.raises(ValueError, match=r"may have a divisor of q.s heads"):
        blockwise_attention(q, q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match="same leading"):
        blockwise_attention(q, q[:1], q[:1])


def test_rotary_flags_frequencies_and_axes_are_checked() -> None:
    """interleaved="no" rotated the interleaved pairs; a list of frequencies raised AttributeError, an odd
    rotary_dim with frequencies a self-contradicting message; coordinates of no axis ZeroDivisionError."""
    x, positions = torch.randn(1, 3, 8), torch.arange(3)
    with pytest.raises(ValueError, match="interleaved must be True or False, got str 'no'"):
        apply_rotary(x, positions, interleaved="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"frequencies must be a tensor of shape \(4,\) for rotary_dim=8, got list"):
        apply_rotary(x, positions, frequencies=[1.0, 0.1, 0.01, 0.001])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rotary(x, positions, rotary_dim=3, frequencies=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"coordinates must have at least one axis, got shape \(3, 0\)"):
        apply_axial_rotary(x, torch.zeros(3, 0, dtype=torch.long))


def test_relative_helpers_and_the_dropout_grid_refuse_what_is_not_theirs() -> None:
    with pytest.raises(ValueError, match=r"q_positions must be a .* integer tensor, got torch.bool"):
        relative_distances(torch.ones(3, dtype=torch.bool), torch.arange(3))
    with pytest.raises(ValueError, match="bidirectional must be True or False, got str 'no'"):
        t5_relative_bucket(torch.arange(-3, 3), bidirectional="no")  # type: ignore[arg-type]
    for p in (1.5, -0.5, math.nan):
        with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\)"):
            dropout_keep_probability(p)
    assert dropout_keep_probability(0.25) == 0.75
