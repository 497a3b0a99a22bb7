"""Per-token positions through every encoding, and left-padded decoding with a cache."""

import numpy as np
import pytest
import torch
from reference import sinusoidal_numpy
from reference_mha import ENCODINGS, make_encoding, naive_mha, visibility

from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import LearnedPositionalEncoding, NoPositionalEncoding, SinusoidalPositionalEncoding

D, H = 16, 4


def _mha(name, seed=0, **kwargs):
    position = make_encoding(name, D, H, seed=seed)
    torch.manual_seed(seed + 1)
    return MultiHeadAttention(D, H, position=position, **kwargs).double().eval()


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_per_token_positions_match_naive(name, causal):
    mha = _mha(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, D, generator=g, dtype=torch.float64)
    positions = torch.tensor([[5, 9, 2, 2, 40, 7], [0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        out, weights = mha(x, x, x, causal=causal, positions=positions, return_weights=True)
        fused = mha(x, x, x, causal=causal, positions=positions)
    expected, expected_w = naive_mha(mha, x, x, x, visibility(2, 6, 6, causal=causal), positions, positions)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(fused, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(weights, expected_w, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ENCODINGS)
def test_key_positions_for_cross_attention(name):
    mha = _mha(name)
    g = torch.Generator().manual_seed(4)
    q, kv = (
        torch.randn(2, 3, D, generator=g, dtype=torch.float64),
        torch.randn(2, 5, D, generator=g, dtype=torch.float64),
    )
    q_pos, k_pos = torch.tensor([[7, 8, 9], [1, 1, 3]]), torch.tensor([[0, 2, 4, 6, 8], [9, 3, 1, 0, 0]])
    with torch.no_grad():
        out = mha(q, kv, kv, positions=q_pos, key_positions=k_pos)
    expected, _ = naive_mha(mha, q, kv, kv, visibility(2, 3, 5), q_pos, k_pos)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ENCODINGS)
def test_offset_is_shorthand_for_positions(name):
    mha = _mha(name)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with torch.no_grad():
        by_offset = mha(x, x, x, causal=True, offset=11)
        by_positions = mha(x, x, x, causal=True, positions=torch.arange(11, 16))
        per_sequence = mha(x, x, x, causal=True, positions=torch.arange(11, 16).expand(2, 5))
    torch.testing.assert_close(by_offset, by_positions, atol=0, rtol=0)
    torch.testing.assert_close(by_offset, per_sequence, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ENCODINGS)
def test_left_padded_decoding_equals_unpadded(name):
    """Two prompts of lengths 5 and 3, the second left-padded by 2, then 3 greedy-free decode steps."""
    mha = _mha(name, num_kv_heads=2)
    g = torch.Generator().manual_seed(7)
    long, short = (
        torch.randn(1, 8, D, generator=g, dtype=torch.float64),
        torch.randn(1, 6, D, generator=g, dtype=torch.float64),
    )
    prompt = torch.cat([long[:, :5], torch.cat([torch.zeros(1, 2, D, dtype=torch.float64), short[:, :3]], 1)])
    padding = torch.tensor([[False] * 5, [True, True, False, False, False]])
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])  # pads' positions do not matter
    cache = KVCache(max_len=8)
    with torch.no_grad():
        first = mha(prompt, prompt, prompt, causal=True, cache=cache, key_padding_mask=padding, positions=positions)
        steps = []
        for t in range(3):
            token = torch.cat([long[:, 5 + t : 6 + t], short[:, 3 + t : 4 + t]])
            step_positions = torch.tensor([[5 + t], [3 + t]])
            steps.append(mha(token, token, token, causal=True, cache=cache, positions=step_positions))
        alone_long = mha(long, long, long, causal=True)
        alone_short = mha(short, short, short, causal=True)
    torch.testing.assert_close(first[0], alone_long[0, :5], atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(first[1, 2:], alone_short[0, :3], atol=1e-10, rtol=1e-9)
    for t, step in enumerate(steps):
        torch.testing.assert_close(step[0, 0], alone_long[0, 5 + t], atol=1e-10, rtol=1e-9)
        torch.testing.assert_close(step[1, 0], alone_short[0, 3 + t], atol=1e-10, rtol=1e-9)


def test_cache_stores_positions_and_padding():
    mha = _mha("alibi")
    cache = KVCache(max_len=6)
    x = torch.randn(2, 3, D, dtype=torch.float64)
    with torch.no_grad():
        mha(
            x,
            x,
            x,
            causal=True,
            cache=cache,
            positions=torch.tensor([[4, 5, 6], [0, 1, 2]]),
            key_padding_mask=torch.tensor([[True, False, False], [False] * 3]),
        )
    seen = cache.update(
        torch.zeros(2, H, 1, D // H, dtype=torch.float64), torch.zeros(2, H, 1, D // H, dtype=torch.float64)
    )
    assert seen.positions.tolist() == [[4, 5, 6, 3], [0, 1, 2, 3]]
    assert seen.padding.tolist() == [[True, False, False, False], [False] * 4]


def test_input_encodings_take_positions():
    positions = torch.tensor([[3, 0, 7], [1, 2, 1500]])
    x = torch.zeros(2, 3, 6)
    sinusoidal = SinusoidalPositionalEncoding(6, max_len=10)
    expected = torch.from_numpy(np.stack([sinusoidal_numpy(p.numpy(), 6) for p in positions])).float()
    torch.testing.assert_close(sinusoidal(x, positions=positions), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(sinusoidal(x[0], positions=torch.tensor([2, 3, 4])), sinusoidal(x[0], offset=2))
    learned = LearnedPositionalEncoding(6, max_len=8)
    torch.testing.assert_close(learned(x[:1], positions=positions[:1]), learned.weight[positions[:1]].detach())
    assert torch.equal(NoPositionalEncoding()(x, positions=positions), x)
    with pytest.raises(ValueError, match="past max_len=8"):
        learned(x, positions=positions)
    with pytest.raises(ValueError, match="positions must be non-negative"):
        sinusoidal(x, positions=torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="either offset or positions"):
        sinusoidal(x, 2, positions=positions)
    with pytest.raises(ValueError, match=r"positions must be integers of shape \(3,\) or \(batch, 3\)"):
        sinusoidal(x, positions=torch.arange(3.0))


def test_position_errors():
    mha = _mha("rotary")
    x, kv = torch.randn(2, 3, D, dtype=torch.float64), torch.randn(2, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor of shape \(3,\) or \(2, 3\)"):
        mha(x, x, x, positions=torch.arange(3.0))
    with pytest.raises(ValueError, match=r"positions must be an integer tensor"):
        mha(x, x, x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="either offset or positions"):
        mha(x, x, x, offset=1, positions=torch.arange(3))
    with pytest.raises(ValueError, match="key_positions are needed"):
        mha(x, kv, kv, positions=torch.arange(3))
    with pytest.raises(ValueError, match=r"key_positions must be an integer tensor of shape \(4,\) or \(2, 4\)"):
        mha(x, kv, kv, positions=torch.arange(3), key_positions=torch.arange(3))
