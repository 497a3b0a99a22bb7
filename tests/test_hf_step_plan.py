"""The transformers backend's step plan (selfattn.integrations._hf_plan): a replayed step equals the full path.

Each test runs a step in full (the plan is made), then the same kind again, and compares with the full
path's answer bit for bit; a step of another kind (a mask, other heads) must not be replayed.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import selfattn.integrations.transformers as backend  # noqa: E402
from selfattn.integrations import _hf_plan  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class _Layer(torch.nn.Module):
    """What the attention functions read off a model's attention layer (a module: plans are kept by weak reference)."""

    is_causal = True
    num_key_value_groups = 2


def _module() -> Any:
    return _Layer().eval()


def _step(lk: int, seed: int = 0, heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, heads, 1, 8, generator=gen),
        torch.randn(2, 2, lk, 8, generator=gen),
        torch.randn(2, 2, lk, 8, generator=gen),
    )


def _refuse_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the full path ran")

    monkeypatch.setattr(backend, "check_keywords", refuse)


def _count_full_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gets "full" each time a call runs the full path (its keyword check), not a plan."""
    calls: list[str] = []
    original = backend.check_keywords
    monkeypatch.setattr(backend, "check_keywords", lambda extra: calls.append("full") or original(extra))
    return calls


@pytest.mark.parametrize(
    "options",
    [{}, {"scaling": 0.3}, {"softcap": 5.0}, {"s_aux": torch.linspace(-1.0, 1.0, 4)}, {"sliding_window": 4}],
    ids=["plain", "scaling", "softcap", "sinks", "window (unmasked step)"],
)
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad mode", "inference (step forms)"])
def test_a_replayed_step_equals_the_full_path(monkeypatch, options, grad_mode):
    module = _module()
    with torch.set_grad_enabled(grad_mode):
        backend.attention_forward(module, *_step(7), None, **options)  # in full: the plan is made
        q, k, v = _step(9, seed=1)  # the cache grew by two
        monkeypatch.setattr(_hf_plan, "replay", lambda *args: (None, None))
        full, _ = backend.attention_forward(_module(), q, k, v, None, **options)
        monkeypatch.undo()
        _refuse_full_path(monkeypatch)
        replayed, weights = backend.attention_forward(module, q, k, v, None, **options)
    assert weights is None
    assert torch.equal(replayed, full)


def test_a_step_of_another_kind_runs_in_full(monkeypatch):
    module = _module()
    backend.attention_forward(module, *_step(7), None)
    calls = _count_full_calls(monkeypatch)
    q, k, v = _step(8, seed=1)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    mask[:, ..., :3] = False
    masked, _ = backend.attention_forward(module, q, k, v, mask)  # a window mask: not this plan's kind
    assert calls == ["full"]
    backend.attention_forward(module, *_step(8, heads=2), None)  # other heads: another kind
    assert calls == ["full", "full"]
    backend.attention_forward(module, q, k, v, None, output_attentions=True)  # weights wanted
    assert calls == ["full", "full", "full"]
    expected, _ = backend.attention_forward(module, q, k[..., 3:, :], v[..., 3:, :], None)
    assert torch.allclose(masked, expected, atol=1e-6)  # the mask was applied, not skipped


@pytest.mark.parametrize("several", [False, True], ids=["decoding step", "prefill"])
def test_a_keyword_of_no_table_planned_as_none_is_refused_once_given(several):
    """The full path lets a keyword it does not know through only when it is None: a plan made with it None must
    not replay a call that gives it a value (the keyword would be ignored); the call runs in full and is refused.
    A keyword known not to change the answer (``use_cache``) stays replayed whatever its value."""
    module = _module()
    heads = _square(5) if several else _step(7)
    backend.attention_forward(module, *heads, None, mystery=None, use_cache=None)  # in full: the plan is made
    backend.attention_forward(module, *heads, None, mystery=None, use_cache=True)  # replayed: no error
    with pytest.raises(ValueError, match="attention_forward got mystery=a tensor of shape \\(3,\\)"):
        backend.attention_forward(module, *heads, None, mystery=torch.ones(3), use_cache=None)


def test_a_prefill_leaves_the_plan_for_the_decoding_steps_after_it(monkeypatch):
    """A call of several queries (planned apart) or with a mask (planned never) keeps the layer's one-query plan:
    the next generate()'s first decoding step replays; a step of another unmasked kind replaces it."""
    module = _module()
    backend.attention_forward(module, *_step(7), None)
    plan = _hf_plan.plans_of(module)[0]
    gen = torch.Generator().manual_seed(3)
    prefill = (torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen))
    backend.attention_forward(module, prefill[0], prefill[1], prefill[1], None)  # 5 queries, causal: in full
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    backend.attention_forward(module, *_step(8, seed=2), mask)  # a mask: in full
    assert _hf_plan.plans_of(module)[0] is plan
    q, k, v = _step(9, seed=1)
    monkeypatch.setattr(_hf_plan, "replay", lambda *args: (None, None))
    full, _ = backend.attention_forward(_module(), q, k, v, None)
    monkeypatch.undo()
    _refuse_full_path(monkeypatch)
    replayed, _ = backend.attention_forward(module, q, k, v, None)
    assert torch.equal(replayed, full)
    monkeypatch.undo()
    backend.attention_forward(module, *_step(8, heads=2), None)  # another unmasked kind: a new plan
    assert _hf_plan.plans_of(module)[0] is not plan


