"""Interleaved M-RoPE (Qwen3-VL, Qwen3.5) and M-RoPE on a partial slice of each head, against float64 formulas.

The reference is a loop written here from the rule transformers' ``recomposition_frequencies``
states (qwen3_5 L190-201): frequency ``j`` reads height when ``j % 3 == 1 and j < 3 * sections[1]``,
width when ``j % 3 == 2 and j < 3 * sections[2]``, time otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selfattn import MultiHeadAttention
from selfattn.positional import MultimodalRotaryPositionalEncoding, RotaryPositionalEncoding, build
from selfattn.positional.mrope import frequency_axes


def axis_of_frequency(j: int, sections: tuple[int, int, int], layout: str) -> int:
    if layout == "sectioned":
        return int(np.searchsorted(np.cumsum(sections), j, side="right"))
    if j % 3 == 1 and j < 3 * sections[1]:
        return 1
    if j % 3 == 2 and j < 3 * sections[2]:
        return 2
    return 0


def mrope_reference(x: np.ndarray, positions: np.ndarray, sections, layout: str, rotary_dim: int, base: float):
    """Pair ``(j, j + r/2)`` of the first ``r`` features turned by ``p[axis(j)] * base^(-2j/r)``; the rest kept."""
    half = rotary_dim // 2
    out = x.copy()
    for j in range(half):
        theta = positions[axis_of_frequency(j, sections, layout)].astype(np.float64) * base ** (-2.0 * j / rotary_dim)
        cos, sin = np.cos(theta), np.sin(theta)
        out[..., j] = x[..., j] * cos - x[..., j + half] * sin
        out[..., j + half] = x[..., j] * sin + x[..., j + half] * cos
    return out


def test_frequency_axes_by_hand() -> None:
    assert frequency_axes((2, 1, 1), "interleaved") == (0, 1, 2, 0)
    assert frequency_axes((2, 1, 1), "sectioned") == (0, 0, 1, 2)
    # Qwen3-VL's [24, 20, 20]: height and width alternate up to 60, time takes every third and the tail.
    axes = frequency_axes((24, 20, 20), "interleaved")
    assert [axes.count(a) for a in range(3)] == [24, 20, 20]
    assert axes[:6] == (0, 1, 2, 0, 1, 2) and axes[60:] == (0, 0, 0, 0)
    # Qwen3.5's [11, 11, 10]: width ends at j = 29, height reaches j = 31.
    axes = frequency_axes((11, 11, 10), "interleaved")
    assert axes[-3:] == (2, 0, 1) and [axes.count(a) for a in range(3)] == [11, 11, 10]
    with pytest.raises(ValueError, match=r"layout must be 'sectioned' or 'interleaved', got 'spiral'"):
        frequency_axes((2, 1, 1), "spiral")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "sections", "layout"),
    [(16, 16, (4, 2, 2), "interleaved"), (16, 8, (2, 1, 1), "interleaved"), (20, 12, (2, 2, 2), "sectioned")],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_encoding_matches_the_formula(head_dim, rotary_dim, sections, layout, dtype) -> None:
    encoding = MultimodalRotaryPositionalEncoding(
        head_dim, 1000.0, sections=sections, layout=layout, rotary_dim=rotary_dim
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, head_dim, generator=generator, dtype=torch.float64)
    positions = torch.randint(0, 300, (3, 9), generator=generator)
    expected = mrope_reference(x.numpy(), positions.numpy(), sections, layout, rotary_dim, 1000.0)
    got = encoding(x.to(dtype), positions)
    assert got.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), torch.from_numpy(expected), rtol=0, atol=tolerance)
    assert torch.equal(got[..., rotary_dim:], x.to(dtype)[..., rotary_dim:])  # the unrotated tail passes through


def test_interleaved_differs_from_sectioned_when_the_axes_differ() -> None:
    """The layout matters: with distinct axes the two rotations disagree (the test above could not tell otherwise)."""
    x = torch.randn(1, 1, 5, 16, dtype=torch.float64)
    positions = torch.stack([torch.arange(5), 3 * torch.arange(5), 7 * torch.arange(5)])
    sectioned = MultimodalRotaryPositionalEncoding(16, sections=(4, 2, 2))(x, positions)
    interleaved = MultimodalRotaryPositionalEncoding(16, sections=(4, 2, 2), layout="interleaved")(x, positions)
    assert (sectioned - interleaved).abs().max() > 0.1


def test_text_positions_are_partial_half_split_rotary() -> None:
    """Text tokens (every axis equal) under interleaved partial M-RoPE: Qwen3-Next's partial half-split rotary."""
    mrope = MultimodalRotaryPositionalEncoding(16, 1e4, sections=(2, 1, 1), layout="interleaved", rotary_dim=8)
    plain = RotaryPositionalEncoding(16, 1e4, False, rotary_dim=8)
    x = torch.randn(2, 2, 6, 16, dtype=torch.float64)
    positions = torch.arange(3, 9)
    torch.testing.assert_close(mrope(x, positions), plain(x, positions), rtol=0, atol=1e-13)


