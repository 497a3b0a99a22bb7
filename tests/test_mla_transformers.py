"""MultiHeadLatentAttention.from_transformers against transformers' own MLA layers, run as transformers runs them.

Each family's layer is called with its model's rotary embedding class and a mask from
``transformers.masking_utils`` (eager and sdpa), on a left-padded batch of 3; outputs, the input's
gradient and every parameter's gradient (same names on both sides) must agree. Cached decoding
(prefill, then one token at a time) is compared with transformers' decoding with its DynamicCache.

float64: transformers forms its rotary angles, its RMSNorm and its eager softmax in float32 whatever
the dtype, so the float64 comparison (1e-10) gives the layer cos/sin computed in float64 from the
YaRN formula (written here) and runs its RMSNorms, eager softmax (and DeepSeek-V2's complex
rotation, Mistral 4's query scaling) in the input's dtype: the same formulas without the float32 round trip.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from reference_mla import yarn_frequencies  # noqa: E402
from transformers import masking_utils  # noqa: E402

from selfattn import KVCache, MultiHeadAttention  # noqa: E402
from selfattn.latent import LatentCache, MultiHeadLatentAttention  # noqa: E402
from selfattn.latent.from_transformers import to_transformers_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SIZES = dict(
    vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, num_hidden_layers=1,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
    beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0,
)  # fmt: skip

# Mistral Large 4: two layers (no_rope_layers per layer), an indexer whose top-k covers every key unless set lower.
ML4 = dict(
    num_hidden_layers=2, index_topk=64, index_n_heads=2, index_head_dim=8,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                         beta_fast=32.0, beta_slow=1.0, attention_factor=1.0),
)  # fmt: skip

DSA = dict(index_topk=64, index_n_heads=2, index_head_dim=8)  # top-k covering every key: dense attention

# family -> (config class, its keyword arguments, attention class, rotary class, module)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, str, str]] = {
    "deepseek_v2": (
        "DeepseekV2Config", dict(q_lora_rank=12, rope_parameters=YARN, attention_bias=True),
        "DeepseekV2Attention", "DeepseekV2RotaryEmbedding", "deepseek_v2",
    ),
    "deepseek_v3": (
        "DeepseekV3Config", dict(q_lora_rank=12, rope_parameters=YARN), "DeepseekV3Attention",
        "DeepseekV3RotaryEmbedding", "deepseek_v3",
    ),
    "deepseek_v3_full_query": (
        "DeepseekV3Config", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True), "DeepseekV3Attention",
        "DeepseekV3RotaryEmbedding", "deepseek_v3",
    ),
    "mistral4": (
        "Mistral4Config",
        dict(q_lora_rank=None, rope_parameters=dict(YARN, original_max_position_embeddings=2, llama_4_scaling_beta=0.5)),
        "Mistral4Attention", "Mistral4RotaryEmbedding", "mistral4",
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig", dict(q_lora_rank=12, rope_interleave=False), "Glm4MoeLiteAttention",
        "Glm4MoeLiteRotaryEmbedding", "glm4_moe_lite",
    ),
    "mistral_large4": (
        "MistralLarge4TextConfig", dict(ML4, no_rope_layers=[1, 0]), "MistralLarge4TextAttention",
        "MistralLarge4TextRotaryEmbedding", "mistral_large4",
    ),
    "mistral_large4_nope": (
        "MistralLarge4TextConfig", dict(ML4, no_rope_layers=[0, 0]), "MistralLarge4TextAttention",
        "MistralLarge4TextRotaryEmbedding", "mistral_large4",
    ),
    "deepseek_v32": (
        "DeepseekV32Config", dict(q_lora_rank=12, rope_parameters=YARN, **DSA), "DeepseekV32Attention",
        "DeepseekV32RotaryEmbedding", "deepseek_v32",
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig", dict(q_lora_rank=12, **DSA), "GlmMoeDsaAttention", "GlmMoeDsaRotaryEmbedding", "glm_moe_dsa",
    ),
    "longcat_flash": (
        "LongcatFlashConfig", dict(q_lora_rank=12, head_dim=4, rope_parameters=YARN), "LongcatFlashMLA",
        "LongcatFlashRotaryEmbedding", "longcat_flash",
    ),
}  # fmt: skip


def _layer(
    family: str, dtype: torch.dtype, implementation: str = "eager", **overrides: Any
) -> tuple[Any, Any, Any, Any]:
    """A transformers MLA layer with random weights, its config, its rotary module and its modeling module."""
    config_name, kwargs, attention_name, rotary_name, module_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**SIZES, **kwargs, **overrides})
    config._attn_implementation = implementation
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    torch.manual_seed(3)
    layer = getattr(modeling, attention_name)(config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if "norm" in name else 1.0))
            if name.endswith(("proj.weight", "mqa.weight")):
                param.mul_(param.shape[-1] ** -0.5 * 1.5)
            if "norm" in name:
                param.add_(1.0)
    rotary = getattr(modeling, rotary_name)(config)
    if hasattr(rotary, "alpha"):  # Mistral Large 4's learned frequencies
        with torch.no_grad():
            rotary.alpha.copy_(0.3 * torch.randn(rotary.alpha.shape))
    return layer.to(dtype), config, rotary, modeling


def _inputs(dtype: torch.dtype, pads: tuple[int, ...] = (0, 3, 1), length: int = 7) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(pads), length, 32, generator=gen, dtype=torch.float64).to(dtype)
    attention_mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        attention_mask[row, :pad] = 0
    return x, attention_mask


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """As generate makes them: count the real tokens; padding gets position 1."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def _exact_embeddings(config: Any, family: str, position_ids: torch.Tensor, rotary: Any = None) -> Any:
    """The layer's position embeddings computed in float64 (cos/sin, or DeepSeek-V2's complex ``freqs_cis``)."""
    frequencies, factor = yarn_frequencies(config.qk_rope_head_dim, dict(config.rope_parameters))
    if hasattr(rotary, "alpha"):
        frequencies = frequencies * rotary.alpha.detach().double().exp()
    angles = position_ids.double()[..., None] * frequencies  # (b, l, dr / 2)
    if family == "deepseek_v2":
        return torch.polar(torch.full_like(angles, factor), angles)
    both = torch.cat((angles, angles), dim=-1)
    return both.cos() * factor, both.sin() * factor


