"""skip_padded_queries: padded query rows are zero and each valid row equals its sequence run alone."""

import importlib

import pytest
import torch
import torch._dynamo as dynamo
from reference_mha import make_encoding, naive_mha, visibility

from selfattn import KVCache, MultiHeadAttention, _validation

attention_module = importlib.import_module("selfattn.attention")  # the module, not the function selfattn.attention
call_module = importlib.import_module("selfattn.core.call")

D, H = 16, 4
LENGTHS = [7, 3, 0, 3]  # two neighbours of length 3 would be a view; here 3s are scattered (gathered)


def _path(monkeypatch, path):
    """Force one of the module's paths: ragged groups, one masked call, or the graph a compiler traces."""
    if path in ("masked", "compiled"):
        monkeypatch.setattr(call_module, "MAX_LENGTH_GROUPS", 0)
    if path == "compiled":
        monkeypatch.setattr(_validation, "is_compiling", lambda: True)


def _alone(mha, x, lengths, *, causal=False, window=None, documents=None, key_padding=None):
    """Float64 reference: each sequence alone at its own length, zero rows past it."""
    b, length, _ = x.shape
    expected = torch.zeros(b, length, mha.num_hiddens, dtype=torch.float64)
    weights = torch.zeros(b, mha.num_heads, length, length, dtype=torch.float64)
    for s, n in enumerate(lengths):
        if n == 0:
            continue
        row = x[s : s + 1, :n]
        docs = None if documents is None else [documents[s][:n].tolist()]
        pad = None if key_padding is None else [key_padding[s][:n].tolist()]
        visible = visibility(1, n, n, causal=causal, window=window, documents=docs, key_padding=pad)
        positions = torch.arange(n)[None]
        if documents is not None:
            positions = attention_module.document_positions(documents[s : s + 1, :n])
        out, w = naive_mha(mha, row, row, row, visible, positions, positions)
        expected[s, :n], weights[s, :, :n, :n] = out[0], w[0]
    return expected, weights


def _module(name="none", **kwargs):
    position = make_encoding(name, D, H)
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, position=position, skip_padded_queries=True, bias=True, **kwargs).double()


def _padded_input(length=7, lengths=LENGTHS):
    torch.manual_seed(1)
    x = torch.randn(len(lengths), length, D, dtype=torch.float64)
    for s, n in enumerate(lengths):
        x[s, n:] = float("nan")  # never to be read
    return x


@pytest.mark.parametrize("path", ["ragged", "masked", "compiled"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["none", "rotary", "alibi", "t5", "shaw"])
def test_equals_each_sequence_alone_with_zero_padded_rows(name, causal, path, monkeypatch):
    _path(monkeypatch, path)
    mha = _module(name, num_kv_heads=2)
    x = _padded_input()
    out = mha(x, x, x, torch.tensor(LENGTHS), causal=causal)
    expected, _ = _alone(mha, x, LENGTHS, causal=causal)
    assert not out.isnan().any()
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)
    assert (out[1, 3:] == 0).all() and (out[2] == 0).all()  # exact zeros: no W_o bias there


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [9, 40])  # 40: long enough for the blocked window path
def test_sliding_window(length, causal):
    lengths = [length, 5, length - 3]
    mha = _module(window=2)
    x = _padded_input(length, lengths)
    assert (mha.explain(x, x, x, torch.tensor(lengths), causal=causal).route == "banded") == (length == 40)
    out = mha(x, x, x, torch.tensor(lengths), causal=causal)
    expected, _ = _alone(mha, x, lengths, causal=causal, window=2)
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)


def test_return_weights_have_zero_padded_rows():
    mha = _module("t5")
    x = _padded_input()
    out, weights = mha(x, x, x, torch.tensor(LENGTHS), return_weights=True)
    expected, expected_weights = _alone(mha, x, LENGTHS)
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(weights.detach(), expected_weights, atol=1e-10, rtol=1e-9)


