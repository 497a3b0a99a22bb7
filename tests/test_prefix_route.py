"""The prefix-LM route: ``causal() | prefix(P)`` as a causal call and a ``P x P`` call, against loop references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selfattn import MultiHeadAttention, masks
from tests.reference_mha import naive_mha

D, H = 16, 4


def _prefix_lm_visibility(b: int, n: int, prefix) -> np.ndarray:
    """Bool (b, n, n) from loops: query i sees key j when j <= i, or when both are in the sequence's prefix."""
    lengths = [prefix] * b if isinstance(prefix, int) else list(prefix)
    vis = np.zeros((b, n, n), dtype=bool)
    for s in range(b):
        for i in range(n):
            for j in range(n):
                vis[s, i, j] = j <= i or (i < lengths[s] and j < lengths[s])
    return vis


@pytest.mark.parametrize(
    ("n", "prefix", "kv_heads"),
    [(23, 7, H), (40, 1, 2), (33, 32, 1), (23, 0, H), (23, 23, 2), (23, [4, 9, 0, 30], 2), (19, [5, 5, 5, 5], H)],
)
def test_prefix_lm_equals_the_loop_reference_forward_and_backward(n, prefix, kv_heads):
    torch.manual_seed(0)
    b = 4
    mha = MultiHeadAttention(D, H, num_kv_heads=kv_heads, dtype=torch.float64).eval()
    x = torch.randn(b, n, D, dtype=torch.float64, requires_grad=True)
    rule = masks.causal() | masks.prefix(prefix if isinstance(prefix, int) else torch.tensor(prefix))
    assert mha.explain(x, x, x, mask=rule).route == "prefix"
    out = mha(x, x, x, mask=rule)
    positions = torch.arange(n).expand(b, n)
    visible = _prefix_lm_visibility(b, n, prefix)
    expected, _ = naive_mha(mha, x, x, x, visible, positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # Gradients against the same module given the same mask as a dense bool tensor (the fused route).
    reference = mha(x, x, x, attn_mask=torch.from_numpy(visible))  # (b, n, n)
    grad = torch.randn_like(out)
    params = [x, *mha.parameters()]
    for got, want in zip(
        torch.autograd.grad(out, params, grad), torch.autograd.grad(reference, params, grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    with torch.no_grad():  # in place, without the copy autograd needs
        torch.testing.assert_close(mha(x, x, x, mask=rule), expected, rtol=1e-10, atol=1e-10)


def test_prefix_order_and_other_rules():
    mha = MultiHeadAttention(D, H, dtype=torch.float64).eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    assert mha.explain(x, x, x, mask=masks.prefix(4) | masks.causal()).route == "prefix"
    with pytest.raises(ValueError, match=r"masks.prefix: lengths of shape \(3,\) has 3 sequences .* has 2 sequences"):
        mha.explain(x, x, x, mask=masks.causal() | masks.prefix(torch.tensor([4, 5, 6])))
    explained = mha.explain(x, x, x, mask=masks.window(3) | masks.prefix(4))
    assert ("prefix", "not causal() | prefix(lengths)") in explained.declined
    explained = mha.explain(x, x, x, mask=masks.causal() | masks.prefix(4), return_weights=True)
    assert explained.route != "prefix"
