"""Rotary scaling methods: each against its published formula written out here in float64 NumPy."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import apply_rotary, rotary_frequencies, rotary_parameters
from selfattn.positional import RotaryPositionalEncoding

# ---- the formulas, from the papers / model cards, independent of selfattn ---------------------------


def np_plain(r: int, base: float) -> np.ndarray:
    return base ** (-np.arange(0, r, 2, dtype=np.float64) / r)


def np_linear(r, base, factor):  # position interpolation: positions / factor
    return np_plain(r, base) / factor


def np_ntk(r, base, factor):  # NTK-aware: base * factor^(r / (r - 2))
    return np_plain(r, base * factor ** (r / (r - 2)))


def np_dynamic(r, base, factor, trained, length):
    length = max(length, trained)
    return np_plain(r, base * (factor * length / trained - (factor - 1)) ** (r / (r - 2)))


def np_yarn(r, base, factor, trained, beta_fast=32.0, beta_slow=1.0, truncate=True):
    w = np_plain(r, base)

    def index_turning(turns):  # theta_i * L0 / (2 pi) = turns, solved for i
        return r * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = index_turning(beta_fast), index_turning(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    if hi == lo:
        hi += 0.001
    gamma = np.clip((np.arange(r // 2) - lo) / (hi - lo), 0, 1)
    return (1 - gamma) * w + gamma * w / factor


def np_llama3(r, base, factor, low, high, trained):
    w = np_plain(r, base)
    out = np.empty_like(w)
    for j, wj in enumerate(w):
        wavelength = 2 * math.pi / wj
        if wavelength < trained / high:
            out[j] = wj
        elif wavelength > trained / low:
            out[j] = wj / factor
        else:
            smooth = (trained / wavelength - low) / (high - low)
            out[j] = (1 - smooth) * wj / factor + smooth * wj
    return out


def np_longrope(r, base, short, long, trained, length):
    return np_plain(r, base) / np.asarray(long if length > trained else short, dtype=np.float64)


HEAD_DIMS = [8, 64, 128]
FACTORS = [2.0, 4.0, 8.0, 32.0]


@pytest.mark.parametrize("r", HEAD_DIMS)
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_static_methods_match_their_formulas(r, factor, base):
    cases = {
        "linear": ({"rope_type": "linear", "factor": factor}, np_linear(r, base, factor)),
        "ntk": ({"rope_type": "ntk", "factor": factor}, np_ntk(r, base, factor)),
        "yarn": (
            {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096},
            np_yarn(r, base, factor, 4096),
        ),
        "yarn-untruncated": (
            {
                "type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": 2048,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            },
            np_yarn(r, base, factor, 2048, 16, 2, truncate=False),
        ),
        "llama3": (
            {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            np_llama3(r, base, factor, 1.0, 4.0, 8192),
        ),
    }
    for name, (scaling, expected) in cases.items():
        got = rotary_frequencies(r, base, scaling=scaling)
        assert got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-13, atol=0, err_msg=name)
    # The name form is the same as the dict form.
    for name in ("linear", "ntk"):
        torch.testing.assert_close(
            rotary_frequencies(r, base, scaling=name, scaling_factor=factor),
            rotary_frequencies(r, base, scaling={"rope_type": name, "factor": factor}),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("r", HEAD_DIMS)
@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_dynamic_recomputes_the_ntk_factor_from_the_length(r, factor):
    scaling = {"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": 1024}
    plain = np_plain(r, 10000.0)
    for length in (None, 1, 1024):  # up to L0: unscaled
        np.testing.assert_allclose(rotary_frequencies(r, scaling=scaling, seq_len=length).numpy(), plain, rtol=1e-15)
    for length in (1025, 2048, 5000, 10**6):
        got = rotary_frequencies(r, scaling=scaling, seq_len=length).numpy()
        np.testing.assert_allclose(got, np_dynamic(r, 10000.0, factor, 1024, length), rtol=1e-13)
    # The NTK growth reaches the factor itself where f L / L0 - (f - 1) = f, at L = (2 - 1/f) L0.
    length = (2 - 1 / factor) * 1024
    assert length == int(length)
    np.testing.assert_allclose(
        rotary_frequencies(r, scaling=scaling, seq_len=int(length)).numpy(), np_ntk(r, 10000.0, factor), rtol=1e-13
    )


@pytest.mark.parametrize("r", [8, 64])
def test_longrope_switches_factors_past_the_trained_length(r):
    rng = np.random.default_rng(r)
    short, long = (1 + rng.random(r // 2)).tolist(), (1 + 20 * rng.random(r // 2)).tolist()
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 4096,
        "factor": 32.0,
    }
    for length, expected in ((None, short), (4096, short), (4097, long), (131072, long)):
        params = rotary_parameters(r, 10000.0, scaling=scaling, seq_len=length)
        np.testing.assert_allclose(
            params.frequencies.numpy(), np_longrope(r, 10000.0, short, long, 4096, length or 0), rtol=1e-14
        )
        np.testing.assert_allclose(params.frequencies.numpy(), np_plain(r, 10000.0) / np.asarray(expected), rtol=1e-14)
        assert params.attention_factor == pytest.approx(math.sqrt(1 + math.log(32.0) / math.log(4096)), rel=1e-15)
    given = rotary_parameters(r, scaling={**scaling, "attention_factor": 1.25}).attention_factor
    assert given == 1.25


def test_llama3_bands_at_the_published_defaults():
    # Llama 3.1: head 128, theta 500000, factor 8, low 1, high 4, L0 8192.
    r, base = 128, 500000.0
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    got = rotary_frequencies(r, base, scaling=scaling).numpy()
    plain = np_plain(r, base)
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    # under 2048 tokens: untouched (to an ulp: numpy 2.4 and torch round base ** x differently)
    np.testing.assert_allclose(got[short], plain[short], rtol=4e-16, atol=0)
    np.testing.assert_allclose(got[long], plain[long] / 8, rtol=1e-15)  # over 8192 tokens: divided by 8
    middle = ~short & ~long
    assert middle.any() and short.any() and long.any()
    assert np.all(got[middle] < plain[middle]) and np.all(got[middle] > plain[middle] / 8)
    assert (int(short.sum()), int(middle.sum()), int(long.sum())) == (29, 6, 29)


@pytest.mark.parametrize("r", [32, 64, 128])
@pytest.mark.parametrize("factor", [4.0, 16.0])
def test_yarn_boundaries_in_turns_within_the_trained_length(r, factor):
    trained = 4096
    got = rotary_frequencies(
        r, scaling={"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}
    ).numpy()
    plain = np_plain(r, 10000.0)
    turns = trained * plain / (2 * math.pi)
    fast, slow = turns >= 32, turns <= 1
    np.testing.assert_allclose(got[fast], plain[fast], rtol=4e-16, atol=0)  # turning 32+ times: kept (to an ulp)
    np.testing.assert_allclose(got[slow], plain[slow] / factor, rtol=1e-15)  # under one turn: interpolated
    assert fast.any() and slow.any()
    middle = ~fast & ~slow
    assert np.all(got[middle] <= plain[middle]) and np.all(got[middle] >= plain[middle] / factor)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 0.1 * math.log(8.0) + 1),
        ({"attention_factor": 0.5}, 0.5),
        ({"mscale": 0.707, "mscale_all_dim": 1.0}, (0.0707 * math.log(8.0) + 1) / (0.1 * math.log(8.0) + 1)),
        ({"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0),  # DeepSeek-V3: the temperature goes elsewhere
        ({"mscale": 1.0, "mscale_all_dim": 0.0}, 0.1 * math.log(8.0) + 1),  # zero falls back to the default
    ],
)
def test_yarn_attention_factor_scales_queries_and_keys(extra, expected):
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, **extra}
    assert rotary_parameters(16, scaling=scaling).attention_factor == pytest.approx(expected, rel=1e-14)
    x = torch.randn(5, 16, dtype=torch.float64)
    positions = torch.tensor([0, 3, 70, 900, 5000])
    rotated = apply_rotary(x, positions, scaling=scaling)
    # A rotation keeps lengths: what is left is the factor on q (and k), so scores gain its square.
    torch.testing.assert_close(rotated.norm(dim=-1), expected * x.norm(dim=-1), rtol=1e-13, atol=0)
    unscaled = apply_rotary(x, positions, frequencies=rotary_frequencies(16, scaling=scaling))
    torch.testing.assert_close(rotated, expected * unscaled, rtol=1e-13, atol=1e-15)


STATIC = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "ntk": {"rope_type": "ntk", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": 64,
        "factor": 8.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_scores_depend_on_distance_only_at_a_fixed_length(name):
    generator = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 1, 8, dtype=torch.float64, generator=generator)
    freqs, factor = rotary_parameters(8, scaling=STATIC[name], seq_len=1000)  # length-dependent ones: frozen at 1000

    def score(m: int, n: int) -> float:
        rq = apply_rotary(q, torch.tensor([m]), frequencies=freqs, attention_factor=factor)
        rk = apply_rotary(k, torch.tensor([n]), frequencies=freqs, attention_factor=factor)
        return float((rq * rk).sum())

    for m, n, shift in ((0, 5, 17), (40, 3, 900), (700, 700, 12345), (-8, 30, 99991)):
        assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-9, abs=1e-11)
    assert score(10, 3) != pytest.approx(score(3, 3), rel=1e-6)


def _mha(scaling, cached_keys="rerotate", *, head_dim=8, heads=2, dtype=torch.float64, interleaved=False):
    torch.manual_seed(3)
    rope = RotaryPositionalEncoding(head_dim, interleaved=interleaved, scaling=scaling, cached_keys=cached_keys)
    return MultiHeadAttention(head_dim * heads, heads, position=rope).to(dtype).eval()


@pytest.mark.parametrize("name", ["linear", "ntk", "yarn", "llama3"])
def test_cache_gives_the_full_pass_for_static_methods(name):
    small = dict(STATIC[name])
    if "original_max_position_embeddings" in small:
        small["original_max_position_embeddings"] = 8
    mha = _mha(small)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        cache = KVCache(20)
        steps = [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)


LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 6},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": 6,
        "factor": 8.0,
    },
}


@pytest.mark.parametrize("chunks", [[1] * 16, [3, 1, 5, 2, 5]])
@pytest.mark.parametrize("name", sorted(LENGTH_DEPENDENT))
def test_rerotate_makes_every_step_a_full_pass_over_the_prefix(name, chunks):
    mha = _mha(LENGTH_DEPENDENT[name], "rerotate")
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    cache, start = KVCache(16), 0
    with torch.no_grad():
        for size in chunks:
            piece = x[:, start : start + size]
            got = mha(piece, piece, piece, causal=True, cache=cache)
            prefix = x[:, : start + size]
            expected = mha(prefix, prefix, prefix, causal=True)[:, start:]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
            start += size


def _keep_reference(mha, x, rope):
    """Each key rotated with the frequencies of the step that added it; the query with the current ones."""
    heads, head_dim = mha.num_heads, rope.head_dim
    q_all = mha.W_q(x).view(1, -1, heads, head_dim).transpose(1, 2)
    k_all = mha.W_k(x).view(1, -1, heads, head_dim).transpose(1, 2)
    v_all = mha.W_v(x).view(1, -1, heads, head_dim).transpose(1, 2)
    outs, keys = [], []
    for t in range(x.shape[1]):
        freqs, factor = rope.frequencies_at(t + 1)
        pos = torch.tensor([t])
        keys.append(
            apply_rotary(k_all[:, :, t : t + 1], pos, interleaved=False, frequencies=freqs, attention_factor=factor)
        )
        q = apply_rotary(q_all[:, :, t : t + 1], pos, interleaved=False, frequencies=freqs, attention_factor=factor)
        k = torch.cat(keys, dim=2)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim), dim=-1)
        outs.append(mha.W_o((weights @ v_all[:, :, : t + 1]).transpose(1, 2).reshape(1, 1, -1)))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", sorted(LENGTH_DEPENDENT))
def test_keep_leaves_cached_keys_as_rotated_like_hugging_face(name):
    mha = _mha(LENGTH_DEPENDENT[name], "keep")
    x = torch.randn(1, 14, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache(14)
        steps = torch.cat(
            [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(14)], dim=1
        )
        expected = _keep_reference(mha, x[0:1], mha.position)
        full = mha(x, x, x, causal=True)
    torch.testing.assert_close(steps, expected, rtol=0, atol=1e-12)
    # Up to L0 = 6 nothing changes; past it, kept keys make decoding differ from a full pass.
    with torch.no_grad():
        first = mha(x[:, :6], x[:, :6], x[:, :6], causal=True)
    torch.testing.assert_close(steps[:, :6], first, rtol=0, atol=1e-12)
    assert float((steps[:, -1] - full[:, -1]).abs().max()) > 1e-6


def test_rerotate_differs_from_keep_only_past_the_trained_length():
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    outputs = {}
    for mode in ("rerotate", "keep"):
        mha, cache = _mha(LENGTH_DEPENDENT["dynamic"], mode), KVCache(12)
        with torch.no_grad():
            outputs[mode] = torch.cat(
                [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(12)],
                dim=1,
            )
    torch.testing.assert_close(outputs["rerotate"][:, :6], outputs["keep"][:, :6], rtol=0, atol=1e-13)
    assert float((outputs["rerotate"][:, 7:] - outputs["keep"][:, 7:]).abs().amax(dim=-1).min()) > 1e-8


def _exact_rotation(x64: np.ndarray, positions: np.ndarray, freqs: np.ndarray, factor: float) -> np.ndarray:
    """Half-split rotation in float64 (exact positions, exact frequencies)."""
    t = positions[:, None].astype(np.float64) * freqs  # (l, r/2); freqs may be per position
    half = x64.shape[-1] // 2
    a, b = x64[..., :half], x64[..., half:]
    return np.concatenate([a * np.cos(t) - b * np.sin(t), a * np.sin(t) + b * np.cos(t)], axis=-1) * factor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(STATIC))
def test_half_precision_at_position_a_million_is_the_exact_formula_rounded_once(name, dtype):
    torch.manual_seed(11)
    x = torch.randn(3, 64, 16).to(dtype)
    positions = torch.arange(10**6, 10**6 + 64)
    scaling = dict(STATIC[name])
    if name == "longrope":
        scaling.update(short_factor=[1.0 + j for j in range(8)], long_factor=[1.0 + 3 * j for j in range(8)])
    freqs, factor = rotary_parameters(16, scaling=scaling, seq_len=10**6 + 64)
    got = apply_rotary(x, positions, interleaved=False, scaling=scaling)
    assert got.dtype == dtype
    exact = _exact_rotation(x.double().numpy(), positions.numpy(), freqs.numpy(), factor)
    assert _rounded_once(got, exact, dtype)
    # The check can fail: angles formed in float32 (the common approach) at 10^6 break it.
    angles32 = (positions.float()[:, None] * freqs.float()[None, :]).double().numpy()
    wrong = _exact_rotation(x.double().numpy(), np.ones(64), angles32, factor)  # angle t = 1 * angles32
    assert not _rounded_once(torch.from_numpy(wrong).to(dtype), exact, dtype)


def _rounded_once(got: torch.Tensor, exact: np.ndarray, dtype: torch.dtype) -> bool:
    """``got`` is ``exact`` rounded to ``dtype``, but for rare ties, one unit in the last place off.

    Only where the exact value sits on a rounding tie (within float32's error of the
    computation) may the float32 rotation round the other way.
    """
    rounded = torch.from_numpy(exact).to(dtype)
    mismatch = got != rounded
    ulp = rounded.double().abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    within = bool(((got.double() - rounded.double()).abs()[mismatch] <= ulp[mismatch] * 1.01 + 1e-30).all())
    return float(mismatch.double().mean()) < 2e-3 and within


def test_from_config_reads_hugging_face_configs():
    llama31 = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    rope = RotaryPositionalEncoding.from_config(llama31)
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved, rope.base) == (128, 128, False, 500000.0)
    np.testing.assert_allclose(rope.inv_freq.numpy(), np_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=1e-13)

    class Config:  # an object with attributes, like transformers' PretrainedConfig
        hidden_size, num_attention_heads, head_dim = 2560, 32, None
        partial_rotary_factor, rope_theta, max_position_embeddings = 0.4, 10000.0, 2048
        rope_scaling: ClassVar[dict[str, object]] = {"type": "dynamic", "factor": 2.0}

    rope = RotaryPositionalEncoding.from_config(Config())
    assert (rope.head_dim, rope.rotary_dim) == (80, 32)
    assert rope.scaling_config is not None and rope.scaling_config.original_max_position_embeddings == 2048
    np.testing.assert_allclose(
        rope.frequencies_at(4096)[0].numpy(), np_dynamic(32, 10000.0, 2.0, 2048, 4096), rtol=1e-13
    )

    # v5 style: everything in rope_parameters; Phi-3 style longrope with a top-level trained length.
    phi3 = {
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 48,
            "long_factor": [2.0] * 48,
        },
    }
    rope = RotaryPositionalEncoding.from_config(phi3)
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)
    np.testing.assert_allclose(rope.frequencies_at(5000)[0].numpy(), np_plain(96, 10000.0) / 2.0, rtol=1e-14)
    x = torch.randn(1, 1, 3, 96, dtype=torch.float64)
    positions = torch.tensor([0, 100, 5000])
    # Hugging Face's apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, cos = cat(freqs, freqs) * factor.
    freqs, factor = rope.frequencies_at(5001)
    angles = positions[:, None].double() * freqs[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1) * factor, torch.cat([angles.sin()] * 2, -1) * factor
    rotate_half = torch.cat([-x[..., 48:], x[..., :48]], dim=-1)
    torch.testing.assert_close(rope(x, positions), x * cos + rotate_half * sin, rtol=0, atol=1e-12)

    default = RotaryPositionalEncoding.from_config(
        {"head_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert default.scaling_config is None and default.base == 1e6


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "mrope"}, "unknown rope_type 'mrope'"),
        ({"factor": 2.0}, "needs a 'rope_type'"),
        ({"rope_type": "linear"}, "scaling 'linear' needs factor"),
        ({"rope_type": "linear", "factor": 0.5}, r"factor must be a finite number >= 1, got 0.5"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor must be a finite number"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3}, "scaling 'linear' does not take beta_fast"),
        ({"rope_type": "linear", "factr": 2.0}, "scaling 'linear' does not take factr; it takes factor"),  # not "needs"
        ({"rope_type": "yarn", "factor": 2.0}, "needs original_max_position_embeddings"),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 10.5}, "must be a positive integer"),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 1,
                "beta_slow": 2,
            },
            "beta_fast must be at least beta_slow",
        ),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": 1},
            "truncate must be True or False",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            "high_freq_factor must exceed low_freq_factor",
        ),
        ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor, original_max_position"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 3,
                "original_max_position_embeddings": 64,
                "factor": 2.0,
            },
            "short_factor has 4 entries but long_factor 3",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 3,
                "long_factor": [1.0] * 3,
                "original_max_position_embeddings": 64,
                "factor": 2.0,
            },
            "one entry per rotated pair",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0, -1, 1, 1],
                "long_factor": [1.0] * 4,
                "original_max_position_embeddings": 64,
                "factor": 2.0,
            },
            r"short_factor\[1\] must be a finite number > 0",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 4,
                "original_max_position_embeddings": 64,
            },
            "needs factor or attention_factor",
        ),
        ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, "rope_type='linear' but type='yarn'"),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, "disagrees with base=10000"),
        ("yarn", "scaling 'yarn' needs original_max_position_embeddings"),
        (3, "scaling must be None, a type name or a dict"),
    ],
)
def test_bad_scalings_are_named(scaling, match):
    with pytest.raises(ValueError, match=match):
        rotary_frequencies(8, 10000.0, scaling=scaling)
    with pytest.raises(ValueError, match=match):
        RotaryPositionalEncoding(8, scaling=scaling)(torch.randn(1, 8), torch.arange(1))


def test_other_bad_options():
    with pytest.raises(ValueError, match="cannot be combined with a scaling dict"):
        rotary_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0}, scaling_factor=2.0)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        rotary_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0}, seq_len=0)
    with pytest.raises(ValueError, match="attention_factor must be a positive finite number"):
        apply_rotary(torch.randn(2, 8), torch.arange(2), attention_factor=0.0)
    with pytest.raises(ValueError, match="cached_keys must be 'rerotate' or 'keep'"):
        RotaryPositionalEncoding(8, cached_keys="drop")
    with pytest.raises(ValueError, match="config needs head_dim, or hidden_size and num_attention_heads"):
        RotaryPositionalEncoding.from_config({"rope_theta": 10000.0})
    with pytest.raises(ValueError, match="gives 3 rotated features"):
        RotaryPositionalEncoding.from_config({"head_dim": 6, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
        RotaryPositionalEncoding.from_config({"head_dim": 6, "partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="rope_scaling must be a dict"):
        RotaryPositionalEncoding.from_config({"head_dim": 8, "rope_scaling": "linear"})


@pytest.mark.parametrize("name", sorted(LENGTH_DEPENDENT))
def test_rerotate_in_float32_stays_near_the_float64_full_pass(name):
    """Each re-rotation rounds the cache once more; after 60 of them the error is still float32-sized."""
    x = torch.randn(1, 64, 16, dtype=torch.float64)
    mha32, mha64 = _mha(LENGTH_DEPENDENT[name], dtype=torch.float32), _mha(LENGTH_DEPENDENT[name])
    cache = KVCache(64)
    with torch.no_grad():
        steps = torch.cat(
            [
                mha32(
                    x[:, t : t + 1].float(), x[:, t : t + 1].float(), x[:, t : t + 1].float(), causal=True, cache=cache
                )
                for t in range(64)
            ],
            1,
        )
        full = mha64(x, x, x, causal=True)
    torch.testing.assert_close(steps[:, -1].double(), full[:, -1], rtol=0, atol=1e-5)


def test_a_failed_call_after_re_rotation_leaves_decoding_consistent():
    mha = _mha(LENGTH_DEPENDENT["dynamic"], "rerotate")
    x = torch.randn(1, 11, 16, dtype=torch.float64)
    cache = KVCache(10)
    with torch.no_grad():
        mha(x[:, :9], x[:, :9], x[:, :9], causal=True, cache=cache)
        with pytest.raises(ValueError, match="cache overflow"):  # re-rotated for length 11, then refused
            mha(x[:, 9:11], x[:, 9:11], x[:, 9:11], causal=True, cache=cache)
        assert cache.length == 9
        got = mha(x[:, 9:10], x[:, 9:10], x[:, 9:10], causal=True, cache=cache)
        expected = mha(x[:, :10], x[:, :10], x[:, :10], causal=True)[:, 9:]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    cache.reset()
    assert cache.encoding_state == {}


@pytest.mark.parametrize("name", sorted(LENGTH_DEPENDENT))
def test_rerotate_refuses_a_call_whose_positions_restart_below_the_cached_ones(name):
    # Packed documents: the second one's positions restart at 0. A full pass rotates every token at the
    # whole sequence's length; a decoding step would rotate at its own document's: refused, not different.
    mha = _mha(LENGTH_DEPENDENT[name], "rerotate")
    x = torch.randn(1, 14, 16, dtype=torch.float64)
    ids = torch.tensor([[0] * 10 + [1] * 4])
    with torch.no_grad():
        full = mha(x, x, x, causal=True, document_ids=ids)
        cache = KVCache(14)
        first = mha(x[:, :10], x[:, :10], x[:, :10], causal=True, cache=cache, document_ids=ids[:, :10])
        torch.testing.assert_close(first, full[:, :10], rtol=0, atol=1e-12)  # one document: equal
        with pytest.raises(ValueError, match="positions reach 0 but the cache holds position 9"):
            mha(x[:, 10:11], x[:, 10:11], x[:, 10:11], causal=True, cache=cache, document_ids=ids[:, 10:11])
        assert cache.length == 10  # the refused call stored nothing
        kept = _mha(LENGTH_DEPENDENT[name], "keep")  # Hugging Face's behaviour decodes, as documented
        kept.load_state_dict(mha.state_dict())
        cache = KVCache(14)
        kept(x[:, :10], x[:, :10], x[:, :10], causal=True, cache=cache, document_ids=ids[:, :10])
        kept(x[:, 10:11], x[:, 10:11], x[:, 10:11], causal=True, cache=cache, document_ids=ids[:, 10:11])
