"""Grouped-query attention: equal to repeating each kv head for its group of query heads."""

import numpy as np
import pytest
import torch
from reference import naive_attention
from reference_mha import ENCODINGS, make_encoding, naive_mha, visibility

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import attention

D, H = 16, 4


def _pair(name, num_kv_heads, bias=False):
    """A grouped module and a full-head one whose W_k/W_v rows repeat kv head j for query heads j*g..j*g+g-1."""
    torch.manual_seed(0)
    grouped = (
        MultiHeadAttention(D, H, num_kv_heads=num_kv_heads, bias=bias, position=make_encoding(name, D, H))
        .double()
        .eval()
    )
    full = MultiHeadAttention(D, H, bias=bias, position=grouped.position).double().eval()
    dh, g = D // H, H // num_kv_heads
    with torch.no_grad():
        for name_ in ("W_q", "W_o"):
            getattr(full, name_).load_state_dict(getattr(grouped, name_).state_dict())
        for name_ in ("W_k", "W_v"):
            src, dst = getattr(grouped, name_), getattr(full, name_)
            for head in range(H):
                rows = slice((head // g) * dh, (head // g + 1) * dh)
                dst.weight[head * dh : (head + 1) * dh] = src.weight[rows]
                if bias:
                    dst.bias[head * dh : (head + 1) * dh] = src.bias[rows]
    return grouped, full


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_grouped_equals_repeated_heads(name, num_kv_heads):
    grouped, full = _pair(name, num_kv_heads, bias=True)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    valid_lens = torch.tensor([6, 4])
    with torch.no_grad():
        for kwargs in ({}, {"causal": True}, {"return_weights": True}):
            a, b = grouped(x, x, x, valid_lens, **kwargs), full(x, x, x, valid_lens, **kwargs)
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    expected, _ = naive_mha(
        grouped,
        x,
        x,
        x,
        visibility(2, 6, 6, valid_lens=[6, 4]),
        torch.arange(6).expand(2, 6),
        torch.arange(6).expand(2, 6),
    )
    with torch.no_grad():
        torch.testing.assert_close(grouped(x, x, x, valid_lens), expected, atol=1e-10, rtol=1e-9)


def test_state_dict_shapes_and_cache_heads():
    mha = MultiHeadAttention(32, 8, num_kv_heads=2)
    shapes = {k: tuple(v.shape) for k, v in mha.state_dict().items()}
    assert shapes == {"W_q.weight": (32, 32), "W_k.weight": (8, 32), "W_v.weight": (8, 32), "W_o.weight": (32, 32)}
    cache = KVCache(max_len=4)
    x = torch.randn(3, 2, 32)
    with torch.no_grad():
        mha(x, x, x, causal=True, cache=cache)
    assert cache._keys.shape == (3, 2, 4, 4)
    assert "num_kv_heads=2" in repr(mha)


def test_grouped_cache_decoding_equals_full_recompute():
    grouped, _ = _pair("rotary", 2)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    cache = KVCache(max_len=5)
    with torch.no_grad():
        steps = [grouped(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(5)]
        full = grouped(x, x, x, causal=True)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-10)


def test_functional_grouped_kv_without_copies():
    q, k, v = torch.randn(2, 6, 5, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 3)
    repeated = attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal=True)
    torch.testing.assert_close(attention(q, k, v, causal=True), repeated, atol=1e-6, rtol=1e-5)
    out, weights = attention(q, k, v, return_weights=True)
    torch.testing.assert_close(
        out, attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)), atol=1e-6, rtol=1e-5
    )
    assert weights.shape == (2, 6, 5, 5)
    v = torch.randn(2, 2, 5, 4)  # the flash kernel wants equal head sizes; with unequal ones torch's math path repeats
    with torch.profiler.profile() as prof:
        attention(q, k, v, causal=True)
    assert not any("repeat_interleave" in e.key for e in prof.key_averages()), "kv heads were copied"
    with pytest.raises(ValueError, match="may have a divisor of q's heads"):
        attention(q, torch.randn(2, 4, 5, 4), torch.randn(2, 4, 5, 3))


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_unmasked_grouped_heads_as_rows_of_their_kv_head_equal_the_loop(monkeypatch, num_queries, dtype):
    """From 512 keys the unmasked kernel call lays each kv head's query heads out as its rows (fused_unmasked):
    outputs and gradients equal the float64 loop, a NaN query gives NaN in its own row only, and
    non-contiguous heads (a cache's narrowed view, a transposed projection) are read right."""
    import selfattn.functional._unmasked as kernels

    kernel_queries = []
    real_kernel = kernels._fused_kernel
    monkeypatch.setattr(
        kernels, "_fused_kernel", lambda q, *args, **kw: kernel_queries.append(q.shape) or real_kernel(q, *args, **kw)
    )
    lk = kernels._ROWS_MIN_KEYS + 37
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, num_queries, 6, 16, generator=gen, dtype=torch.float64).transpose(1, 2)  # (b, h, lq, d)
    storage = torch.randn(2, 2, lk + 9, 16, generator=gen, dtype=torch.float64)
    k, v = storage[:, :, :lk], torch.randn(2, 2, lk, 16, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, causal=num_queries == 1)  # one query after the keys: its causal rule hides nothing
    repeat = lambda t: t.detach().double().repeat_interleave(3, 1).numpy()  # noqa: E731
    visible = np.ones((2, 6, num_queries, lk), dtype=bool)
    expected, _ = naive_attention(q.detach().double().numpy(), repeat(k), repeat(v), visible)
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(out.detach().double().numpy(), expected, atol=tolerance, rtol=tolerance)
    assert kernel_queries == [(2, 2, 3 * num_queries, 16)]  # the rows' layout was used
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    reference = torch.softmax(q64 @ k64.repeat_interleave(3, 1).transpose(-1, -2) / 4, dim=-1) @ v64.repeat_interleave(
        3, 1
    )
    reference.sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=tolerance * 10, rtol=tolerance * 10)
    with torch.no_grad():
        poisoned = q.detach().clone()
        poisoned[1, 4, -1, 3] = float("nan")
        rows = attention(poisoned, k.detach(), v.detach())
    assert rows[1, 4, -1].isnan().all()
    assert not rows[1, :4].isnan().any() and not rows[0].isnan().any() and not rows[1, 5].isnan().any()


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["GQA", "MQA"])
def test_a_direct_grouped_call_goes_as_rows_from_its_threshold(monkeypatch, num_queries, dtype, kv_heads):
    """A call with no gradient wanted lays grouped heads out as rows of their kv head, one query from b * h * lk *
    d = _ROWS_MIN_WORK (here 342 keys: b 2, h 6, d 16), several from _ROWS_MIN_KEYS, and not one key before,
    through fused_unmasked and through a step made for the kind at 40 keys alike: both give the same answer bit
    for bit, the float64 loop's within rounding, NaN in the row of a query holding NaN or an infinity and in no
    other row, and read a cache's narrowed keys and a transposed projection's (non-viewable) queries right."""
    import selfattn.functional._unmasked as unmasked

    rows_calls = []
    real_rows = unmasked._grouped_rows
    monkeypatch.setattr(unmasked, "_grouped_rows", lambda q, *a: rows_calls.append(q.shape) or real_rows(q, *a))
    gen = torch.Generator().manual_seed(kv_heads)

    def heads_of(lk):
        q = torch.randn(2, num_queries, 6, 16, generator=gen, dtype=dtype).transpose(1, 2)  # (b, h, lq, d) view
        storage = torch.randn(2, kv_heads, lk + 5, 16, generator=gen, dtype=dtype)
        return q, storage[:, :, :lk], torch.randn(2, kv_heads, lk, 7, generator=gen, dtype=dtype)

    threshold = 342 if num_queries == 1 else unmasked._ROWS_MIN_KEYS
    assert unmasked._rows_from_keys(heads_of(1)[0]) == threshold
    with torch.no_grad():
        step = unmasked.unmasked_step(*heads_of(40), 0.3)
        for lk in (16, threshold - 1, threshold, threshold + 58):
            q, k, v = heads_of(lk)
            q[1, 0, -1, 2], q[1, 3, 0, 3], q[0, 5, -1, 4] = float("inf"), float("-inf"), float("nan")
            rows_calls.clear()
            out = step(q, k, v)
            torch.testing.assert_close(out, unmasked.fused_unmasked(q, k, v, scale=0.3), rtol=0, atol=0, equal_nan=True)
            assert rows_calls == ([(2, 6, num_queries, 16)] * 2 if lk >= threshold else []), lk
            poisoned = torch.zeros(2, 6, num_queries, dtype=torch.bool)
            poisoned[1, 0, -1] = poisoned[1, 3, 0] = poisoned[0, 5, -1] = True
            assert out[poisoned].isnan().all() and not out[~poisoned].isnan().any()
            clean = q.masked_fill(poisoned[..., None], 0.0)
            repeat = lambda t: t.double().repeat_interleave(6 // kv_heads, 1).numpy()  # noqa: E731
            visible = np.ones((2, 6, num_queries, lk), dtype=bool)
            expected, _ = naive_attention(clean.double().numpy(), repeat(k), repeat(v), visible, scale=0.3)
            tolerance = 1e-12 if dtype == torch.float64 else 2e-6
            got = step(clean, k, v).double().numpy()
            np.testing.assert_allclose(got, expected, atol=tolerance, rtol=tolerance)


def test_num_kv_heads_errors():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        MultiHeadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer"):
        MultiHeadAttention(16, 4, num_kv_heads=0)
