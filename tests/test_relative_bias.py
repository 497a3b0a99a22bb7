"""T5 bucketed bias and ALiBi: published boundaries and slopes, naive references, the modules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import naive_attention

from selfattn import MultiHeadAttention
from selfattn.functional import alibi_slopes, t5_relative_bucket
from selfattn.positional import ALiBiPositionalBias, T5RelativePositionBias


def t5_bucket_reference(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """The T5 rule for one pair, written from the paper's description in plain float64 Python."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative_position > 0:  # key after the query: upper half
            bucket = num_buckets
        distance = abs(relative_position)
    else:
        distance = max(-relative_position, 0)
    exact = num_buckets // 2
    if distance < exact:
        return bucket + distance
    log_bucket = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return bucket + min(log_bucket, num_buckets - 1)


def buckets(values, **kwargs) -> list[int]:
    return t5_relative_bucket(torch.tensor(values), **kwargs).tolist()


def test_t5_published_boundaries_causal():
    # relative_position = key - query, so a key n steps in the past is -n.
    assert buckets([-n for n in range(16)], bidirectional=False) == list(range(16))
    assert buckets([-16, -17], bidirectional=False) == [16, 16]
    assert buckets([-112, -113, -128, -10_000], bidirectional=False) == [30, 31, 31, 31]
    first = {}
    for n in range(400):
        first.setdefault(buckets([-n], bidirectional=False)[0], n)
    assert first[16] == 16 and first[31] == 113
    assert sorted(first) == list(range(32))  # every bucket is used
    assert buckets([1, 5, 1000], bidirectional=False) == [0, 0, 0]  # future keys count as distance 0


def test_t5_published_boundaries_bidirectional():
    assert buckets([-n for n in range(8)]) == list(range(8))
    assert buckets([-90, -91, -200]) == [14, 15, 15]
    assert buckets(list(range(1, 8))) == [16 + n for n in range(1, 8)]
    assert buckets([90, 91, 5000]) == [30, 31, 31]
    first = {}
    for n in range(200):
        first.setdefault(buckets([-n])[0], n)
    assert first[8] == 8 and first[15] == 91


# The published code takes the log in float32; it agrees with this float64 reference for these
# settings (exotic ones can differ on exact near-ties).
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(
    ("num_buckets", "max_distance"), [(32, 128), (16, 64), (64, 256), (8, 20), (12, 33), (128, 1000)]
)
def test_t5_matches_reference(bidirectional, num_buckets, max_distance):
    values = list(range(-1500, 1501))
    expected = [t5_bucket_reference(v, bidirectional, num_buckets, max_distance) for v in values]
    assert buckets(values, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance) == expected


def test_t5_module_bias_is_the_table_entry_of_each_pair():
    torch.manual_seed(0)
    t5 = T5RelativePositionBias(3, num_buckets=8, max_distance=12, bidirectional=True)
    q = torch.randn(2, 3, 4, 5)
    q_positions = torch.arange(20, 24)
    k_positions = torch.arange(0, 24, 3)  # uneven key positions, some in the queries' future
    bias = t5(q, q_positions=q_positions, k_positions=k_positions)
    assert bias.shape == (1, 3, 4, 8)
    table = t5.relative_attention_bias.weight
    for head in range(3):
        for i, qp in enumerate(q_positions.tolist()):
            for j, kp in enumerate(k_positions.tolist()):
                bucket = t5_bucket_reference(kp - qp, True, 8, 12)
                assert bias[0, head, i, j] == table[bucket, head]
    assert list(t5.state_dict()) == ["relative_attention_bias.weight"]
    (bias.sum()).backward()
    assert t5.relative_attention_bias.weight.grad is not None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_buckets": 3}, "num_buckets must be at least 4"),
        ({"num_buckets": 1, "bidirectional": False}, "num_buckets must be at least 2"),
        ({"max_distance": 8}, "max_distance must exceed the 8 exact buckets"),
        ({"num_buckets": 0}, "num_buckets must be a positive integer"),
        ({"max_distance": -1}, "max_distance must be a positive integer"),
    ],
)
def test_t5_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        t5_relative_bucket(torch.arange(3), **kwargs)
    with pytest.raises(ValueError, match=match):
        T5RelativePositionBias(2, **kwargs)


