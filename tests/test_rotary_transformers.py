"""``from_config`` against Hugging Face transformers itself, where it is installed (it is no dependency).

Run with transformers on the path to check every rope type: frequencies to float32 rounding
(transformers computes them in float32), attention factors exactly, and the half-split rotation
against its ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional cross-check)")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from selfattn.positional import RotaryPositionalEncoding  # noqa: E402

HEAD_DIM, HEADS = 64, 4
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    "yarn-deepseek": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 512,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 256},
    "longrope-phi3": {"rope_type": "longrope"},
}


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(name, partial):
    rotary_dim = int(HEAD_DIM * partial)
    config = {
        "hidden_size": HEAD_DIM * HEADS,
        "num_attention_heads": HEADS,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    }
    if name == "longrope-phi3":
        config["original_max_position_embeddings"] = 128
    parameters = dict(CASES[name], rope_theta=10000.0)
    if name.startswith("longrope"):
        parameters["short_factor"] = [1.0 + 0.05 * i for i in range(rotary_dim // 2)]
        parameters["long_factor"] = [1.0 + 0.3 * i for i in range(rotary_dim // 2)]
    if partial != 1.0:
        parameters["partial_rotary_factor"] = partial
    hf_config = transformers.LlamaConfig(**config, rope_parameters=dict(parameters))
    for ours in (
        RotaryPositionalEncoding.from_config({**config, "rope_parameters": dict(parameters)}),
        RotaryPositionalEncoding.from_config(hf_config),
    ):
        assert ours.rotary_dim == rotary_dim
        for seq_len in (None, 100, 700, 1500):
            hf_freqs, hf_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf_config, "cpu", seq_len=seq_len)
            freqs, factor = ours.frequencies_at(seq_len)
            torch.testing.assert_close(freqs, hf_freqs.double(), rtol=3e-7, atol=0)
            assert factor == hf_factor
        # The rotation: Hugging Face's layout with cos/sin of these frequencies.
        positions = torch.arange(0, 1500, 7)
        x = torch.randn(1, HEADS, positions.shape[0], HEAD_DIM, dtype=torch.float64)
        freqs, factor = ours.frequencies_at(int(positions.max()) + 1)
        angles = positions[:, None].double() * freqs[None]
        cos = torch.cat([angles.cos()] * 2, -1)[None] * factor
        sin = torch.cat([angles.sin()] * 2, -1)[None] * factor
        rotated, _ = apply_rotary_pos_emb(x[..., :rotary_dim], x[..., :rotary_dim], cos, sin)
        expected = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
        torch.testing.assert_close(ours(x, positions), expected, rtol=0, atol=1e-12)
