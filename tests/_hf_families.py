"""Tiny transformers (5.24) configs of every attention family, and how transformers runs each layer.

Read by tests/test_families.py. One :class:`Family` per config ``model_type``: the config class and
its keyword arguments (hidden 32, 4 heads, 2 key/value heads, head sizes 8-16, 2 layers whose types
differ where the family has several, 64 positions), the attention and rotary classes, and the few
facts a caller needs to run the layer the way its model does (the rotary's layout, positions of
three axes for M-RoPE, extra forward arguments). Families not yet in selfattn's table are here too,
so a family joins the parity test by being added to ``selfattn.integrations.from_transformers.LAYERS``.

Shape legend:
    b: batch, l: tokens, h: query heads, dh: head size, n: rotary frequencies, d: hidden size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

COMMON: dict[str, Any] = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
TWO_TYPES: dict[str, Any] = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
MOE: dict[str, Any] = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers attention family: how to build a tiny layer and run it as its model does.

    Attributes:
        config: the config class name in ``transformers``.
        kwargs: its keyword arguments beyond :data:`COMMON`.
        attention: the attention class in ``transformers.models.<module>.modeling_<module>``.
        rotary: the rotary class there.
        module: the ``transformers.models`` package.
        layers: the layer indices to test (one per layer type).
        mrope: ``"sectioned"`` or ``"interleaved"`` M-RoPE, whose positions are ``(3, b, l)``.
        token_index_positions: the layer reads each token's index in the batch (Llama 4's
            temperature on NoPE layers), not ``position_ids``, given the layer.
        no_rope: the model passes no rotary to this layer (Muse's ``layer_rope_theta == 0``).
        make: builds the layer as the family's decoder layer does, given the modeling module, the
            config and the layer index, where that is not ``Attention(config, layer_idx)``.
    """

    config: str
    kwargs: dict[str, Any]
    attention: str
    rotary: str
    module: str
    layers: tuple[int, ...] = (0, 1)
    mrope: str | None = None
    token_index_positions: Callable[[Any], bool] = lambda layer: False
    no_rope: Callable[[Any, int], bool] = lambda config, layer_idx: False
    make: Callable[[Any, Any, int], Any] | None = None


def _family(module: str, prefix: str, config: str | None = None, **fields: Any) -> Family:
    """A :class:`Family` whose classes follow transformers' names: ``<prefix>Attention`` and so on."""
    kwargs = fields.pop("kwargs", {})
    return Family(
        config=config or f"{prefix}Config",
        kwargs=kwargs,
        attention=fields.pop("attention", f"{prefix}Attention"),
        rotary=fields.pop("rotary", f"{prefix}RotaryEmbedding"),
        module=module,
        **fields,
    )


def _mrope(sections: list[int], theta: float = 10000.0, **more: Any) -> dict[str, Any]:
    return dict(rope_type="default", rope_theta=theta, mrope_section=sections, **more)


def _per_type(sliding: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_attention": sliding, "full_attention": full}


_LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
_YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=16,
)
_LINEAR = dict(rope_type="linear", factor=4.0, rope_theta=10000.0)
_DEFAULT = dict(rope_type="default", rope_theta=100.0)


def _step3p7_attention(modeling: Any, config: Any, layer_idx: int) -> Any:
    """As Step3p7DecoderLayer builds it: from the layer's resolved config, then pointed at the model's."""
    layer = modeling.Step3p7Attention(config.per_layer_config[layer_idx], layer_idx)
    layer.config = config
    return layer