def test_with_documents_and_key_padding():
    mha = _module("rotary")
    x = _padded_input()
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1], [0] * 7, [0, 0, 1, 1, 1, 1, 1]])
    key_padding = torch.zeros(4, 7, dtype=torch.bool)
    key_padding[0, 1] = key_padding[3, 0] = True
    out = mha(x, x, x, torch.tensor(LENGTHS), document_ids=documents, key_padding_mask=key_padding)
    expected, _ = _alone(mha, x, LENGTHS, documents=documents, key_padding=key_padding)
    torch.testing.assert_close(out.detach(), expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("path", ["ragged", "masked"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_each_sequence_alone_and_padding_gets_none(path, causal, monkeypatch):
    mha = _module("rotary", num_kv_heads=1)
    clean = _padded_input().nan_to_num(0.0)
    torch.manual_seed(2)
    grad = torch.randn(4, 7, D, dtype=torch.float64)
    expected = [torch.zeros_like(p) for p in (clean, *mha.parameters())]
    for s, n in enumerate(LENGTHS):
        if n == 0:
            continue
        row = clean[s : s + 1, :n].clone().requires_grad_(True)
        alone = MultiHeadAttention.forward(mha, row, row, row, causal=causal)  # no valid_lens: the full path
        grads = torch.autograd.grad(alone, (row, *mha.parameters()), grad[s : s + 1, :n])
        expected[0][s, :n] += grads[0][0]
        for total, g in zip(expected[1:], grads[1:], strict=True):
            total += g
    _path(monkeypatch, path)
    x = _padded_input().requires_grad_(True)  # NaN in the padding
    out = mha(x, x, x, torch.tensor(LENGTHS), causal=causal)
    got = torch.autograd.grad(out, (x, *mha.parameters()), grad)
    for a, b in zip(got, expected, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    assert (got[0][1, 3:] == 0).all() and (got[0][2] == 0).all()


def test_separate_queries_keys_values_and_training_dropout():
    mha = _module()
    q, k, v = _padded_input(), _padded_input() * 2, _padded_input() - 1
    out = mha(q, k, v, torch.tensor(LENGTHS))
    masked = mha(q, k, v, torch.tensor(LENGTHS), key_padding_mask=torch.zeros(4, 7, dtype=torch.bool))
    torch.testing.assert_close(out, masked, atol=1e-10, rtol=1e-9)
    assert not out.isnan().any() and (out[1, 3:] == 0).all()
    dropping = MultiHeadAttention(D, H, dropout=0.5, skip_padded_queries=True, bias=True).double().train()
    out = dropping(q, q, q, torch.tensor(LENGTHS))
    assert not out.isnan().any() and (out[1, 3:] == 0).all() and (out[2] == 0).all()


def test_without_valid_lens_nothing_changes():
    mha = _module()
    plain = MultiHeadAttention(D, H, bias=True).double()
    plain.load_state_dict(mha.state_dict())
    x = _padded_input().nan_to_num(0.0)
    torch.testing.assert_close(mha(x, x, x, causal=True), plain(x, x, x, causal=True), atol=0, rtol=0)
    assert "skip_padded_queries=True" in repr(mha) and "skip_padded_queries" not in repr(plain)


def test_all_full_ragged_group_returns_the_projection():
    mha = _module()
    x = _padded_input(7, [7, 7])
    torch.testing.assert_close(mha(x, x, x, torch.tensor([7, 7])), mha(x, x, x), atol=1e-12, rtol=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="skip_padded_queries must be True or False, got 1"):
        MultiHeadAttention(D, H, skip_padded_queries=1)
    mha = _module()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"skip_padded_queries needs valid_lens of shape \(batch,\)"):
        mha(x, x, x, torch.full((2, 5), 3))
    with pytest.raises(ValueError, match="skip_padded_queries does not apply with a cache"):
        mha(x, x, x, torch.tensor([5, 3]), cache=KVCache(max_len=16))
    with pytest.raises(ValueError, match=r"as many queries as keys.*got 2 queries and 5 keys"):
        mha(x[:, :2], x, x, torch.tensor([5, 3]))


def test_compiles_without_graph_breaks():
    mha = MultiHeadAttention(D, H, skip_padded_queries=True, position=make_encoding("rotary", D, H)).eval()
    x = torch.randn(2, 8, D)
    dynamo.reset()
    explanation = dynamo.explain(mha)(x, x, x, torch.tensor([8, 3]), causal=True)
    dynamo.reset()
    assert explanation.graph_break_count == 0, [str(r.reason)[:200] for r in explanation.break_reasons]
    compiled = torch.compile(mha, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, x, x, torch.tensor([8, 3])), mha(x, x, x, torch.tensor([8, 3])))
    dynamo.reset()
