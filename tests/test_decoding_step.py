"""A decoding step of the sinks, softcap and score-term routes: the formula, without a copy of the keys per query head."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfattn.core.routes._blocks as blocks
from selfattn import KVCache, MultiHeadAttention
from selfattn.core import dispatch
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from selfattn.positional import build

H, HK, D = 4, 2, 8


def _formula(q, k, v, softcap=None, sinks=None, bias=None, visible=None):
    """float64 per (batch, head, query): query head i reads key/value head i // (h / hk); hidden keys
    (``visible`` bool ``(b, lq, lk)`` False) take no weight, and a query that sees none gets zeros."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    batch, heads, num_queries, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros((batch, heads, num_queries, v.shape[-1]))
    for b in range(batch):
        for h in range(heads):
            for i in range(num_queries):
                scores = k[b, h // group] @ q[b, h, i] / math.sqrt(dim)
                if bias is not None:
                    scores = scores + bias[b if bias.shape[0] > 1 else 0, h, 0]
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                seen = np.ones_like(scores, dtype=bool) if visible is None else visible[b, i].numpy()
                if not seen.any():
                    continue
                scores = np.where(seen, scores, -np.inf)
                top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                weights = np.exp(scores - top)
                total = weights.sum() + (0.0 if sinks is None else math.exp(float(sinks[h]) - top))
                out[b, h, i] = (weights / total) @ v[b, h // group]
    return torch.from_numpy(out)


def _refuse_copies(monkeypatch):
    """From now on, repeating the keys and values per query head (what the blockwise routes feed their blocks) fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("the keys were repeated per query head")

    monkeypatch.setattr(blocks, "_repeat_kv", refuse)


@pytest.fixture
def no_copy_of_the_keys(monkeypatch):
    _refuse_copies(monkeypatch)


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize(
    ("softcap", "with_sinks", "route"),
    [(5.0, False, "blockwise"), (None, True, "fused sinks"), (5.0, True, "blockwise")],
    ids=["softcap", "sinks", "softcap and sinks"],
)
def test_a_grouped_decoding_step_is_the_formula(no_copy_of_the_keys, num_queries, softcap, with_sinks, route):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, num_queries, D, generator=gen)
    k, v = torch.randn(2, HK, 40, D, generator=gen), torch.randn(2, HK, 40, D, generator=gen)
    sinks = torch.randn(H, generator=gen) if with_sinks else None
    options = {"softcap": softcap, "sinks": sinks, "causal": num_queries == 1}  # one query after the keys sees all
    assert dispatch.explain(describe_attention(q, k, v, **options)).route == route
    with torch.no_grad():
        out = attention(q, k, v, **options)
    torch.testing.assert_close(out.double(), _formula(q, k, v, softcap, sinks), rtol=1e-5, atol=1e-6)


def test_an_alibi_decoding_step_is_the_formula(monkeypatch):
    """The key-row route's step: ALiBi's key-only row (a constant per query apart from the bias, so the same softmax)."""
    mha = MultiHeadAttention(16, H, num_kv_heads=HK, position=build("alibi", num_hiddens=16, num_heads=H)).eval()
    cache = KVCache(max_len=32)
    x = torch.randn(1, 21, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        mha(x[:, :20], x[:, :20], x[:, :20], cache=cache, causal=True)
        step = x[:, 20:]
        _refuse_copies(monkeypatch)  # the prompt's blocks repeat them; the step does not
        assert mha.explain(step, step, step, cache=cache, causal=True).route == "blockwise key row"
        last = mha(step, step, step, cache=cache, causal=True)
    torch.testing.assert_close(last, full[:, 20:], rtol=1e-5, atol=1e-6)


def test_training_keeps_the_routes_own_functions():
    """With a gradient wanted the step goes through the route's autograd Function (the keys repeated), as before."""
    q = torch.randn(1, H, 1, D, requires_grad=True)
    k, v = torch.randn(1, HK, 12, D), torch.randn(1, HK, 12, D)
    out = attention(q, k, v, softcap=5.0)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    reference = q.detach().clone().requires_grad_(True)
    expected = _formula(reference.detach(), k, v, softcap=5.0)
    torch.testing.assert_close(out.detach().double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options", [{"softcap": 5.0}, {"sinks": torch.zeros(H)}, {}, {"causal": True}],
    ids=["softcap", "sinks", "plain (the fused kernel's step)", "causal (hides nothing)"],
)  # fmt: skip
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kv_heads", [HK, H], ids=["grouped", "a key head per query head"])
@pytest.mark.parametrize(
    "num_keys", [5, 7, 8, 15, 16, 31, 32, 600], ids=lambda n: f"{n} keys" + (" (rows layout)" if n == 600 else "")
)
def test_a_nan_query_gives_nan_in_a_decoding_step(no_copy_of_the_keys, options, bad, kv_heads, num_keys):
    if bad == float("inf") and "softcap" in options:
        pytest.skip("capped, an infinite score is finite: the formula gives a number")
    q = torch.randn(1, H, 1, D)
    q[0, 1, 0, 2] = bad
    # 5 keys: where PyTorch's CPU kernel gives a NaN query a finite row (the guard must make it NaN); from one
    # vector of keys (8 with AVX2, 16 with AVX-512, 32 elsewhere) the kernel gives NaN itself (the next test pins
    # that) and the unmasked step adds no guard.
    k, v = torch.randn(1, kv_heads, num_keys, D), torch.randn(1, kv_heads, num_keys, D)
    with torch.no_grad():
        for _ in range(2):  # the second call from the functional memory
            out = attention(q, k, v, **options)
            assert out[0, 1].isnan().all()
            assert not out[0, [0, 2, 3]].isnan().any()


@settings(max_examples=60, deadline=None)
@given(
    keys_past=st.one_of(st.integers(0, 40), st.integers(0, 1200)), head_dim=st.sampled_from([8, 16, 32, 64, 128, 256]),
    heads=st.sampled_from([(8, 8), (8, 2), (4, 1)]), num_queries=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float64]), threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_cpu_kernel_gives_a_nan_query_a_nan_row_from_one_vector_of_keys(
    keys_past, head_dim, heads, num_queries, dtype, threads, seed
):
    """What fused_unmasked relies on to leave out its guard on the output from _KERNEL_SPREADS_NAN_FROM_KEYS keys
    (one vector of the dtype's lanes on this machine's capability): PyTorch's own kernel gives a query holding a
    NaN a row of NaN, and no other row a NaN. (An infinity it does not always: the next test.) If a PyTorch
    release or a CPU changes that, this fails, and the threshold must go (the guard then runs for every size, as
    below it)."""
    from selfattn.functional._unmasked import _KERNEL_SPREADS_NAN_FROM_KEYS

    num_keys = _KERNEL_SPREADS_NAN_FROM_KEYS[dtype] + keys_past
    gen = torch.Generator().manual_seed(seed)
    h, hk = heads
    q = torch.randn(2, h, num_queries, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(2, hk, num_keys, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(2, hk, num_keys, head_dim, generator=gen, dtype=dtype)
    where = (1, seed % h, seed % num_queries)
    q[(*where, seed % head_dim)] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=h != hk)
    finally:
        torch.set_num_threads(before)
    assert out[where].isnan().all()
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[where] = False
    assert not out[others].isnan().any()


@pytest.mark.parametrize("num_keys", [5, 15, 16, 31, 32, 100, 600])
@pytest.mark.parametrize("kv_heads", [HK, H], ids=["grouped", "a key head per query head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_infinite_query_that_every_key_opposes_gets_a_nan_row(num_keys, kv_heads, dtype):
    """An infinite query element whose keys all have the opposite sign there makes every score of its row -inf:
    PyTorch's kernel reads that as a row that sees no key and gives zeros at any number of keys; the formula (a
    softmax of -inf only) gives NaN, and so must a decoding step, a step made for the kind, and a call."""
    from selfattn.functional._unmasked import fused_unmasked, unmasked_step

    gen = torch.Generator().manual_seed(num_keys)
    q = torch.randn(2, H, 1, D, generator=gen, dtype=dtype)
    k = torch.randn(2, kv_heads, num_keys, D, generator=gen, dtype=dtype)
    v = torch.randn(2, kv_heads, num_keys, D, generator=gen, dtype=dtype)
    q[1, 2, 0, 5] = float("inf")
    k[1, 2 // (H // kv_heads), :, 5] = -k[1, 2 // (H // kv_heads), :, 5].abs()  # every score of that row -inf
    kernel = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != H)
    assert not kernel[1, 2].isnan().any()  # the kernel's zeros: what the guard is for
    with torch.no_grad():
        step = unmasked_step(q, k, v, 0.25)
        for out in (fused_unmasked(q, k, v, scale=0.25), step(q, k, v), attention(q, k, v), attention(q, k, v)):
            assert out[1, 2].isnan().all()
            others = torch.ones(out.shape[:3], dtype=torch.bool)
            others[1, 2] = False
            assert not out[others].isnan().any()


@pytest.mark.parametrize("options", [{}, {"sinks": "zeros"}, {"causal": True}], ids=["plain", "sinks", "causal"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kv_heads", [HK, H], ids=["grouped", "a key head per query head"])
@pytest.mark.parametrize("grad_mode", [False, True], ids=["inference", "a gradient wanted"])
def test_a_single_key_whose_score_is_not_finite_gives_nan(options, bad, kv_heads, grad_mode):
    """One key: PyTorch's kernel gives each query the key's value whatever its score, where the formula's softmax
    of one NaN or infinite score is NaN. The guard forms each query's one score (a key holding NaN or an infinity,
    with a query of either sign there)."""
    if "sinks" in options:
        options = {"sinks": torch.zeros(H)}
    q = torch.randn(1, H, 1, D).abs()  # every score of key element 2 has the key's sign
    k, v = torch.randn(1, kv_heads, 1, D), torch.randn(1, kv_heads, 1, D)
    k[0, 1 if kv_heads == HK else 2, 0, 2] = bad
    with torch.set_grad_enabled(grad_mode):
        q.requires_grad_(grad_mode)
        for _ in range(2):  # the second call from the functional memory
            out = attention(q, k, v, **options)
            hit = H // kv_heads if kv_heads == HK else 1  # query heads reading the key/value head holding it
            first = 2 if kv_heads == H else hit
            assert out[0, first : first + hit].isnan().all()
            assert not out[0, [h for h in range(H) if not first <= h < first + hit]].isnan().any()


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from selfattn.functional._unmasked import _KERNEL_SPREADS_NAN_FROM_KEYS
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
for dtype, fewest in _KERNEL_SPREADS_NAN_FROM_KEYS.items():
    for num_keys in (fewest - 1, fewest, fewest + 1):
        q, k, v = torch.randn(1, 2, 1, 16, dtype=dtype), torch.randn(1, 2, num_keys, 16, dtype=dtype), torch.randn(1, 2, num_keys, 16, dtype=dtype)
        q[0, 1, 0, 3] = float("nan")
        print(dtype, num_keys, bool(F.scaled_dot_product_attention(q, k, v)[0, 1].isnan().all()))
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="an x86 CPU with AVX2")
def test_with_avx2_the_guard_covers_the_keys_below_one_of_its_vectors():
    """Forced to AVX2 (``ATEN_CPU_CAPABILITY``), the thresholds are AVX2's vector (8 float32 or 4 float64 keys),
    and PyTorch's kernel gives a NaN query a finite row just below them and a row of NaN from them on."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", _AVX2_PROBE], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:-1] == [
        "torch.float32 7 False", "torch.float32 8 True", "torch.float32 9 True",
        "torch.float64 3 False", "torch.float64 4 True", "torch.float64 5 True",
    ]  # fmt: skip


@pytest.mark.parametrize("with_sinks", [False, True], ids=["softcap", "softcap and sinks"])
def test_a_masked_decoding_step_hides_its_keys(no_copy_of_the_keys, with_sinks):
    """A mask at a decoding step (transformers passes one; a sliding window hides old keys) is applied, and a
    query that sees no key gets zeros, as the blockwise routes give."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, H, 1, D, generator=gen)
    k, v = torch.randn(3, HK, 30, D, generator=gen), torch.randn(3, HK, 30, D, generator=gen)
    visible = torch.rand(3, 1, 30, generator=gen) > 0.5
    visible[2] = False  # this sequence's query sees nothing
    sinks = torch.randn(H, generator=gen) if with_sinks else None
    options = {"softcap": 5.0, "sinks": sinks, "mask": visible[:, None]}
    assert dispatch.explain(describe_attention(q, k, v, **options)).route == "blockwise"
    with torch.no_grad():
        out = attention(q, k, v, **options)
    expected = _formula(q, k, v, 5.0, sinks, visible=visible)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_mode", [False, True], ids=["no grad", "grad mode"])
@pytest.mark.parametrize("scale", [0.3, 1 / math.sqrt(D)], ids=["a scale", "the kernel's default (left to it)"])
def test_a_step_made_for_a_kind_computes_every_size_of_it(heads, dtype, grad_mode, scale):
    """unmasked_step reads the kind's facts once (at 40 keys here) and then only the number of keys: at sizes on
    both sides of its thresholds (the NaN guard's one vector of keys, the rows layout's 512) it gives
    fused_unmasked's answer bit for bit, the formula's within rounding, and a query holding NaN or an infinity a
    row of NaN (below one vector of keys too, where PyTorch's kernel gives some such queries a finite row)."""
    from selfattn.functional._unmasked import fused_unmasked, unmasked_step

    h, hk = heads
    gen = torch.Generator().manual_seed(hk)

    def heads_of(num_keys: int, value_size: int = D + 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shapes = ((2, h, 1, D), (2, hk, num_keys, D), (2, hk, num_keys, value_size))
        return tuple(torch.randn(*shape, generator=gen, dtype=dtype) for shape in shapes)  # type: ignore[return-value]

    with torch.set_grad_enabled(grad_mode):
        step = unmasked_step(*heads_of(40), scale)
        for num_keys in (1, 3, 4, 7, 8, 15, 16, 31, 32, 33, 511, 512, 700):
            q, k, v = heads_of(num_keys)
            q[1, 0, 0, 2], q[1, 1, 0, 3], q[1, 2, 0, 4] = float("inf"), float("-inf"), float("nan")
            out = step(q, k, v)
            torch.testing.assert_close(out, fused_unmasked(q, k, v, scale=scale), rtol=0, atol=0, equal_nan=True)
            assert out[1, :3].isnan().all() and not out[1, 3].isnan().any() and not out[0].isnan().any()
            expected = _formula(q[:1] * (scale * math.sqrt(D)), k[:1], v[:1])
            tolerance = 1e-12 if dtype == torch.float64 else 1e-5
            np.testing.assert_allclose(out[:1].double().numpy(), expected, atol=tolerance, rtol=tolerance)
        # in grad mode the kind does not say whether a tensor wants a gradient: one that does gets the autograd
        # path, whose gradients have gradients themselves (second order; values as wide as the keys let PyTorch
        # choose its flash kernel, whose backward has no gradient)
        for wanting, num_keys in itertools.product(range(3 if grad_mode else 0), (7, 40)):
            heads = [t.requires_grad_(i == wanting) for i, t in enumerate(heads_of(num_keys, value_size=D))]
            out, expected = step(*heads), fused_unmasked(*heads, scale=scale)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            torch.testing.assert_close(_two_orders(out, heads[wanting]), _two_orders(expected, heads[wanting]))


def _two_orders(out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``out``'s sum of squares in ``x``, and that gradient's own."""
    (first,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.square().sum(), x)
    return first, second
