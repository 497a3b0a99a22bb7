"""skip_padded_queries on every route it can take, when the longest valid length is shorter than the batch.

Keys at or past the longest valid length are dropped before attention; the padded rows of
the (shorter) keys must then still be found. Each case runs a batch whose longest sequence
is shorter than the padded length, with NaN in the padding, and compares:

* output and weights with a float64 loop reference (``reference_mha.naive_mha``) of each
  sequence alone at its own length, padded rows zero;
* every gradient with the sum of each sequence run alone through the same module (no
  ``valid_lens``), which is what the option promises;
* the route taken, with ``explain``.

Shape legend: b batch, l padded length, d model size, h heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from reference_mha import make_encoding, naive_mha

from selfattn import MultiHeadAttention, masks

D, H, L = 16, 4, 7
LENGTHS = [5, 0, 2, 5]  # longest 5 < 7: keys 5 and 6 are dropped; the two 5s are neighbours, 2 and 0 alone
ONE_KEY = [1, 0, 1]  # one key left after the drop


@dataclass(frozen=True)
class Case:
    """A module and a call: ``module`` and ``call`` keyword arguments, the route it takes."""

    route: str
    module: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)


def _attn_mask() -> torch.Tensor:
    """(l, l) bool, True = attend: a fixed pattern with the diagonal kept."""
    generator = torch.Generator().manual_seed(5)
    return (torch.rand(L, L, generator=generator) < 0.6) | torch.eye(L, dtype=torch.bool)


def _key_padding(batch: int) -> torch.Tensor:
    padding = torch.zeros(batch, L, dtype=torch.bool)
    padding[0, 1] = padding[-1, 0] = True  # inside valid lengths: real padding the option must honour
    return padding


CASES = {
    "plain": Case("ragged valid rows"),
    "rotary gqa causal": Case("ragged valid rows", dict(position="rotary", num_kv_heads=2), dict(causal=True)),
    "weights": Case("explicit", call=dict(return_weights=True)),
    "weights sinks causal": Case("explicit", dict(sinks=True), dict(return_weights=True, causal=True)),
    "sinks float mask": Case("explicit softcap/sinks", dict(sinks=True), dict(attn_mask="float mask")),
    "softcap float mask causal": Case(
        "explicit softcap/sinks", dict(softcap=2.0), dict(attn_mask="float mask", causal=True)
    ),
    "weights t5": Case("explicit", dict(position="t5"), dict(return_weights=True)),
    "sinks": Case("blockwise", dict(sinks=True)),
    "sinks mqa causal": Case("blockwise", dict(sinks=True, num_kv_heads=1), dict(causal=True)),
    "softcap": Case("blockwise", dict(softcap=2.0)),
    "t5": Case("blockwise band", dict(position="t5")),
    "t5 softcap causal": Case("blockwise", dict(position="t5", softcap=2.0), dict(causal=True)),
    "alibi": Case("blockwise band", dict(position="alibi")),
    "alibi key row": Case("blockwise key row", dict(position="alibi_causal")),  # one bias row for every query
    "alibi causal gqa": Case("blockwise", dict(position="alibi_causal", num_kv_heads=2), dict(causal=True)),
    "shaw": Case("blockwise clipped", dict(position="shaw")),
    "shaw weights": Case("explicit value term", dict(position="shaw"), dict(return_weights=True)),
    "window causal": Case("fused", dict(window=2), dict(causal=True)),
    "chunks causal": Case("fused", dict(chunk_size=3), dict(causal=True)),
    "prefix": Case("fused", call=dict(mask=masks.causal() | masks.prefix(2))),
    "key padding": Case("fused", call=dict(key_padding_mask="padding")),
    "attn mask": Case("fused", call=dict(attn_mask="mask")),
}


def _module(case: Case) -> MultiHeadAttention:
    options = dict(case.module)
    position = make_encoding(options.pop("position", "none"), D, H, seed=3)
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, position=position, skip_padded_queries=True, bias=True, **options).double()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(torch.randn(H, dtype=torch.float64))  # not the zeros they start at
    return mha


def _call(case: Case, batch: int) -> dict[str, Any]:
    call = dict(case.call)
    if call.get("key_padding_mask") == "padding":
        call["key_padding_mask"] = _key_padding(batch)
    if call.get("attn_mask") == "mask":
        call["attn_mask"] = _attn_mask()
    if call.get("attn_mask") == "float mask":  # 0 or -inf: a float bias, which the explicit route takes
        call["attn_mask"] = torch.zeros(L, L, dtype=torch.float64).masked_fill(~_attn_mask(), float("-inf"))
    return call


def _alone_call(call: dict[str, Any], row: int, length: int) -> dict[str, Any]:
    """The call's arguments for sequence ``row`` alone, cut to ``length`` tokens."""
    alone = {key: value for key, value in call.items() if key != "return_weights"}
    if "key_padding_mask" in alone:
        alone["key_padding_mask"] = alone["key_padding_mask"][row : row + 1, :length]
    if "attn_mask" in alone:
        alone["attn_mask"] = alone["attn_mask"][:length, :length]
    return alone


