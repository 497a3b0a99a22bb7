"""Ragged batches in every layout: neighbouring groups (views), scattered groups (gathers), empty rows.

Query rows past a sequence's valid length are not padding to drop: as on the masked path (and
in the textbook), they attend over that sequence's valid keys. Each layout is checked against
the float64 loop reference and against the single masked call, outputs and gradients.
"""

import importlib

import pytest
import torch
from reference_mha import make_encoding, naive_mha, visibility

from selfattn import MultiHeadAttention

attention_module = importlib.import_module("selfattn.attention")  # the module, not the function selfattn.attention
call_module = importlib.import_module("selfattn.core.call")

D, H, L = 16, 4, 8

LAYOUTS = {
    "one long, then short neighbours": [8, 2, 2, 2],
    "interleaved": [2, 8, 2, 8],
    "empty rows and a full one": [0, 8, 0, 5],
    "all equal, short": [4, 4, 4, 4],
}


@pytest.mark.parametrize("lengths", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_sequence_positions", [False, True])
def test_layouts_match_reference_and_masked_path(lengths, causal, per_sequence_positions, monkeypatch):
    position = make_encoding("rotary", D, H)
    torch.manual_seed(3)
    mha = MultiHeadAttention(D, H, position=position, num_kv_heads=2, bias=True).double()
    b = len(lengths)
    valid_lens = torch.tensor(lengths)
    x = torch.randn(b, L, D, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(L).expand(b, L) + (torch.arange(b)[:, None] * 3 if per_sequence_positions else 0)
    kwargs = {"positions": positions} if per_sequence_positions else {}
    assert mha.explain(x, x, x, valid_lens, causal=causal, **kwargs).route == "ragged"
    out = mha(x, x, x, valid_lens, causal=causal, **kwargs)
    expected, _ = naive_mha(mha, x, x, x, visibility(b, L, L, causal=causal, valid_lens=lengths), positions, positions)
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)

    grad = torch.randn_like(out)
    grouped_grads = torch.autograd.grad(out, (x, *mha.parameters()), grad)
    monkeypatch.setattr(call_module, "MAX_LENGTH_GROUPS", 0)  # one masked call instead
    masked = mha(x, x, x, valid_lens, causal=causal, **kwargs)
    torch.testing.assert_close(out, masked, atol=1e-12, rtol=1e-10)
    masked_grads = torch.autograd.grad(masked, (x, *mha.parameters()), grad)
    for a, b_ in zip(grouped_grads, masked_grads, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-10, rtol=1e-9)


def test_rows_past_the_valid_length_attend_over_the_valid_keys():
    torch.manual_seed(4)
    mha = MultiHeadAttention(D, H).double()
    x = torch.randn(2, L, D, dtype=torch.float64)
    with torch.no_grad():
        out = mha(x, x, x, torch.tensor([L, 3]))
        alone = mha(x[1:], x[1:, :3], x[1:, :3])  # every query of row 1 against its 3 valid keys
    torch.testing.assert_close(out[1:], alone, atol=1e-12, rtol=1e-10)
    assert out[1, 3:].abs().min() > 0  # not zeros: the padded rows see the valid keys


def test_empty_rows_get_the_output_bias_only():
    torch.manual_seed(5)
    mha = MultiHeadAttention(D, H, bias=True).double()
    x = torch.randn(3, L, D, dtype=torch.float64)
    with torch.no_grad():
        out = mha(x, x, x, torch.tensor([0, L, 0]))
    torch.testing.assert_close(out[0], mha.W_o.bias.expand(L, D))
    torch.testing.assert_close(out[2], mha.W_o.bias.expand(L, D))


def test_second_order_gradients_through_ragged_groups():
    # Half the model size and length of the tests above (96 inputs, not 384: gradgradcheck checks each one),
    # and still a gathered group of two with rows past its length, and a whole-length row.
    d, length = 8, 4
    torch.manual_seed(6)
    mha = MultiHeadAttention(d, 2).double()
    x = torch.randn(3, length, d, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([2, length, 2])
    assert mha.explain(x, x, x, lens).route == "ragged"
    assert torch.autograd.gradgradcheck(lambda t: mha(t, t, t, lens), (x,), atol=1e-6)
