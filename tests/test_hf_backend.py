"""selfattn as a transformers attention implementation, against transformers' own ``sdpa`` (and ``eager``)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from selfattn.integrations.transformers import attention_forward, register  # noqa: E402

ATOL = 1e-5
VOCAB = 100
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    assert register() == "selfattn"


def _module(is_causal: bool, groups: int = 1) -> Any:
    """What the attention functions read off a model's attention layer."""
    return types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=groups, training=False)


def _qkv(lq: int, lk: int, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, lq, 8, generator=gen)
    k = torch.randn(2, kv_heads, lk, 8, generator=gen)
    v = torch.randn(2, kv_heads, lk, 8, generator=gen)
    return q, k, v


def _padding_mask(lq: int, lk: int, causal: bool) -> torch.Tensor:
    """transformers' bool (b, 1, lq, lk) mask, True = attend: left padding on row 1, causal or not."""
    mask = torch.ones(2, 1, lq, lk, dtype=torch.bool)
    mask[1, ..., :2] = False
    if causal:
        mask &= torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    return mask


@pytest.mark.parametrize(
    ("lq", "lk", "is_causal", "mask"),
    [
        (5, 5, True, None),  # causal from the module, no mask
        (5, 5, False, None),  # bidirectional (encoder) layer, no mask
        (1, 6, True, None),  # one new token: it sees every cached key
        (4, 9, True, None),  # prefill into a static cache: the first lq slots hold the tokens
        (5, 5, True, "bool"),
        (3, 7, True, "bool"),  # decoding a few tokens after a cache, with left padding
        (5, 5, False, "float"),
    ],
)
@pytest.mark.parametrize("scaling", [None, 0.2])
def test_matches_sdpa_function(lq: int, lk: int, is_causal: bool, mask: str | None, scaling: float | None) -> None:
    q, k, v = _qkv(lq, lk)
    attention_mask = None
    if mask == "bool":
        attention_mask = _padding_mask(lq, lk, is_causal)
    elif mask == "float":
        attention_mask = torch.randn(2, 1, lq, lk)
    module = _module(is_causal, groups=2)
    expected, _ = sdpa_attention_forward(module, q, k, v, attention_mask, scaling=scaling)
    got, weights = attention_forward(module, q, k, v, attention_mask, scaling=scaling)
    assert weights is None and got.shape == (2, lq, 4, 8) and got.is_contiguous()
    seen = torch.ones(2, lq, dtype=torch.bool) if mask != "bool" else attention_mask[:, 0].any(-1)  # (b, lq)
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)
    # A query that sees no key: sdpa gives zeros, selfattn eager's answer (every key weighed evenly).
    mean_value = v.mean(-2).repeat_interleave(2, 1)[:, None].expand(2, lq, 4, 8)
    torch.testing.assert_close(got[~seen], mean_value[~seen], atol=ATOL, rtol=0)


def test_a_query_that_sees_no_key_matches_eager() -> None:
    """Left padding hides every key from the first queries of row 1: eager spreads them evenly over every key.

    A padded query's output reaches the model's next layers: with zeros there Gemma 3n, which takes
    ``mean(h ** 2) ** 0.5`` of each token's state (an infinite derivative at zero), had NaN gradients.
    """
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = (tensor.requires_grad_() for tensor in _qkv(5, 5))
    mask = _padding_mask(5, 5, causal=True)
    assert not mask[1, 0, :2].any(-1).any()  # the premise: queries 0 and 1 of row 1 see no key
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # as eager gets it
    module = _module(True, groups=2)
    expected, expected_weights = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    got, weights = attention_forward(module, q, k, v, mask, scaling=0.3, output_attentions=True)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights[1, :, :2], torch.full((4, 2, 5), 0.2))
    # The values' gradient too (the queries' and keys' of such a row are zeros here; eager's come
    # from scores the lowest value swallowed).
    (gradient,) = torch.autograd.grad(got.square().sum(), v)
    (expected_gradient,) = torch.autograd.grad(expected.square().sum(), v)
    torch.testing.assert_close(gradient, expected_gradient, atol=ATOL, rtol=0)