def _visible(mha: MultiHeadAttention, call: dict[str, Any], row: int, length: int) -> np.ndarray:
    """Bool (1, n, n) from loops: what query i of sequence ``row`` sees alone at its length ``n``."""
    causal = call.get("causal", False)
    padding = call.get("key_padding_mask")
    attn_mask = call.get("attn_mask")
    prefix = 2 if "mask" in call else None  # the one rule used here: causal() | prefix(2)
    visible = np.zeros((1, length, length), dtype=bool)
    for i in range(length):
        for j in range(length):
            ok = not (causal and j > i)
            if prefix is not None:
                ok = j <= i or j < prefix
            if mha.window is not None:
                ok = ok and i - j < mha.window and (causal or j - i < mha.window)
            if mha.chunk_size is not None:
                ok = ok and i // mha.chunk_size == j // mha.chunk_size
            if padding is not None:
                ok = ok and not bool(padding[row, j])
            if attn_mask is not None:
                ok = ok and bool(attn_mask[i, j] == 0 if attn_mask.is_floating_point() else attn_mask[i, j])
            visible[0, i, j] = ok
    return visible


def _reference(mha: MultiHeadAttention, x: torch.Tensor, lengths: list[int], call: dict[str, Any]):
    """Float64 output (b, l, d) and weights (b, h, l, l): each sequence alone, zero past its length."""
    batch = x.shape[0]
    out = torch.zeros(batch, L, D, dtype=torch.float64)
    weights = torch.zeros(batch, H, L, L, dtype=torch.float64)
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        tokens = x[row : row + 1, :length]
        positions = torch.arange(length)[None]
        visible = _visible(mha, call, row, length)
        out_row, weights_row = naive_mha(mha, tokens, tokens, tokens, visible, positions, positions)
        out[row, :length], weights[row, :, :length, :length] = out_row[0], weights_row[0]
    return out, weights


def _reference_gradients(mha: MultiHeadAttention, clean: torch.Tensor, lengths: list[int], call, grad_out):
    """Gradients of ``sum(out * grad_out)`` for the input and each parameter: each sequence run alone."""
    parameters = tuple(mha.parameters())
    expected = [torch.zeros_like(clean)] + [torch.zeros_like(p) for p in parameters]
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        tokens = clean[row : row + 1, :length].clone().requires_grad_(True)
        alone = mha(tokens, tokens, tokens, **_alone_call(call, row, length))  # no valid_lens
        grads = torch.autograd.grad(alone, (tokens, *parameters), grad_out[row : row + 1, :length])
        expected[0][row, :length] += grads[0][0]
        for total, grad in zip(expected[1:], grads[1:], strict=True):
            total += grad
    return expected


def _padded_input(lengths: list[int]) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(len(lengths), L, D, dtype=torch.float64)
    for row, length in enumerate(lengths):
        x[row, length:] = float("nan")  # never to be read
    return x