def test_t5_bad_inputs():
    with pytest.raises(ValueError, match="relative_position must be an integer tensor"):
        t5_relative_bucket(torch.arange(3.0))
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        T5RelativePositionBias(0)
    with pytest.raises(ValueError, match=r"q must have shape \(batch, 2, length, head_dim\)"):
        T5RelativePositionBias(2)(torch.randn(1, 3, 2, 4), q_positions=torch.arange(2), k_positions=torch.arange(2))
    with pytest.raises(ValueError, match=r"q_positions must be a \(length,\) or \(batch, length\) integer tensor"):
        T5RelativePositionBias(2)(torch.randn(1, 2, 2, 4), q_positions=torch.arange(2.0), k_positions=torch.arange(2))


@pytest.mark.parametrize(
    ("num_heads", "expected"),
    [
        (1, [1 / 256]),
        (2, [1 / 16, 1 / 256]),
        (4, [1 / 4, 1 / 16, 1 / 64, 1 / 256]),
        (6, [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]),
        (8, [2.0**-k for k in range(1, 9)]),
        (3, [1 / 16, 1 / 256, 1 / 4]),
        (12, [2.0**-k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]),
        (16, [2.0 ** -(k / 2) for k in range(1, 17)]),
    ],
)
def test_alibi_slopes_follow_the_paper(num_heads, expected):
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == torch.float64
    torch.testing.assert_close(slopes, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_naive(causal):
    alibi = ALiBiPositionalBias(6, causal=causal)
    q_positions, k_positions = torch.arange(7, 10), torch.arange(2, 12)
    bias = alibi(torch.randn(1, 6, 3, 4), q_positions=q_positions, k_positions=k_positions)
    assert bias.shape == (1, 6, 3, 10)
    slopes = [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]
    for h, m in enumerate(slopes):
        for a, i in enumerate(q_positions.tolist()):
            for c, j in enumerate(k_positions.tolist()):
                expected = -m * (i - j) if causal else -m * abs(i - j)
                assert math.isclose(float(bias[0, h, a, c]), expected, rel_tol=1e-7, abs_tol=1e-9)
    # The bias does not depend on the head size (it is not scaled by 1/sqrt(dh)).
    wide = alibi(torch.randn(1, 6, 3, 64), q_positions=q_positions, k_positions=k_positions)
    assert torch.equal(bias, wide)


def test_alibi_inside_attention_is_added_to_scaled_scores_unscaled():
    torch.manual_seed(1)
    d, h, length = 8, 2, 5
    mha = MultiHeadAttention(d, h, position=ALiBiPositionalBias(h, causal=False)).double()
    x = torch.randn(1, length, d, dtype=torch.float64)
    with torch.no_grad():
        _, weights = mha(x, x, x, return_weights=True)
        q, k, v = (mha.split_heads(w(x)).numpy() for w in (mha.W_q, mha.W_k, mha.W_v))
    slopes = [1 / 16, 1 / 256]
    bias = np.array([[[-slopes[head] * abs(i - j) for j in range(length)] for i in range(length)] for head in range(h)])
    visible = np.ones((1, h, length, length), dtype=bool)
    _, expected = naive_attention(q, k, v, visible, bias=bias[None])
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_alibi_slopes_are_exact_non_persistent_buffers():
    alibi = ALiBiPositionalBias(12)
    assert alibi.state_dict() == {} and "slopes" in alibi._non_persistent_buffers_set
    alibi.to(torch.bfloat16)
    assert alibi.slopes.dtype == torch.float64
    torch.testing.assert_close(alibi.slopes, alibi_slopes(12), rtol=0, atol=0)
    bias = alibi(
        torch.randn(1, 12, 2, 4, dtype=torch.bfloat16), q_positions=torch.arange(2), k_positions=torch.arange(2)
    )
    assert bias.dtype == torch.bfloat16


def test_alibi_bad_inputs():
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match=r"num_heads must be a positive integer, got 2\.5"):
        ALiBiPositionalBias(2.5)
    with pytest.raises(ValueError, match=r"q must have shape \(batch, 4, length, head_dim\)"):
        ALiBiPositionalBias(4)(torch.randn(1, 2, 3, 4), q_positions=torch.arange(3), k_positions=torch.arange(3))
    with pytest.raises(ValueError, match=r"k_positions must be a \(length,\) or \(batch, length\) integer tensor"):
        ALiBiPositionalBias(2)(torch.randn(1, 2, 3, 4), q_positions=torch.arange(3), k_positions=torch.zeros(3))