def test_a_query_that_sees_no_key_with_sinks_or_shared_indices_is_zeros() -> None:
    """Sinks take the whole weight of such a row in eager (gpt-oss); shared ``indices`` run the sparse route (zeros)."""
    q, k, v = _qkv(5, 5)
    mask = _padding_mask(5, 5, causal=True)
    module = _module(True, groups=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))
    with_sinks, _ = attention_forward(module, q, k, v, mask, s_aux=sinks)
    indices = torch.arange(3).expand(2, 5, 3)  # every query picks keys 0, 1, 2 (row 1's first two are padding)
    picked, _ = attention_forward(module, q, k, v, mask, indices=indices)
    for out in (with_sinks, picked):
        assert torch.equal(out[1, :2], torch.zeros(2, 4, 8))
        assert out[1, 2:].abs().amax() > 0.1  # the rows that see a key have an answer


def test_no_mask_with_a_causal_module_is_causal() -> None:
    q, k, v = _qkv(4, 4, kv_heads=4)
    causal, _ = attention_forward(_module(True), q, k, v, None)
    full, _ = attention_forward(_module(False), q, k, v, None)
    torch.testing.assert_close(causal[:, 0], v[:, :, 0])  # the first query sees the first key alone
    assert not torch.allclose(causal, full)
    overridden, _ = attention_forward(_module(True), q, k, v, None, is_causal=False)  # the kwarg wins
    torch.testing.assert_close(overridden, full, atol=0, rtol=0)


def test_sliding_window_without_mask_and_position_bias() -> None:
    q, k, v = _qkv(6, 6, kv_heads=4)
    band = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # i - 3 < j <= i
    bias = torch.randn(1, 4, 6, 6)
    expected, _ = sdpa_attention_forward(_module(True), q, k, v, band[None, None], position_bias=bias)
    got, _ = attention_forward(_module(True), q, k, v, None, sliding_window=3, position_bias=bias)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_dropout_is_applied() -> None:
    q, k, v = _qkv(5, 5, kv_heads=4)
    plain, _ = attention_forward(_module(True), q, k, v, None)
    torch.manual_seed(0)
    dropped, _ = attention_forward(_module(True), q, k, v, None, dropout=0.5)
    assert not torch.allclose(plain, dropped)


def test_softcap_and_sinks_match_eager() -> None:
    """What Gemma 2 (softcap) and gpt-oss (s_aux, its (h,) sinks) pass, against their own eager functions."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    q, k, v = _qkv(5, 5)
    q = q * 4  # scores of a few units, so a cap of 2 bites
    mask = _padding_mask(5, 5, causal=True)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # as eager gets it
    seen = mask[:, 0].any(-1)  # (b, lq): the queries that see a key
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False, head_dim=8)
    expected, _ = gemma2_eager(module, q, k, v, additive, scaling=0.3, softcap=2.0)
    got, _ = attention_forward(module, q, k, v, mask, scaling=0.3, softcap=2.0)
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)
    uncapped, _ = attention_forward(module, q, k, v, mask, scaling=0.3)
    assert (uncapped - expected)[seen].abs().max() > 0.1  # the cap matters here

    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2
    module.sinks = sinks
    expected, _ = gpt_oss_eager(module, q, k, v, additive, scaling=0.3)
    got, _ = attention_forward(module, q, k, v, mask, scaling=0.3, s_aux=sinks)
    torch.testing.assert_close(got[seen], expected[seen], atol=ATOL, rtol=0)
    sinkless, _ = attention_forward(module, q, k, v, mask, scaling=0.3)
    assert (sinkless - expected)[seen].abs().max() > 0.1  # the sinks matter here


def test_softcap_with_an_additive_mask_raises() -> None:
    q, k, v = _qkv(3, 3, kv_heads=4)
    with pytest.raises(ValueError, match=r"softcap=50.0 with a float attention_mask or a position_bias"):
        attention_forward(_module(True), q, k, v, torch.randn(2, 1, 3, 3), softcap=50.0)  # a bias, not 0/-inf
    with pytest.raises(ValueError, match=r"softcap=50.0 with a float attention_mask or a position_bias"):
        attention_forward(_module(True), q, k, v, None, softcap=50.0, position_bias=torch.zeros(1, 4, 3, 3))


def _model(family: str, **overrides: Any) -> Any:
    torch.manual_seed(0)
    if family == "llama":
        config: Any = transformers.LlamaConfig(**COMMON)
        return transformers.LlamaForCausalLM(config).eval()
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON)).eval()
    if family == "gemma2":
        config = transformers.Gemma2Config(**COMMON, sliding_window=4, query_pre_attn_scalar=16, **overrides)
        return transformers.Gemma2ForCausalLM(config).eval()
    config = transformers.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    return transformers.GptOssForCausalLM(config).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 7 tokens, two of them left-padded."""
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :1] = 0
    return ids.masked_fill(attention_mask == 0, 0), attention_mask


