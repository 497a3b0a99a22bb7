"""The windowed cache with every encoding: decoding == the full windowed pass, storage O(window)."""

import pytest
import torch
from reference_mha import ENCODINGS, make_encoding, naive_mha, visibility

from selfattn import KVCache, MultiHeadAttention

D, H, W, L = 8, 2, 4, 30


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("chunks", [[6] + [1] * (L - 6), [5, 3, 10, 2, 10]], ids=["tokens", "chunks"])
def test_window_cache_decoding_equals_full_pass(name, chunks):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    mha = MultiHeadAttention(D, H, position=position, window=W, num_kv_heads=1).double().eval()
    x = torch.randn(2, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cache = KVCache(window=W)
    outs, start, stored = [], 0, []
    with torch.no_grad():
        for size in chunks:
            part = x[:, start : start + size]
            outs.append(mha(part, part, part, causal=True, cache=cache))
            stored.append(cache._keys.shape[-2])
            start += size
        full = mha(x, x, x, causal=True)
    positions = torch.arange(L).expand(2, L)
    expected, _ = naive_mha(mha, x, x, x, visibility(2, L, L, causal=True, window=W), positions, positions)
    torch.testing.assert_close(full, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-10)
    assert max(stored) == W - 1 and cache.length == L  # never more than the window keeps


def test_cache_reports_the_bytes_it_holds():
    """nbytes: the storage allocated at the first call (max_len positions), or a window's worth, and nothing before."""
    layer = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    full, windowed = KVCache(50), KVCache(window=8, sink_tokens=2)
    assert full.nbytes == windowed.nbytes == 0
    x = torch.randn(3, 20, 16)
    with torch.no_grad():
        layer(x, x, x, cache=full, causal=True)
        layer(x, x, x, cache=windowed, causal=True)
    float_bytes, long_bytes = 4, 8
    # keys and values (b, hk, max_len, dh) = (3, 2, 50, 4) each, positions (b, max_len) int64
    assert full.nbytes == 2 * 3 * 2 * 50 * 4 * float_bytes + 3 * 50 * long_bytes
    kept = 2 + 8 - 1  # sinks and the last window - 1 keys
    assert windowed.nbytes == 2 * 3 * 2 * kept * 4 * float_bytes + 3 * kept * long_bytes


@pytest.mark.parametrize("sink_tokens", [0, 2])
@pytest.mark.parametrize("prompt", [3, 40], ids=["shorter than the window", "longer"])
def test_a_windowed_cache_holds_copies_of_what_it_keeps(sink_tokens, prompt):
    """What it stores shares no memory with the caller's keys (changed in place, they leave it as it was) nor
    with a long prompt's keys it dropped (kept alive by a view, they would stay in memory); steps slide it."""
    cache = KVCache(window=8, sink_tokens=sink_tokens)
    keys = torch.randn(1, 2, prompt, 4)
    cache.update(keys, keys + 1)
    held = {t.untyped_storage().data_ptr() for t in (cache._keys, cache._values, cache._positions)}
    assert keys.untyped_storage().data_ptr() not in held
    kept = list(range(min(sink_tokens, prompt))) + list(range(max(prompt - 7, min(sink_tokens, prompt)), prompt))
    expected = keys[:, :, kept]  # a copy (advanced indexing)
    keys.add_(1.0)
    nothing = torch.zeros(1, 2, 0, 4)
    torch.testing.assert_close(cache.update(nothing, nothing).keys, expected, rtol=0, atol=0)
    for step in range(10):  # one token at a time: the oldest key past the sinks leaves
        token = torch.full((1, 2, 1, 4), float(step))
        seen = cache.update(token, token)
        assert seen.keys.shape[-2] == min(sink_tokens, prompt) + min(7, prompt - min(sink_tokens, prompt) + step) + 1
        torch.testing.assert_close(seen.keys[:, :, -1:], token, rtol=0, atol=0)


@pytest.mark.parametrize("sink_tokens", [0, 2])
@pytest.mark.parametrize("shared", [True, False], ids=["shared positions", "positions per sequence"])
def test_a_window_step_returns_and_keeps_what_an_update_does(sink_tokens, shared):
    """KVCache.write_window_step (a layer's decoding plan writes each step of a windowed cache with it) against
    update(..., commit=False) then commit, over steps that fill the window and slide it."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randn(2, 2, 3, 4, generator=gen)
    step_cache, update_cache = KVCache(window=5, sink_tokens=sink_tokens), KVCache(window=5, sink_tokens=sink_tokens)
    positions = None if shared else torch.tensor([[0, 1, 2], [4, 5, 6]])
    for cache in (step_cache, update_cache):
        cache.update(prompt, prompt * 2, positions=positions)
    for first in range(3, 12):
        token = torch.randn(2, 2, 1, 4, generator=gen)
        stepped = step_cache.write_window_step(token, token * 2, first)
        updated = update_cache.update(token, token * 2, positions=torch.tensor([first]), commit=False)
        assert stepped is not None
        for name, got, expected in zip(updated._fields, stepped, updated, strict=True):
            if expected is None or isinstance(expected, int):
                assert got == expected, (first, name)
            else:
                assert torch.equal(got, expected), (first, name)
        step_cache.commit()
        update_cache.commit()
    nothing = torch.zeros(2, 2, 0, 4)
    after_steps, after_updates = step_cache.update(nothing, nothing), update_cache.update(nothing, nothing)
    assert torch.equal(after_steps.keys, after_updates.keys) and torch.equal(
        after_steps.positions, after_updates.positions
    )


def test_a_window_step_writes_nothing_where_an_update_must_decide():
    token = torch.randn(1, 2, 1, 4)
    assert KVCache(window=4).write_window_step(token, token, 0) is None  # nothing stored yet
    assert KVCache(max_len=8).write_window_step(token, token, 0) is None  # no window
    cache = KVCache(window=4)
    cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), padding=torch.tensor([[True, False]]))
    assert cache.write_window_step(token, token, 2) is None  # padding held: the visibility reads it
    cache = KVCache(window=4)
    cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert cache.write_window_step(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), 2) is None  # other heads
    assert cache.write_window_step(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), 2) is None  # two entries
    assert cache.length == 2 and cache.write_window_step(token.double(), token.double(), 2) is None
    with pytest.raises(ValueError, match="do not fit a cache"):
        cache.update(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))  # what the full path then says