# Keyed by the config's model_type, the name selfattn's table (LAYERS) uses.
FAMILIES: dict[str, Family] = {
    "llama": _family("llama", "Llama", kwargs=dict(head_dim=8, attention_bias=True, rope_parameters=_LLAMA3)),
    "mistral": _family("mistral", "Mistral", kwargs=dict(head_dim=8, sliding_window=3), layers=(0,)),
    "ministral3": _family(
        "ministral3",
        "Ministral3",
        kwargs=dict(
            head_dim=8,
            sliding_window=5,
            rope_parameters=dict(
                _YARN,
                original_max_position_embeddings=2,
                llama_4_scaling_beta=0.3,
            ),
        ),
        layers=(0,),
    ),
    "ministral": _family("ministral", "Ministral", kwargs=dict(head_dim=8, **TWO_TYPES)),
    "qwen2": _family("qwen2", "Qwen2", kwargs=dict(use_sliding_window=True, **TWO_TYPES)),
    "qwen3": _family("qwen3", "Qwen3", kwargs=dict(head_dim=16, use_sliding_window=True, **TWO_TYPES)),
    "qwen3_moe": _family(
        "qwen3_moe", "Qwen3Moe", kwargs=dict(head_dim=16, use_sliding_window=True, sliding_window=3, **MOE), layers=(0,)
    ),
    "qwen3_next": _family(
        "qwen3_next",
        "Qwen3Next",
        kwargs=dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True, layer_types=["full_attention"] * 2),
        layers=(0,),
    ),
    "qwen3_5_text": _family(
        "qwen3_5",
        "Qwen3_5",
        config="Qwen3_5TextConfig",
        rotary="Qwen3_5TextRotaryEmbedding",
        kwargs=dict(
            head_dim=16,
            attention_bias=True,
            layer_types=["full_attention"] * 2,
            rope_parameters=_mrope(
                [2, 1, 1],
                partial_rotary_factor=0.5,
                mrope_interleaved=True,
            ),
        ),
        layers=(0,),
        mrope="interleaved",
    ),
    "qwen3_5_moe_text": _family(
        "qwen3_5_moe",
        "Qwen3_5Moe",
        config="Qwen3_5MoeTextConfig",
        rotary="Qwen3_5MoeTextRotaryEmbedding",
        kwargs=dict(
            head_dim=16,
            layer_types=["full_attention"] * 2,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            rope_parameters=_mrope([2, 1, 1], partial_rotary_factor=0.5, mrope_interleaved=True),
        ),
        layers=(0,),
        mrope="interleaved",
    ),
    "qwen3_vl_text": _family(
        "qwen3_vl",
        "Qwen3VLText",
        attention="Qwen3VLTextAttention",
        kwargs=dict(head_dim=8, rope_parameters=_mrope([2, 1, 1], mrope_interleaved=True)),
        layers=(0,),
        mrope="interleaved",
    ),
    "qwen2_vl_text": _family(
        "qwen2_vl",
        "Qwen2VL",
        config="Qwen2VLTextConfig",
        kwargs=dict(rope_parameters=_mrope([1, 1, 2])),
        layers=(0,),
        mrope="sectioned",
    ),
    "qwen2_5_vl_text": _family(
        "qwen2_5_vl",
        "Qwen2_5_VL",
        config="Qwen2_5_VLTextConfig",
        kwargs=dict(rope_parameters=_mrope([2, 1, 1], theta=1000.0)),
        layers=(0,),
        mrope="sectioned",
    ),
    "gemma2": _family(
        "gemma2", "Gemma2", kwargs=dict(head_dim=16, query_pre_attn_scalar=10, attn_logit_softcapping=2.0, **TWO_TYPES)
    ),
    "gemma3_text": _family(
        "gemma3",
        "Gemma3",
        config="Gemma3TextConfig",
        kwargs=dict(head_dim=16, query_pre_attn_scalar=12, rope_parameters=_per_type(_DEFAULT, _LINEAR), **TWO_TYPES),
    ),
    "gemma3n_text": _family(
        "gemma3n",
        "Gemma3n",
        config="Gemma3nTextConfig",
        attention="Gemma3nTextAttention",
        kwargs=dict(
            head_dim=8,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            activation_sparsity_pattern=[0.0, 0.0],
            rope_parameters=_per_type(_DEFAULT, _LINEAR),
            **TWO_TYPES,
        ),
    ),
    "gemma4_text": _family(
        "gemma4",
        "Gemma4",
        config="Gemma4TextConfig",
        attention="Gemma4TextAttention",
        rotary="Gemma4TextRotaryEmbedding",
        kwargs=dict(
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=8,
            rope_parameters=_per_type(
                _DEFAULT, dict(rope_type="proportional", partial_rotary_factor=0.5, rope_theta=1000.0)
            ),
            **TWO_TYPES,
        ),
    ),
    "gpt_oss": _family(
        "gpt_oss",
        "GptOss",
        kwargs=dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1, rope_parameters=_YARN, **TWO_TYPES),
    ),
    "llama4_text": _family(
        "llama4",
        "Llama4Text",
        config="Llama4TextConfig",
        kwargs=dict(
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=4,
            floor_scale=2,
            attn_scale=0.5,
            attention_bias=True,
        ),
        token_index_positions=lambda layer: not layer.use_rope,
    ),
    "olmo2": _family("olmo2", "Olmo2", kwargs=dict(attention_bias=True), layers=(0,)),
    "olmo3": _family("olmo3", "Olmo3", kwargs=dict(**TWO_TYPES)),
    "flex_olmo": _family("flex_olmo", "FlexOlmo", kwargs=dict(num_experts=2, num_experts_per_tok=1), layers=(0,)),
    "cohere2": _family(
        "cohere2",
        "Cohere2",
        kwargs=dict(**TWO_TYPES),
    ),
    "glm4": _family("glm4", "Glm4", kwargs=dict(head_dim=16, partial_rotary_factor=0.5), layers=(0,)),
    "glm4_moe": _family(
        "glm4_moe",
        "Glm4Moe",
        kwargs=dict(
            head_dim=16,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=2,
        ),
        layers=(0,),
    ),
    "ernie4_5": _family(
        "ernie4_5",
        "Ernie4_5",
        kwargs=dict(head_dim=8, use_bias=True),
        layers=(0,),
    ),
    "hunyuan_v1_dense": _family(
        "hunyuan_v1_dense",
        "HunYuanDenseV1",
        kwargs=dict(head_dim=8, rope_parameters=dict(rope_type="dynamic", rope_theta=1000.0, alpha=2.0, factor=1.0)),
        layers=(0,),
    ),
    "hunyuan_v1_moe": _family(
        "hunyuan_v1_moe",
        "HunYuanMoEV1",
        kwargs=dict(
            head_dim=8,
            num_experts=2,
            moe_topk=1,
            rope_parameters=dict(rope_type="dynamic", rope_theta=1000.0, alpha=2.0, factor=1.0),
        ),
        layers=(0,),
    ),
    "hy_v3": _family("hy_v3", "HYV3", kwargs=dict(head_dim=8, num_experts=2, num_experts_per_tok=1), layers=(0,)),
    "seed_oss": _family(
        "seed_oss", "SeedOss", kwargs=dict(head_dim=8, attention_bias=True, attention_out_bias=True), layers=(0,)
    ),
    "apertus": _family("apertus", "Apertus", kwargs=dict(head_dim=8, rope_parameters=_LLAMA3), layers=(0,)),
    "dots1": _family("dots1", "Dots1", kwargs=dict(head_dim=8, n_routed_experts=2, **TWO_TYPES)),
    "smollm3": _family("smollm3", "SmolLM3", kwargs=dict(head_dim=8, no_rope_layers=[1, 0])),
    "exaone4": _family("exaone4", "Exaone4", kwargs=dict(head_dim=8, **TWO_TYPES)),
    "afmoe": _family(
        "afmoe", "Afmoe", kwargs=dict(head_dim=8, num_experts=2, num_experts_per_tok=1, num_dense_layers=2, **TWO_TYPES)
    ),
    "minimax_m2": _family(
        "minimax_m2",
        "MiniMaxM2",
        kwargs=dict(head_dim=16, partial_rotary_factor=0.5, num_local_experts=2, num_experts_per_tok=1),
        layers=(0,),
    ),
    "mimo_v2_flash": _family(
        "mimo_v2_flash",
        "MiMoV2Flash",
        kwargs=dict(
            head_dim=16,
            v_head_dim=8,
            attention_value_scale=0.5,
            n_routed_experts=2,
            num_experts_per_tok=1,
            rope_parameters=_per_type(
                dict(_DEFAULT, partial_rotary_factor=0.5),
                dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
            ),
            **TWO_TYPES,
        ),
    ),
    "step3p5": _family(
        "step3p7",
        "Step3p7",
        config="Step3p7TextConfig",
        kwargs=dict(
            head_dim=8,
            num_sliding_attention_heads=2,
            gating="per-head",
            n_routed_experts=2,
            pad_token_id=0,
            num_experts_per_tok=1,
            mlp_layer_types=["dense", "dense"],
            partial_rotary_factors=[0.5, 1.0],
            **TWO_TYPES,
        ),
        make=_step3p7_attention,
    ),
    "lfm2": _family("lfm2", "Lfm2", kwargs=dict(layer_types=["full_attention"] * 2, block_multiple_of=8), layers=(0,)),
    "muse_glimmer_text": _family(
        "muse_glimmer",
        "MuseGlimmerText",
        config="MuseGlimmerTextConfig",
        kwargs=dict(head_dim=8, qk_scale_factor=2.5, **TWO_TYPES),
        no_rope=lambda config, layer_idx: not config.layer_rope_theta[layer_idx],
    ),
    "muse_spark_text": _family(
        "muse_spark",
        "MuseSparkText",
        config="MuseSparkTextConfig",
        kwargs=dict(head_dim=8, qk_scale_factor=4.5, mlp_layer_types=["dense", "dense"], **TWO_TYPES),
        no_rope=lambda config, layer_idx: not config.layer_rope_theta[layer_idx],
    ),
    "phi3": _family(
        "phi3",
        "Phi3",
        kwargs=dict(sliding_window=3, rope_parameters=dict(_DEFAULT, partial_rotary_factor=0.5)),
        layers=(0,),
    ),
    "laguna": _family(
        "laguna",
        "Laguna",
        kwargs=dict(
            head_dim=8,
            num_attention_heads_per_layer=[4, 2],
            num_experts=2,
            num_experts_per_tok=1,
            rope_parameters=_per_type(_DEFAULT, dict(_DEFAULT, partial_rotary_factor=0.5)),
            **TWO_TYPES,
        ),
        make=lambda modeling, config, i: modeling.LagunaAttention(config, i, config.num_attention_heads_per_layer[i]),
    ),
    "lfm3": _family(
        "lfm3",
        "Lfm3",
        kwargs=dict(
            head_dim=8,
            rope_parameters=_per_type(
                _DEFAULT,
                dict(
                    rope_type="proportional",
                    partial_rotary_factor=0.5,
                    rope_theta=1000.0,
                ),
            ),
            **TWO_TYPES,
        ),
    ),
}


