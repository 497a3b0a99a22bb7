"""Blockwise attention equals dense attention with the full bias: forward, gradients, masks, dropout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import naive_attention

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import (
    attention,
    blockwise_attention,
    choose_block_size,
    dropout_keep_probability,
    flex_score_attention,
)
from selfattn.positional import build

HEADS, HEAD_DIM = 4, 8
# gradcheck checks every input element, one at a time: its tests use a head size of 2 (a quarter of the
# elements, the same blocks, heads and term parameters; shaw's tables shrink with the head size).
GRADCHECK_HEAD_DIM = 2
# (label, registry name, options): every score encoding and its variants.
TERMS = [
    ("alibi", "alibi", {}),
    ("alibi-bidirectional", "alibi", {"causal": False}),
    ("t5", "t5", {}),
    ("t5-causal", "t5", {"bidirectional": False, "num_buckets": 8, "max_distance": 12}),
    ("shaw", "shaw", {"max_distance": 3}),
    ("shaw-keys", "shaw", {"max_distance": 3, "values": False}),
    ("shaw-values", "shaw", {"max_distance": 3, "keys": False}),
    ("kerple", "kerple", {}),
    ("fire", "fire", {"hidden_size": 8, "threshold": 2.0}),
]
LABELS = [label for label, _, _ in TERMS]


def make_term(label: str, dtype: torch.dtype = torch.float64, head_dim: int = HEAD_DIM):
    _, name, options = next(t for t in TERMS if t[0] == label)
    torch.manual_seed(3)
    term = build(name, num_hiddens=HEADS * head_dim, num_heads=HEADS, **options).double()
    with torch.no_grad():  # learned tables start at zero or near it: make every term visible
        for p in term.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return term.to(dtype)


def qkv(
    b: int,
    lq: int,
    lk: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    grad: bool = False,
    head_dim: int = HEAD_DIM,
):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, HEADS, n, head_dim, generator=gen, dtype=torch.float64).to(dtype) for n in (lq, lk, lk)]
    return [t.requires_grad_(grad) for t in out]


def visibility(b, lq, lk, *, causal=False, valid_lens=None, mask=None) -> torch.Tensor:
    """Bool (b, h, lq, lk), written out with loops."""
    visible = torch.ones(b, HEADS, lq, lk, dtype=torch.bool)
    for bi in range(b):
        for i in range(lq):
            for j in range(lk):
                if causal and j > i + lk - lq:
                    visible[bi, :, i, j] = False
                if valid_lens is not None:
                    length = valid_lens[bi] if valid_lens.dim() == 1 else valid_lens[bi, i]
                    if j >= int(length):
                        visible[bi, :, i, j] = False
    if mask is not None:
        visible &= mask.expand_as(visible)
    return visible


def dense(term, q, k, v, q_positions, k_positions, visible):
    """Softmax over the full (b, h, lq, lk) scores plus the whole bias, rows without keys -> zeros."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if term is not None:
        scores = scores + term(q, q_positions=q_positions, k_positions=k_positions)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = weights @ v
    if term is not None and getattr(term, "uses_weights", False):
        out = out + term.value_term(weights, q_positions=q_positions, k_positions=k_positions)
    return out


def check_forward_and_gradients(label, *, b, lq, lk, block, dtype=torch.float64, atol=1e-10, stride=1, **masking):
    """``stride > 1`` spreads the positions out, so the term is evaluated per block, not read from one band."""
    term = make_term(label, dtype)
    q, k, v = qkv(b, lq, lk, dtype, grad=True)
    offset = 17
    k_positions = torch.arange(offset + lq - lk, offset + lq) * stride
    q_positions = torch.arange(offset, offset + lq) * stride
    visible = visibility(b, lq, lk, **masking)
    out = blockwise_attention(
        q, k, v, term=term, q_positions=q_positions, k_positions=k_positions, block_size=block, **masking
    )
    ref = dense(term, q, k, v, q_positions, k_positions, visible)
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    grad = torch.randn_like(out)
    params = list(term.parameters())
    got = torch.autograd.grad(out, [q, k, v, *params], grad, allow_unused=True)
    want = torch.autograd.grad(ref, [q, k, v, *params], grad, allow_unused=True)
    for name, g, w in zip(["q", "k", "v", *[n for n, _ in term.named_parameters()]], got, want, strict=True):
        if w is None:
            assert g is None or not bool(g.any()), name
            continue
        torch.testing.assert_close(g, w, rtol=0, atol=atol * 10, msg=lambda m, name=name: f"{label} d{name}: {m}")
    return out


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize(("lq", "lk", "block"), [(13, 13, 4), (12, 12, 4), (5, 13, 2), (16, 16, 512)])
def test_blockwise_equals_dense_with_causal_mask(label, lq, lk, block):
    check_forward_and_gradients(label, b=2, lq=lq, lk=lk, block=block, causal=True)


