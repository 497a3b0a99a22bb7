"""p-RoPE, xPos, axial rotary for grids, and converting checkpoints between pair layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import apply_axial_rotary, apply_rotary
from selfattn.positional import (
    RotaryPositionalEncoding,
    RotaryPositionalEncodingND,
    XPosEncoding,
    build,
    convert_rotary_layout,
)

# ---- p-RoPE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "rotated"), [(0.0, 0), (0.25, 2), (0.75, 6), (0.8, 6), (1.0, 8)])
def test_p_rope_rotates_only_the_fastest_pairs(p, rotated):
    rope = build("rotary", num_hiddens=32, num_heads=2, p=p)  # head_dim 16: 8 pairs
    assert rope.rotated_pairs == rotated
    x = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    positions = torch.arange(100, 105)
    got = rope(x, positions)
    full = apply_rotary(x, positions)
    # Interleaved pairs (2j, 2j + 1): the first `rotated` pairs as full rotary, the rest untouched.
    torch.testing.assert_close(got[..., : 2 * rotated], full[..., : 2 * rotated], rtol=0, atol=1e-13)
    assert torch.equal(got[..., 2 * rotated :], x[..., 2 * rotated :])


def test_p_zero_is_nope_and_p_one_is_rotary():
    x = torch.randn(2, 6, 32)
    torch.manual_seed(0)
    nope = MultiHeadAttention(32, 2, position=RotaryPositionalEncoding(16, p=0.0)).eval()
    torch.manual_seed(0)
    plain = MultiHeadAttention(32, 2).eval()
    with torch.no_grad():
        torch.testing.assert_close(nope(x, x, x), plain(x, x, x), rtol=0, atol=0)
    rope = RotaryPositionalEncoding(16, p=1.0, interleaved=False)
    positions = torch.arange(6)
    torch.testing.assert_close(
        rope(x.view(2, 1, 6, 32)[..., :16], positions),
        apply_rotary(x.view(2, 1, 6, 32)[..., :16], positions, interleaved=False),
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match=r"p must be a fraction in \[0, 1\], got 1.5"):
        RotaryPositionalEncoding(16, p=1.5)
    assert "p=0.5" in repr(RotaryPositionalEncoding(16, p=0.5))


# ---- xPos --------------------------------------------------------------------------------------------


def xpos_reference(x: np.ndarray, positions, *, keys: bool, scale_base=512.0, gamma=0.4, base=10000.0):
    """Sun et al. 2023 pair by pair: RoPE rotation times zeta_j^(+-n / scale_base)."""
    out = x.astype(np.float64).copy()
    d = x.shape[-1]
    for row, n in enumerate(positions):
        for j in range(d // 2):
            zeta = (2 * j / d + gamma) / (1 + gamma)
            scale = zeta ** ((-n if keys else n) / scale_base)
            t = n * base ** (-2 * j / d)
            a, b = x[..., row, 2 * j], x[..., row, 2 * j + 1]
            out[..., row, 2 * j] = (a * math.cos(t) - b * math.sin(t)) * scale
            out[..., row, 2 * j + 1] = (a * math.sin(t) + b * math.cos(t)) * scale
    return out


def test_xpos_matches_the_paper_and_decays_with_distance():
    xpos = build("xpos", num_hiddens=16, num_heads=2)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    positions = [0, 7, 300, 2000]
    for keys in (False, True):
        got = xpos(x, torch.tensor(positions), keys=keys)
        np.testing.assert_allclose(got.numpy(), xpos_reference(x.numpy(), positions, keys=keys), rtol=1e-12, atol=1e-12)
    # Scores depend on m - n only, and |score| of one pair shrinks with the distance behind the query.
    q, k = torch.randn(2, 1, 8, dtype=torch.float64)

    def score(m, n):
        return float((xpos(q, torch.tensor([m])) * xpos.encode_keys(k, torch.tensor([n]))).sum())

    assert score(900, 880) == pytest.approx(score(20, 0), rel=1e-10)
    pair = torch.zeros(1, 8, dtype=torch.float64)
    pair[0, 0] = 1.0
    magnitudes = [
        float((xpos(pair, torch.tensor([m])) * xpos.encode_keys(pair, torch.tensor([0]))).norm()) for m in (0, 1)
    ]
    decay = [abs(score_pair) for score_pair in magnitudes]
    assert decay[0] == pytest.approx(1.0) and decay[1] < decay[0]


def test_xpos_in_attention_caches_and_is_relative():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, position=XPosEncoding(8)).double().eval()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        shifted = mha(x, x, x, causal=True, offset=1000)
        cache = KVCache(10)
        steps = torch.cat(
            [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(10)], 1
        )
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(shifted, full, rtol=0, atol=1e-10)


def test_xpos_refuses_positions_whose_scales_leave_the_dtype():
    xpos = XPosEncoding(8)
    assert xpos.max_position(torch.float32) == 18130
    assert xpos.max_position(torch.float16) == 2266
    xpos(torch.randn(1, 8), torch.tensor([18130]))
    with pytest.raises(ValueError, match=r"xpos: positions up to 18131 .* must be <= 18130"):
        xpos(torch.randn(1, 8), torch.tensor([18131]))
    with pytest.raises(ValueError, match=r"must be <= 2266"):
        xpos(torch.randn(1, 8).half(), torch.tensor([3000]), keys=True)
    with pytest.raises(ValueError, match="head_dim must be even"):
        XPosEncoding(7)
    with pytest.raises(ValueError, match="scale_base must be a positive finite number"):
        XPosEncoding(8, scale_base=0)


# ---- axial rotary ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("axes", "head_dim", "block"), [(2, 16, 8), (3, 12, 4), (3, 16, 4), (2, 6, 2)])
def test_axial_rotary_is_1d_rotary_per_block(axes, head_dim, block):
    name = {2: "rotary2d", 3: "rotary3d"}[axes]
    encoding = build(name, num_hiddens=head_dim * 2, num_heads=2)
    assert encoding.block == block
    x = torch.randn(2, 2, 7, head_dim, dtype=torch.float64)
    coords = torch.randint(-50, 300, (7, axes))
    got = encoding(x, coords)
    pieces = [apply_rotary(x[..., a * block : (a + 1) * block], coords[:, a]) for a in range(axes)]
    pieces.append(x[..., axes * block :])
    torch.testing.assert_close(got, torch.cat(pieces, -1), rtol=0, atol=0)
    torch.testing.assert_close(apply_axial_rotary(x, coords), got, rtol=0, atol=0)


def test_axial_scores_depend_on_coordinate_differences_only():
    encoding = build("rotary2d", num_hiddens=32, num_heads=2)
    q, k = torch.randn(2, 1, 16, dtype=torch.float64)

    def score(cq, ck):
        return float((encoding(q, torch.tensor([cq])) * encoding(k, torch.tensor([ck]))).sum())

    assert score((3, 4), (1, 9)) == pytest.approx(score((103, -6), (101, -1)), rel=1e-10)
    assert score((3, 4), (1, 9)) != pytest.approx(score((3, 4), (9, 1)), rel=1e-6)  # axes are told apart


def test_axial_token_indices_unravel_over_the_grid():
    encoding = RotaryPositionalEncodingND(12, 3, grid=(2, 3, 4))
    x = torch.randn(1, 30, 12, dtype=torch.float64)
    tokens = torch.arange(30)  # 30 > 24 cells: axis 0 keeps counting
    coords = torch.stack([tokens // 12, (tokens // 4) % 3, tokens % 4], dim=-1)
    torch.testing.assert_close(encoding(x, tokens), encoding(x, coords), rtol=0, atol=0)
    # Without a grid, tokens run along the last axis.
    line = RotaryPositionalEncodingND(12, 3)
    zeros = torch.zeros_like(tokens)
    torch.testing.assert_close(line(x, tokens), line(x, torch.stack([zeros, zeros, tokens], -1)), rtol=0, atol=0)
    # Inside attention over an image: cached decoding equals the full pass.
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 2, position=build("rotary3d", num_hiddens=24, num_heads=2, grid=(2, 3, 4))).double()
    h = torch.randn(1, 24, 24, dtype=torch.float64)
    with torch.no_grad():
        full = mha(h, h, h, causal=True)
        cache = KVCache(24)
        steps = torch.cat(
            [mha(h[:, t : t + 3], h[:, t : t + 3], h[:, t : t + 3], causal=True, cache=cache) for t in range(0, 24, 3)],
            1,
        )
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)


def test_axial_errors():
    with pytest.raises(ValueError, match="head_dim=4 is too small for 3 axes"):
        build("rotary3d", num_hiddens=8, num_heads=2)
    with pytest.raises(ValueError, match=r"grid must have 2 sizes, got \(3,\)"):
        build("rotary2d", num_hiddens=16, num_heads=2, grid=(3,))
    encoding = build("rotary2d", num_hiddens=16, num_heads=2)
    with pytest.raises(ValueError, match=r"positions must have shape \(5, 2\) or \(5,\), got \(5, 3\)"):
        encoding(torch.randn(5, 8), torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        encoding(torch.randn(5, 8), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="too few for 3 axes"):
        apply_axial_rotary(torch.randn(5, 4), torch.zeros(5, 3, dtype=torch.long))


# ---- layout conversion -------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("to", ["half_split", "interleaved"])
def test_converted_checkpoint_gives_the_same_outputs(to, rotary_dim):
    num_hiddens, heads = 24, 3
    source_interleaved = to == "half_split"
    torch.manual_seed(0)
    source = MultiHeadAttention(
        num_hiddens, heads, position=RotaryPositionalEncoding(8, interleaved=source_interleaved, rotary_dim=rotary_dim)
    ).double()
    target = MultiHeadAttention(
        num_hiddens,
        heads,
        position=RotaryPositionalEncoding(8, interleaved=not source_interleaved, rotary_dim=rotary_dim),
    ).double()
    x = torch.randn(2, 9, num_hiddens, dtype=torch.float64)
    converted = convert_rotary_layout(source.state_dict(), num_heads=heads, to=to, rotary_dim=rotary_dim)
    target.load_state_dict(converted)
    with torch.no_grad():
        torch.testing.assert_close(
            target(x, x, x, causal=True, offset=50), source(x, x, x, causal=True, offset=50), rtol=0, atol=1e-12
        )
        # Loading unconverted weights into the other layout is wrong (the test can fail).
        target.load_state_dict(source.state_dict())
        assert float((target(x, x, x) - source(x, x, x)).abs().max()) > 1e-3
    # Converting back restores the original tensors exactly.
    back = convert_rotary_layout(
        converted, num_heads=heads, to="interleaved" if to == "half_split" else "half_split", rotary_dim=rotary_dim
    )
    assert all(torch.equal(back[key], value) for key, value in source.state_dict().items())


def test_layout_conversion_of_nested_and_grouped_checkpoints():
    state = {
        "layers.0.attn.q_proj.weight": torch.arange(8 * 2.0).view(8, 2),  # 2 heads of 4
        "layers.0.attn.k_proj.weight": torch.arange(4 * 2.0).view(4, 2),  # 1 key head (GQA)
        "layers.0.attn.v_proj.weight": torch.ones(4, 2),
    }
    out = convert_rotary_layout(state, num_heads=2, to="half_split", projections=("q_proj", "k_proj"))
    rows = out["layers.0.attn.q_proj.weight"][:, 0] / 2
    assert rows.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert (out["layers.0.attn.k_proj.weight"][:, 0] / 2).tolist() == [0, 2, 1, 3]
    assert out["layers.0.attn.v_proj.weight"] is state["layers.0.attn.v_proj.weight"]
    with pytest.raises(ValueError, match="to must be 'half_split' or 'interleaved'"):
        convert_rotary_layout(state, num_heads=2, to="neox")
    with pytest.raises(
        ValueError, match=r"state_dict has no W_q\.weight / W_q\.bias / W_k\.weight / W_k\.bias entries"
    ):
        convert_rotary_layout(state, num_heads=2, to="half_split")
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        convert_rotary_layout(state, num_heads=3, to="half_split", projections=("q_proj", "k_proj"))
    with pytest.raises(ValueError, match="rotary_dim must be even and at most head_dim=4"):
        convert_rotary_layout(state, num_heads=2, to="half_split", projections=("q_proj", "k_proj"), rotary_dim=6)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_p_rope_caches_like_the_full_pass(scaling):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 2, position=RotaryPositionalEncoding(16, p=0.5, scaling=scaling)).double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        cache = KVCache(12)
        steps = torch.cat(
            [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(12)], 1
        )
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-12)
