"""The rotary variants of model families, read from their configs, against float64 formulas written here.

* ``rope_type="proportional"`` (Gemma 4's and LFM3's full layers): frequency ``j`` of the ``dh / 2`` is
  ``base^(-2j / dh) / factor`` for ``j < int(partial_rotary_factor * dh // 2)`` and 0 after; half-split
  over the whole head, so the rotated features are the first ``k`` of each half.
* Hunyuan V1's ``rope_type="dynamic"`` with ``alpha`` (transformers' ``ntk_alpha``): static frequencies
  ``base'^(-2j / dh)`` with ``base' = rope_theta * alpha^(dh / (dh - 2))``.

Where transformers is installed, its own frequency functions are checked too (float32 rounding).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from selfattn.integrations._family_steps import proportional_rope_parameters, read_ntk_alpha
from selfattn.positional import RotaryPositionalEncoding


def proportional_frequencies(head_dim: int, partial: float, base: float, factor: float = 1.0) -> np.ndarray:
    rotated = int(partial * head_dim // 2)
    return np.array([base ** (-2.0 * j / head_dim) / factor if j < rotated else 0.0 for j in range(head_dim // 2)])


def half_split_rotation(x: np.ndarray, positions: np.ndarray, frequencies: np.ndarray) -> np.ndarray:
    """Pair ``(j, j + dh/2)`` turned by ``p * w_j``, in float64; ``x`` ``(..., l, dh)``, positions ``(l,)``."""
    half = x.shape[-1] // 2
    out = x.copy()
    for j, frequency in enumerate(frequencies):
        theta = positions.astype(np.float64) * frequency
        cos, sin = np.cos(theta), np.sin(theta)
        out[..., j] = x[..., j] * cos - x[..., j + half] * sin
        out[..., j + half] = x[..., j] * sin + x[..., j + half] * cos
    return out


def _proportional_config(head_dim: int, **parameters: Any) -> dict[str, Any]:
    return {"head_dim": head_dim, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1000.0, **parameters}}


@pytest.mark.parametrize(
    ("head_dim", "partial", "factor"), [(16, 0.5, 1.0), (16, 0.25, 4.0), (20, 0.3, 1.0), (12, 1.0, 2.0), (8, 0.0, 1.0)]
)
def test_proportional_matches_the_formula(head_dim: int, partial: float, factor: float) -> None:
    config = _proportional_config(head_dim, partial_rotary_factor=partial, factor=factor)
    rotary = RotaryPositionalEncoding.from_config(config)
    expected = proportional_frequencies(head_dim, partial, 1000.0, factor)
    np.testing.assert_allclose(rotary.inv_freq.numpy(), expected, rtol=1e-14, atol=0)
    assert (rotary.rotary_dim, rotary.interleaved) == (head_dim, False)
    x = torch.randn(2, 3, 9, head_dim, dtype=torch.float64)
    positions = torch.arange(5, 14)
    torch.testing.assert_close(
        rotary(x, positions), torch.from_numpy(half_split_rotation(x.numpy(), positions.numpy(), expected)),
        rtol=0, atol=1e-12,
    )  # fmt: skip
    rotated = int(partial * head_dim // 2)
    half = head_dim // 2
    still = [*range(rotated, half), *range(half + rotated, head_dim)]  # past the first k of each half: unturned
    assert torch.equal(rotary(x, positions)[..., still], x[..., still])


def test_proportional_reads_the_dict_before_the_config() -> None:
    """LFM3 / Gemma 4 keep partial_rotary_factor in the per-type rope_parameters; it wins over a top-level one."""
    config = _proportional_config(16, partial_rotary_factor=0.25) | {"partial_rotary_factor": 1.0}
    assert int((RotaryPositionalEncoding.from_config(config).inv_freq != 0).sum()) == 2
    top_level_only = _proportional_config(16) | {"partial_rotary_factor": 0.5}
    assert int((RotaryPositionalEncoding.from_config(top_level_only).inv_freq != 0).sum()) == 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_proportional_config(16, beta_fast=2.0), r"rope_type 'proportional' does not take beta_fast"),
        (_proportional_config(16, partial_rotary_factor=1.5), r"partial_rotary_factor must be in \[0, 1\] .* got 1\.5"),
        (_proportional_config(15, partial_rotary_factor=0.5), r"head_dim=15: rope_type 'proportional' .* even"),
        (_proportional_config(16, factor=0.5), r"factor must be a finite number >= 1, got 0\.5"),
    ],
)
def test_proportional_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RotaryPositionalEncoding.from_config(config)


@pytest.mark.parametrize(("head_dim", "partial", "factor"), [(512, 0.25, 1.0), (16, 0.5, 8.0), (20, 0.3, 1.0)])
def test_proportional_matches_transformers(head_dim: int, partial: float, factor: float) -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    configuration = pytest.importorskip("transformers.models.llama.configuration_llama")
    parameters = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": partial, "factor": factor}
    config = configuration.LlamaConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4)
    config.rope_parameters = parameters
    theirs, scaling = rope_utils.ROPE_INIT_FUNCTIONS["proportional"](config, None)
    ours = RotaryPositionalEncoding.from_config({"head_dim": head_dim, "rope_parameters": parameters})
    assert scaling == ours.attention_factor == 1.0
    torch.testing.assert_close(ours.inv_freq.float(), theirs.float(), rtol=1e-6, atol=0)
    assert torch.equal(ours.inv_freq == 0, theirs == 0)  # the same pairs stay put


def _hunyuan(head_dim: int, **parameters: Any) -> tuple[Any, Any]:
    config = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1000.0, **parameters},
                             max_position_embeddings=64, partial_rotary_factor=None)  # fmt: skip
    return SimpleNamespace(head_dim=head_dim), config


@pytest.mark.parametrize(("head_dim", "alpha"), [(8, 2.0), (128, 1000.0), (16, 1.0)])
def test_ntk_alpha_matches_the_formula(head_dim: int, alpha: float) -> None:
    layer, config = _hunyuan(head_dim, alpha=alpha, factor=1.0)
    options: dict[str, Any] = {}
    read_ntk_alpha(layer, config, options)
    rotary = options["position"]
    base = 1000.0 * alpha ** (head_dim / (head_dim - 2))
    expected = np.array([base ** (-2.0 * j / head_dim) for j in range(head_dim // 2)])
    np.testing.assert_allclose(rotary.inv_freq.numpy(), expected, rtol=1e-13, atol=0)
    assert rotary.scaling_config is None or not rotary.scaling_config.depends_on_length  # static, not dynamic
    assert rotary.frequencies_at(10 * 64)[0].equal(rotary.inv_freq)  # past max_position_embeddings: unchanged


def test_dynamic_without_alpha_stays_dynamic() -> None:
    layer, config = _hunyuan(8, factor=2.0)
    options: dict[str, Any] = {}
    read_ntk_alpha(layer, config, options)
    assert options["position"].scaling_config.rope_type == "dynamic"


def test_ntk_alpha_on_a_partial_head_raises() -> None:
    layer, config = _hunyuan(8, alpha=2.0)
    config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5 with alpha: Hunyuan's ntk_alpha .* whole head"):
        read_ntk_alpha(layer, config, {})


@pytest.mark.parametrize(("head_dim", "rotated", "factor"), [(16, 4, 1.0), (20, 3, 2.0), (512, 64, 1.0), (14, 5, 1.0)])
def test_proportional_parameters_read_back_as_the_same_rotary(head_dim: int, rotated: int, factor: float) -> None:
    """The way back (``proportional_rope_parameters``) gives parameters transformers reads as the same pairs."""
    scaling = None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    rotary = RotaryPositionalEncoding(head_dim, 500.0, False, p=rotated / (head_dim // 2), scaling=scaling)
    assert rotary.rotated_pairs == rotated
    parameters = proportional_rope_parameters(rotary)
    assert int(parameters["partial_rotary_factor"] * head_dim // 2) == rotated  # transformers' rope_angles
    again = RotaryPositionalEncoding.from_config({"head_dim": head_dim, "rope_parameters": parameters})
    assert torch.equal(again.inv_freq, rotary.inv_freq)


def test_proportional_parameters_refuse_what_proportional_cannot_say() -> None:
    for rotary in (
        RotaryPositionalEncoding(16, 500.0, True, p=0.5),
        RotaryPositionalEncoding(16, 500.0, False, rotary_dim=8, p=0.5),
        RotaryPositionalEncoding(16, 500.0, False, p=0.5, scaling="ntk", scaling_factor=2.0),
    ):
        with pytest.raises(ValueError, match=r"rope_type 'proportional' is half-split p-RoPE over the whole head"):
            proportional_rope_parameters(rotary)
