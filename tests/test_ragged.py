"""Ragged batches: one fused call per distinct valid length gives the masked answer and its gradients."""

import importlib

import pytest
import torch
from reference_mha import make_encoding, naive_mha, visibility

from selfattn import MultiHeadAttention

attention_module = importlib.import_module("selfattn.attention")  # the module, not the function selfattn.attention
call_module = importlib.import_module("selfattn.core.call")

D, H = 16, 4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["none", "rotary"])
def test_grouped_lengths_match_naive_and_masked_gradients(causal, name, monkeypatch):
    position = make_encoding(name, D, H)
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=position, num_kv_heads=2).double()
    lengths = [3, 7, 0, 3]
    valid_lens = torch.tensor(lengths)
    x = torch.randn(4, 7, D, dtype=torch.float64, requires_grad=True)
    assert mha.explain(x, x, x, valid_lens, causal=causal).route == "ragged"
    out = mha(x, x, x, valid_lens, causal=causal)
    positions = torch.arange(7).expand(4, 7)
    expected, _ = naive_mha(mha, x, x, x, visibility(4, 7, 7, causal=causal, valid_lens=lengths), positions, positions)
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)
    grad = torch.randn_like(out)
    grouped_grads = torch.autograd.grad(out, (x, *mha.parameters()), grad)
    monkeypatch.setattr(call_module, "MAX_LENGTH_GROUPS", 0)  # one masked call instead
    masked = mha(x, x, x, valid_lens, causal=causal)
    masked_grads = torch.autograd.grad(masked, (x, *mha.parameters()), grad)
    for a, b in zip(grouped_grads, masked_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


def test_many_lengths_fall_back_to_one_masked_call():
    mha = MultiHeadAttention(D, H)
    lengths = torch.arange(1, 11)
    x10 = torch.randn(10, 10, D)
    assert mha.explain(x10, x10, x10, lengths).route == "fused"
    x3 = torch.randn(3, 10, D)
    assert mha.explain(x3, x3, x3, lengths[:3], return_weights=True).route == "explicit"  # one explicit call
    assert mha.explain(x3, x3, x3, lengths[:3]).route == "ragged"
