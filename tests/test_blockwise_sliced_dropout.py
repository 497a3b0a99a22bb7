"""Dropout with no score term on CPU, slice by slice (``_SlicedAttention``).

References are dense float64 attention whose weights are multiplied by the same keep masks,
drawn here tile by tile from the documented seeding (call seed, slice, block index).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import selfattn.functional._block_sliced as blockwise
from selfattn.functional import blockwise_attention, dropout_keep_probability
from selfattn.functional._block_plan import _Plan
from selfattn.functional._block_sliced import _slice_seed, choose_slice_block
from selfattn.functional._dropout_masks import _keep_mask

HEADS, HEAD_DIM = 2, 3


@pytest.fixture
def sliced(monkeypatch):
    """Send even tiny calls to the per-slice route (it normally starts at SLICED_MIN_SCORES scores per slice)."""
    monkeypatch.setattr(blockwise, "SLICED_MIN_SCORES", 0)
    calls = []
    original = blockwise._SlicedAttention.apply
    monkeypatch.setattr(blockwise._SlicedAttention, "apply", lambda *args: calls.append(1) or original(*args))
    return calls


def _tile_masks(seed: int, p: float, batch: int, lq: int, lk: int, block: int, causal: bool) -> list[torch.Tensor]:
    """Per block of queries, ``(b, HEADS, rows, keys)`` keep masks, one tile per (batch, head) slice."""
    plan = SimpleNamespace(seed=seed)
    plan.block_seed = lambda index: _Plan.block_seed(plan, index)
    masks = []
    for index, start in enumerate(range(0, lq, block)):
        end = min(start + block, lq)
        keys = min(lk, max(end + lk - lq, 1)) if causal else lk
        tiles = [
            _keep_mask((end - start, keys), _slice_seed(plan, s, index), p, torch.device("cpu"))
            for s in range(batch * HEADS)
        ]
        masks.append(torch.stack(tiles).view(batch, HEADS, end - start, keys))
    return masks


def _dense(q, k, v, masks, *, p, visible):
    """Dense float64 attention, weights times the tile masks (padded with zeros past each block's keys) / keep."""
    lk = k.shape[-2]
    scores = (q @ k.transpose(-2, -1) / HEAD_DIM**0.5).masked_fill(~visible, float("-inf"))  # (b, h, lq, lk)
    empty = ~visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    keep = torch.cat([torch.nn.functional.pad(m, (0, lk - m.shape[-1])) for m in masks], dim=-2)
    out = (weights * keep.to(weights.dtype) / dropout_keep_probability(p)) @ v
    return out.masked_fill(empty, 0.0)


def _qkv(batch, lq, lk, seed=0, dtype=torch.float64, k_heads=HEADS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, lq, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, k_heads, lk, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, k_heads, lk, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


def _call_seed(torch_seed: int) -> int:
    torch.manual_seed(torch_seed)
    return int(torch.randint(0, 2**62, (1,)).item())


@pytest.mark.parametrize(
    ("lq", "lk", "block", "causal", "visibility"),
    [
        (7, 7, 3, False, "valid_lens_2d"),  # a block size that does not divide n, an empty row
        (8, 8, 4, True, None),
        (5, 9, 2, True, "valid_lens_1d"),  # causal with more keys than queries (a cache)
        (6, 6, 6, False, "mask"),
    ],
)
def test_sliced_dropout_equals_dense_dropout_with_the_same_masks(sliced, lq, lk, block, causal, visibility):
    b, p = 2, 0.3
    q, k, v = _qkv(b, lq, lk)
    columns, rows = torch.arange(lk), torch.arange(lq)[:, None]
    visible = torch.ones(b, HEADS, lq, lk, dtype=torch.bool)
    kwargs = {}
    if visibility == "valid_lens_2d":
        valid_lens = torch.tensor([[7, 2, 5, 0, 7, 1, 3], [4, 4, 4, 4, 4, 4, 4]])  # row 3 of batch 0 sees nothing
        kwargs["valid_lens"] = valid_lens
        visible = visible & (columns < valid_lens[..., None])[:, None]
    elif visibility == "valid_lens_1d":
        valid_lens = torch.tensor([9, 6])
        kwargs["valid_lens"] = valid_lens
        visible = visible & (columns < valid_lens[:, None])[:, None, None, :]
    elif visibility == "mask":
        mask = torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(4)) > 0.4
        kwargs["mask"] = mask
        visible = visible & mask
    if causal:
        visible = visible & (columns <= rows + lk - lq)
    torch.manual_seed(5)
    got = blockwise_attention(q, k, v, causal=causal, dropout_p=p, block_size=block, **kwargs)
    assert sliced, "the per-slice route did not run"
    want = _dense(q, k, v, _tile_masks(_call_seed(5), p, b, lq, lk, block, causal), p=p, visible=visible)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(g_got).all()
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10)