def _check(case: Case, lengths: list[int]) -> None:
    mha = _module(case)
    x = _padded_input(lengths).requires_grad_(True)
    valid_lens = torch.tensor(lengths)
    call = _call(case, len(lengths))
    assert mha.explain(x, x, x, valid_lens, **call).route == case.route
    result = mha(x, x, x, valid_lens, **call)
    out, weights = result if call.get("return_weights") else (result, None)
    expected_out, expected_weights = _reference(mha, x.detach(), lengths, call)
    torch.testing.assert_close(out.detach(), expected_out, atol=1e-10, rtol=1e-9)
    if weights is not None:
        torch.testing.assert_close(weights.detach(), expected_weights, atol=1e-10, rtol=1e-9)
    for row, length in enumerate(lengths):
        assert (out[row, length:] == 0).all()  # exactly zero: no W_o bias
        assert weights is None or (weights[row, :, length:] == 0).all()
    grad_out = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    parameters = tuple(mha.parameters())
    got = torch.autograd.grad(out, (x, *parameters), grad_out)
    expected = _reference_gradients(mha, x.detach().nan_to_num(0.0), lengths, call, grad_out)
    for name, a, b in zip(("input", *(n for n, _ in mha.named_parameters())), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_every_route_exact_when_the_longest_sequence_is_short(name):
    _check(CASES[name], LENGTHS)


@pytest.mark.parametrize("name", ["plain", "weights", "sinks", "t5", "alibi", "key padding"])
def test_one_key_left(name):
    _check(CASES[name], ONE_KEY)


def test_separate_queries_keys_and_values():
    """Three tensors: the queries keep their length, the keys and values are cut, each zeroed on its own rows."""
    mha = _module(Case("explicit"))
    q = _padded_input(LENGTHS)
    k, v = q * 2, q - 1
    out, weights = mha(q, k, v, torch.tensor(LENGTHS), return_weights=True)
    plain = MultiHeadAttention(D, H, bias=True).double()
    plain.load_state_dict(mha.state_dict())
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]
    expected, expected_weights = plain(*clean, torch.tensor(LENGTHS), return_weights=True)  # without the option
    valid = torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]  # (b, l)
    torch.testing.assert_close(out, expected.masked_fill(~valid[..., None], 0.0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(
        weights, expected_weights.masked_fill(~valid[:, None, :, None], 0.0), atol=1e-12, rtol=1e-12
    )


@pytest.mark.parametrize("name", ["plain", "weights", "sinks", "t5", "window causal"])
def test_every_row_padded_gives_zeros_and_zero_gradients(name):
    """valid_lens all 0: the output is zero and still joins the autograd graph (backward gives zeros)."""
    case = CASES[name]
    mha = _module(case)
    x = torch.randn(2, L, D, dtype=torch.float64, requires_grad=True)
    call = _call(case, 2)
    result = mha(x, x, x, torch.tensor([0, 0]), **call)
    out = result[0] if call.get("return_weights") else result
    assert (out == 0).all()
    out.sum().backward()
    assert x.grad is not None and (x.grad == 0).all()
    for parameter_name, parameter in mha.named_parameters():
        assert parameter.grad is not None and (parameter.grad == 0).all(), parameter_name


def test_every_row_padded_leaves_the_valid_rows_route():
    mha = _module(Case("ragged valid rows"))
    x = torch.randn(2, L, D, dtype=torch.float64)
    explanation = mha.explain(x, x, x, torch.tensor([0, 0]))
    assert ("ragged valid rows", "no valid row (every valid length is 0)") in explanation.declined
    assert mha.explain(x, x, x, torch.tensor([0, 3])).route == "ragged valid rows"


def test_sliced_route_with_softcap_on_a_long_short_batch():
    """Softcap over at least 2**16 scores takes the sliced route; a float64 dense formula per sequence checks it."""
    lengths, length = [290, 3], 300
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, softcap=2.0, skip_padded_queries=True, bias=True).double()
    x = torch.randn(2, length, 8, dtype=torch.float64)
    x[1, 3:] = float("nan")
    assert mha.explain(x, x, x, torch.tensor(lengths)).route == "sliced"
    out = mha(x, x, x, torch.tensor(lengths))
    for row, n in enumerate(lengths):
        tokens = x[row, :n]  # (n, d)
        q, k, v = (linear(tokens).view(n, 2, 4).transpose(0, 1) for linear in (mha.W_q, mha.W_k, mha.W_v))
        scores = 2.0 * torch.tanh(q @ k.transpose(1, 2) / 4**0.5 / 2.0)  # (h, n, n), softcapped
        expected = mha.W_o((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, 8))
        torch.testing.assert_close(out[row, :n], expected, atol=1e-10, rtol=1e-9)
        assert (out[row, n:] == 0).all()
