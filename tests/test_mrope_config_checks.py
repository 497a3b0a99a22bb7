"""MultimodalRotaryPositionalEncoding.from_config refuses the M-RoPE configs it would compute differently.

It implements Qwen2-VL's contiguous sections (time owns the first frequencies, then height,
then width). Qwen3-VL and its successors interleave them (frequency j follows axis j % 3 within
the sections), with or without ``mrope_interleaved`` in the config; before, such a config was
read as contiguous and the rotation was silently wrong. Tiny configs, built here, no downloads.
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


def test_refuses_a_qwen3_vl_config_with_mrope_interleaved() -> None:
    with pytest.raises(
        ValueError, match=r"config sets mrope_interleaved=True: .*interleaved M-RoPE is not implemented"
    ):
        MRoPE.from_config(_qwen3_vl_text_config(mrope_interleaved=True))


def test_refuses_a_qwen3_vl_config_by_its_model_type() -> None:
    """transformers' Qwen3-VL interleaves whatever mrope_interleaved says: the model type is enough."""
    with pytest.raises(ValueError, match=r"model_type='qwen3_vl_text' interleaves its M-RoPE sections"):
        MRoPE.from_config(_qwen3_vl_text_config())
    configuration = pytest.importorskip("transformers.models.qwen3_vl.configuration_qwen3_vl")
    whole = configuration.Qwen3VLConfig(text_config=dict(SIZES))
    with pytest.raises(ValueError, match=r"model_type='qwen3_vl' interleaves"):
        MRoPE.from_config(whole)
    for model_type in ("qwen3_vl_moe_text", "qwen3_5_text", "qwen3_omni_moe_talker_text"):
        with pytest.raises(ValueError, match=rf"model_type='{model_type}'"):
            MRoPE.from_config({"model_type": model_type, "head_dim": 32, "mrope_section": SECTIONS})


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("flag", ["mrope_interleaved", "interleaved"])
def test_refuses_the_flag_in_a_plain_dict(key: str, flag: str) -> None:
    """A Qwen3-VL checkpoint's config.json: rope_scaling {"mrope_interleaved": true, "mrope_section": ...}."""
    config = {"head_dim": 32, "rope_theta": 5e6, key: {"rope_type": "default", flag: True, "mrope_section": SECTIONS}}
    with pytest.raises(ValueError, match=rf"config sets {flag}=True"):
        MRoPE.from_config(config)
    config[key][flag] = False  # says contiguous: taken
    assert MRoPE.from_config(config).sections == tuple(SECTIONS)


def test_refuses_scaling_and_partial_rotation() -> None:
    base = {"head_dim": 32, "mrope_section": SECTIONS}
    with pytest.raises(ValueError, match=r"config rope_type='yarn' rescales"):
        MRoPE.from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": SECTIONS}})
    with pytest.raises(ValueError, match=r"config partial_rotary_factor=0\.25 rotates part of each head"):
        MRoPE.from_config({**base, "partial_rotary_factor": 0.25})
    legacy = {**base, "rope_scaling": {"type": "mrope", "mrope_section": SECTIONS}}  # Qwen2-VL's old spelling
    assert MRoPE.from_config(legacy).sections == tuple(SECTIONS)


def test_still_reads_a_qwen2_vl_config() -> None:
    configuration = pytest.importorskip("transformers.models.qwen2_vl.configuration_qwen2_vl")
    parameters = {"rope_type": "default", "mrope_section": SECTIONS, "rope_theta": 1e6}
    config = configuration.Qwen2VLTextConfig(**SIZES, rope_parameters=parameters)
    encoding = MRoPE.from_config(config)
    assert (encoding.head_dim, encoding.base, encoding.sections) == (32, 1e6, tuple(SECTIONS))
