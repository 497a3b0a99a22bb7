"""Whole tiny models of the families where selfattn's backend once differed from ``eager``, against ``eager``.

A sweep over every causal LM family of transformers (built tiny from its config class, no
download) found these: DeepSeek-V4 appends ``-inf`` blocks to the mask as if it were eager's
float mask, GIT adds the mask to its scores itself (both went wrong with ``sdpa``'s bool masks),
GOT-OCR2 passes ``logits_to_keep`` down to its layers (refused), and GPT-2 and OPT record the
weights without passing ``output_attentions`` down (none came back). Gemma 2 (softcap) and gpt-oss
(sinks) support no ``sdpa`` and so get eager's masks too: they run here as well.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from selfattn.integrations.transformers import register  # noqa: E402

ATOL = 1e-5
LAYERS = 2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# Tiny sizes, each applied where the family's config has that field; the rest keeps its defaults.
TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, max_position_embeddings=128, moe_intermediate_size=32, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=24, n_positions=128,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip

# DeepSeek-V4's compressed layers (sparse over blocks of 2 keys, dense over blocks of 4) emit keys within 9 tokens.
EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v4": dict(
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=2,
    ),
}  # fmt: skip

FAMILIES = ["deepseek_v4", "git", "got_ocr2", "gpt2", "opt", "gemma2", "gpt_oss"]


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


def _tiny(fields: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """A config's fields with the tiny sizes it has (under its own names) and its per-layer lists cut; recursive."""
    layers = fields.get(aliases.get("num_hidden_layers", "num_hidden_layers"))
    tiny = dict(fields)
    for name, value in fields.items():
        if isinstance(value, list) and len(value) == layers:
            tiny[name] = value[:LAYERS]
        if isinstance(value, dict) and "hidden_size" in value:  # a sub-model's config (text, vision)
            tiny[name] = _tiny(value, {})
    for name, value in TINY.items():
        if aliases.get(name, name) in fields:
            tiny[aliases.get(name, name)] = value
    return tiny


def _tiny_model(family: str) -> Any:
    """The family's causal LM from its config class, tiny, with attention projections large enough to matter."""
    config_class = type(transformers.AutoConfig.for_model(family))
    fields = _tiny(config_class().to_dict(), getattr(config_class, "attribute_map", {}))
    fields.update(EXTRA.get(family, {}))
    config = config_class(**{name: value for name, value in fields.items() if name != "model_type"})
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # scores of order 1 (not the near-uniform weights of a 0.02 init), random sinks
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "attn" in module_name.lower():
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / math.sqrt(module.in_features))
            for name, param in module.named_parameters(recurse=False):
                if "sink" in name:
                    param.copy_(torch.randn(param.shape, generator=gen))
    return model


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    return ids.masked_fill(attention_mask == 0, 0), attention_mask


def _run(model: Any, implementation: str) -> dict[str, Any]:
    """Logits at real tokens and weights of real queries (DeepSeek-V4's eager spreads a padded one over fewer keys)."""
    ids, attention_mask = _left_padded()
    real = attention_mask.bool()
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
        unpadded = model(input_ids=ids).logits
        generated = model.generate(
            input_ids=ids, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    weights = [layer[real[:, None, :, None].expand_as(layer)] for layer in padded.attentions]
    return dict(
        logits=padded.logits[real], unpadded=unpadded, weights=weights, tokens=generated.sequences,
        scores=torch.stack(generated.scores),
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_eager(family: str) -> None:
    model = _tiny_model(family)
    expected = _run(model, "eager")
    got = _run(model, "selfattn")
    torch.testing.assert_close(got["logits"], expected["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["unpadded"], expected["unpadded"], atol=ATOL, rtol=0)
    assert len(got["weights"]) == len(expected["weights"]) == LAYERS  # output_attentions=True: every layer's
    for got_weights, expected_weights in zip(got["weights"], expected["weights"], strict=True):
        torch.testing.assert_close(got_weights, expected_weights, atol=ATOL, rtol=0)
    assert torch.equal(got["tokens"], expected["tokens"])
    torch.testing.assert_close(got["scores"], expected["scores"], atol=ATOL, rtol=0)  # -inf where both forbid


def test_families_that_support_sdpa_keep_its_masks() -> None:
    """A causal batch without padding needs no mask for an sdpa model (the fast causal route); others get eager's."""
    from selfattn.integrations.transformers import model_masks

    def build(family: str) -> Any:
        config = transformers.AutoConfig.for_model(family)
        return model_masks(
            batch_size=1, q_length=4, kv_length=4, attention_mask=torch.ones(1, 4, dtype=torch.bool), config=config
        )

    assert build("llama") is None
    assert build("gemma2") is None and build("gpt_oss") is None  # no sdpa, but they only pass the mask on
    eager = build("mpt")  # supports no sdpa
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.testing.assert_close(eager, torch.where(causal, 0.0, torch.finfo(torch.float32).min).expand(1, 1, 4, 4))