def test_llama_generates_the_same_tokens_with_plans(monkeypatch):
    assert backend.register() == "selfattn"
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "selfattn"
    prompt = torch.randint(3, 50, (2, 5))
    options = {"max_new_tokens": 10, "do_sample": False, "min_new_tokens": 10}
    with torch.no_grad():
        planned = model.generate(prompt, **options)
        assert all(_hf_plan.plans_of(layer.self_attn) is not None for layer in model.model.layers)
        monkeypatch.setattr(_hf_plan, "replay", lambda *args: (None, None))
        full = model.generate(prompt, **options)
    assert torch.equal(planned, full)


@pytest.mark.parametrize(
    ("options", "stepped"),
    [({}, True), ({"softcap": 5.0}, True), ({"s_aux": torch.linspace(-1.0, 1.0, 4)}, True), ({"dropout": 0.5}, False)],
    ids=["plain", "softcap", "sinks", "dropout"],
)
def test_a_route_with_a_step_form_runs_it_without_describing_the_call(monkeypatch, options, stepped):
    """In inference a plain step replays the fused kernel's step form from the heads, a softcapped one or one with
    sinks the decoding step of the routes that apply them; a call with dropout (training) has its call described."""
    module = _module()
    with torch.no_grad():  # as generate() runs
        backend.attention_forward(module, *_step(7), None, **options)
        plan = _hf_plan.plans_of(module)[0]
        assert plan is not None and (plan.step is not None) is stepped
        monkeypatch.setattr(_hf_plan.dispatch, "VERIFY_REMEMBERED_CHOICES", False)  # the suite's check describes them
        described: list[object] = []
        real = _hf_plan.AttentionCall.of_heads
        monkeypatch.setattr(_hf_plan.AttentionCall, "of_heads", lambda *a, **kw: described.append(a) or real(*a, **kw))
        backend.attention_forward(module, *_step(9, seed=1), None, **options)
    assert bool(described) is not stepped


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_sliding_layers_past_their_window_are_replayed_and_generate_as_eager(monkeypatch, family):
    """Once a sliding layer's cache holds a whole window, transformers builds an all-True mask for each step;
    the backend's mask function lets transformers skip it (the offsets show the window hides nothing), so
    the step is replayed, and the tokens are eager's, with padding in the batch too."""
    common = dict(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, sliding_window=6,
    )  # fmt: skip
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, attn_logit_softcapping=50.0)
    else:
        config = transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    backend.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    prompt = torch.randint(3, 50, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # the second row left-padded
    options = {"max_new_tokens": 12, "do_sample": False, "min_new_tokens": 12}
    real, replayed, outs = _hf_plan.replay, [], {}
    with torch.no_grad():
        for implementation in ("eager", "selfattn"):
            model.set_attn_implementation(implementation)
            counted = []

            def counting(*a: Any, counted: list = counted) -> tuple[torch.Tensor | None, Any]:
                out, kind = real(*a)
                if out is not None:
                    counted.append(a[0])
                return out, kind

            monkeypatch.setattr(_hf_plan, "replay", counting)
            outs[implementation] = model.generate(prompt, **options)
            outs[implementation, "padded"] = model.generate(prompt, attention_mask=mask, **options)
            monkeypatch.undo()
            replayed.append(counted)
    assert torch.equal(outs["eager"], outs["selfattn"])
    assert torch.equal(outs["eager", "padded"], outs["selfattn", "padded"])
    sliding = model.model.layers[0].self_attn
    assert sliding.sliding_window == 6
    assert sum(layer is sliding for layer in replayed[-1]) >= 5  # steps after the window filled were replayed


def test_the_mask_function_lets_a_whole_window_be_skipped_only_where_it_hides_nothing():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_overlay,
    )

    window = 4
    pattern = and_masks(causal_mask_function, sliding_window_overlay(window))
    config = transformers.MistralConfig(sliding_window=window)

    def build(mask_function: Any = pattern, config: Any = config, **offsets: int) -> torch.Tensor | None:
        return backend.model_masks(
            batch_size=1, q_length=1, mask_function=mask_function, attention_mask=None, local_size=window,
            allow_is_causal_skip=True, config=config, device=torch.device("cpu"), **offsets,
        )  # fmt: skip

    assert build(kv_length=4, q_offset=9, kv_offset=6) is None  # keys 6..9, the query at 9: the window's 4
    cut = build(kv_length=6, q_offset=9, kv_offset=4)  # keys 4..9: the window hides 4 and 5
    assert cut is not None and cut.tolist() == [[[[False, False, True, True, True, True]]]]
    ahead = build(kv_length=4, q_offset=8, kv_offset=6)  # a free slot after the query (a static cache's)
    assert ahead is not None and ahead.tolist() == [[[[True, True, True, False]]]]
    # Chunked attention passes its chunk size as local_size too: keys 6..9 seen from 9 cross the chunk at 8.
    chunked = build(
        mask_function=chunked_causal_mask_function(window, torch.zeros(1, dtype=torch.long)), kv_length=4, q_offset=9,
        kv_offset=6,
        config=transformers.MistralConfig(sliding_window=None, attention_chunk_size=window),
    )  # fmt: skip
    assert chunked is not None and chunked.tolist() == [[[[False, False, True, True]]]]