def modeling(family: Family) -> Any:
    """The ``transformers.models.<module>.modeling_<module>`` module of ``family``."""
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def build_config(model_type: str, attn_implementation: str = "eager", **overrides: Any) -> Any:
    """The family's tiny config, set to run ``attn_implementation``."""
    import transformers

    family = FAMILIES[model_type]
    config = getattr(transformers, family.config)(**(COMMON | family.kwargs | overrides))
    config._attn_implementation = attn_implementation
    return config


def randomize(layer: torch.nn.Module, seed: int) -> None:
    """Random weights, norms and sinks included, sized so scores are a few units (softcaps and sinks matter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            param.copy_(noise * (0.3 if "norm" in name else 1.0) * (2 if "sinks" in name else 1))
            if "proj.weight" in name:
                param.mul_(param.shape[-1] ** -0.5 * 1.5)


def build_layer(model_type: str, layer_idx: int, dtype: torch.dtype, config: Any | None = None) -> tuple[Any, Any]:
    """The family's attention layer ``layer_idx`` with random weights in ``dtype``, and its config."""
    family = FAMILIES[model_type]
    config = build_config(model_type) if config is None else config
    module = modeling(family)
    make = family.make or (lambda module, config, i: getattr(module, family.attention)(config, i))
    layer = make(module, config, layer_idx).eval()
    randomize(layer, seed=layer_idx)
    return layer.to(dtype), config


