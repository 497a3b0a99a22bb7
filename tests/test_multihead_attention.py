"""MultiHeadAttention against torch.nn.MultiheadAttention, the textbook's algorithm and a naive loop."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import TextbookMultiHeadAttention, naive_attention, torch_multihead_copy

from selfattn import KVCache, MultiHeadAttention, SinusoidalPositionalEncoding


def _mha(num_hiddens=16, num_heads=4, seed=0, **kwargs):
    torch.manual_seed(seed)
    return MultiHeadAttention(num_hiddens, num_heads, **kwargs).eval()


def _naive_mha(mha, queries, keys, values, visible):
    """Projections and per-query softmax in float64, from the module's weights."""

    def project(linear, x):
        y = x.double() @ linear.weight.detach().double().T
        return y if linear.bias is None else y + linear.bias.detach().double()

    b, lq, _ = queries.shape

    def split(x: torch.Tensor) -> np.ndarray:
        return x.reshape(b, x.shape[1], mha.num_heads, -1).transpose(1, 2).numpy()  # (b, h, l, dh)

    q, k, v = split(project(mha.W_q, queries)), split(project(mha.W_k, keys)), split(project(mha.W_v, values))
    out, weights = naive_attention(q, k, v, np.broadcast_to(visible, (b, mha.num_heads, *visible.shape[-2:])))
    merged = torch.from_numpy(out).transpose(1, 2).reshape(b, lq, -1)  # (b, lq, d)
    return project(mha.W_o, merged), torch.from_numpy(weights)


def _visible(valid_lens, lq, lk, causal):
    b = valid_lens.shape[0]
    lens = valid_lens.numpy()
    lens = np.broadcast_to(lens[:, None] if lens.ndim == 1 else lens, (b, lq))
    visible = np.arange(lk)[None, None, :] < lens[..., None]  # (b, lq, lk)
    if causal:
        visible &= np.arange(lk)[None, None, :] <= np.arange(lq)[None, :, None] + (lk - lq)
    return visible[:, None]  # (b, 1, lq, lk)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_multihead_attention(bias):
    mha = _mha(bias=bias)
    ref = torch_multihead_copy(mha)
    x = torch.randn(3, 7, 16)
    valid_lens = torch.tensor([7, 4, 1])
    with torch.no_grad():
        expected, expected_w = ref(x, x, x, need_weights=True, average_attn_weights=False)
        torch.testing.assert_close(mha(x, x, x), expected, atol=1e-5, rtol=1e-5)
        _, weights = mha(x, x, x, return_weights=True)
        torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-5)
        padded = torch.arange(7)[None, :] >= valid_lens[:, None]  # True = ignore
        expected = ref(x, x, x, key_padding_mask=padded, need_weights=False)[0]
        torch.testing.assert_close(mha(x, x, x, valid_lens), expected, atol=1e-5, rtol=1e-5)
        causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
        expected = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
        torch.testing.assert_close(mha(x, x, x, causal=True), expected, atol=1e-5, rtol=1e-5)


def test_textbook_state_dict_loads_and_agrees():
    textbook = TextbookMultiHeadAttention(20, 4, query_size=6, key_size=5, value_size=3)
    mha = MultiHeadAttention(20, 4, query_size=6, key_size=5, value_size=3).eval()
    mha.load_state_dict(textbook.state_dict())  # strict: same names and shapes
    queries, keys, values = torch.randn(2, 4, 6), torch.randn(2, 9, 5), torch.randn(2, 9, 3)
    valid_lens = torch.tensor([[3, 9, 1, 2], [5, 5, 5, 5]])
    with torch.no_grad():
        torch.testing.assert_close(
            mha(queries, keys, values, valid_lens), textbook(queries, keys, values, valid_lens), atol=1e-5, rtol=1e-5
        )