def _square(length: int, seed: int = 0, heads: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, heads, length, 8), (2, 2, length, 8), (2, 2, length, 8))
    return tuple(torch.randn(*shape, generator=gen) for shape in shapes)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": False}, {"scaling": 0.3}, {"sliding_window": 6}, {"sliding_window": 7}],
    ids=["causal", "not causal", "scaling", "window as long as the queries", "window longer"],
)
def test_a_replayed_prefill_equals_the_full_path(monkeypatch, options):
    """A call of several queries with no mask (a prefill: the causal rule on a square; or an encoder's pass) is
    planned beside the one-query plan and replayed by the fused kernel's step form, bit for bit the full path's,
    against the float64 formula too."""
    module = _module()
    backend.attention_forward(module, *_step(7), None)  # a decoding step's plan
    decoding_plan = _hf_plan.plans_of(module)[0]
    backend.attention_forward(module, *_square(6), None, **options)  # in full: the prefill's plan is made
    assert _hf_plan.plans_of(module)[0] is decoding_plan and _hf_plan.plans_of(module)[1] is not None
    q, k, v = _square(6, seed=1)
    monkeypatch.setattr(_hf_plan, "replay", lambda *args: (None, None))
    full, _ = backend.attention_forward(_module(), q, k, v, None, **options)
    monkeypatch.undo()
    _refuse_full_path(monkeypatch)
    replayed, _ = backend.attention_forward(module, q, k, v, None, **options)
    assert torch.equal(replayed, full)
    causal = options.get("is_causal", True)
    scale = options.get("scaling", 8**-0.5)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, 1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = (scores.softmax(-1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(replayed.double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("shapes", "options"),
    [((6, 6), {"sliding_window": 4}), ((6, 9), {})],
    ids=["a window shorter than the queries", "a static cache's free slots"],
)
def test_a_prefill_whose_rule_needs_a_mask_is_not_planned(monkeypatch, shapes, options):
    """Several queries under a window that hides keys, or facing more keys than themselves (a static cache):
    the full path's masks each time, no plan kept."""
    module = _module()
    num_queries, num_keys = shapes
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, num_queries, 8, generator=gen)
    k, v = torch.randn(2, 2, num_keys, 8, generator=gen), torch.randn(2, 2, num_keys, 8, generator=gen)
    first, _ = backend.attention_forward(module, q, k, v, None, **options)
    assert (_hf_plan.plans_of(module) or (None, None))[1] is None
    calls = _count_full_calls(monkeypatch)
    again, _ = backend.attention_forward(module, q, k, v, None, **options)
    assert calls == ["full"] and torch.equal(first, again)


def test_a_layers_plans_go_with_it_and_are_not_another_layers():
    """Plans are kept by the layer's id beside a weak reference: a dead layer's entry goes, and a new layer (which
    may get the dead one's id) starts with none."""
    module = _module()
    backend.attention_forward(module, *_step(7), None)
    key = id(module)
    assert _hf_plan.plans_of(module) is not None and key in _hf_plan._PLANS
    del module
    gc.collect()
    assert key not in _hf_plan._PLANS
    assert _hf_plan.plans_of(_module()) is None


class _Subclass(torch.Tensor):
    """A tensor subclass (a wrapper a user might pass): not exactly ``torch.Tensor``."""


def test_a_tensor_subclass_runs_in_full(monkeypatch):
    module = _module()
    backend.attention_forward(module, *_step(7), None)
    calls = _count_full_calls(monkeypatch)
    q, k, v = _step(8, seed=1)
    plain, _ = backend.attention_forward(module, q, k, v, None)
    assert calls == []  # replayed
    wrapped, _ = backend.attention_forward(module, q.as_subclass(_Subclass), k, v, None)
    assert calls == ["full"]
    assert torch.equal(wrapped.as_subclass(torch.Tensor), plain)


def test_the_kind_holds_the_dispatchers_size_fact(monkeypatch):
    """The kind reads the dispatcher's one size fact inline (no helper call per step): it must stay
    ``dispatch.few_scores``, also where a test lowers the threshold."""
    q, k, v = _step(9)
    for threshold, few in ((10_000, True), (9, False), (10, True)):  # a step of 9 scores
        monkeypatch.setattr(_hf_plan._block_sliced, "SLICED_MIN_SCORES", threshold)
        out, kind = _hf_plan.replay(_module(), q, k, v, 0.0, None, None, None, None, None, {})
        assert out is None  # a layer with no plan
        assert kind is not None and kind[-2] is few is _hf_plan.dispatch.few_scores(1, 9)