def _run(model: Any, implementation: str, cache: str | None = None) -> tuple[torch.Tensor, ...]:
    ids, attention_mask = _batch()
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask).logits  # (b, l, vocab)
        unpadded = model(input_ids=ids[:1]).logits  # no attention_mask at all
        generated = model.generate(
            input_ids=ids,
            attention_mask=attention_mask,
            max_new_tokens=5,
            do_sample=False,
            cache_implementation=cache,
        )
    return logits[attention_mask.bool()], unpadded, generated


@pytest.mark.parametrize(
    ("family", "reference", "cache"),
    [
        ("llama", "sdpa", None),
        ("llama", "sdpa", "static"),
        ("qwen3", "sdpa", None),
        # transformers refuses sdpa for Gemma 2 (soft-capping): eager is its reference
        ("gemma2", "eager", None),
    ],
)
def test_model_matches_reference(family: str, reference: str, cache: str | None) -> None:
    model = _model(family, attn_logit_softcapping=None)
    logits, unpadded, generated = _run(model, reference, cache)
    got_logits, got_unpadded, got_generated = _run(model, "selfattn", cache)
    torch.testing.assert_close(got_logits, logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_unpadded, unpadded, atol=ATOL, rtol=0)
    assert torch.equal(got_generated, generated)


def _exercised(model: Any, name: str, scale: float) -> Any:
    """Larger attention weights (and sinks), so softcap and sinks change the logits: the tests can fail."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if ".self_attn." in param_name and param_name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
            if param_name.endswith(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 2)
    return model


def test_gemma2_with_softcapping() -> None:
    """Gemma 2 passes softcap; transformers refuses sdpa for it, so eager is the reference."""
    model = _exercised(_model("gemma2", attn_logit_softcapping=1.0), "no parameter", 0.5)
    logits, _, generated = _run(model, "eager")
    got_logits, _, got_generated = _run(model, "selfattn")
    torch.testing.assert_close(got_logits, logits, atol=ATOL, rtol=0)
    assert torch.equal(got_generated, generated)
    model.config.attn_logit_softcapping = None  # the layers read the shared config: the cap is off
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped, _, _ = _run(model, "eager")
    assert (uncapped - logits).abs().max() > 10 * ATOL  # the cap changed the logits, so the test can fail


@pytest.mark.parametrize("cache", [None, "static"])
def test_gpt_oss(cache: str | None) -> None:
    """gpt-oss passes its sinks as s_aux ((h,)); it supports no sdpa, so eager is the reference."""
    model = _exercised(_model("gpt_oss"), "self_attn.sinks", 0.5)
    logits, _, generated = _run(model, "eager", cache)
    got_logits, _, got_generated = _run(model, "selfattn", cache)
    torch.testing.assert_close(got_logits, logits, atol=ATOL, rtol=0)
    assert torch.equal(got_generated, generated)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: attention without sinks
    sinkless, _, _ = _run(model, "eager", cache)
    assert (sinkless - logits).abs().max() > 10 * ATOL  # the sinks changed the logits
