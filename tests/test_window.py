"""Sliding-window attention == dense attention with a band mask; the windowed cache keeps O(w) keys."""

import pytest
import torch
from reference_mha import ENCODINGS, make_encoding, naive_mha, visibility
from routes import WINDOW_ROUTES, without_routes

from selfattn import KVCache, MultiHeadAttention

D, H = 8, 2


def _mha(name, window, **kwargs):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    return MultiHeadAttention(D, H, position=position, window=window, **kwargs).double().eval()


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_window_matches_band_mask(name, causal):
    # window 3: 24-query blocks, so 60 tokens take the blocked path and 9 the dense one.
    for length in (60, 9):
        mha = _mha(name, 3)
        x = torch.randn(2, length, D, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
        valid_lens = torch.tensor([length, length - 7])
        route = mha.explain(x, x, x, valid_lens, causal=causal).route
        if name == "shaw":  # its value term needs the weights: blocks at any length
            assert route == "blockwise clipped"
        else:
            assert (route == "banded") == (length == 60)
        with torch.no_grad():
            out = mha(x, x, x, valid_lens, causal=causal)
        visible = visibility(2, length, length, causal=causal, window=3, valid_lens=valid_lens.tolist())
        positions = torch.arange(length).expand(2, length)
        expected, _ = naive_mha(mha, x, x, x, visible, positions, positions)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)


def test_window_with_documents_and_gradients():
    mha = _mha("alibi", 5, num_kv_heads=1)
    length = 100
    documents = torch.tensor([[0] * 30 + [1] * 70, [0] * 99 + [1]])
    x = torch.randn(2, length, D, dtype=torch.float64, requires_grad=True)
    assert mha.explain(x, x, x, causal=True, document_ids=documents).route == "banded"
    out = mha(x, x, x, causal=True, document_ids=documents)
    mha_dense = _mha("alibi", 5, num_kv_heads=1)
    mha_dense.load_state_dict(mha.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    with without_routes(*WINDOW_ROUTES):  # the same module on the dense band mask
        dense = mha_dense(x2, x2, x2, causal=True, document_ids=documents)
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    dense.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-12, rtol=1e-10)
    restart = torch.cat([torch.arange(30), torch.arange(70)])[None]
    visible = visibility(1, length, length, causal=True, window=5, documents=documents[:1].tolist())
    expected, _ = naive_mha(mha, x[:1].detach(), x[:1].detach(), x[:1].detach(), visible, restart, restart)
    torch.testing.assert_close(out[:1].detach(), expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ["rotary", "t5"])
def test_window_cache_keeps_only_the_window(name):
    mha = _mha(name, 4)
    x = torch.randn(2, 20, D, dtype=torch.float64)
    cache = KVCache(window=4)
    with torch.no_grad():
        prefix = mha(x[:, :6], x[:, :6], x[:, :6], causal=True, cache=cache)
        steps = [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(6, 20)]
        full = mha(x, x, x, causal=True)
        _, weights = mha(x[:, :1], x[:, :1], x[:, :1], causal=True, cache=KVCache(window=4), return_weights=True)
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, atol=1e-12, rtol=1e-10)
    assert cache._keys.shape[-2] == 3 and cache.length == 20  # O(window) storage after 20 tokens
    assert weights.shape == (2, H, 1, 1)


def test_window_errors():
    with pytest.raises(ValueError, match="window must be a positive integer"):
        MultiHeadAttention(8, 2, window=0)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        KVCache()
    mha = MultiHeadAttention(8, 2, window=4)
    x = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="cache keeps only a window of 2 keys, and this layer has window=4"):
        mha(x, x, x, cache=KVCache(window=2))
    with pytest.raises(ValueError, match="this layer has window=None"):
        MultiHeadAttention(8, 2)(x, x, x, cache=KVCache(window=2))


def test_window_with_key_padding_per_query_lengths_and_a_windowed_prefill():
    mha = _mha("rotary", 3)
    length = 60
    x = torch.randn(2, length, D, dtype=torch.float64)
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[0, :5] = True
    padding[1, 30:33] = True
    per_query = torch.randint(0, length + 1, (2, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand(2, length)
    with torch.no_grad():
        prefill = mha(x, x, x, causal=True, key_padding_mask=padding, cache=KVCache(window=3))
        lens = mha(x, x, x, per_query, causal=True)
    visible = visibility(2, length, length, causal=True, window=3, key_padding=padding.tolist())
    expected, _ = naive_mha(mha, x, x, x, visible, positions, positions)
    torch.testing.assert_close(prefill, expected, atol=1e-10, rtol=1e-9)
    visible = visibility(2, length, length, causal=True, window=3, valid_lens=per_query.tolist())
    expected, _ = naive_mha(mha, x, x, x, visible, positions, positions)
    torch.testing.assert_close(lens, expected, atol=1e-10, rtol=1e-9)
