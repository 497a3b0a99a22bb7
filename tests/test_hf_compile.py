"""The transformers backend under ``torch.compile(fullgraph=True)``, against the same model run uncompiled.

transformers' own recipe compiles a model's forward over a static cache (the masks then hide its free slots); a
model decoding with a dynamic cache, compiled after eager steps made the layers' plans, must trace the full path
(a graph reads no plan); and a forward that records its attention weights reads transformers' collector, which
dynamo cannot read as a context variable (torch.export's strict mode meets the same). Any graph break fails these
tests (``fullgraph=True``). The compiler backend is dynamo's ``eager`` (the graph run as traced): what is checked
is the tracing, in seconds.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from selfattn.integrations import _hf_plan  # noqa: E402
from selfattn.integrations.transformers import attention_forward, register  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

FAMILIES = ("llama", "gemma2", "gpt_oss")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Each test compiles from nothing (dynamo keeps what it traced per code object, shared by the tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(family: str) -> Any:
    register()
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
        bos_token_id=1,
    )  # fmt: skip
    if family == "llama":
        config = transformers.LlamaConfig(**common)
    elif family == "gemma2":  # a window shorter than the generated text, a softcap
        config = transformers.Gemma2Config(**common, sliding_window=8, attn_logit_softcapping=50.0)
    else:  # sinks, a window
        config = transformers.GptOssConfig(**common, sliding_window=8, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="selfattn").eval()


def _prompt(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 6 tokens, the first left-padded by 2 (or not)."""
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[0, :2] = 0
    return ids, (ids != 0).long()


def _generate(model: Any, padded: bool = True, **options: Any) -> Any:
    ids, mask = _prompt(padded)
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **options,
        )  # fmt: skip


def _assert_same(compiled: Any, reference: Any) -> None:
    assert torch.equal(compiled.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(reference.logits))


@pytest.mark.parametrize(("family", "padded"), [*((family, True) for family in FAMILIES), ("llama", False)])
def test_static_cache_forward_compiles_in_one_graph(family: str, padded: bool) -> None:
    """With a padded prompt transformers builds every mask outside the compiled forward; with none given, the
    backend's mask function also runs inside it (traced)."""
    model = _model(family)
    reference = _generate(model, padded, cache_implementation="static")
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    _assert_same(_generate(model, padded, cache_implementation="static"), reference)


def test_dynamic_cache_compiled_after_plans_traces_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager steps leave plans; their step forms are then made wrong (zeros): eager decoding replays them (its
    tokens change), a compiled forward must not read them."""
    model = _model("llama")
    reference = _generate(model, padded=False)  # no padding: the decoding steps get no mask
    for layer in model.model.layers:
        entry = _hf_plan._PLANS[id(layer.self_attn)]
        one_query, several = entry[1]
        assert one_query is not None and one_query.step is not None  # the eager steps made them
        poisoned = one_query._replace(step=lambda q, k, v: torch.zeros_like(q))
        monkeypatch.setitem(_hf_plan._PLANS, id(layer.self_attn), (entry[0], (poisoned, several)))
    monkeypatch.setattr(_hf_plan.dispatch, "VERIFY_REMEMBERED_CHOICES", False)  # as users run: steps trusted
    assert not torch.equal(_generate(model, padded=False).sequences, reference.sequences)  # eager replays them
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    _assert_same(_generate(model, padded=False), reference)


def test_recorded_weights_under_compile() -> None:
    model = _model("llama")
    ids, mask = _prompt()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, output_attentions=True)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        recorded = compiled(ids, attention_mask=mask, output_attentions=True)
        unrecorded = compiled(ids, attention_mask=mask)
    assert len(recorded.attentions) == len(reference.attentions) == 2
    for ours, theirs in zip(recorded.attentions, reference.attentions, strict=True):
        assert ours.shape == (2, 4, 6, 6)
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(recorded.logits, reference.logits)
    assert unrecorded.attentions is None
    torch.testing.assert_close(unrecorded.logits, reference.logits)


def test_a_scale_that_changes_between_calls_traces() -> None:
    """A float that changes between calls of one compiled function is traced as a symbol the second time (dynamo's
    automatic dynamic): the checks of the scale and the softcap must trace on it (two models of other head sizes,
    or softcaps, compiled in one process share the backend's code)."""
    layer = _model("llama").model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 3, 8, generator=gen) for heads in (4, 2, 2))

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, softcap: float) -> torch.Tensor:
        return attention_forward(layer, q, k, v, None, scaling=scaling, softcap=softcap)[0]

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    for scaling, softcap in ((0.3, 20.0), (0.4, 30.0), (0.5, 40.0)):
        torch.testing.assert_close(compiled(q, k, v, scaling, softcap), forward(q, k, v, scaling, softcap))


@pytest.mark.parametrize("strict", [True, False])
def test_export_of_a_forward(strict: bool) -> None:
    """torch.export traces the backend as compile does (strict: dynamo; non-strict: fake tensors, the full path)."""
    model = _model("llama")
    ids, mask = _prompt()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        program = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False}, strict=strict)
        got = program.module()(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, expected)


# Causal LM families whose own code compiles in one graph with a static cache (under sdpa, or eager where it has
# none); a sweep of 30 found those and these others: GIT's own code branches on data, and the sweep's static cache
# did not fit DeepSeek-V3/V4 or Qwen3-Next.
SWEEP = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "gpt2", "opt",
    "phi", "phi3", "olmo2", "gpt_oss", "smollm3", "cohere", "starcoder2", "granite", "falcon", "llama4_text",
    "minimax", "glm4", "exaone4", "hunyuan_v1_dense", "got_ocr2",
)  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("SELFATTN_ALL_FAMILIES") != "1",
    reason="SELFATTN_ALL_FAMILIES=1 compiles 26 families (~40 s on 2 workers)",
)
@pytest.mark.parametrize("family", SWEEP)
def test_family_compiles_in_one_graph_with_a_static_cache(family: str) -> None:
    from test_hf_backend_families import _tiny_model

    register()
    model = _tiny_model(family)
    model.set_attn_implementation("selfattn")
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    options: dict[str, Any] = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        reference = model.generate(ids, **options)
        model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        assert torch.equal(model.generate(ids, **options), reference)
