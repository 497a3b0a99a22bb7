"""Properties over random cases (hypothesis, bounded by the conftest profile).

* the fused path == the explicit path == a float64 per-query loop, over random shapes, masks,
  causal with fewer queries than keys, biases (with -inf entries), scales and dtypes;
* no NaN from any mask pattern, forward or backward;
* a key/value cache, token by token from any offset, == one full pass, for every encoding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import naive_attention

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import attention
from selfattn.positional import NAMES, build

# Absolute tolerance per dtype, in units of max |v| (outputs are convex combinations of values).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@st.composite
def attention_cases(draw: st.DrawFn) -> dict[str, Any]:
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    lk = draw(st.integers(1, 7))
    lq = draw(st.integers(1, 7))
    d, dv = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]))
    spread = draw(st.sampled_from([0.5, 1.0, 4.0]))
    q = (torch.randn(b, h, lq, d, generator=g) * spread).to(dtype)
    k = (torch.randn(b, h, lk, d, generator=g) * spread).to(dtype)
    v = torch.randn(b, h, lk, dv, generator=g).to(dtype)
    mask_shape = draw(st.sampled_from([None, (b, h, lq, lk), (b, 1, 1, lk), (lq, lk), (b, 1, lq, lk)]))
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=g) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    bias = None
    if draw(st.booleans()):
        bias_shape = draw(st.sampled_from([(b, h, lq, lk), (1, h, lq, lk), (lq, lk)]))
        bias = torch.randn(bias_shape, generator=g)
        if draw(st.booleans()):
            bias = bias.masked_fill(torch.rand(bias_shape, generator=g) < 0.3, float("-inf"))
    scale = draw(st.sampled_from([None, 0.1, 1.0, 2.5]))
    return {"q": q, "k": k, "v": v, "mask": mask, "bias": bias, "causal": draw(st.booleans()), "scale": scale}


def visible_keys(case: dict[str, Any]) -> np.ndarray:
    """``(b, h, lq, lk)``: mask, lower-right causal alignment and ``bias > -inf``, spelled out."""
    q, k = case["q"], case["k"]
    b, h, lq, _ = q.shape
    lk = k.shape[-2]
    visible = np.ones((b, h, lq, lk), dtype=bool)
    if case["mask"] is not None:
        visible &= np.broadcast_to(case["mask"].numpy(), visible.shape)
    if case["causal"]:
        for i in range(lq):
            visible[..., i, max(0, i + lk - lq + 1) :] = False
    if case["bias"] is not None:
        visible &= np.broadcast_to(case["bias"].numpy() > -np.inf, visible.shape)
    return visible


@given(attention_cases())
def test_fused_equals_explicit_equals_a_float64_loop(case: dict[str, Any]) -> None:
    q, k, v = case["q"], case["k"], case["v"]
    kwargs = {key: case[key] for key in ("mask", "bias", "causal", "scale")}
    fused = attention(q, k, v, **kwargs)
    explicit, weights = attention(q, k, v, return_weights=True, **kwargs)
    visible = visible_keys(case)
    bias = None
    if case["bias"] is not None:
        bias = np.broadcast_to(np.nan_to_num(case["bias"].numpy(), neginf=0.0), visible.shape)  # -inf: not visible
    expected, expected_weights = naive_attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), visible, bias, case["scale"]
    )
    atol = TOLERANCE[q.dtype] * max(1.0, float(v.abs().max()))
    for name, out in (("fused", fused), ("explicit", explicit)):
        assert isinstance(out, torch.Tensor) and out.dtype == q.dtype, name
        np.testing.assert_allclose(out.double().numpy(), expected, atol=atol, rtol=0, err_msg=name)
    np.testing.assert_allclose(weights.double().numpy(), expected_weights, atol=TOLERANCE[q.dtype] * 2, rtol=0)
    assert weights.dtype == q.dtype


@given(
    st.integers(1, 6),
    st.integers(1, 6),
    st.booleans(),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_no_nan_from_any_mask_pattern(lq: int, lk: int, causal: bool, seed: int, density: float) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, lq, 4, generator=g, requires_grad=True)
    k = torch.randn(2, 2, lk, 4, generator=g, requires_grad=True)
    v = torch.randn(2, 2, lk, 3, generator=g, requires_grad=True)
    mask = torch.rand(2, 2, lq, lk, generator=g) < density
    bias = torch.randn(2, 2, lq, lk, generator=g).masked_fill(
        torch.rand(2, 2, lq, lk, generator=g) < density / 2, float("-inf")
    )
    for kwargs in ({"mask": mask}, {"bias": bias}, {"mask": mask, "bias": bias}):
        fused = attention(q, k, v, causal=causal, **kwargs)
        explicit, weights = attention(q, k, v, causal=causal, return_weights=True, **kwargs)
        assert isinstance(fused, torch.Tensor)
        for out in (fused, explicit, weights):
            assert out.isfinite().all()
        (fused.sum() + explicit.sum()).backward()
        for t in (q, k, v):
            assert t.grad is not None and t.grad.isfinite().all()
            t.grad = None


def _encodings_for_decoding() -> list[str]:
    """Every registered encoding a decoder can use token by token (grid encodings have no sequence)."""
    names = []
    for name in NAMES:
        if name == "rotary3d":  # a grid encoding too, and a head of 4 is too small for 3 axes
            continue
        encoding = build(name, num_hiddens=8, num_heads=2)
        if getattr(encoding, "num_axes", 1) == 1:
            names.append(name)
    return names


@pytest.mark.parametrize("name", _encodings_for_decoding())
@given(
    batch=st.integers(1, 2),
    length=st.integers(2, 7),
    prompt=st.integers(1, 3),
    offset=st.sampled_from([0, 3, 1000]),
    padded=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cache_token_by_token_equals_one_full_pass(
    name: str, batch: int, length: int, prompt: int, offset: int, padded: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    num_hiddens, num_heads = 8, 2
    encoding = build(name, num_hiddens=num_hiddens, num_heads=num_heads).double().eval()
    inside = encoding.acts_on != "input"
    mha = MultiHeadAttention(num_hiddens, num_heads, position=encoding if inside else None).double().eval()
    x = torch.randn(batch, length, num_hiddens, dtype=torch.float64)
    if name == "learned" and offset + length > 1000:
        offset = 0  # a learned table has max_len rows
    prompt = min(prompt, length - 1)
    # Key lengths reach the end of the sequence or stop inside it (with a cache they count every key).
    valid_lens = torch.randint(prompt, length + 1, (batch,)) if padded else None

    def encode(chunk: torch.Tensor, start: int) -> torch.Tensor:
        return chunk if inside else encoding(chunk, offset=offset + start)

    with torch.no_grad():
        h = encode(x, 0)
        full = mha(h, h, h, valid_lens, causal=True, offset=offset)
        cache = KVCache(max_len=length)
        first = encode(x[:, :prompt], 0)
        steps = [mha(first, first, first, valid_lens, causal=True, offset=offset, cache=cache)]
        for t in range(prompt, length):
            token = encode(x[:, t : t + 1], t)
            steps.append(mha(token, token, token, valid_lens, causal=True, offset=offset + t, cache=cache))
    assert cache.length == length
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
