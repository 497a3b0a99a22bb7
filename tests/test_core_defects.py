"""The defects the attention-core redesign fixed, each a test that failed before it.

* A score term that depends on the query's absolute position was evaluated as relative (once,
  on one band): off on the default path, and fused and explicit paths disagreed under causal.
* A forward-only score term on CUDA went to FlexAttention and raised (see test_dispatch).
* A learnable score term under ``torch.func.functional_call`` got no gradient.
* float64 gradcheck of MultiHeadAttention with T5 failed.
"""

from __future__ import annotations

import pytest
import torch
from test_score_term_contract import AbsoluteTerm, _visible, reference

from selfattn import MultiHeadAttention
from selfattn.positional import build

D, H = 8, 2


def test_absolute_query_term_on_the_default_path_and_fused_equals_explicit():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=AbsoluteTerm(), block_size=8).double().eval()  # five blocks
    x = torch.randn(2, 40, D, dtype=torch.float64)
    with torch.no_grad():
        out = mha(x, x, x, causal=True)
        explicit, _ = mha(x, x, x, causal=True, return_weights=True)
    expected, _ = reference(mha, x, _visible(40, causal=True), torch.arange(40).expand(2, 40))
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out, explicit, atol=1e-10, rtol=1e-9)


def test_t5_gets_its_gradient_under_functional_call():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=build("t5", num_hiddens=D, num_heads=H)).double()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    params = {name: p.detach().clone().requires_grad_(True) for name, p in mha.named_parameters()}
    out = torch.func.functional_call(mha, params, (x, x, x), {"causal": True})
    table = "position.relative_attention_bias.weight"
    (grad,) = torch.autograd.grad(out.sum(), [params[table]])
    out_ref = mha(x, x, x, causal=True)  # the module's own parameters: the same values
    (expected,) = torch.autograd.grad(out_ref.sum(), [mha.position.relative_attention_bias.weight])
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-10)
    assert grad.abs().sum() > 0


def test_t5_gradients_by_torch_func_grad():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=build("t5", num_hiddens=D, num_heads=H)).double()
    x = torch.randn(1, 6, D, dtype=torch.float64)
    params = {name: p.detach() for name, p in mha.named_parameters()}

    def loss(p):
        return torch.func.functional_call(mha, p, (x, x, x), {"causal": True}).pow(2).sum()

    grads = torch.func.grad(loss)(params)
    out = mha(x, x, x, causal=True).pow(2).sum()
    expected = torch.autograd.grad(out, list(mha.parameters()))
    for (name, _), want in zip(mha.named_parameters(), expected, strict=True):
        torch.testing.assert_close(grads[name], want, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("length", [5, 12])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_of_t5_table_through_a_stateless_call(causal, length, training):
    """float64 gradcheck of the output with respect to T5's table, handed in by functional_call (8 of 8 failed)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=build("t5", num_hiddens=D, num_heads=H), block_size=4).double()
    mha.train(training)
    x = torch.randn(1, length, D, dtype=torch.float64)
    table = mha.position.relative_attention_bias.weight.detach().clone().requires_grad_(True)

    def out(t):
        return torch.func.functional_call(
            mha, {"position.relative_attention_bias.weight": t}, (x, x, x), {"causal": causal}
        )

    assert torch.autograd.gradcheck(out, (table,), fast_mode=True)