@pytest.mark.parametrize("label", ["alibi", "t5", "kerple", "shaw-values"])
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_equals_dense_at_spread_out_positions(label, causal):
    check_forward_and_gradients(label, b=2, lq=11, lk=11, block=4, stride=3, causal=causal)


@pytest.mark.parametrize("label", LABELS)
def test_blockwise_equals_dense_with_valid_lens(label):
    lens_1d = torch.tensor([9, 0, 4])
    check_forward_and_gradients(label, b=3, lq=11, lk=11, block=3, valid_lens=lens_1d)
    lens_2d = torch.tensor([[1, 2, 0, 4, 5, 6, 7], [7, 7, 7, 0, 0, 3, 7]])
    check_forward_and_gradients(label, b=2, lq=7, lk=7, block=3, valid_lens=lens_2d, causal=True)


@pytest.mark.parametrize("label", ["alibi", "t5", "shaw", "fire"])
def test_blockwise_equals_dense_with_a_bool_mask_and_more_queries_than_keys(label):
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(2, 1, 9, 6, generator=gen) > 0.4
    mask[0, 0, 3] = False  # a row with no key
    check_forward_and_gradients(label, b=2, lq=9, lk=6, block=4, mask=mask)
    # Lower-right causal with lq > lk: the first three queries see nothing.
    out = check_forward_and_gradients(label, b=1, lq=9, lk=6, block=2, causal=True)
    assert not bool(out[:, :, :3].any())


def test_blockwise_matches_the_naive_float64_loop():
    term = make_term("t5")
    q, k, v = qkv(2, 10, 10)
    positions = torch.arange(10)
    lens = torch.tensor([7, 3])
    visible = visibility(2, 10, 10, causal=True, valid_lens=lens)
    bias = term(q, q_positions=positions, k_positions=positions).expand(2, HEADS, 10, 10)
    want, _ = naive_attention(q.numpy(), k.numpy(), v.numpy(), visible.numpy(), bias=bias.detach().numpy())
    with torch.no_grad():
        got = blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                                  valid_lens=lens, causal=True, block_size=3)  # fmt: skip
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("label", ["alibi", "t5", "shaw", "kerple", "fire"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 0.03)])
def test_low_precision_blockwise_agrees_with_float64(label, dtype, atol):
    term, term64 = make_term(label, dtype), make_term(label, torch.float64)
    q, k, v = qkv(2, 21, 21, dtype)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    positions = torch.arange(100, 121)
    with torch.no_grad():
        out = blockwise_attention(
            q, k, v, term=term, q_positions=positions, k_positions=positions, causal=True, block_size=8
        )
        want = dense(term64, q64, k64, v64, positions, positions, visibility(2, 21, 21, causal=True))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("label", ["t5", "shaw", "kerple", "fire", "alibi"])
def test_gradcheck_blockwise_float64_including_the_bias_parameters(label):
    term = make_term(label, head_dim=GRADCHECK_HEAD_DIM)
    q, k, v = qkv(1, 6, 6, grad=True, head_dim=GRADCHECK_HEAD_DIM)
    params = list(term.parameters())
    positions = torch.arange(3, 9)
    lens = torch.tensor([5])

    def run(q, k, v, *_params):  # gradcheck perturbs its inputs in place: the term's own parameters
        return blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                                   valid_lens=lens, causal=True, block_size=4)  # fmt: skip

    inputs = (q, k, v, *params)
    assert torch.autograd.gradcheck(run, inputs, atol=1e-7, rtol=1e-5)


