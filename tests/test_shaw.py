"""Shaw relative position representations and Music Transformer skewing, against per-pair loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from selfattn import MultiHeadAttention
from selfattn.functional import relative_shift
from selfattn.positional import ShawRelativePositionEncoding


def clip(distance: int, k: int) -> int:
    return max(-k, min(k, distance))


def shaw_attention_reference(q, k, v, q_positions, k_positions, visible, a_key, a_value, max_distance):
    """Shaw et al. eq. (3)-(5), one pair at a time.

    e_ij = q_i (k_j + a^K_ij) / sqrt(d), z_i = sum_j alpha_ij (v_j + a^V_ij).
    """
    batch, heads, num_queries, dh = q.shape
    out = torch.zeros(batch, heads, num_queries, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(num_queries):
                rows = []
                for j in range(k.shape[2]):
                    if not visible[b][i][j]:
                        continue
                    r = clip(int(k_positions[j]) - int(q_positions[i]), max_distance) + max_distance
                    score = sum(float(q[b, h, i, c]) * (float(k[b, h, j, c]) + float(a_key[r, c])) for c in range(dh))
                    rows.append((j, r, score / math.sqrt(dh)))
                if not rows:
                    continue
                top = max(s for _, _, s in rows)
                total = sum(math.exp(s - top) for _, _, s in rows)
                for j, r, s in rows:
                    alpha = math.exp(s - top) / total
                    out[b, h, i] += alpha * (v[b, h, j].double() + a_value[r].double())
    return out


def test_key_and_value_terms_match_pairwise_sums():
    torch.manual_seed(0)
    shaw = ShawRelativePositionEncoding(4, max_distance=2).double()
    q = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    weights = torch.rand(2, 3, 4, 6, dtype=torch.float64)
    q_positions, k_positions = torch.arange(5, 9), torch.arange(3, 9)
    with torch.no_grad():
        bias = shaw(q, q_positions=q_positions, k_positions=k_positions)
        value = shaw.value_term(weights, q_positions=q_positions, k_positions=k_positions)
    a_key, a_value = shaw.key_embeddings.detach(), shaw.value_embeddings.detach()
    for b in range(2):
        for h in range(3):
            for i, qp in enumerate(q_positions.tolist()):
                expected_value = torch.zeros(4, dtype=torch.float64)
                for j, kp in enumerate(k_positions.tolist()):
                    r = clip(kp - qp, 2) + 2
                    expected = float(q[b, h, i] @ a_key[r]) / 2.0  # / sqrt(4)
                    assert math.isclose(float(bias[b, h, i, j]), expected, rel_tol=1e-12, abs_tol=1e-12)
                    expected_value += weights[b, h, i, j] * a_value[r]
                torch.testing.assert_close(value[b, h, i], expected_value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_multihead_attention_with_shaw_matches_reference(causal):
    torch.manual_seed(1)
    d, h, length = 8, 2, 6
    shaw = ShawRelativePositionEncoding(d // h, max_distance=2)
    mha = MultiHeadAttention(d, h, position=shaw).double()
    x = torch.randn(2, length, d, dtype=torch.float64)
    valid_lens = torch.tensor([3, 5])
    with torch.no_grad():
        out = mha(x, x, x, valid_lens, causal=causal, offset=3)
        q, k, v = (mha.split_heads(w(x)) for w in (mha.W_q, mha.W_k, mha.W_v))
        visible = [
            [[j < n and (not causal or j <= i) for j in range(length)] for i in range(length)]
            for n in valid_lens.tolist()
        ]
        positions = torch.arange(3, 3 + length)
        heads = shaw_attention_reference(
            q, k, v, positions, positions, visible, shaw.key_embeddings, shaw.value_embeddings, 2
        )
        expected = mha.W_o(heads.transpose(1, 2).reshape(2, length, d))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any single operator output has."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_per_pair_embeddings():
    torch.manual_seed(2)
    length, dh, max_distance = 64, 32, 4
    shaw = ShawRelativePositionEncoding(dh, max_distance=max_distance)
    q = torch.randn(1, 1, length, dh, requires_grad=True)
    k = torch.randn(1, 1, length, dh)
    positions = torch.arange(length)
    with _LargestTensor() as tracker:
        bias = shaw(q, q_positions=positions, k_positions=positions)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(dh) + bias, dim=-1)
        out = weights @ k + shaw.value_term(weights, q_positions=positions, k_positions=positions)
        out.sum().backward()
    # O(L^2 + L*k*dh) elements, far from the L^2 * dh = 131072 of a gathered embedding tensor.
    assert tracker.largest >= length * length  # the tracker saw the score matrix
    assert tracker.largest <= max(length * length, length * (2 * max_distance + 1) * dh, length * dh)
    assert shaw.key_embeddings.grad is not None and shaw.value_embeddings.grad is not None


def test_keys_only_and_values_only():
    q = torch.randn(1, 2, 3, 4)
    positions = torch.arange(3)
    keys_only = ShawRelativePositionEncoding(4, keys=True, values=False)
    assert not keys_only.uses_weights and keys_only.value_embeddings is None
    assert list(keys_only.state_dict()) == ["key_embeddings"]
    with pytest.raises(NotImplementedError, match="adds nothing to the values"):
        keys_only.value_term(torch.rand(1, 2, 3, 3), q_positions=positions, k_positions=positions)
    values_only = ShawRelativePositionEncoding(4, keys=False, values=True)
    assert values_only.uses_weights and list(values_only.state_dict()) == ["value_embeddings"]
    bias = values_only(q, q_positions=positions, k_positions=positions)
    assert bias.shape == (1, 1, 1, 1) and float(bias.abs().sum()) == 0.0
    full = ShawRelativePositionEncoding(4, max_distance=3)
    assert full.uses_weights and full.key_embeddings.shape == (7, 4)
    assert list(full.state_dict()) == ["key_embeddings", "value_embeddings"]


def test_bad_inputs():
    with pytest.raises(ValueError, match="head_dim must be a positive integer, got 0"):
        ShawRelativePositionEncoding(0)
    with pytest.raises(ValueError, match="max_distance must be a non-negative integer, got -1"):
        ShawRelativePositionEncoding(4, max_distance=-1)
    with pytest.raises(ValueError, match="at least one of keys and values must be True"):
        ShawRelativePositionEncoding(4, keys=False, values=False)
    shaw = ShawRelativePositionEncoding(4)
    positions = torch.arange(3)
    with pytest.raises(ValueError, match="q must have head size 4"):
        shaw(torch.randn(1, 1, 3, 5), q_positions=positions, k_positions=positions)
    with pytest.raises(ValueError, match=r"q must have shape \(batch, heads, lq, \.\.\.\)"):
        shaw(torch.randn(3, 4), q_positions=positions, k_positions=positions)
    with pytest.raises(ValueError, match=r"weights must end in \(3, 3\)"):
        shaw.value_term(torch.rand(1, 1, 3, 4), q_positions=positions, k_positions=positions)


def relative_shift_reference(scores: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """The entries that mean something: (i, j) with key j not after query i, read at distance j - i."""
    num_queries, num_keys = scores.shape[-2:]
    entries = {}
    for i in range(num_queries):
        query_position = num_keys - num_queries + i  # queries are the last lq keys
        for j in range(num_keys):
            distance = j - query_position  # -(lk - 1) .. 0 for visible keys
            if distance <= 0:
                entries[i, j] = scores[..., i, distance + num_keys - 1]
    return entries


@settings(max_examples=25, deadline=None)
@given(num_queries=st.integers(1, 7), extra_keys=st.integers(0, 5), batch=st.integers(1, 3))
def test_relative_shift_matches_loop(num_queries, extra_keys, batch):
    num_keys = num_queries + extra_keys
    scores = torch.randn(batch, num_queries, num_keys)
    shifted = relative_shift(scores)
    assert shifted.shape == scores.shape
    for (i, j), expected in relative_shift_reference(scores).items():
        assert torch.equal(shifted[..., i, j], expected)


def test_relative_shift_gives_unclipped_shaw_key_term():
    # Music Transformer attention is Shaw's key term without clipping, computed by skewing.
    torch.manual_seed(3)
    num_queries, num_keys, dh = 5, 8, 4
    shaw = ShawRelativePositionEncoding(dh, max_distance=num_keys)
    q = torch.randn(2, 3, num_queries, dh, dtype=torch.float64)
    table = shaw.key_embeddings.detach().double()
    by_distance = table[num_keys - (num_keys - 1) : num_keys + 1]  # distances -(lk-1) .. 0, (lk, dh)
    skewed = relative_shift(q @ by_distance.T) / math.sqrt(dh)
    q_positions, k_positions = torch.arange(num_keys - num_queries, num_keys), torch.arange(num_keys)
    with torch.no_grad():
        bias = shaw.double()(q, q_positions=q_positions, k_positions=k_positions)
    causal = k_positions[None, :] <= q_positions[:, None]
    torch.testing.assert_close(skewed[..., causal], bias[..., causal], rtol=1e-12, atol=1e-12)


def test_relative_shift_bad_input():
    with pytest.raises(ValueError, match=r"scores must be a tensor of shape \(\.\.\., lq, lk\)"):
        relative_shift(torch.randn(4))
