"""Blockwise dropout after its pass reductions: gradients against a dense float64 reference with the same mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from selfattn.functional import blockwise_attention
from selfattn.functional._block_common import _add_matmul
from selfattn.functional._block_plan import _Plan
from selfattn.functional._dropout_masks import _keep_mask

HEADS, HEAD_DIM = 2, 3


def _dense_dropout(q, k, v, keep_masks, *, block, p, visible):
    """Dense attention whose weights are multiplied by the given per-block keep masks and divided by keep."""
    from selfattn.functional import dropout_keep_probability

    scores = q @ k.transpose(-2, -1) / HEAD_DIM**0.5  # (b, h, lq, lk)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    keep = torch.cat(keep_masks, dim=-2).to(weights.dtype)  # (b, h, lq, lk)
    out = (weights * keep / dropout_keep_probability(p)) @ v
    return out.masked_fill(empty, 0.0)


@pytest.mark.parametrize("block", [3, 8])
def test_dropout_alone_equals_dense_dropout_with_the_same_mask_forward_and_backward(block):
    """No score term (the route whose dropped weights are made in place late in the backward pass)."""
    gen = torch.Generator().manual_seed(3)
    b, lq, lk, p = 2, 7, 7, 0.3
    q, k, v = (
        torch.randn(b, HEADS, n, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True) for n in (lq, lk, lk)
    )
    valid_lens = torch.tensor([[7, 2, 5, 0, 7, 1, 3], [4, 4, 4, 4, 4, 4, 4]])  # row 3 of batch 0 sees nothing
    columns = torch.arange(lk)
    visible = (columns < valid_lens[..., None])[:, None]  # (b, 1, lq, lk)
    visible = visible.expand(b, HEADS, lq, lk)
    torch.manual_seed(5)
    got = blockwise_attention(q, k, v, valid_lens=valid_lens, dropout_p=p, block_size=block)
    # The seed the call drew: redraw it the same way, then the per-block masks.
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**62, (1,)).item())
    plan = SimpleNamespace(seed=seed)  # block_seed reads .seed only
    masks = [
        _keep_mask(
            (b, HEADS, min(start + block, lq) - start, lk), _Plan.block_seed(plan, index), p, torch.device("cpu")
        )
        for index, start in enumerate(range(0, lq, block))
    ]
    want = _dense_dropout(q, k, v, masks, block=block, p=p, visible=visible)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got[0, :, 3], torch.zeros_like(got[0, :, 3]))
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(g_got).all()
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10)


def test_dropout_alone_passes_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(1, HEADS, 6, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )

    def run(q, k, v):
        torch.manual_seed(21)
        return blockwise_attention(q, k, v, causal=True, dropout_p=0.4, block_size=4)

    assert torch.autograd.gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)


def test_add_matmul_adds_in_place_and_falls_back_for_broadcast_operands():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    a = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64)
    want = target + a @ b
    view = target[..., :5, :]
    _add_matmul(view, a, b)
    torch.testing.assert_close(target, want, rtol=0, atol=1e-12)
    # A key slice of a longer tensor (the causal blocks' view), and operands broadcast over heads.
    full = torch.randn(2, 3, 8, 4, generator=gen, dtype=torch.float64)
    expected = full.clone()
    expected[..., :5, :] += a[:, :1] @ b
    _add_matmul(full[..., :5, :], a[:, :1], b)
    torch.testing.assert_close(full, expected, rtol=0, atol=1e-12)
    expected[..., :5, :] += a @ b
    _add_matmul(full[..., :5, :], a, b)
    torch.testing.assert_close(full, expected, rtol=0, atol=1e-12)