def test_attention_with_interleaved_partial_mrope_decodes_as_it_runs_whole() -> None:
    torch.manual_seed(0)
    position = build("mrope", num_hiddens=32, num_heads=2, sections=(2, 1, 1), layout="interleaved", rotary_dim=8)
    mha = MultiHeadAttention(32, 2, position=position, dtype=torch.float64).eval()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    positions = torch.stack([torch.arange(6), torch.arange(6) % 2, torch.arange(6) // 2])[:, None]  # (3, 1, 6)
    whole = mha(x, x, x, causal=True, positions=positions)
    from selfattn import KVCache

    cache = KVCache(max_len=6)
    steps = [mha(x[:, i : i + 1], x[:, i : i + 1], x[:, i : i + 1], causal=True, cache=cache,
                 positions=positions[..., i : i + 1]) for i in range(6)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rotary_dim=20), r"rotary_dim must be at most head_dim=16, got rotary_dim=20"),
        (dict(rotary_dim=7), r"rotary_dim must be even .* got 7"),
        (dict(rotary_dim=8, sections=(4, 2, 2)), r"adding up to half the rotated size, 4; got sections=\(4, 2, 2\)"),
        (dict(layout="diagonal"), r"layout must be 'sectioned' or 'interleaved', got 'diagonal'"),
    ],
)
def test_bad_options_raise(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        MultimodalRotaryPositionalEncoding(16, **kwargs)


def test_repr_names_the_layout_and_the_rotated_size() -> None:
    encoding = MultimodalRotaryPositionalEncoding(16, sections=(2, 1, 1), layout="interleaved", rotary_dim=8)
    assert "rotary_dim=8" in repr(encoding) and "layout='interleaved'" in repr(encoding)


@pytest.mark.parametrize("options", [dict(layout="interleaved"), dict(rotary_dim=8, sections=(2, 1, 1))])
def test_the_way_back_does_not_write_qwen2_vl_sections_for_another_m_rope(options) -> None:
    """Qwen2-VL's config says contiguous sections over the whole head; any other M-RoPE is refused, not rewritten."""
    sections = options.pop("sections", (4, 2, 2))
    position = build("mrope", num_hiddens=32, num_heads=2, sections=sections, **options)
    mha = MultiHeadAttention(32, 2, bias=True, output_bias=False, position=position)
    with pytest.raises(ValueError, match=r"Qwen2-VL's M-RoPE has contiguous sections over the whole head; got layout="):
        mha.to_transformers_config()
    sectioned = MultiHeadAttention(
        32, 2, bias=True, output_bias=False, position=build("mrope", num_hiddens=32, num_heads=2)
    )
    assert sectioned.to_transformers_config()["rope_parameters"]["mrope_section"] == [2, 3, 3]
