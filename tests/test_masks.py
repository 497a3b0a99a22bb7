"""attn_mask and key_padding_mask as forward arguments, and from_torch(nn.MultiheadAttention)."""

import numpy as np
import pytest
import torch
from reference import naive_attention
from reference_mha import make_encoding, naive_mha, visibility
from torch import nn

from selfattn import KVCache, MultiHeadAttention

D, H = 16, 4


def _mha(name="none", **kwargs):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    return MultiHeadAttention(D, H, position=position, **kwargs).double().eval()


@pytest.mark.parametrize("name", ["none", "alibi", "shaw"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks_combine_with_each_other(name, causal):
    mha = _mha(name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, D, generator=g, dtype=torch.float64)
    attend = torch.rand(2, 6, 6, generator=g) > 0.3  # True = attend
    attend[0, 3] = False  # a query that sees nothing
    padding = torch.tensor([[False, True, False, False, False, False], [False] * 5 + [True]])
    valid_lens = torch.tensor([5, 6])
    with torch.no_grad():
        out, weights = mha(
            x, x, x, valid_lens, causal=causal, attn_mask=attend, key_padding_mask=padding, return_weights=True
        )
        fused = mha(x, x, x, valid_lens, causal=causal, attn_mask=attend, key_padding_mask=padding)
    visible = visibility(2, 6, 6, causal=causal, valid_lens=[5, 6], key_padding=padding.tolist()) & attend.numpy()
    positions = torch.arange(6).expand(2, 6)
    expected, expected_w = naive_mha(mha, x, x, x, visible, positions, positions)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(fused, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(weights, expected_w, atol=1e-10, rtol=1e-9)
    assert weights[0, :, 3].abs().max() == 0


def test_float_mask_is_added_to_scaled_scores():
    mha = _mha()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, D, generator=g, dtype=torch.float64)
    additive = torch.randn(H, 5, 5, generator=g, dtype=torch.float64)[None]  # (1, h, lq, lk)
    additive[0, :, 2] = float("-inf")  # row 2 sees nothing: zeros, never NaN
    additive[0, :, 0, 4] = float("-inf")
    with torch.no_grad():
        out, weights = mha(x, x, x, attn_mask=additive, return_weights=True)
        fused = mha(x, x, x, attn_mask=additive)
    q = mha.split_heads(mha.W_q(x)).detach().numpy()
    k = mha.split_heads(mha.W_k(x)).detach().numpy()
    v = mha.split_heads(mha.W_v(x)).detach().numpy()
    visible = np.isfinite(additive.numpy())
    _, expected_w = naive_attention(q, k, v, visible, bias=np.where(visible, additive.numpy(), 0.0))
    torch.testing.assert_close(weights, torch.from_numpy(expected_w), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(fused, out, atol=1e-12, rtol=1e-10)
    assert torch.isfinite(out).all() and weights[0, :, 2].abs().max() == 0


def test_key_padding_mask_with_cache_is_remembered():
    mha = _mha("rotary")
    x = torch.randn(2, 4, D, dtype=torch.float64)
    padding = torch.tensor([[True, False, False, False], [False] * 4])
    cache = KVCache(max_len=4)
    with torch.no_grad():
        first = mha(x[:, :2], x[:, :2], x[:, :2], causal=True, cache=cache, key_padding_mask=padding[:, :2])
        second = mha(x[:, 2:], x[:, 2:], x[:, 2:], causal=True, cache=cache)
        full = mha(x, x, x, causal=True, key_padding_mask=padding)
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kdim", [None, 6])
def test_from_torch_matches_nn_multihead_attention(bias, kdim):
    torch.manual_seed(5)
    ref = nn.MultiheadAttention(D, H, bias=bias, kdim=kdim, vdim=kdim and 5, batch_first=True).double().eval()
    if bias:
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    mha = MultiHeadAttention.from_torch(ref)
    assert mha.W_q.weight.dtype == torch.float64 and not mha.training
    q = torch.randn(2, 4, D, dtype=torch.float64)
    k = torch.randn(2, 6, kdim or D, dtype=torch.float64)
    v = torch.randn(2, 6, (kdim and 5) or D, dtype=torch.float64)
    padding = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    masked_out = torch.rand(4, 6) > 0.7  # torch: True = masked out
    masked_out[:, 0] = False
    float_mask = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad():
        expected = ref(q, k, v, key_padding_mask=padding, attn_mask=masked_out, need_weights=False)[0]
        got = mha(q, k, v, key_padding_mask=padding, attn_mask=~masked_out)  # selfattn: True = attend
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
        expected = ref(q, k, v, attn_mask=float_mask, need_weights=False)[0]
        torch.testing.assert_close(mha(q, k, v, attn_mask=float_mask), expected, atol=1e-12, rtol=1e-10)


def test_from_torch_errors():
    with pytest.raises(ValueError, match=r"module must be an nn\.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


def test_mask_errors():
    mha = _mha()
    x = torch.randn(2, 3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(3, 3\) or \(2, 3, 3\) or \(2, 4, 3, 3\)"):
        mha(x, x, x, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be bool"):
        mha(x, x, x, attn_mask=torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \(True = padding\) of shape \(2, 3\)"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="the cache remembers earlier ones"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool), cache=KVCache(max_len=4))