def layer_type(config: Any, layer_idx: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return None if types is None else types[layer_idx]


def build_rotary(model_type: str, config: Any) -> Any:
    """The family's rotary module, as its model builds it."""
    family = FAMILIES[model_type]
    return getattr(modeling(family), family.rotary)(config)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(b, l)`` as generate makes them: count the real tokens; padding gets position 1."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def rotary_positions(model_type: str, attention_mask: torch.Tensor) -> torch.Tensor:
    """What the rotary reads: ``position_ids``, or for M-RoPE ``(3, b, l)`` whose axes differ as an image's do."""
    ids = position_ids(attention_mask)
    if FAMILIES[model_type].mrope is None:
        return ids
    return torch.stack((ids, (2 * ids) % 5, ids // 2))


def selfattn_positions(model_type: str, layer: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """The ``positions`` selfattn is given: the rotary's, or each token's index where the layer reads that."""
    if FAMILIES[model_type].token_index_positions(layer):
        return torch.arange(attention_mask.shape[1]).expand_as(attention_mask)
    return rotary_positions(model_type, attention_mask)


def _takes_layer_type(rotary: Any) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters


def hf_frequencies(rotary: Any, kind: str | None) -> tuple[torch.Tensor, float]:
    """transformers' (float32) inverse frequencies ``(n,)`` and attention scaling for a layer of type ``kind``."""
    if _takes_layer_type(rotary):
        return getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling"))
    return rotary.inv_freq, float(rotary.attention_scaling)


def embeddings(
    model_type: str,
    rotary: Any,
    config: Any,
    layer_idx: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    exact: tuple[torch.Tensor, float] | None = None,
) -> Any:
    """``position_embeddings`` for the layer: the rotary module's own output, or None for a NoPE layer.

    With ``exact=(inv_freq, scaling)`` (float64 frequencies) the same layout is formed from float64
    angles, as transformers would form them without its float32 ``position * inv_freq``: the
    float64 comparison then sees every other rounding of the layer. The layouts: half-split
    ``cat(f, f)``; gpt-oss ``f`` (half size); Llama 4 complex ``polar(1, f)``; M-RoPE's recomposition.
    """
    family, kind = FAMILIES[model_type], layer_type(config, layer_idx)
    if family.no_rope(config, layer_idx):
        return None
    if exact is None:
        return rotary(x, positions, kind) if _takes_layer_type(rotary) else rotary(x, positions)
    inv_freq, scaling = exact
    freqs = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)  # (b, l, n) or (3, b, l, n)
    name = type(rotary).__name__
    if name == "Llama4TextRotaryEmbedding":
        return torch.polar(torch.ones_like(freqs), freqs) * scaling
    if name == "GptOssRotaryEmbedding":
        return (freqs.cos() * scaling).to(x.dtype), (freqs.sin() * scaling).to(x.dtype)
    if family.mrope is not None:
        cos, sin = (rotary.recomposition_frequencies(part * scaling) for part in (freqs.cos(), freqs.sin()))
        return cos.to(x.dtype), sin.to(x.dtype)
    if name == "Cohere2RotaryEmbedding":  # pairs (2j, 2j + 1): each frequency twice in a row
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def mask(
    config: Any,
    layer_idx: int,
    x: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    cache: Any = None,
) -> Any:
    """The mask transformers' model builds for this layer's type (masking_utils), materialized.

    Args:
        x: ``(b, lq, d)`` this call's tokens.
        attention_mask: ``(b, past + lq)`` 1 for real tokens, 0 for padding.
        positions: ``(b, lq)`` position ids of this call's tokens.
        cache: the DynamicCache before this call's update, or None.
    """
    from transformers import masking_utils

    kind = layer_type(config, layer_idx)
    if kind is None and getattr(config, "sliding_window", None) is not None:
        kind = "sliding_attention"  # Mistral, Ministral 3, Phi-3: one window for every layer
    make = {
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "chunked_attention": masking_utils.create_chunked_causal_mask,
    }.get(kind or "", masking_utils.create_causal_mask)
    return make(
        config, x, attention_mask, cache, position_ids=positions, layer_idx=layer_idx, allow_is_causal_skip=False
    )


def forward_kwargs(layer: Any, positions: torch.Tensor) -> dict[str, Any]:
    """What the layer's forward needs beyond its embeddings, mask and cache (Ministral 3's position_ids,
    Gemma 3n's and Gemma 4's store of shared keys and values)."""
    parameters = inspect.signature(layer.forward).parameters
    extra: dict[str, Any] = {}
    if "position_ids" in parameters:
        extra["position_ids"] = positions
    if "shared_kv_states" in parameters:
        extra["shared_kv_states"] = {}
    return extra


def supports_sdpa(model_type: str) -> bool:
    """Whether the family's model offers ``attn_implementation="sdpa"``."""
    module = modeling(FAMILIES[model_type])
    pretrained = [
        cls
        for name, cls in vars(module).items()
        if name.endswith("PreTrainedModel") and inspect.isclass(cls) and cls.__module__ == module.__name__
    ]
    return bool(pretrained) and all(getattr(cls, "_supports_sdpa", False) for cls in pretrained)


@contextlib.contextmanager
def float64_kept() -> Iterator[None]:
    """Within: transformers' float32 upcasts leave a float64 tensor float64.

    transformers' layers upcast to float32 in several places (eager's ``softmax(scores,
    dtype=torch.float32)`` llama L187, the RMSNorms' ``x.to(torch.float32)`` llama L64 or
    ``x.float()``, Cohere 2's, ERNIE 4.5's and Llama 4's rotations of ``q.float()``, Llama 4's
    temperature from ``positions.float()``, Ministral 3's query scale from integer positions divided in the
    default dtype); for a float64 layer each of these rounds to float32
    (3e-7 on these layers). The float64 comparison lifts exactly those casts: a float64 tensor
    asked for float32 stays float64, and ``.float()`` of an integer tensor gives float64; every step
    of the layer is still its own code. Only for float64 runs: below, it would change float32 ones.
    """
    tensor, functional = torch.Tensor, torch.nn.functional
    original_to, original_float, original_softmax = tensor.to, tensor.float, functional.softmax

    def kept(self: torch.Tensor, dtype: Any) -> Any:
        return torch.float64 if dtype is torch.float32 and self.dtype is torch.float64 else dtype

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple(kept(self, arg) for arg in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = kept(self, kwargs["dtype"])
        return original_to(self, *args, **kwargs)

    def to_float(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.dtype is torch.float64 or not self.dtype.is_floating_point:
            return original_to(self, torch.float64)
        return original_float(self, *args, **kwargs)

    def softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:
        return original_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=kept(input, dtype))

    tensor.to, tensor.float, functional.softmax = to, to_float, softmax  # type: ignore[method-assign,assignment]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # Ministral 3's query scale: integer positions / L0 (ministral3 L106)
    try:
        yield
    finally:
        tensor.to, tensor.float, functional.softmax = original_to, original_float, original_softmax  # type: ignore[method-assign]
        torch.set_default_dtype(default)
