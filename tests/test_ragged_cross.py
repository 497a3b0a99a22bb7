"""Ragged batches read self-attention's keys once; distinct keys and values stay distinct.

Keys and values given as two tensors (cross-attention of equal lengths) must each reach their
own projection, with their own gradients, on the grouped path as on the single masked call.
"""

import importlib

import pytest
import torch

from selfattn import MultiHeadAttention

attention_module = importlib.import_module("selfattn.attention")  # the module, not the function selfattn.attention
call_module = importlib.import_module("selfattn.core.call")

D, H, L = 16, 4, 8


@pytest.mark.parametrize(
    "lengths", [[8, 3, 3, 5], [5, 3, 5, 3], [6, 6, 6, 6]], ids=["full-row", "trimmed", "one-group"]
)
def test_distinct_keys_and_values_match_the_masked_call(lengths, monkeypatch):
    torch.manual_seed(5)
    mha = MultiHeadAttention(D, H, num_kv_heads=2, bias=True).double()
    b = len(lengths)
    valid_lens = torch.tensor(lengths)
    queries, keys, values = (torch.randn(b, L, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert mha.explain(queries, keys, values, valid_lens).route == "ragged"
    out = mha(queries, keys, values, valid_lens)
    grad = torch.randn_like(out)
    grouped = torch.autograd.grad(out, (queries, keys, values, *mha.parameters()), grad)
    monkeypatch.setattr(call_module, "MAX_LENGTH_GROUPS", 0)  # one masked call instead
    masked = mha(queries, keys, values, valid_lens)
    torch.testing.assert_close(out, masked, atol=1e-12, rtol=1e-10)
    expected = torch.autograd.grad(masked, (queries, keys, values, *mha.parameters()), grad)
    for a, b_ in zip(grouped, expected, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-10, rtol=1e-9)
    assert grouped[2].abs().sum() > 0 and all(bool((grouped[2][i, lengths[i] :] == 0).all()) for i in range(b))


def test_self_attention_with_trimmed_keys_matches_the_masked_call(monkeypatch):
    torch.manual_seed(6)
    mha = MultiHeadAttention(D, H).double()
    valid_lens = torch.tensor([5, 2, 5, 2])  # every key past 5 is skipped before the projections
    x = torch.randn(4, L, D, dtype=torch.float64, requires_grad=True)
    out = mha(x, x, x, valid_lens)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x)
    monkeypatch.setattr(call_module, "MAX_LENGTH_GROUPS", 0)
    masked = mha(x, x, x, valid_lens)
    (expected,) = torch.autograd.grad(masked.square().sum(), x)
    torch.testing.assert_close(out, masked, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad_x, expected, atol=1e-10, rtol=1e-9)
