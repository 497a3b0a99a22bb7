"""A softcap on the per-slice CPU route (``_SlicedAttention``), and the cap computed through a sigmoid.

References: the capped attention written out in float64 torch ops here, the loop reference of
``tests/reference_mha.py`` for whole modules, and ``torch.tanh`` in float64 for the cap itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import selfattn.functional._block_common as block_common
import selfattn.functional._block_sliced as sliced_engine
from selfattn import MultiHeadAttention, masks
from selfattn.core import dispatch
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from tests.reference_mha import naive_mha

HEADS, HEAD_DIM = 4, 8


@pytest.fixture
def small_tiles(monkeypatch):
    """Send small calls to the per-slice route, in tiles of MIN_BLOCK (16) queries."""
    monkeypatch.setattr(sliced_engine, "SLICED_MIN_SCORES", 0)
    monkeypatch.setattr(sliced_engine, "SLICE_TILE_BYTES", 1)
    calls = []
    original = sliced_engine._SlicedAttention.apply
    monkeypatch.setattr(sliced_engine._SlicedAttention, "apply", lambda *args: calls.append(1) or original(*args))
    return calls


def _capped_attention(q, k, v, *, softcap, visible, sinks=None):
    """float64 ``softmax(c tanh(q k^T / sqrt(d) / c))`` over the visible keys (and a sink logit per head, which
    takes weight and adds no value), zeros for a row that sees none."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = softcap * torch.tanh(q @ k.transpose(-2, -1) / HEAD_DIM**0.5 / softcap)  # (b, h, lq, lk)
    empty = ~visible.any(dim=-1, keepdim=True)
    logits = logits.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0)
    if sinks is None:
        weights = torch.softmax(logits, dim=-1)
    else:
        exp_keys = torch.exp(logits - logits.amax(-1, keepdim=True))
        exp_sink = torch.exp(sinks.view(1, -1, 1, 1) - logits.amax(-1, keepdim=True))
        weights = exp_keys / (exp_keys.sum(-1, keepdim=True) + exp_sink)
    return (weights @ v).masked_fill(empty, 0.0)


def _qkv(b, lq, lk, *, k_heads=HEADS, seed=0, dtype=torch.float64, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, HEADS, lq, HEAD_DIM, generator=gen, dtype=dtype) * spread).requires_grad_(True)
    k = (torch.randn(b, k_heads, lk, HEAD_DIM, generator=gen, dtype=dtype) * spread).requires_grad_(True)
    v = torch.randn(b, k_heads, lk, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("k_heads", [HEADS, 1])
@pytest.mark.parametrize(
    ("lq", "lk", "causal", "visibility_kind"),
    [
        (40, 40, True, None),  # three tiles (16, 16, 8)
        (40, 24, True, None),  # more queries than keys: the first 16 see nothing
        (37, 50, True, "valid_lens_2d"),  # causal with more keys than queries, a row that sees nothing
        (33, 33, False, "mask"),
        (20, 45, False, None),
    ],
)
def test_softcap_on_the_sliced_route_equals_the_float64_formula(small_tiles, lq, lk, causal, visibility_kind, k_heads):
    b, softcap = 2, 0.7
    q, k, v = _qkv(b, lq, lk, k_heads=k_heads)
    columns, rows = torch.arange(lk), torch.arange(lq)[:, None]
    visible = torch.ones(b, HEADS, lq, lk, dtype=torch.bool)
    mask = None
    if visibility_kind == "valid_lens_2d":
        limits = torch.randint(0, lk + 1, (b, lq), generator=torch.Generator().manual_seed(3))
        limits[0, 5] = 0  # row 5 of batch 0 sees no key
        mask = (columns < limits[..., None])[:, None]  # (b, 1, lq, lk)
    elif visibility_kind == "mask":
        mask = torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(4)) > 0.3
    if mask is not None:
        visible = visible & mask
    if causal:
        visible = visible & (columns <= rows + lk - lq)
    assert dispatch.explain(describe_attention(q, k, v, mask=mask, causal=causal, softcap=softcap)).route == "sliced"
    got = attention(q, k, v, mask=mask, causal=causal, softcap=softcap)
    assert small_tiles, "the per-slice route did not run"
    want = _capped_attention(q, k, v, softcap=softcap, visible=visible)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for name, g_got, g_want in zip(
        "qkv", torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
    ):
        assert g_got.shape == g_want.shape
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10, msg=name)


