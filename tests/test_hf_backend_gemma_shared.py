"""Whole tiny Gemma 3n and Gemma 4 text models (layers that share keys and values) through ``attn_implementation="selfattn"``.

Both families end in layers that reuse the keys and values of the last earlier layer of their type
(sliding or full); Gemma 4's full layers also have their own head size and key/value head count,
keys equal to values (``attention_k_eq_v``: ``v = v_norm(k_proj(x))``, unrotated) and a value
norm. Each model is built from its text config with random weights (no download): four layers
(sliding, full, sliding, full), the last two sharing, a window of 3 that hides keys in a prompt of 8.

References: ``eager`` in float32. In float64 the reference is transformers' ``sdpa``: these
families' eager function takes its softmax in float32 (so it agrees with float64 to ~1e-7 only)
and turns the lowest float64 of its padding mask into ``-inf`` there (NaN on padded rows, which
reaches the real tokens).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.integrations.transformers import register  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHARED = dict(num_hidden_layers=4, layer_types=LAYER_TYPES, num_kv_shared_layers=2, sliding_window=3)
COMMON = dict(
    vocab_size=128, vocab_size_per_layer_input=128, hidden_size=32, hidden_size_per_layer_input=8,
    intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, **SHARED,
)  # fmt: skip
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(laurel_rank=4, altup_num_inputs=2)),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        # Full layers: head size 16 and one key/value head (the sliding ones: 8 and 2), keys = values.
        dict(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0),
    ),
}
FAMILIES = list(CONFIGS)
PROMPT = 8
NEW_TOKENS = 5


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


@functools.cache
def _built(family: str) -> Any:
    config_name, model_name, extra = CONFIGS[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # scores of order 1, not the near-uniform weights of a 0.02 init
        for module_name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "self_attn" in module_name:
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / math.sqrt(module.in_features))
    return model


def _model(family: str, dtype: torch.dtype = torch.float32) -> Any:
    model = copy.deepcopy(_built(family)).to(dtype)
    modes = model.config.kv_sharing_modes  # the test's premise: the last two layers read the first two's keys
    assert modes[2:] == ["reuse", "reuse"], modes
    return model


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 8 tokens, left-padded by 0, 2 and 5 tokens (or none)."""
    ids = torch.randint(3, 100, (3, PROMPT), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    if padded:
        attention_mask[1, :2] = 0
        attention_mask[2, :5] = 0
    return ids.masked_fill(attention_mask == 0, 0), attention_mask


def _forward(model: Any, implementation: str, **options: Any) -> Any:
    ids, attention_mask = _batch(padded=True)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention_mask, **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_weights_match_eager(family: str) -> None:
    """Every position's, padded ones too: a query that sees no key weighs every key evenly in both."""
    model = _model(family)
    expected = _forward(model, "eager", output_attentions=True)
    got = _forward(model, "selfattn", output_attentions=True)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
    assert len(got.attentions) == len(expected.attentions) == len(LAYER_TYPES)
    for got_weights, expected_weights in zip(got.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(got_weights, expected_weights, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_logits_match_sdpa(family: str) -> None:
    model = _model(family, torch.float64)
    _, attention_mask = _batch(padded=True)
    real = attention_mask.bool()
    expected = _forward(model, "sdpa").logits[real]
    got = _forward(model, "selfattn").logits[real]
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_eager(family: str, cache: str, padded: bool) -> None:
    """The same tokens, and the same scores at each step (prefill, then decoding through the shared layers).

    Gemma 4 runs its shared layers on the prompt's last token alone in the prefill of
    ``generate``; with a static cache and no padding the full layers' mask is None there.
    """
    model = _model(family)
    ids, attention_mask = _batch(padded)
    results = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            results[implementation] = model.generate(
                input_ids=ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, cache_implementation=cache, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
    expected, got = results["eager"], results["selfattn"]
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_last_logits_match_eager(family: str) -> None:
    """``logits_to_keep=3`` without padding: Gemma 4's shared layers see the last 3 queries against all 8 keys."""
    model = _model(family)
    ids, _ = _batch(padded=False)
    logits = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(input_ids=ids, logits_to_keep=3).logits
    assert logits["selfattn"].shape[1] == 3
    torch.testing.assert_close(logits["selfattn"], logits["eager"], atol=1e-5, rtol=0)


def test_models_that_cut_queries_get_a_mask_where_causality_decides() -> None:
    """A causal batch without padding: Gemma 4 gets the causal mask for a prompt (it may cut its queries), Gemma 3n None."""
    from selfattn.integrations.transformers import model_masks

    def build(family: str, q_length: int = 4) -> Any:
        config = transformers.AutoConfig.for_model(family)
        return model_masks(
            batch_size=1, q_length=q_length, kv_length=4, q_offset=4 - q_length,
            attention_mask=torch.ones(1, 4, dtype=torch.bool), config=config,
        )  # fmt: skip

    assert build("gemma3n_text") is None
    torch.testing.assert_close(build("gemma4_text"), torch.ones(4, 4, dtype=torch.bool).tril().expand(1, 1, 4, 4))
    assert build("gemma4_text", q_length=1) is None  # decoding one token: never cut, the fast route


def test_every_model_that_cuts_queries_is_listed() -> None:
    """Re-scan the installed transformers: each text model that cuts its queries after its masks are built is in CUT_QUERIES."""
    import pathlib
    import re

    from selfattn.integrations.transformers import CUT_QUERIES

    found = set()
    for modeling in pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py"):
        if "def _maybe_slice_kv_shared_inputs" not in modeling.read_text(encoding="utf-8"):
            continue
        for configuration in modeling.parent.glob("configuration_*.py"):
            model_types = re.findall(r'model_type = "(\w+)"', configuration.read_text(encoding="utf-8"))
            found |= {name for name in model_types if not name.endswith(("_audio", "_vision"))}
    assert "gemma4_text" in found
    assert found <= CUT_QUERIES, found - CUT_QUERIES


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_gradients_match_eager(family: str) -> None:
    """Every parameter's gradient of the loss at real queries (a padded query's output differs by design)."""
    model = _model(family)
    ids, attention_mask = _batch(padded=True)
    real_query = torch.cat(
        [attention_mask[:, :1], attention_mask[:, :-1]], dim=1
    ).bool()  # the query predicting each label
    labels = ids.masked_fill(~real_query, -100)
    gradients = {}
    for implementation in ("eager", "selfattn"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        gradients[implementation] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert gradients["selfattn"].keys() == gradients["eager"].keys()
    assert any("self_attn.k_proj" in name for name in gradients["eager"])
    assert not any(gradient.isnan().any() for gradient in gradients["selfattn"].values())
    for name, expected in gradients["eager"].items():
        torch.testing.assert_close(gradients["selfattn"][name], expected, atol=1e-5, rtol=0)