def _rms_norm_float64(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _v2_rotary_float64(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V2's complex rotation of interleaved pairs, in complex128."""
    as_complex = [torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) for t in (xq, xk)]
    freqs_cis = freqs_cis.unsqueeze(1)
    return tuple(torch.view_as_real(t * freqs_cis).flatten(3) for t in as_complex)


_SOFTMAX = torch.nn.functional.softmax


def _softmax_in_input_dtype(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
    """Eager attention's softmax, without its float32 round trip for float64 scores."""
    return _SOFTMAX(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kw)


def _llama_4_scale_float64(position_ids: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Mistral 4's query scaling ``1 + beta log(1 + floor(p / L0))`` in float64."""
    return (1 + beta * torch.log1p(torch.floor(position_ids.double() / original)))[:, None, :, None]


def _head_scaling_float64(self: Any, q: torch.Tensor, position_ids: torch.Tensor, head_dim_first: bool) -> torch.Tensor:
    """Mistral Large 4's per-head ``scale_i log(p + 1) + bias_i`` in float64 (heads first: the attention's use)."""
    multiplier = self.scale[None, :, None] * torch.log1p(position_ids.double())[:, None, :] + self.bias[None, :, None]
    return q * (multiplier if head_dim_first else multiplier.transpose(1, 2))[..., None]


@pytest.fixture
def exact_float64(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Patch a family's RMSNorm, eager softmax (and V2's rotation) to run in the input's dtype."""

    def patch(layer: Any, modeling: Any) -> None:
        monkeypatch.setattr(type(layer.kv_a_layernorm), "forward", _rms_norm_float64)
        monkeypatch.setattr(modeling.nn.functional, "softmax", _softmax_in_input_dtype)
        if hasattr(modeling, "MistralLarge4TextSoftmaxScaling"):
            monkeypatch.setattr(modeling.MistralLarge4TextSoftmaxScaling, "forward", _head_scaling_float64)
        if hasattr(modeling, "get_llama_4_attn_scale"):
            monkeypatch.setattr(modeling, "get_llama_4_attn_scale", _llama_4_scale_float64)
        if hasattr(modeling, "apply_rotary_emb"):
            monkeypatch.setattr(modeling, "apply_rotary_emb", _v2_rotary_float64)

    return patch


def _call(layer: Any, family: str, x: torch.Tensor, embeddings: Any, mask: Any, position_ids: torch.Tensor, **kw: Any):
    extra: dict[str, Any] = {"position_ids": position_ids} if family.startswith("mistral") else {}
    if family.startswith("mistral_large4"):
        extra["shared_kv_states"] = transformers.cache_utils.KVSharingDict()
    return layer(x, position_embeddings=embeddings, attention_mask=mask, **extra, **kw)[0]


def _load(layer: Any, rotary: Any) -> MultiHeadLatentAttention:
    """The selfattn layer of ``layer`` (with Mistral Large 4's learned frequencies from its rotary module)."""
    learned = rotary if hasattr(rotary, "alpha") else None
    return MultiHeadLatentAttention.from_transformers(layer, rotary_embedding=learned)


def _embeddings(rotary: Any, config: Any, family: str, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
    if x.dtype == torch.float64:
        return _exact_embeddings(config, family, position_ids, rotary)
    return rotary(x, position_ids)


def _grads(module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(sum of weighted real rows)/d(input and every parameter), by parameter name."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    (out * weights * real[..., None]).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if not name.startswith("indexer.")}  # type: ignore[union-attr]  # the DSA indexer is not part of the latent layer (its top-k has no gradient)
    grads["input"] = x.grad.clone()  # type: ignore[union-attr]
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_equals_the_layer(family: str, implementation: str, dtype: torch.dtype, exact_float64: Any) -> None:
    layer, config, rotary, modeling = _layer(family, dtype, implementation)
    if dtype == torch.float64:
        exact_float64(layer, modeling)
    x, attention_mask = _inputs(dtype)
    position_ids, real = _position_ids(attention_mask), attention_mask.bool()
    mask = masking_utils.create_causal_mask(config, x, attention_mask, None, position_ids=position_ids)
    x_theirs = x.clone().requires_grad_(True)
    theirs = _call(layer, family, x_theirs, _embeddings(rotary, config, family, x, position_ids), mask, position_ids)
    expected = _grads(layer, x_theirs, theirs, real)
    mla = _load(layer, rotary)
    x_ours = x.clone().requires_grad_(True)
    ours = mla(x_ours, positions=position_ids, key_padding_mask=attention_mask == 0)
    got = _grads(mla, x_ours, ours, real)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    scale = max(float(theirs[real].abs().max()), 1.0)
    worst = float((ours[real] - theirs[real]).abs().max()) / scale
    assert worst <= tolerance, f"output differs by {worst:.2e}"
    assert set(got) == set(expected)
    worst_grad = 0.0
    for name, grad in expected.items():
        size = max(float(grad.abs().max()), 1.0)
        error = float((got[name] - grad).abs().max()) / size
        assert error <= tolerance, f"{name}: gradient differs by {error:.2e}"
        worst_grad = max(worst_grad, error)
    print(f"{family} {implementation} {dtype}: output {worst:.1e}, gradients {worst_grad:.1e}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_equals_transformers_cache(family: str, exact_float64: Any) -> None:
    """Prefill 3 tokens, then one at a time: LatentCache vs transformers' DynamicCache, float64, to 1e-10."""
    layer, config, rotary, modeling = _layer(family, torch.float64)
    exact_float64(layer, modeling)
    x, attention_mask = _inputs(torch.float64)
    position_ids, real = _position_ids(attention_mask), attention_mask.bool()
    mla = _load(layer, rotary)
    theirs_cache, ours_cache = transformers.DynamicCache(config=config), LatentCache(max_len=x.shape[1])
    theirs, ours = [], []
    with torch.no_grad():
        for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, x.shape[1])]:
            chunk, positions = x[:, start:stop], position_ids[:, start:stop]
            mask = masking_utils.create_causal_mask(
                config, chunk, attention_mask[:, :stop], theirs_cache, position_ids=positions
            )
            embeddings = _exact_embeddings(config, family, positions, rotary)
            theirs.append(_call(layer, family, chunk, embeddings, mask, positions, cache=theirs_cache))
            ours.append(
                mla(chunk, positions=positions, key_padding_mask=attention_mask[:, start:stop] == 0, cache=ours_cache)
            )
    got, expected = torch.cat(ours, dim=1), torch.cat(theirs, dim=1)
    worst = float((got[real] - expected[real]).abs().max())
    print(f"{family} decoding: {worst:.1e}")
    assert worst <= 1e-10
    assert ours_cache.length == x.shape[1]
    # The cache holds what transformers' holds: the normalized latent and the rotated key (same layout).
    stored_latent, stored_rope = theirs_cache.layers[0].keys, theirs_cache.layers[0].values
    joined = ours_cache._store._keys[..., : x.shape[1], :]
    rows = real[:, None, :, None]
    torch.testing.assert_close((joined[..., :16] * rows), stored_latent * rows, atol=1e-12, rtol=0)
    torch.testing.assert_close((joined[..., 16:] * rows), stored_rope * rows, atol=1e-12, rtol=0)


def test_state_dict_loads_both_ways() -> None:
    """The parameter names are transformers': a state dict goes from one layer to the other as it is."""
    layer, _, _, _ = _layer("deepseek_v3", torch.float32)
    mla = MultiHeadLatentAttention.from_transformers(layer)
    assert set(mla.state_dict()) == set(layer.state_dict())
    with torch.no_grad():
        for p in mla.parameters():
            p.mul_(1.5)
    layer.load_state_dict(mla.state_dict(), strict=True)
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, mla.state_dict()[name])


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_full_query"])
def test_config_round_trip(family: str) -> None:
    """to_transformers_config builds a DeepseekV3Attention that, with the weights loaded, equals the module."""
    layer, _, _, _ = _layer(family, torch.float32)
    mla = MultiHeadLatentAttention.from_transformers(layer)
    fields = to_transformers_config(mla)
    fields.pop("model_type")
    config = transformers.DeepseekV3Config(vocab_size=50, max_position_embeddings=64, **fields)
    config._attn_implementation = "eager"
    modeling = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    rebuilt = modeling.DeepseekV3Attention(config, 0).eval()
    rebuilt.load_state_dict(mla.state_dict(), strict=True)
    assert rebuilt.scaling == pytest.approx(mla.scale, rel=1e-12)
    x, attention_mask = _inputs(torch.float32)
    position_ids, real = _position_ids(attention_mask), attention_mask.bool()
    mask = masking_utils.create_causal_mask(config, x, attention_mask, None, position_ids=position_ids)
    rotary = modeling.DeepseekV3RotaryEmbedding(config)
    with torch.no_grad():
        theirs = _call(rebuilt, "deepseek_v3", x, rotary(x, position_ids), mask, position_ids)
        ours = mla(x, positions=position_ids, key_padding_mask=attention_mask == 0)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def test_caches_are_not_interchangeable() -> None:
    layer, _, _, _ = _layer("deepseek_v3", torch.float32)
    mla = MultiHeadLatentAttention.from_transformers(layer)
    x = torch.randn(1, 2, 32)
    with pytest.raises(ValueError, match=r"cache is a KVCache.*LatentCache"):
        mla(x, cache=KVCache(max_len=4))
    mha = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match="cache must be a KVCache, got LatentCache"):
        mha(x, x, x, cache=LatentCache(max_len=4))


def test_mismatched_ranks_are_named() -> None:
    layer, _, _, _ = _layer("deepseek_v3", torch.float32)
    layer.kv_lora_rank = 12  # the weights were made for 16
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight is \(20, 32\).*kv_lora_rank=12"):
        MultiHeadLatentAttention.from_transformers(layer)
    longcat, _, _, _ = _layer("longcat_flash", torch.float32)
    longcat.qk_head_dim = 16
    with pytest.raises(ValueError, match="qk_head_dim=16 is not qk_nope_head_dim"):
        MultiHeadLatentAttention.from_transformers(longcat)


def test_unknown_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="transformers MLA layer"):
        MultiHeadLatentAttention.from_transformers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "mistral_large4"])