def test_fully_masked_rows_are_zero_and_their_gradients_finite():
    term = make_term("t5")
    q, k, v = qkv(2, 6, 6, grad=True)
    positions = torch.arange(6)
    out = blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                              valid_lens=torch.tensor([0, 3]), block_size=4)  # fmt: skip
    assert not bool(out[0].any()) and bool(torch.isfinite(out).all())
    out.sum().backward()
    for t in (q, k, v, *term.parameters()):
        assert bool(torch.isfinite(t.grad).all())
    assert not bool(q.grad[0].any())


def test_unbiased_attention_without_dropout_is_dense_attention():
    q, k, v = qkv(2, 9, 9)
    got = blockwise_attention(q, k, v, causal=True, valid_lens=torch.tensor([4, 9]), block_size=4)
    want = attention(
        q, k, v, causal=True, mask=torch.arange(9)[None, None, None, :] < torch.tensor([4, 9])[:, None, None, None]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ---- dropout ------------------------------------------------------------------------------


def test_dropout_mask_is_redrawn_identically_in_backward():
    """With a fixed seed the call is a deterministic function: gradcheck holds only if backward sees forward's mask."""
    term = make_term("t5", head_dim=GRADCHECK_HEAD_DIM)
    q, k, v = qkv(1, 7, 7, grad=True, head_dim=GRADCHECK_HEAD_DIM)
    positions = torch.arange(7)

    def run(q, k, v):
        torch.manual_seed(11)
        return blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                                   causal=True, dropout_p=0.3, block_size=3)  # fmt: skip

    assert torch.autograd.gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)
    torch.manual_seed(11)
    first = run(q, k, v)
    assert torch.equal(first, run(q, k, v))
    torch.manual_seed(12)
    other = blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                                causal=True, dropout_p=0.3, block_size=3)  # fmt: skip
    assert not torch.equal(first, other)


def test_dropout_with_shaw_values_matches_gradcheck():
    term = make_term("shaw", head_dim=GRADCHECK_HEAD_DIM)
    q, k, v = qkv(1, 6, 6, grad=True, head_dim=GRADCHECK_HEAD_DIM)
    positions = torch.arange(6)

    def run(q, k, v):
        torch.manual_seed(2)
        return blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                                   dropout_p=0.25, block_size=4)  # fmt: skip

    assert torch.autograd.gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)


def test_dropout_statistics_match_dense_dropout():
    """Mean and variance of the output over many draws agree with dropout on the full weights."""
    torch.manual_seed(0)
    p, draws = 0.2, 4000
    q, k, v = qkv(1, 8, 8)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), dim=-1)  # (1, h, lq, lk)
    expected_mean = weights @ v
    keep = dropout_keep_probability(p)
    # Var of sum_j w_ij m_j v_j / keep with independent Bernoulli(keep) m_j: (1 - keep) / keep * sum_j w_ij^2 v_j^2.
    expected_var = (1 - keep) / keep * (weights**2 @ v**2)
    q_rep, k_rep, v_rep = (t.expand(draws, -1, -1, -1) for t in (q, k, v))
    with torch.no_grad():
        outs = blockwise_attention(q_rep, k_rep, v_rep, dropout_p=p, block_size=3)  # (draws, h, lq, d)
        dense_outs = torch.nn.functional.dropout(weights.expand(draws, -1, -1, -1), p=p) @ v
    for sample in (outs, dense_outs):
        mean, var = sample.mean(0, keepdim=True), sample.var(0, keepdim=True)
        # Standard error of the mean: sqrt(var / draws); of the variance about var * sqrt(2 / draws) (plus kurtosis).
        assert float(((mean - expected_mean).abs() / (expected_var / draws).sqrt().clamp_min(1e-12)).max()) < 5.0
        assert float((var / expected_var.clamp_min(1e-12)).log().abs().max()) < 0.35
    kept = (outs != 0).double().mean()  # sanity: outputs are not zero
    assert kept > 0.9
    assert abs(keep - (1 - p)) < 2**-16


