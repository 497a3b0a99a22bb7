"""Second-order gradients through the fused attention path (create_graph=True, gradgradcheck)."""

import pytest
import torch
from torch.autograd import gradgradcheck

from selfattn import MultiHeadAttention
from selfattn.functional import attention
from selfattn.positional import build


@pytest.mark.parametrize("name", ["none", "rotary", "alibi", "t5"])
def test_gradgradcheck_multihead_attention(name):
    torch.manual_seed(0)
    position = None if name == "none" else build(name, num_hiddens=4, num_heads=2)
    mha = MultiHeadAttention(4, 2, position=position, num_kv_heads=1).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    valid_lens = torch.tensor([3, 2])

    def f(x):
        return mha(x, x, x, valid_lens, causal=True)

    assert gradgradcheck(f, (x,))


def test_gradient_penalty_runs_and_first_order_grads_unchanged():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    out = attention(q, k, v, bias=bias, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias), create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    penalty.backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, bias))
    plain = torch.autograd.grad(attention(q, k, v, bias=bias, causal=True).square().sum(), (q, k, v, bias))
    explicit = attention(q, k, v, bias=bias, causal=True, return_weights=True)[0]
    reference = torch.autograd.grad(explicit.square().sum(), (q, k, v, bias))
    for a, b, c in zip(grads, plain, reference, strict=True):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(b, c, atol=1e-12, rtol=1e-10)