def test_dsa_layers_with_their_indexer_selection_as_mask(family: str, implementation: str) -> None:
    """With top-k 3 of 7 keys, transformers' indexer selects; that selection passed as ``mask=`` gives its output."""
    layer, config, rotary, _ = _layer(family, torch.float32, implementation, index_topk=3)
    x, attention_mask = _inputs(torch.float32)
    position_ids, real = _position_ids(attention_mask), attention_mask.bool()
    mask = masking_utils.create_causal_mask(config, x, attention_mask, None, position_ids=position_ids)
    selected: list[torch.Tensor] = []
    layer.indexer.register_forward_hook(lambda module, args, out: selected.append(out))
    with torch.no_grad():
        theirs = _call(layer, family, x, rotary(x, position_ids), mask, position_ids)
        selection = torch.zeros(3, 7, 7, dtype=torch.bool).scatter(-1, selected[0].long(), True)  # (b, l, n)
        mla = _load(layer, rotary)
        ours = mla(x, positions=position_ids, key_padding_mask=attention_mask == 0, mask=selection)
        dense = mla(x, positions=position_ids, key_padding_mask=attention_mask == 0)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert float((dense[real] - theirs[real]).abs().max()) > 1e-3  # the selection mattered


def test_mistral_large4_latent_sharing_is_refused() -> None:
    layer, _, _, _ = _layer("mistral_large4", torch.float32)
    layer.config.kv_source_layers = [0, 0]  # layer 1 would read layer 0's latent
    modeling = importlib.import_module("transformers.models.mistral_large4.modeling_mistral_large4")
    sharing = modeling.MistralLarge4TextAttention(layer.config, 1)
    with pytest.raises(ValueError, match=r"kv_sharing_modes\[1\]='reuse.*cross-layer latent sharing"):
        MultiHeadLatentAttention.from_transformers(sharing)
    with pytest.raises(ValueError, match="rotary_embedding is read for Mistral Large 4"):
        deepseek, _, deepseek_rotary, _ = _layer("deepseek_v3", torch.float32)
        MultiHeadLatentAttention.from_transformers(deepseek, rotary_embedding=deepseek_rotary)