def test_dropout_keep_probability_and_block_size_rule():
    assert dropout_keep_probability(0.0) == 1.0
    assert dropout_keep_probability(0.1) == pytest.approx(0.9, abs=2**-17)
    assert dropout_keep_probability(0.99999999) > 0
    assert choose_block_size(2, 8, 4096, 4096, dtype=torch.float32) == 128
    assert choose_block_size(1, 8, 32768, 32768, dtype=torch.float32) == 32
    assert choose_block_size(1, 8, 32768, 32768, dtype=torch.bfloat16) == 32  # scores are float32
    assert choose_block_size(1, 8, 32768, 32768, dtype=torch.float64) == 16
    assert choose_block_size(1, 1, 10, 10, dtype=torch.float32) == 10  # never more than lq
    assert choose_block_size(64, 64, 10**6, 10**6, dtype=torch.float32) == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"dropout_p": 1.0}, r"dropout_p must be a probability in \[0, 1\), got 1.0"),
        ({"mask": torch.ones(4, 4)}, "mask must be a bool tensor"),
        ({"q_positions": torch.arange(3)}, "q_positions and k_positions must end in 4 and 4"),
    ],
)
def test_blockwise_errors(kwargs, match):
    q, k, v = qkv(1, 4, 4)
    term = make_term("alibi") if "q_positions" in kwargs else None
    with pytest.raises(ValueError, match=match):
        blockwise_attention(q, k, v, term=term, **kwargs)
    with pytest.raises(ValueError, match="q, k and v must have shape"):
        blockwise_attention(q[0], k[0], v[0])


# ---- inside MultiHeadAttention -------------------------------------------------------------


@pytest.mark.parametrize("label", LABELS)
def test_multihead_attention_blockwise_equals_its_dense_path(label):
    term = make_term(label, torch.float32)
    torch.manual_seed(4)
    mha = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, position=term, block_size=3)
    x = torch.randn(2, 10, HEADS * HEAD_DIM)
    lens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 5, 5, 5, 5, 9, 9, 9, 9, 9]])
    out = mha(x, x, x, lens, causal=True, offset=40)
    dense_out, _ = mha(x, x, x, lens, causal=True, offset=40, return_weights=True)
    torch.testing.assert_close(out, dense_out, rtol=0, atol=2e-6)


@pytest.mark.parametrize("label", ["t5", "shaw", "kerple"])
def test_multihead_attention_cache_equals_full_pass(label):
    term = make_term(label, torch.float32)
    mha = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, position=term, block_size=2).eval()
    x = torch.randn(1, 9, HEADS * HEAD_DIM)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        cache, pieces, start = KVCache(9), [], 0
        for size in (4, 1, 3, 1):
            pieces.append(mha(x[:, start : start + size], x[:, start : start + size], x[:, start : start + size],
                              causal=True, cache=cache))  # fmt: skip
            start += size
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=2e-6)