def _rule_visibility(kind, n):
    """Bool (2, n, n) from loops: causal and a window of 5, causal within chunks of 8, or a bidirectional prefix of 12."""
    vis = np.zeros((2, n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            if kind == "window":
                vis[:, i, j] = j <= i and i - j < 5
            elif kind == "chunks":
                vis[:, i, j] = j <= i and i // 8 == j // 8
            else:
                vis[:, i, j] = j <= i or (i < 12 and j < 12)
    return vis


@pytest.mark.parametrize("kind", ["window", "chunks", "prefix"])
def test_a_module_with_a_softcap_and_a_mask_rule_equals_the_loop_reference(small_tiles, kind):
    torch.manual_seed(0)
    d, n = HEADS * HEAD_DIM, 48
    window = 5 if kind == "window" else None
    mha = MultiHeadAttention(d, HEADS, softcap=1.3, num_kv_heads=2, window=window, dtype=torch.float64).eval()
    x = torch.randn(2, n, d, dtype=torch.float64)
    rule = {"window": masks.causal(), "chunks": masks.causal() & masks.chunks(8)}.get(
        kind, masks.causal() | masks.prefix(12)
    )
    assert mha.explain(x, x, x, mask=rule).route == "sliced"
    out = mha(x, x, x, mask=rule)
    assert small_tiles
    positions = torch.arange(n).expand(2, n)
    expected, _ = naive_mha(mha, x, x, x, _rule_visibility(kind, n), positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_tiles_skip_the_keys_a_window_hides(small_tiles, monkeypatch):
    """With a window of 5 and tiles of 16 queries, a tile's keys start 4 before its first query."""
    seen = []
    original = sliced_engine._slice_tile_probs
    monkeypatch.setattr(
        sliced_engine, "_slice_tile_probs", lambda q, k, *a, **kw: seen.append(k.shape[0]) or original(q, k, *a, **kw)
    )
    torch.manual_seed(0)
    mha = MultiHeadAttention(HEADS * HEAD_DIM, HEADS, softcap=1.3, window=5).eval()
    x = torch.randn(1, 48, HEADS * HEAD_DIM)
    with torch.no_grad():
        mha(x, x, x, causal=True)
    assert sorted(set(seen)) == [16, 20]  # tile 0: keys 0..15; tiles 1, 2: 4 + 16 keys


def _check_twice_differentiable(run, full, small):
    """gradcheck and gradgradcheck of ``run``: element by element on ``small``, in fast_mode on ``full``.

    Checking each of ``full``'s elements took minutes. ``small`` keeps the tiles (16 queries, then 2), two heads
    and a head size of 2; fast_mode compares one random projection of each Jacobian, where a small error in a
    few elements can hide (a 1% error in the last tile's query gradient did, in a trial), so it only adds the
    full sizes.
    """
    for inputs, fast_mode in ((small, False), (full, True)):
        assert torch.autograd.gradcheck(run, inputs, atol=1e-7, rtol=1e-5, fast_mode=fast_mode)
        assert torch.autograd.gradgradcheck(run, inputs, atol=1e-6, rtol=1e-4, fast_mode=fast_mode)


def test_softcap_with_dropout_and_double_backward_pass_gradcheck(small_tiles):
    q, k, v = (t.detach()[:1, :2, :18] for t in _qkv(1, 18, 18, k_heads=HEADS, seed=8))

    def run(q, k, v):
        torch.manual_seed(21)
        return attention(q, k, v, causal=True, dropout_p=0.3, softcap=0.9)

    full = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    small = tuple(t[..., :2].clone().requires_grad_(True) for t in (q, k, v))
    _check_twice_differentiable(run, full, small)
    assert small_tiles


def test_float32_at_gemmas_cap_stays_near_the_float64_formula(small_tiles):
    q, k, v = _qkv(2, 64, 64, seed=5, dtype=torch.float64, spread=3.0)
    low = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    got = attention(*low, causal=True, softcap=50.0)
    assert small_tiles
    visible = torch.ones(64, 64, dtype=torch.bool).tril()
    want = _capped_attention(q, k, v, softcap=50.0, visible=visible)
    assert (got.double() - want).abs().max().item() < 1e-5
    grad = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad(got, low, grad.float())
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        assert (g_got.double() - g_want).abs().max().item() < 1e-4 * max(g_want.abs().max().item(), 1.0)


@pytest.mark.parametrize("k_heads", [HEADS, 2])
def test_softcap_with_sinks_on_the_sliced_route_equals_the_float64_formula(small_tiles, k_heads):
    q, k, v = _qkv(2, 37, 37, k_heads=k_heads, seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 3.5], dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 37, 37, generator=torch.Generator().manual_seed(6)) > 0.3
    mask[1, 0, 4] = False  # a query that sees no key: zeros, and no share of the sink's gradient
    call = describe_attention(q, k, v, mask=mask, causal=True, softcap=0.8, sinks=sinks)
    assert dispatch.explain(call).route == "sliced"
    got = attention(q, k, v, mask=mask, causal=True, softcap=0.8, sinks=sinks)
    assert small_tiles
    visible = mask & torch.ones(37, 37, dtype=torch.bool).tril()
    want = _capped_attention(q, k, v, softcap=0.8, visible=visible, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got[1, :, 4], torch.zeros_like(got[1, :, 4]))
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    inputs = (q, k, v, sinks)
    for name, g_got, g_want in zip(
        ("q", "k", "v", "sinks"), torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad),
        strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-10, msg=name)


def test_sinks_with_dropout_pass_gradcheck_and_gradgradcheck(small_tiles):
    q, k, v = (t.detach()[:1, :, :18] for t in _qkv(1, 18, 18, seed=4))
    sinks = torch.tensor([0.3, -0.2, 1.1, 0.0], dtype=torch.float64)

    def run(q, k, v, sinks):
        torch.manual_seed(5)
        return attention(q, k, v, causal=True, dropout_p=0.25, sinks=sinks, softcap=1.5)

    full = tuple(t.clone().requires_grad_(True) for t in (q, k, v, sinks))
    assert dispatch.explain(describe_attention(*full[:3], causal=True, dropout_p=0.25, sinks=full[3])).route == "sliced"
    small = (*(t[:, :2, :, :2].clone().requires_grad_(True) for t in (q, k, v)), sinks[:2].clone().requires_grad_(True))
    _check_twice_differentiable(run, full, small)
    assert small_tiles


def test_sinks_alone_keep_the_flash_routes(small_tiles):
    q, k, v = _qkv(1, 20, 20)
    sinks = torch.zeros(HEADS, dtype=torch.float64)
    assert dispatch.explain(describe_attention(q, k, v, causal=True, sinks=sinks)).route == "fused sinks"
    explanation = dispatch.explain(describe_attention(q, k, v, mask=torch.rand(20, 20) > 0.5, sinks=sinks))
    assert explanation.route == "blockwise"
    assert ("sliced", "no dropout and no softcap") in explanation.declined


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_numpy", [True, False], ids=["numpy tanh", "torch tanh"])
def test_the_cap_and_its_slope_against_float64_tanh(monkeypatch, dtype, with_numpy):
    if not with_numpy:
        monkeypatch.setattr(block_common, "_numpy", None)
    softcap = 50.0
    scores = torch.cat([torch.linspace(-3 * softcap, 3 * softcap, 4001), torch.tensor([0.0, 1e-3, -2.5, 1e-30])])
    scores = scores.to(dtype).view(1, -1)
    exact = scores.double() / softcap
    want, want_slope = softcap * torch.tanh(exact), 1 - torch.tanh(exact) ** 2
    got = scores.clone()
    slope = block_common._cap_in_place(got, softcap, block_common._Workspace(scores.device), want_slope=True)
    eps = torch.finfo(dtype).eps
    assert ((got.double() - want).abs() <= 4 * eps * want.abs()).all()  # relative: small logits keep their precision
    assert (slope.double() - want_slope).abs().max().item() <= 4 * eps


def test_the_cap_keeps_nan_and_infinity():
    scores = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0]])
    block_common._cap_in_place(scores, 2.0, block_common._Workspace(scores.device), want_slope=False)
    assert scores[0, 0].isnan() and scores[0, 1:].tolist() == [2.0, -2.0, 0.0]


def test_bfloat16_softcap_and_sinks_compute_in_float32_and_keep_their_dtype(small_tiles):
    q, k, v = (t.detach().float() for t in _qkv(2, 40, 40, seed=7, dtype=torch.float32, spread=1.0))
    sinks = torch.tensor([0.2, -0.4, 1.0, 0.0])
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    got = attention(*low, causal=True, softcap=2.0, sinks=sinks.bfloat16())
    assert small_tiles and got.dtype == torch.bfloat16
    want = attention(
        *(t.bfloat16().float() for t in (q, k, v)), causal=True, softcap=2.0, sinks=sinks.bfloat16().float()
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in low)
