"""The layer's parts (selfattn.parts) against a float64 layer written here from the formulas, and old state dicts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from reference_mha import _rotate

from selfattn import KVCache, MultiHeadAttention
from selfattn.parts import HeadLogScaling, HeadNorm, LogFloorScaling, OutputGate, TemperatureTuning, ValueScale
from selfattn.positional import RotaryPositionalEncoding

DATA = Path(__file__).parent / "data"


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().double().numpy()


def _linear(layer, x):
    y = x @ _np(layer.weight).T
    return y if layer.bias is None else y + _np(layer.bias)


def _rms(x, weight, eps):
    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def _part(x, part, positions):
    """One part applied to x (..., features) of a single sequence, from the part's formula."""
    if isinstance(part, HeadNorm):
        return _rms(x, _np(part.weight), part.eps)
    if isinstance(part, ValueScale):
        return x * part.factor
    p = positions.astype(np.float64)  # (l,); x is (h, l, dq)
    if isinstance(part, TemperatureTuning):
        factor = 1 + part.attn_scale * np.log(1 + np.floor((p + 1) / part.floor_scale))
    elif isinstance(part, LogFloorScaling):
        factor = 1 + part.beta * np.log(1 + np.floor(p / part.original_length))
    elif isinstance(part, HeadLogScaling):
        factor = _np(part.scale)[:, None] * np.log(p + 1)[None, :] + _np(part.bias)[:, None]  # (h, l)
    else:
        raise AssertionError(part)
    return x * factor[..., None]


def _reference(mha: MultiHeadAttention, x: torch.Tensor) -> np.ndarray:
    """Causal self-attention of one layer over x (b, l, d), float64, loops over sequences and heads."""
    out = []
    h, hk, dq, dv = mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.value_head_dim
    for seq in _np(x):
        length = seq.shape[0]
        positions = np.arange(length)
        q, k = _linear(mha.W_q, seq), _linear(mha.W_k, seq)  # (l, h*dq), (l, hk*dq)
        v = k.copy() if mha.W_v is None else _linear(mha.W_v, seq)
        for part in mha.parts("query_features"):
            q = _part(q, part, positions)
        for part in mha.parts("key_features"):
            k = _part(k, part, positions)
        q = q.reshape(length, h, dq).transpose(1, 0, 2)  # (h, l, dq)
        k = k.reshape(length, hk, dq).transpose(1, 0, 2)
        v = v.reshape(length, hk, dv).transpose(1, 0, 2)
        for part in mha.parts("queries"):
            q = _part(q, part, positions)
        for part in mha.parts("keys"):
            k = _part(k, part, positions)
        if mha.position is not None:
            q = np.stack([_rotate(head, positions, dq) for head in q])
            k = np.stack([_rotate(head, positions, dq) for head in k])
        for part in mha.parts("rotated_queries"):
            q = _part(q, part, positions)
        for part in mha.parts("rotated_keys"):
            k = _part(k, part, positions)
        for part in mha.parts("values"):
            v = _part(v, part, positions)
        heads = []
        for head in range(h):
            kv = head // (h // hk)
            scores = q[head] @ k[kv].T / math.sqrt(dq)
            scores[np.triu(np.ones((length, length), bool), 1)] = -np.inf
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((weights / weights.sum(-1, keepdims=True)) @ v[kv])  # (l, dv)
        attended = np.stack(heads, axis=1)  # (l, h, dv)
        for part in mha.parts("output_heads"):
            attended = _part(attended, part, positions)
        merged = attended.reshape(length, h * dv)
        for part in mha.parts("merged"):
            assert isinstance(part, OutputGate)
            logits = _linear(part, seq)
            gate = 1 / (1 + np.exp(-logits)) if part.activation == "sigmoid" else np.log1p(np.exp(logits))
            merged = merged * gate if part.per == "feature" else (attended * gate[..., None]).reshape(length, -1)
            attended = merged.reshape(length, h, dv)
        out.append(_linear(mha.W_o, merged))
    return np.stack(out)


def _randomized(mha: MultiHeadAttention) -> MultiHeadAttention:
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in mha.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.5 if "W_" in name else 0.3) + (1.0 if "norm" in name else 0.0))
    return mha.double().eval()


