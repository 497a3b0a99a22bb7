"""A user's score term that defines only ``forward`` gives the right answer on every route.

The term depends on the query's and the key's *absolute* positions and has a parameter, which
the documented contract allows. It is checked against a float64 dense reference written here
(scores, the term entry by entry, mask, softmax, weighted sum, all in plain torch ops), forward
and gradients, with causal masks, windows, valid lengths, documents, a cache and weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import ScoreEncoding

D, H = 8, 2


class AbsoluteTerm(ScoreEncoding):
    """``w_h sin(0.3 i) cos(0.2 j) + 0.05 i``: absolute in both positions, one parameter per head."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.7, -1.3]))

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        i = q_positions[..., :, None].to(self.weight.dtype)  # (.., lq, 1)
        j = k_positions[..., None, :].to(self.weight.dtype)  # (.., 1, lk)
        pair = torch.sin(0.3 * i) * torch.cos(0.2 * j) + 0.05 * i  # (.., lq, lk)
        pair = pair[None, None] if pair.dim() == 2 else pair[:, None]  # (1 or b, 1, lq, lk)
        return (self.weight[:, None, None] * pair).to(q.dtype)  # (1 or b, h, lq, lk)


def reference(mha, x, visible, positions):
    """Float64 dense attention from the formulas; ``visible`` (b, lq, lk) bool, ``positions`` (b, l)."""
    b, length, _ = x.shape
    dh = mha.head_dim

    def heads(linear):
        return (x @ linear.weight.T).view(b, length, -1, dh).transpose(1, 2)  # (b, h, l, dh)

    q, k, v = heads(mha.W_q), heads(mha.W_k), heads(mha.W_v)
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # (b, h, l, l)
    i = positions[:, :, None].double()
    j = positions[:, None, :].double()
    term = torch.sin(0.3 * i) * torch.cos(0.2 * j) + 0.05 * i  # (b, l, l)
    scores = scores + mha.position.weight[None, :, None, None] * term[:, None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    out = (weights @ v).transpose(1, 2).reshape(b, length, -1)
    return out @ mha.W_o.weight.T, weights


def _mha(window=None, num_kv_heads=None, block_size=None):
    torch.manual_seed(0)
    return MultiHeadAttention(
        D, H, position=AbsoluteTerm(), window=window, num_kv_heads=num_kv_heads, block_size=block_size
    ).double()


def _visible(length, *, causal=False, window=None, lengths=None, documents=None):
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    visible = torch.ones(length, length, dtype=torch.bool)
    if causal:
        visible = visible & (j <= i)
    if window is not None:
        visible = visible & ((i - j).abs() < window)
    visible = visible.expand(2, length, length)
    if lengths is not None:
        visible = visible & (j[None] < torch.tensor(lengths)[:, None, None])
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])
    return visible


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "causal, blocks of 8": {"causal": True, "length": 40, "block_size": 8},
    "bidirectional, blocks of 8": {"length": 40, "block_size": 8},
    "window": {"causal": True, "window": 4, "length": 90},
    "window bidirectional": {"window": 3, "length": 90},
    "valid_lens": {"lengths": [9, 5]},
    "valid_lens causal": {"lengths": [9, 5], "causal": True},
    "documents": {"documents": True, "causal": True},
    "gqa": {"causal": True, "num_kv_heads": 1},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("weights", [False, True], ids=["output", "weights"])
def test_forward_only_term_equals_the_dense_reference(name, weights):
    case = dict(CASES[name])
    length = case.pop("length", 9)
    mha = _mha(case.get("window"), case.pop("num_kv_heads", None), case.pop("block_size", None))
    x = torch.randn(2, length, D, dtype=torch.float64, requires_grad=True)
    kwargs: dict = {"causal": case.get("causal", False), "return_weights": weights}
    documents = None
    if case.get("documents"):
        documents = torch.tensor([[0] * (length // 3) + [1] * (length - length // 3), [0] * length])
        kwargs["document_ids"] = documents
    lengths = case.get("lengths")
    result = mha(x, x, x, None if lengths is None else torch.tensor(lengths), **kwargs)
    out = result[0] if weights else result
    positions = torch.arange(length).expand(2, length)
    if documents is not None:  # positions restart at each document
        positions = torch.stack(
            [torch.cat([torch.arange(length // 3), torch.arange(length - length // 3)]), positions[1]]
        )
    visible = _visible(length, causal=kwargs["causal"], window=case.get("window"), lengths=lengths, documents=documents)
    x_ref = x.detach().clone().requires_grad_(True)
    expected, expected_weights = reference(mha, x_ref, visible, positions)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)
    if weights:
        torch.testing.assert_close(result[1], expected_weights, atol=1e-10, rtol=1e-9)
    grad = torch.randn_like(out)
    (param_grad,) = torch.autograd.grad(out, [mha.position.weight], grad, retain_graph=True)
    out.backward(grad)
    (expected_param_grad,) = torch.autograd.grad(expected, [mha.position.weight], grad, retain_graph=True)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(param_grad, expected_param_grad, atol=1e-10, rtol=1e-9)


def test_forward_only_term_decoding_with_a_cache_equals_the_full_pass():
    mha = _mha().eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        cache = KVCache(max_len=12)
        steps = [mha(x[:, :5], x[:, :5], x[:, :5], causal=True, cache=cache)]
        for t in range(5, 12):
            steps.append(mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-9)


def test_the_term_is_not_taken_for_relative():
    assert AbsoluteTerm.is_relative is False
    assert not AbsoluteTerm().has_elementwise_form
    mha = _mha()
    x = torch.randn(2, 70, D, dtype=torch.float64)
    assert mha.explain(x, x, x, causal=True).route == "blockwise"
