"""selfattn.functional.attention: both paths against a naive float64 loop, and each other."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import naive_attention

from selfattn.functional import attention, attention_weights, causal_mask, valid_lens_mask


def _random_qkv(b=2, h=3, lq=5, lk=7, d=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, lq, d, generator=g, dtype=dtype),
        torch.randn(b, h, lk, d, generator=g, dtype=dtype),
        torch.randn(b, h, lk, dv, generator=g, dtype=dtype),
    )


def _visible(mask, causal, shape):
    _, _, lq, lk = shape
    visible = np.ones(shape, dtype=bool)
    if mask is not None:
        visible &= np.broadcast_to(mask.numpy(), shape)
    if causal:
        for i in range(lq):
            visible[..., i, i + lk - lq + 1 :] = False
    return visible


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_naive_loop(return_weights, causal, with_mask, with_bias):
    q, k, v = _random_qkv()
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4 if with_mask else None
    bias = torch.randn(1, 3, 5, 7, generator=g, dtype=torch.float64) if with_bias else None
    result = attention(q, k, v, mask=mask, bias=bias, causal=causal, return_weights=return_weights)
    visible = _visible(mask, causal, (2, 3, 5, 7))
    bias_np = None if bias is None else np.broadcast_to(bias.numpy(), (2, 3, 5, 7))
    expected_out, expected_w = naive_attention(q.numpy(), k.numpy(), v.numpy(), visible, bias_np)
    out = result[0] if return_weights else result
    np.testing.assert_allclose(out.numpy(), expected_out, atol=1e-10)
    if return_weights:
        np.testing.assert_allclose(result[1].numpy(), expected_w, atol=1e-12)


@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    d=st.integers(1, 8),
    causal=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fused_and_explicit_paths_agree(b, h, lq, lk, d, causal, seed):
    q, k, v = _random_qkv(b, h, lq, lk, d, d, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, 1, lq, lk, generator=g) > 0.5
    bias = torch.randn(1, h, lq, lk, generator=g)
    fused = attention(q, k, v, mask=mask, bias=bias, causal=causal)
    explicit, weights = attention(q, k, v, mask=mask, bias=bias, causal=causal, return_weights=True)
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    rows = weights.sum(-1)
    assert torch.all(((rows - 1).abs() < 1e-5) | (rows == 0)), "each row sums to 1, or is empty"


def test_fully_masked_rows_are_zero_and_gradients_finite():
    q, k, v = (t.requires_grad_() for t in _random_qkv(dtype=torch.float32))
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of sequence 0 sees nothing
    mask[1] = False  # sequence 1 sees nothing at all
    for return_weights in (False, True):
        result = attention(q, k, v, mask=mask, return_weights=return_weights)
        out = result[0] if return_weights else result
        assert torch.isfinite(out).all()
        assert out[0, :, 2].abs().max() == 0 and out[1].abs().max() == 0
        assert out[0, :, 0].abs().max() > 0
        if return_weights:
            assert result[1][0, :, 2].abs().max() == 0
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
            t.grad = None


def test_causal_is_lower_right_aligned_for_fewer_queries():
    # Decoding: 2 new queries against 5 keys; the last query sees all 5 keys, the first 4.
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    q, k, v = _random_qkv(lq=2, lk=5)
    out_last = attention(q[..., 1:, :], k, v)  # the newest query sees every key
    out_causal = attention(q, k, v, causal=True)
    torch.testing.assert_close(out_causal[..., 1:, :], out_last)


def test_causal_equal_lengths_uses_same_answer_as_explicit_mask():
    q, k, v = _random_qkv(lq=6, lk=6, dtype=torch.float32)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(attention(q, k, v, causal=True), attention(q, k, v, mask=tril))


def test_valid_lens_mask_shapes_and_values():
    per_sequence = valid_lens_mask(torch.tensor([2, 0]), 3)
    assert per_sequence.shape == (2, 1, 1, 3)
    assert per_sequence[:, 0, 0].tolist() == [[True, True, False], [False, False, False]]
    per_query = valid_lens_mask(torch.tensor([[1, 3], [0, 2]]), 3)
    assert per_query.shape == (2, 1, 2, 3)
    assert per_query[1, 0].tolist() == [[False, False, False], [True, True, False]]


def test_attention_weights_matches_returned_weights():
    q, k, v = _random_qkv()
    _, weights = attention(q, k, v, causal=True, return_weights=True)
    torch.testing.assert_close(attention_weights(q, k, causal=True), weights)


def test_dropout_only_in_output_not_in_returned_weights():
    torch.manual_seed(0)
    q, k, v = _random_qkv(dtype=torch.float32)
    out, weights = attention(q, k, v, dropout_p=0.5, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))
    assert not torch.allclose(out, attention(q, k, v))


def test_half_precision_bias_is_cast():
    q, k, v = _random_qkv(dtype=torch.bfloat16)
    bias = torch.randn(1, 1, 5, 7)  # float32 bias with bf16 inputs
    out = attention(q, k, v, bias=bias)
    assert out.dtype == torch.bfloat16
    ref = attention(q.double(), k.double(), v.double(), bias=bias.double())
    torch.testing.assert_close(out.double(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mask=torch.ones(1, 1, 5, 7)), "mask must be a bool tensor"),
        (dict(bias=torch.ones(1, 1, 5, 7, dtype=torch.long)), "bias must be a floating-point tensor"),
        (dict(dropout_p=1.5), r"dropout_p must be a probability in \[0, 1\), got 1.5"),
        (dict(dropout_p=-0.1), "dropout_p must be a probability"),
    ],
)
def test_argument_errors(kwargs, message):
    q, k, v = _random_qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, **kwargs)


def test_shape_errors():
    q, k, v = _random_qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match="q and k must share their last dimension"):
        attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="k and v must have the same number of keys"):
        attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="q must be floating point"):
        attention(q.long(), k, v)
    with pytest.raises(ValueError, match="k must be a tensor of shape"):
        attention(q, k[0, 0, 0], v)


def test_long_sequences_from_head_split_views_agree_with_explicit_path():
    # 2048 x 2048 pairs: the fused path re-lays the transposed head views out contiguously.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1, 2048, 2 * 8, generator=g)  # (qkv, b, l, h * d)
    q, k, v = (t.view(1, 2048, 2, 8).transpose(1, 2) for t in x)  # (b, h, l, d) views
    assert not q.is_contiguous()
    mask = torch.arange(2048) < 1500
    fused = attention(q, k, v, mask=mask, causal=True)
    explicit, _ = attention(q, k, v, mask=mask, causal=True, return_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
