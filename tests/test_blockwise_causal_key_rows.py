"""Causal attention with ALiBi through the flash kernel, chunk by chunk (`_CausalKeyRows`), against dense float64."""

from __future__ import annotations

import pytest
import torch

from selfattn.functional import _block_key_rows, blockwise_attention
from selfattn.positional import build

HEADS, HEAD_DIM = 4, 3


def _dense_causal(q, k, v, term, q_positions, k_positions):
    """softmax(q k^T / sqrt(d) + term, causal) v, written out densely."""
    scores = q @ k.transpose(-2, -1) / HEAD_DIM**0.5 + term(q, q_positions=q_positions, k_positions=k_positions)
    length = q.shape[-2]
    hidden = torch.arange(length)[None, :] > torch.arange(length)[:, None]  # (l, l)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


def _qkv(b, length, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
        for _ in range(3)
    ]


@pytest.fixture
def count_causal_calls(monkeypatch):
    """Counts the flash calls made with the kernel's own causal mask (only this route makes them)."""
    calls = []
    flash = _block_key_rows._flash_forward

    def counting(*args, **kwargs):
        calls.append(bool(kwargs.get("is_causal", False)))
        return flash(*args, **kwargs)

    monkeypatch.setattr(_block_key_rows, "_flash_forward", counting)
    return calls


@pytest.mark.parametrize("positions", ["default", "offset", "per_batch"])
def test_small_chunks_equal_dense_attention_with_gradients(monkeypatch, count_causal_calls, positions):
    monkeypatch.setattr(_block_key_rows, "CAUSAL_CHUNK", 4)  # 10 queries: chunks of 4, 4 and 2
    term = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS).double()
    b, length = 2, 10
    q, k, v = _qkv(b, length)
    if positions == "default":
        qp = kp = torch.arange(length)
    elif positions == "offset":
        qp = kp = torch.arange(1000, 1000 + length)
    else:
        qp = kp = torch.stack([torch.arange(length), torch.arange(7, 7 + length)])  # (b, l)
    kwargs = {} if positions == "default" else {"q_positions": qp, "k_positions": kp}
    got = blockwise_attention(q, k, v, term=term, causal=True, **kwargs)
    assert sum(count_causal_calls) == 3  # one diagonal tile per chunk
    want = _dense_causal(q, k, v, term, qp, kp)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for g_got, g_want in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-11)


def test_gradcheck_and_gradgradcheck_in_float64(monkeypatch):
    monkeypatch.setattr(_block_key_rows, "CAUSAL_CHUNK", 3)
    term = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS).double()
    q, k, v = _qkv(1, 7, seed=4)

    def run(q, k, v):
        return blockwise_attention(q, k, v, term=term, causal=True)

    assert torch.autograd.gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradgradcheck(run, (q, k, v), atol=1e-6, rtol=1e-4)


def test_float32_at_the_default_chunk_stays_close_to_float64(count_causal_calls):
    """Several default chunks (the row anchored per chunk keeps float32 near the term's own precision)."""
    term = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS)
    length = 2 * _block_key_rows.CAUSAL_CHUNK + 37
    q, k, v = _qkv(1, length, dtype=torch.float32, seed=2)
    with torch.no_grad():
        got = blockwise_attention(q, k, v, term=term, causal=True)
        want = _dense_causal(
            q.double(), k.double(), v.double(), term.double(), torch.arange(length), torch.arange(length)
        )
    assert sum(count_causal_calls) == 3
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_other_cases_keep_their_routes(count_causal_calls):
    """A set block size, a mask, fewer queries than keys, or the bidirectional form do not take this route."""
    term = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS).double()
    q, k, v = _qkv(1, 6)
    with torch.no_grad():
        blockwise_attention(q, k, v, term=term, causal=True, block_size=2)
        blockwise_attention(q, k, v, term=term, causal=True, valid_lens=torch.tensor([4]))
        blockwise_attention(q[..., 2:, :], k, v, term=term, causal=True)
        both_ways = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS, causal=False).double()
        blockwise_attention(q, k, v, term=both_ways, causal=True)
    assert not any(count_causal_calls)


def test_a_nan_in_a_query_gives_nan_in_its_row_only(monkeypatch):
    monkeypatch.setattr(_block_key_rows, "CAUSAL_CHUNK", 4)
    term = build("alibi", num_hiddens=HEADS * HEAD_DIM, num_heads=HEADS)
    q, k, v = _qkv(1, 9, dtype=torch.float32)
    q = q.detach().clone()
    q[0, 1, 6, 0] = float("nan")
    out = blockwise_attention(q, k.detach(), v.detach(), term=term, causal=True)
    assert torch.isnan(out[0, 1, 6]).all()
    nan_rows = torch.isnan(out).any(dim=-1)
    assert nan_rows.sum() == 1