def test_valid_length_zero_attends_to_nothing_unlike_textbook():
    textbook = TextbookMultiHeadAttention(16, 4)
    mha = MultiHeadAttention(16, 4).eval()
    mha.load_state_dict(textbook.state_dict())
    x = torch.randn(2, 5, 16)
    valid_lens = torch.tensor([[0, 2, 5, 0, 1], [3, 3, 3, 3, 3]])
    with torch.no_grad():
        out, weights = mha(x, x, x, valid_lens, return_weights=True)
        fused = mha(x, x, x, valid_lens)
        old = textbook(x, x, x, valid_lens)
    assert torch.isfinite(out).all()
    assert out[0, 0].abs().max() == 0 and out[0, 3].abs().max() == 0  # no bias: zero rows
    assert weights[0, :, 0].abs().max() == 0
    torch.testing.assert_close(fused, out, atol=1e-6, rtol=1e-5)
    assert old[0, 0].abs().max() > 1e-3, "the textbook averages the padding instead"
    torch.testing.assert_close(out[0, 1:3], old[0, 1:3], atol=1e-5, rtol=1e-5)


@given(
    b=st.integers(1, 3),
    lq=st.integers(1, 7),
    lk=st.integers(1, 7),
    heads=st.sampled_from([1, 2, 4]),
    per_query=st.booleans(),
    causal=st.booleans(),
    return_weights=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_against_naive_loop(b, lq, lk, heads, per_query, causal, return_weights, seed):
    mha = _mha(8, heads, seed=seed)
    g = torch.Generator().manual_seed(seed)
    queries, keys = torch.randn(b, lq, 8, generator=g), torch.randn(b, lk, 8, generator=g)
    values = torch.randn(b, lk, 8, generator=g)
    valid_lens = torch.randint(0, lk + 1, (b, lq) if per_query else (b,), generator=g)
    with torch.no_grad():
        result = mha(queries, keys, values, valid_lens, causal=causal, return_weights=return_weights)
    expected, expected_w = _naive_mha(mha, queries, keys, values, _visible(valid_lens, lq, lk, causal))
    out = result[0] if return_weights else result
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)
    if return_weights:
        assert result[1].shape == (b, heads, lq, lk)
        torch.testing.assert_close(result[1].double(), expected_w, atol=1e-6, rtol=1e-4)


def test_skipping_padded_keys_changes_nothing_with_causal():
    # Longest valid length 3 of 8 keys: keys 3.. are skipped, and the causal mask must still
    # be aligned to the full length.
    mha = _mha()
    x = torch.randn(2, 8, 16)
    valid_lens = torch.tensor([3, 2])
    with torch.no_grad():
        out, weights = mha(x, x, x, valid_lens, causal=True, return_weights=True)
    expected, expected_w = _naive_mha(mha, x, x, x, _visible(valid_lens, 8, 8, True))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights.double(), expected_w, atol=1e-6, rtol=1e-4)
    # Decoding-style: 3 queries, 8 keys, lower-right alignment with padding skipped.
    with torch.no_grad():
        out = mha(x[:, -3:], x, x, torch.tensor([6, 8]), causal=True)
    expected, _ = _naive_mha(mha, x[:, -3:], x, x, _visible(torch.tensor([6, 8]), 3, 8, True))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)


def test_gradients_flow_and_stay_finite_with_empty_rows():
    mha = MultiHeadAttention(16, 4, dropout=0.1).train()
    x = torch.randn(2, 6, 16, requires_grad=True)
    out = mha(x, x, x, torch.tensor([0, 4]), causal=True)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())


def test_cross_attention_sizes():
    mha = MultiHeadAttention(12, 3, query_size=5, key_size=7, value_size=2)
    out = mha(torch.randn(2, 4, 5), torch.randn(2, 9, 7), torch.randn(2, 9, 2))
    assert out.shape == (2, 4, 12)