def test_multihead_attention_dropout_goes_blockwise_and_eval_does_not():
    torch.manual_seed(0)
    mha = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, dropout=0.5)
    x = torch.randn(2, 6, HEADS * HEAD_DIM)
    train_out = mha(x, x, x)
    mha.eval()
    eval_out = mha(x, x, x)
    assert not torch.allclose(train_out, eval_out)
    torch.manual_seed(1)
    mha.train()
    a = mha(x, x, x)
    torch.manual_seed(1)
    torch.testing.assert_close(mha(x, x, x), a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got -1"):
        MultiHeadAttention(HEADS * HEAD_DIM, HEADS, block_size=-1)


# ---- score_mod -----------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["alibi", "alibi-bidirectional", "t5", "t5-causal", "shaw-keys", "kerple", "fire"])
def test_score_mod_on_index_grids_equals_the_dense_bias(label):
    term = make_term(label)
    q, _, _ = qkv(2, 5, 7)
    q_positions, k_positions = torch.arange(30, 35), torch.arange(28, 35)
    score_mod, params = term.to_score_mod(q_positions=q_positions, k_positions=k_positions, q=q)
    assert {id(p) for p in params} <= {id(p) for p in term.parameters()}
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(HEADS)[None, :, None, None]
    i = torch.arange(5)[None, None, :, None]
    j = torch.arange(7)[None, None, None, :]
    zeros = torch.zeros(2, HEADS, 5, 7, dtype=torch.float64)
    with torch.no_grad():
        got = score_mod(zeros, b, h, i, j)
        want = term(q, q_positions=q_positions, k_positions=k_positions).expand(2, HEADS, 5, 7)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("label", ["alibi", "t5", "kerple", "fire", "shaw-keys"])
def test_flex_attention_forward_on_cpu_equals_dense(label):
    term = make_term(label, torch.float32)
    q, k, v = qkv(2, 8, 8, torch.float32)
    positions = torch.arange(3, 11)
    lens = torch.tensor([0, 6])
    mask = (torch.arange(8) < lens[:, None])[:, None, None, :]  # (b, 1, 1, lk)
    with torch.no_grad():
        got = flex_score_attention(
            q, k, v, term=term, q_positions=positions, k_positions=positions, mask=mask, causal=True
        )
        want = dense(term, q, k, v, positions, positions, visibility(2, 8, 8, causal=True, valid_lens=lens))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("label", ["alibi", "t5", "kerple"])
def test_flex_attention_on_cuda_forward_and_backward(label):  # pragma: no cover - GPU only
    term = make_term(label, torch.float32).cuda()
    gen = torch.Generator().manual_seed(0)
    # (b, h, l, 16): the compiled kernel takes head sizes from 16 up (FLEX_MIN_HEAD_SIZE)
    q, k, v = (torch.randn(2, HEADS, 128, 16, generator=gen).cuda().requires_grad_(True) for _ in range(3))
    positions = torch.arange(128, device="cuda")
    visible = torch.ones(2, HEADS, 128, 128, dtype=torch.bool, device="cuda").tril()
    out = flex_score_attention(q, k, v, term=term, q_positions=positions, k_positions=positions, causal=True)
    want = dense(term, q, k, v, positions, positions, visible)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-4)
    params = list(term.parameters())
    got = torch.autograd.grad(out.sum(), [q, *params])
    ref = torch.autograd.grad(want.sum(), [q, *params])
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)


@pytest.mark.filterwarnings("ignore")
def test_flex_attention_names_itself_to_the_profiler():
    q, k, v = qkv(1, 4, 4, torch.float32)
    positions = torch.arange(4)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flex_score_attention(
            q, k, v, term=make_term("alibi", torch.float32), q_positions=positions, k_positions=positions
        )
    assert "selfattn::flex_attention" in {event.key for event in prof.key_averages()}


def test_functional_attention_with_dropout_runs_blockwise():
    q, k, v = qkv(2, 9, 9)
    mask = torch.arange(9) < 7  # (lk,): a 1-D mask broadcasts too
    torch.manual_seed(5)
    got = attention(q, k, v, mask=mask, causal=True, dropout_p=0.3)
    torch.manual_seed(5)
    want = blockwise_attention(q, k, v, mask=mask, causal=True, dropout_p=0.3)
    assert torch.equal(got, want)
    assert bool((got != attention(q, k, v, mask=mask, causal=True)).any())


@pytest.mark.parametrize(("label", "dropout_p"), [("alibi", 0.0), ("t5", 0.0), ("shaw", 0.0), (None, 0.2)])
def test_a_nan_in_a_query_gives_nan_in_its_row_only(label, dropout_p):
    term = None if label is None else make_term(label)
    q, k, v = qkv(1, 6, 6)
    q[0, 1, 2, 3] = float("nan")
    positions = torch.arange(6)
    out = blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions,
                              dropout_p=dropout_p, block_size=4)  # fmt: skip
    assert bool(out[0, 1, 2].isnan().all())
    out[0, 1, 2] = 0.0
    assert bool(out.isfinite().all())
