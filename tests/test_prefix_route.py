"""The prefix-LM route: ``causal() | prefix(P)`` as a causal call and a ``P x P`` call, against loop references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selfattn import MultiHeadAttention, masks
from tests.reference_mha import naive_mha

D, H = 16, 4


def _prefix_lm_visibility(b: int, n: int, prefix: int) -> np.ndarray:
    """Bool (b, n, n) from loops: query i sees key j when j <= i, or when both are in the prefix."""
    vis = np.zeros((b, n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            vis[:, i, j] = j <= i or (i < prefix and j < prefix)
    return vis


@pytest.mark.parametrize(("n", "prefix", "kv_heads"), [(23, 7, H), (40, 1, 2), (33, 32, 1)])
def test_prefix_lm_equals_the_loop_reference_forward_and_backward(n, prefix, kv_heads):
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, num_kv_heads=kv_heads, dtype=torch.float64).eval()
    x = torch.randn(2, n, D, dtype=torch.float64, requires_grad=True)
    rule = masks.causal() | masks.prefix(prefix)
    assert mha.explain(x, x, x, mask=rule).route == "prefix"
    out = mha(x, x, x, mask=rule)
    positions = torch.arange(n).expand(2, n)
    expected, _ = naive_mha(mha, x, x, x, _prefix_lm_visibility(2, n, prefix), positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # Gradients against the same module given the same mask as a dense bool tensor (the fused route).
    dense = torch.from_numpy(_prefix_lm_visibility(1, n, prefix)[0])
    reference = mha(x, x, x, attn_mask=dense)
    grad = torch.randn_like(out)
    params = [x, *mha.parameters()]
    for got, want in zip(
        torch.autograd.grad(out, params, grad), torch.autograd.grad(reference, params, grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_prefix_order_and_other_rules():
    mha = MultiHeadAttention(D, H, dtype=torch.float64).eval()
    x = torch.randn(1, 12, D, dtype=torch.float64)
    assert mha.explain(x, x, x, mask=masks.prefix(4) | masks.causal()).route == "prefix"
    explained = mha.explain(x, x, x, mask=masks.causal() | masks.prefix(torch.tensor([4])))
    assert explained.route != "prefix"
    assert ("prefix", "not causal() | prefix(n) with an int n") in explained.declined
    explained = mha.explain(x, x, x, mask=masks.causal() | masks.prefix(12))
    assert ("prefix", "the prefix is empty or the whole sequence") in explained.declined
    explained = mha.explain(x, x, x, mask=masks.causal() | masks.prefix(4), return_weights=True)
    assert explained.route != "prefix"