def test_keys_shared_by_heads_get_the_sum_of_their_gradients(sliced):
    b, lq, lk, p = 2, 6, 6, 0.25
    q, k, v = _qkv(b, lq, lk, seed=2, k_heads=1)  # (b, 1, lk, d): one key and value head for all
    torch.manual_seed(3)
    got = blockwise_attention(q, k, v, dropout_p=p, block_size=4)
    assert sliced
    visible = torch.ones(b, HEADS, lq, lk, dtype=torch.bool)
    want = _dense(q, k, v, _tile_masks(_call_seed(3), p, b, lq, lk, 4, False), p=p, visible=visible)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, dtype=torch.float64)
    for g_got, g_want in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
    ):
        assert g_got.shape == g_want.shape
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10)


def test_sliced_dropout_passes_gradcheck_and_gradgradcheck(sliced):
    q, k, v = (t.detach()[:1].requires_grad_(True) for t in _qkv(1, 5, 5, seed=8))

    def run(q, k, v):
        torch.manual_seed(21)
        return blockwise_attention(q, k, v, causal=True, dropout_p=0.4, block_size=2)

    assert torch.autograd.gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradgradcheck(run, (q, k, v), atol=1e-6, rtol=1e-4)


def test_sliced_dropout_does_not_depend_on_the_thread_count_and_restores_it():
    """Two threads send slices to one-thread workers; one thread runs them in turn: the same numbers."""
    gen = torch.Generator().manual_seed(1)
    # (b, h, 256, 16): 2**16 scores per slice, the smallest the route takes by default.
    q, k, v = (torch.randn(2, HEADS, 256, 16, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, HEADS, 256, 16, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            torch.manual_seed(6)
            out = blockwise_attention(q, k, v, dropout_p=0.2, block_size=64)
            results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), grad)))
            assert torch.get_num_threads() == count  # the workers' one thread each is theirs alone
    finally:
        torch.set_num_threads(threads)
    assert blockwise._slice_pool is not None and blockwise._slice_pool._max_workers == 2  # the workers ran
    for first, other in zip(results[0], results[1], strict=True):
        assert torch.equal(first, other)
    for first, other in zip(results[0], results[2], strict=True):
        assert torch.equal(first, other)


def test_bfloat16_runs_in_float32_and_keeps_its_dtype(sliced):
    q, k, v = (t.detach().float().requires_grad_(True) for t in _qkv(2, 6, 6, seed=4, dtype=torch.float32))
    low = [t.detach().bfloat16().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(2)
    want = blockwise_attention(*(t.detach().bfloat16().float() for t in (q, k, v)), dropout_p=0.3, block_size=4)
    torch.manual_seed(2)
    got = blockwise_attention(*low, dropout_p=0.3, block_size=4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in low)


def test_slice_block_rule():
    assert choose_slice_block(4096, 4096, dtype=torch.float32) == 128  # (128, 4096) float32 scores: 2 MiB
    assert choose_slice_block(16384, 16384, dtype=torch.float32) == 32
    assert choose_slice_block(16384, 16384, dtype=torch.bfloat16) == 32  # scores are float32
    assert choose_slice_block(4096, 4096, dtype=torch.float64) == 64
    assert choose_slice_block(10**6, 10**6, dtype=torch.float32) == 16
    assert choose_slice_block(100, 64, dtype=torch.float32) == 100  # never more than lq
