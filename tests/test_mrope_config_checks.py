"""MultimodalRotaryPositionalEncoding.from_config reads each M-RoPE config in its own layout, or refuses it.

Qwen2-VL has contiguous sections (time owns the first frequencies, then height, then width).
Qwen3-VL and its successors interleave them (frequency j follows axis j % 3 within the sections),
with or without ``mrope_interleaved`` in the config; such a config read as contiguous would rotate
silently wrong, so the layout follows the flag or the model type. Scalings are refused. Tiny
configs, built here, no downloads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from selfattn.positional import MultimodalRotaryPositionalEncoding as MRoPE

SIZES = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
SECTIONS = [6, 5, 5]  # of head_dim / 2 = 16 frequencies


def _qwen3_vl_text_config(**rope: Any) -> Any:
    configuration = pytest.importorskip("transformers.models.qwen3_vl.configuration_qwen3_vl")
    parameters = {"rope_type": "default", "mrope_section": SECTIONS, "rope_theta": 10000.0, **rope}
    return configuration.Qwen3VLTextConfig(**SIZES, rope_parameters=parameters)


def test_qwen3_vl_layout_is_not_the_contiguous_one() -> None:
    """The premise: transformers' Qwen3-VL rotary differs from contiguous sections at the same positions."""
    modeling = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    rotary = modeling.Qwen3VLTextRotaryEmbedding(_qwen3_vl_text_config(mrope_interleaved=True))
    positions = torch.stack([torch.arange(4), torch.arange(4) * 3, torch.arange(4) * 7])[:, None, :]  # (3, 1, l)
    angles = positions[..., None].double() * rotary.inv_freq.double()  # (3, 1, l, dh / 2)
    interleaved = rotary.recomposition_frequencies(angles.clone())[..., :16]
    contiguous = torch.cat([part[axis] for axis, part in enumerate(angles.split(SECTIONS, dim=-1))], dim=-1)
    assert (interleaved - contiguous).abs().max() > 1.0


def test_reads_a_qwen3_vl_config_with_mrope_interleaved_as_interleaved() -> None:
    encoding = MRoPE.from_config(_qwen3_vl_text_config(mrope_interleaved=True))
    assert (encoding.layout, encoding.sections, encoding.rotary_dim) == ("interleaved", tuple(SECTIONS), 32)


def test_reads_a_qwen3_vl_config_as_interleaved_by_its_model_type() -> None:
    """transformers' Qwen3-VL interleaves whatever mrope_interleaved says: the model type is enough."""
    assert MRoPE.from_config(_qwen3_vl_text_config()).layout == "interleaved"
    for model_type in ("qwen3_vl", "qwen3_vl_moe_text", "qwen3_5_text", "qwen3_omni_moe_talker_text"):
        config = {"model_type": model_type, "head_dim": 32, "mrope_section": SECTIONS}
        assert MRoPE.from_config(config).layout == "interleaved", model_type
    assert MRoPE.from_config({"model_type": "qwen2_vl_text", "head_dim": 32, "mrope_section": SECTIONS}).layout == (
        "sectioned"
    )


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("flag", ["mrope_interleaved", "interleaved"])
def test_reads_the_flag_in_a_plain_dict(key: str, flag: str) -> None:
    """A Qwen3-VL checkpoint's config.json: rope_scaling {"mrope_interleaved": true, "mrope_section": ...}."""
    config = {"head_dim": 32, "rope_theta": 5e6, key: {"rope_type": "default", flag: True, "mrope_section": SECTIONS}}
    assert MRoPE.from_config(config).layout == "interleaved"
    config[key][flag] = False  # says contiguous: taken
    encoding = MRoPE.from_config(config)
    assert (encoding.layout, encoding.sections) == ("sectioned", tuple(SECTIONS))


def test_refuses_scaling_and_reads_partial_rotation() -> None:
    base = {"head_dim": 32, "mrope_section": SECTIONS}
    with pytest.raises(ValueError, match=r"config rope_type='yarn' rescales"):
        MRoPE.from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": SECTIONS}})
    partial = MRoPE.from_config({**base, "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2]})
    assert (partial.rotary_dim, partial.sections, tuple(partial.inv_freq.shape)) == (16, (3, 3, 2), (8,))
    with pytest.raises(ValueError, match=r"adding up to half the rotated size, 8; got sections=\(6, 5, 5\)"):
        MRoPE.from_config({**base, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"head_dim=32 \* partial_rotary_factor=0\.1 gives 3 rotated features"):
        MRoPE.from_config({**base, "partial_rotary_factor": 0.1})
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be in \(0, 1\], got 1\.5"):
        MRoPE.from_config({**base, "partial_rotary_factor": 1.5})
    legacy = {**base, "rope_scaling": {"type": "mrope", "mrope_section": SECTIONS}}  # Qwen2-VL's old spelling
    assert MRoPE.from_config(legacy).sections == tuple(SECTIONS)


def test_still_reads_a_qwen2_vl_config() -> None:
    configuration = pytest.importorskip("transformers.models.qwen2_vl.configuration_qwen2_vl")
    parameters = {"rope_type": "default", "mrope_section": SECTIONS, "rope_theta": 1e6}
    config = configuration.Qwen2VLTextConfig(**SIZES, rope_parameters=parameters)
    encoding = MRoPE.from_config(config)
    assert (encoding.head_dim, encoding.base, encoding.sections) == (32, 1e6, tuple(SECTIONS))