def test_dtype_is_kept():
    for dtype in (torch.bfloat16, torch.float64):
        mha = _mha().to(dtype)
        x = torch.randn(2, 5, 16, dtype=dtype)
        assert mha(x, x, x, torch.tensor([2, 5])).dtype == dtype


def test_cache_token_by_token_equals_one_causal_pass():
    mha = _mha()
    x = torch.randn(2, 9, 16)
    valid_lens = torch.tensor([9, 5])
    with torch.no_grad():
        full = mha(x, x, x, valid_lens, causal=True)
        cache = KVCache(max_len=9)
        steps = [
            mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], valid_lens, causal=True, cache=cache)
            for t in range(9)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-5)
    assert cache.length == 9
    with torch.no_grad():  # a prompt of 4, then one token at a time
        cache = KVCache(max_len=9)
        first = mha(x[:, :4], x[:, :4], x[:, :4], causal=True, cache=cache)
        rest = [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), mha(x, x, x, causal=True), atol=1e-6, rtol=1e-5)


def test_chapter_shape_check():
    attention = MultiHeadAttention(100, 5, 0.5)
    X = torch.ones((2, 4, 100))
    assert attention(X, X, X, torch.tensor([3, 2])).shape == (2, 4, 100)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MultiHeadAttention(10, 3), "num_hiddens=10 is not divisible by num_heads=3"),
        (lambda: MultiHeadAttention(0, 1), "num_hiddens must be a positive integer, got 0"),
        (lambda: MultiHeadAttention(8, -2), "num_heads must be a positive integer, got -2"),
        (lambda: MultiHeadAttention(8, 2, key_size=0), "key_size must be a positive integer, got 0"),
        (lambda: MultiHeadAttention(8, 2, dropout=2), "dropout must be a probability in"),
        (
            lambda: MultiHeadAttention(8, 2, position=SinusoidalPositionalEncoding(8)),
            "add input encodings to the input",
        ),
        (lambda: KVCache(0), "max_len must be a positive integer, got 0"),
    ],
)
def test_constructor_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m, x: m(x, x, x, torch.tensor([1, 2, 3])),
            r"valid_lens must have shape \(2,\) or \(2, 5\), got \(3,\)",
        ),
        (lambda m, x: m(x, x, x, torch.tensor([-1, 2])), r"valid_lens must lie in \[0, 5\].*\[-1, 2\]"),
        (lambda m, x: m(x, x, x, torch.tensor([6, 2])), r"valid_lens must lie in \[0, 5\].*\[6, 2\]"),
        (lambda m, x: m(x, x, x, torch.tensor([1.5, 2.0])), r"valid_lens must hold whole numbers, got \[1.5, 2.0\]"),
        (lambda m, x: m(x, x, x, torch.tensor([True, False])), "valid_lens must hold integer lengths"),
        (lambda m, x: m(x, x, x, offset=-4), "offset must be a non-negative integer, got -4"),
        (lambda m, x: m(x[..., :7], x, x), r"queries must have shape \(batch, length, 8\), got \(2, 5, 7\)"),
        (lambda m, x: m(x, x[0], x), r"keys must have shape \(batch, length, 8\), got \(5, 8\)"),
        (lambda m, x: m(x, x, x[:, :3]), "keys and values must have the same length, got 5 and 3"),
        (lambda m, x: m(x[:1], x, x), "queries, keys and values must share the batch size, got 1, 2, 2"),
        (lambda m, x: m(x.long(), x, x), "queries must be floating point"),
        (
            lambda m, x: [m(x, x, x, cache=c) for c in [KVCache(6)] for _ in range(2)],
            "cache overflow: 5 positions stored",
        ),
    ],
)
def test_forward_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(MultiHeadAttention(8, 2), torch.randn(2, 5, 8))


def test_float_valid_lens_are_accepted_as_the_textbook_does():
    mha = _mha()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x, x, torch.tensor([3.0, 2.0])), mha(x, x, x, torch.tensor([3, 2])))