LAYERS = {
    "whole-projection QK-norm (OLMo 2)": dict(
        parts={
            "q_norm": HeadNorm(16, slot="query_features"),
            "k_norm": HeadNorm(8, slot="key_features", eps=1e-5),
        },
        num_kv_heads=2,
    ),
    "QK-norm after the rotation (Hunyuan), unweighted": dict(
        parts={
            "query_layernorm": HeadNorm(4, slot="rotated_queries", weighted=False),
            "key_layernorm": HeadNorm(4, slot="rotated_keys"),
        },
        rotary=True,
    ),
    "keys as values, value norm (Gemma 4 global)": dict(
        values_from_keys=True, qk_norm=True, parts={"v_norm": HeadNorm(4, slot="values", weighted=False)}, rotary=True
    ),
    "value head size 6 (MiMo), output norm per head": dict(
        value_head_dim=6, num_kv_heads=2, parts={"o_norm": HeadNorm(6, slot="output_heads")}
    ),
    "value head size 6 scaled by 0.707 (MiMo-V2-Flash)": dict(
        value_head_dim=6, num_kv_heads=2, parts={"v_scale": ValueScale(0.707)}, rotary=True
    ),
    "gate per head, softplus (Step-3.7)": dict(
        parts={"g_proj": OutputGate(16, 4, 4, per="head", activation="softplus", bias=True)}, rotary=True
    ),
    "gate per feature after the query scalings": dict(
        gated_output=True,
        temperature_tuning=(0.3, 2.0),
        parts={"beta_scaling": LogFloorScaling(0.4, 2), "softmax_scaling": HeadLogScaling(4)},
    ),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_with_parts_equals_the_formulas(name: str) -> None:
    options = dict(LAYERS[name])
    rotary = options.pop("rotary", False)
    mha = MultiHeadAttention(16, 4, position=RotaryPositionalEncoding(4) if rotary else None, **options)
    mha = _randomized(mha)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    got = mha(x, x, x, causal=True)
    np.testing.assert_allclose(got.detach().numpy(), _reference(mha, x), rtol=1e-10, atol=1e-11)
    # cached decoding equals the full pass
    cache, steps = KVCache(max_len=6), []
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 6)):
        steps.append(mha(x[:, start:stop], x[:, start:stop], x[:, start:stop], causal=True, cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), got, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("factor", [0, 0.0, float("nan"), float("inf"), True, "0.7"])
def test_value_scale_refuses_a_factor_that_is_not_a_finite_nonzero_number(factor: object) -> None:
    with pytest.raises(ValueError, match="factor"):
        ValueScale(factor)  # type: ignore[arg-type]


def test_gradients_reach_every_part() -> None:
    options = dict(LAYERS["gate per head, softplus (Step-3.7)"])
    options.pop("rotary")
    mha = _randomized(MultiHeadAttention(16, 4, qk_norm=True, **options))
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    mha(x, x, x, causal=True).square().sum().backward()
    for name, param in mha.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_explain_names_the_parts() -> None:
    mha = MultiHeadAttention(16, 4, qk_norm=True, gated_output=True, position=RotaryPositionalEncoding(4))
    x = torch.randn(1, 3, 16)
    text = str(mha.explain(x, x, x, causal=True))
    assert "part: position = RotaryPositionalEncoding" in text
    assert "part: q_norm at queries: HeadNorm(4" in text
    assert "part: W_g at merged: OutputGate(" in text
    assert mha.explain(x, x, x).parts == mha.describe_parts()


def test_a_state_dict_saved_before_the_parts_loads() -> None:
    """Saved at commit 6f6518f (before the layer was parts) with its outputs; loaded now, the outputs are equal."""
    saved = torch.load(DATA / "mha_state_dicts_6f6518f.pt", weights_only=True)
    x, xq = saved["inputs"]
    layers = {
        "plain": MultiHeadAttention(16, 4, 0.1),
        "every_option": MultiHeadAttention(
            16, 4, bias=True, output_bias=False, num_kv_heads=2, qk_norm=True, gated_output=True, sinks=True,
            softcap=3.0, scale=0.3, window=4, temperature_tuning=(0.5, 2.0), output_size=12, query_size=10,
        ),
        "rotary": MultiHeadAttention(16, 4, position=RotaryPositionalEncoding(4), qk_norm=True),
    }  # fmt: skip
    for name, mha in layers.items():
        mha.load_state_dict(saved["state_dicts"][name])  # strict: the same keys
        got = mha.eval()(xq if name == "every_option" else x, x, x, causal=True)
        # float32 on another CPU sums in another order (an Intel Xeon: 3.8e-6 from outputs saved on an AMD EPYC); a
        # weight loaded into the wrong place moves them by tenths
        torch.testing.assert_close(got, saved["outputs"][name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: HeadNorm(0, slot="queries"), "size must be a positive integer"),
        (lambda: HeadNorm(4, slot="scores"), "slot must be one of"),
        (lambda: HeadNorm(4, slot="keys", weighted=1), "weighted must be True or False, got 1"),
        (lambda: OutputGate(8, 2, 4, per="token"), "per must be 'feature' or 'head', got 'token'"),
        (lambda: OutputGate(8, 2, 4, activation="relu"), "activation must be one of"),
        (lambda: LogFloorScaling(float("nan"), 4), "beta must be a finite number, got nan"),
        (lambda: LogFloorScaling(0.1, 0), "original_length must be a positive finite number, got 0"),
        (lambda: MultiHeadAttention(8, 2, parts={"a": torch.nn.Linear(2, 2)}), "parts\\['a'\\] must be a selfattn"),
        (lambda: MultiHeadAttention(8, 2, parts=[HeadNorm(4, slot="keys")]), "parts must be a mapping"),
        (lambda: MultiHeadAttention(8, 2, parts={"W_o": HeadNorm(4, slot="keys")}), "the name is an attribute"),
        (lambda: MultiHeadAttention(8, 2, qk_norm=True, parts={"q_norm": HeadNorm(4, slot="keys")}), "taken"),
        (lambda: MultiHeadAttention(8, 2, values_from_keys=True, value_head_dim=2), "values_from_keys=True"),
        (lambda: MultiHeadAttention(8, 2, value_head_dim=0), "value_head_dim must be a positive integer"),
    ],
)
def test_bad_parts_are_refused(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_a_part_of_the_wrong_size_says_so() -> None:
    mha = MultiHeadAttention(16, 4, parts={"q_norm": HeadNorm(8, slot="queries")})
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="HeadNorm of size 8 at slot 'queries' got 4 features"):
        mha(x, x, x)


def test_log_floor_scaling_refuses_negative_positions() -> None:
    mha = MultiHeadAttention(8, 2, parts={"scaling": LogFloorScaling(0.5, 4)})
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="non-negative with LogFloorScaling"):
        mha(x, x, x, positions=torch.tensor([-1, 0, 1]))
