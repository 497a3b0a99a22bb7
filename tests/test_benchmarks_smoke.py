"""The benchmarks' textbook baseline computes what the chapter computes (its speed is not tested here).

Checked against torch.nn.MultiheadAttention with the same weights, selfattn's
MultiHeadAttention, and a naive float64 loop.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import naive_attention, torch_multihead_copy

from selfattn import MultiHeadAttention

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "textbook.py"
_spec = importlib.util.spec_from_file_location("benchmarks_textbook", _PATH)
textbook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(textbook)

D, H = 16, 4


def _pair(seed=0, bias=False):
    torch.manual_seed(seed)
    ours = MultiHeadAttention(D, H, bias=bias).double()
    baseline = textbook.TextbookMultiHeadAttention(D, H, bias=bias).double()
    baseline.load_state_dict(ours.state_dict())  # same keys, W_q .. W_o
    return ours, baseline


def _x(b=2, length=6, seed=1):
    return torch.randn(b, length, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lens", [None, [6, 6], [3, 5]])
def test_matches_torch_multihead_attention(bias, lens):
    ours, baseline = _pair(bias=bias)
    x = _x()
    valid_lens = None if lens is None else torch.tensor(lens)
    padding = None if lens is None else torch.arange(6)[None, :] >= valid_lens[:, None]
    expected, _ = torch_multihead_copy(ours)(x, x, x, key_padding_mask=padding, need_weights=False)
    torch.testing.assert_close(baseline(x, x, x, valid_lens), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours(x, x, x, valid_lens), expected, rtol=1e-10, atol=1e-10)


def test_per_query_lengths_and_cross_attention_match_a_naive_loop():
    ours, baseline = _pair(seed=3)
    queries, keys = _x(length=4, seed=4), _x(length=7, seed=5)
    valid_lens = torch.tensor([[1, 2, 7, 4], [5, 5, 3, 6]])  # (b, lq)
    got = baseline(queries, keys, keys, valid_lens)

    def heads(t):  # (b, l, d) -> (b, h, l, dh)
        return t.reshape(t.shape[0], t.shape[1], H, D // H).transpose(1, 2).detach().numpy()

    visible = np.arange(7)[None, None, :] < valid_lens.numpy()[:, :, None]  # (b, lq, lk)
    visible = np.broadcast_to(visible[:, None], (2, H, 4, 7))
    out, _ = naive_attention(heads(ours.W_q(queries)), heads(ours.W_k(keys)), heads(ours.W_v(keys)), visible)
    merged = torch.from_numpy(out).transpose(1, 2).reshape(2, 4, D)  # (b, lq, d)
    torch.testing.assert_close(got, ours.W_o(merged), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours(queries, keys, keys, valid_lens), got, rtol=1e-10, atol=1e-10)


def test_textbook_quirk_is_kept_a_query_with_no_valid_key_averages_everything():
    # The baseline keeps the chapter's -1e6 fill, so length 0 gives uniform weights (selfattn gives zeros).
    scores = torch.randn(2, 3, 5, dtype=torch.float64)
    weights = textbook.masked_softmax(scores, torch.tensor([0, 2]))
    torch.testing.assert_close(weights[0], torch.full((3, 5), 0.2, dtype=torch.float64))
    assert torch.all(weights[1, :, 2:] == 0)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(3, dtype=torch.float64))


def test_backward_matches_selfattn():
    ours, baseline = _pair(seed=7)
    x1, x2 = _x(seed=8).requires_grad_(True), _x(seed=8).requires_grad_(True)
    valid_lens = torch.tensor([4, 6])
    ours(x1, x1, x1, valid_lens).square().sum().backward()
    baseline(x2, x2, x2, valid_lens).square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-9, atol=1e-10)
    for (name, p), q in zip(ours.named_parameters(), baseline.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
