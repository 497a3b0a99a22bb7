"""The transformers families whose attention layers load as a :class:`~selfattn.MultiHeadAttention`: one entry each.

A :class:`Family` says how its layer differs from the common reading (heads, sizes, biases,
dropout, window, softcap, sinks, scale, chunks, half-split rotary), in data where it can and in
small functions (:mod:`selfattn.integrations._family_steps`) where it must. :data:`FAMILIES` is the
table :func:`~selfattn.integrations.from_transformers.from_transformers` reads; adding a family is
adding an entry here (and its tiny config in ``tests/_hf_families.py``).

Shape legend: h heads, hk key/value heads, dh head size, d hidden size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import selfattn.integrations._family_steps as steps
import selfattn.integrations._size_steps as size_steps

__all__ = ["FAMILIES", "Family", "family_of_layer"]

_PLAIN_TYPES = frozenset({None, "full_attention", "sliding_attention"})


@dataclass(frozen=True)
class Family:
    """How one family's attention layer becomes parts.

    Attributes:
        model_type: the config's ``model_type``.
        layers: the attention classes' names.
        rotary: ``"half-split"``, ``"interleaved"`` (pairs ``2j, 2j + 1``), ``"mrope"`` (Qwen2-VL's
            sections) or ``"none"``.
        qk_norm: where the layer's QK-norm acts, a slot of :mod:`selfattn.parts` (``"queries"``: per
            head before the rotation; ``"query_features"``: over the whole projection;
            ``"rotated_queries"``: after the rotation), or None.
        norm_names: the layer's attributes of the query and key norms.
        norm_plus_one: whether the norm multiplies by ``1 + w`` (Gemma's RMSNorm).
        projections: the layer's attributes of ``W_q, W_k, W_v, W_o``; a fused ``qkv_proj`` (Phi-3)
            is named three times and split by rows ``[q | k | v]``.
        layer_types: the ``layer_types`` entries a layer may have.
        read: more options from the layer and its config: ``read(hf, config, options)``.
        copy: more weights into the module: ``copy(hf, mha)`` (under ``no_grad``).
        expresses: options :func:`~selfattn.integrations.from_transformers.to_transformers_config`
            may write as this family (empty: not a target).
        requires: options the family's layer always has, as alternatives: a module must use one
            option of each set to be written as this family (Qwen3's layer always normalises).
        write: more config fields for the way back: ``write(mha, fields)``.
    """

    model_type: str
    layers: tuple[str, ...]
    rotary: str = "half-split"
    qk_norm: str | None = None
    norm_names: tuple[str, str] = ("q_norm", "k_norm")
    norm_plus_one: bool = False
    projections: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    layer_types: frozenset[str | None] = _PLAIN_TYPES
    read: Callable[[Any, Any, dict[str, Any]], None] | None = None
    copy: Callable[[Any, Any], None] | None = None
    expresses: frozenset[str] = field(default_factory=frozenset)
    requires: tuple[frozenset[str], ...] = ()
    write: Callable[[Any, dict[str, Any]], None] | None = None


_HALF = "half-split rotary"
_UNIT = "qk_norm with unit weights"
_BIAS = "a bias on W_q, W_k, W_v and W_o"
_QKV = "a bias on W_q, W_k, W_v only"
_NORMED = (frozenset({"qk_norm", _UNIT}),)  # the layer always has a QK-norm per head
_PROJECTION_NORM = "qk_norm at query_features"
_UNWEIGHTED = "qk_norm at queries, unweighted"
# Laguna, Step-3.7: a gate per head (or Laguna's softplus per feature) from g_proj, a weighted QK-norm, a rotary.
_GATED_PER_HEAD = frozenset(
    {_HALF, "partial rotary", _BIAS, "window", "qk_norm", _UNIT, "gated_output", "part OutputGate"}
)
# Gemma 3n, Gemma 4: scale 1 (never dh ** -0.5, so "scale" is always used), a weighted QK-norm, a value norm.
_GEMMA_VALUES = frozenset({_BIAS, "window", "scale", "qk_norm", _UNIT, "part HeadNorm"})
_GEMMA_REQUIRES = (*_NORMED, frozenset({"scale"}), frozenset({"part HeadNorm"}))

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaAttention",), expresses=frozenset({_HALF, _BIAS})),
    Family(
        "qwen3", ("Qwen3Attention",), qk_norm="queries",
        expresses=frozenset({_HALF, _BIAS, "window", "qk_norm", _UNIT}), requires=_NORMED, write=steps.write_qwen3,
    ),
    Family(
        "gemma2", ("Gemma2Attention",),
        expresses=frozenset({_HALF, _BIAS, "window", "scale", "softcap"}), write=steps.write_gemma,
    ),
    Family(
        "gemma3_text", ("Gemma3Attention",), qk_norm="queries", norm_plus_one=True, read=steps.read_no_softcap,
        expresses=frozenset({_HALF, _BIAS, "window", "scale", "qk_norm", _UNIT}), requires=_NORMED,
        write=steps.write_gemma,
    ),
    Family("gpt_oss", ("GptOssAttention",), expresses=frozenset({_HALF, _BIAS, "window", "sinks"})),
    Family(
        "llama4_text", ("Llama4TextAttention",), rotary="interleaved",
        layer_types=frozenset({None, "full_attention", "chunked_attention"}), read=steps.read_llama4,
        expresses=frozenset({"interleaved rotary", _BIAS, "chunk_size", _UNIT, "no rotary", "temperature_tuning"}),
        write=steps.write_llama4,
    ),
    Family(
        "qwen3_next", ("Qwen3NextAttention",), qk_norm="queries", norm_plus_one=True,
        layer_types=frozenset({None, "full_attention"}), read=steps.read_query_gate, copy=steps.copy_query_gate,
        expresses=frozenset({_HALF, _BIAS, "qk_norm", _UNIT, "gated_output", "partial rotary"}),
        requires=(*_NORMED, frozenset({"gated_output"})),
    ),
    Family(
        "qwen2_vl_text", ("Qwen2VLAttention",), rotary="mrope",
        expresses=frozenset({"M-RoPE", _QKV}), write=steps.write_qwen2_vl,
    ),
    Family("qwen2_5_vl_text", ("Qwen2_5_VLAttention",), rotary="mrope"),
    # Llama plus options the common reading sees: biases, windows, QK-norm per head.
    Family(
        "mistral", ("MistralAttention",), read=steps.read_model_window,
        expresses=frozenset({_HALF, "window"}), write=steps.write_model_window,
    ),
    Family("ministral", ("MinistralAttention",), expresses=frozenset({_HALF, "window"})),
    Family(
        "qwen2", ("Qwen2Attention",), expresses=frozenset({_HALF, _QKV, "window"}), requires=(frozenset({_QKV}),),
        write=steps.write_qwen2,
    ),
    Family(
        "hy_v3", ("HYV3Attention",), qk_norm="queries", expresses=frozenset({_HALF, _BIAS, "qk_norm", _UNIT}),
        requires=_NORMED,
    ),
    Family(
        "dots1", ("Dots1Attention",), qk_norm="queries",
        expresses=frozenset({_HALF, _BIAS, "window", "qk_norm", _UNIT}), requires=_NORMED, write=steps.write_qwen3,
    ),
    Family(
        "apertus", ("ApertusAttention",), qk_norm="queries", expresses=frozenset({_HALF, _BIAS, "qk_norm", _UNIT}),
        requires=_NORMED,
    ),
    Family(
        "seed_oss", ("SeedOssAttention",), expresses=frozenset({_HALF, _BIAS, _QKV}), write=steps.write_seed_oss,
    ),
    Family(
        "glm4_moe", ("Glm4MoeAttention",), qk_norm="queries",
        expresses=frozenset({_HALF, "partial rotary", _QKV, "qk_norm", _UNIT}), write=steps.write_glm4_moe,
    ),
    Family(
        "exaone4", ("Exaone4Attention",), qk_norm="queries", read=steps.read_exaone4,
        expresses=frozenset({_HALF, "window", "no rotary", "qk_norm", _UNIT}), requires=_NORMED,
        write=steps.write_exaone4,
    ),
    Family(
        "smollm3", ("SmolLM3Attention",), read=steps.read_no_rope_layers,
        expresses=frozenset({_HALF, _BIAS, "window", "no rotary"}), write=steps.write_smollm3,
    ),
    Family(
        "lfm2", ("Lfm2Attention",), qk_norm="queries", norm_names=("q_layernorm", "k_layernorm"),
        projections=("q_proj", "k_proj", "v_proj", "out_proj"), expresses=frozenset({_HALF, "qk_norm", _UNIT}),
        requires=_NORMED, write=steps.write_lfm2,
    ),
    Family(
        "phi3", ("Phi3Attention",), projections=("qkv_proj", "qkv_proj", "qkv_proj", "o_proj"),
        read=steps.read_model_window, expresses=frozenset({_HALF, "partial rotary", "window"}),
        write=steps.write_model_window,
    ),
    # QK-norm over the whole projection, before the head split.
    Family(
        "olmo2", ("Olmo2Attention",), qk_norm="query_features", expresses=frozenset({_HALF, _BIAS, _PROJECTION_NORM}),
        requires=(frozenset({_PROJECTION_NORM}),),
    ),
    Family(
        "olmo3", ("Olmo3Attention",), qk_norm="query_features",
        expresses=frozenset({_HALF, _BIAS, "window", _PROJECTION_NORM}), requires=(frozenset({_PROJECTION_NORM}),),
    ),
    Family("flex_olmo", ("FlexOlmoAttention",), qk_norm="query_features"),
    Family(
        "minimax_m2", ("MiniMaxM2Attention",), qk_norm="query_features",
        expresses=frozenset({_HALF, "partial rotary", _PROJECTION_NORM}), requires=(frozenset({_PROJECTION_NORM}),),
        write=steps.write_minimax_m2,
    ),
    # Query scaling by position.
    Family(
        "ministral3", ("Ministral3Attention",), read=steps.read_ministral3,
        expresses=frozenset({_HALF, "window", "part LogFloorScaling"}),
        requires=(frozenset({"part LogFloorScaling"}),), write=steps.write_ministral3,
    ),
    # Rotary variants: interleaved M-RoPE (read by read_mrope: the loader's "mrope" is Qwen2-VL's sections).
    Family(
        "qwen3_vl_text", ("Qwen3VLTextAttention",), rotary="none", qk_norm="queries", read=steps.read_mrope,
        layer_types=frozenset({None, "full_attention"}),
        expresses=frozenset({"M-RoPE", _BIAS, "qk_norm", _UNIT}), requires=_NORMED, write=steps.write_qwen3_vl,
    ),
    Family(
        "qwen3_5_text", ("Qwen3_5Attention",), rotary="none", qk_norm="queries", norm_plus_one=True,
        layer_types=frozenset({None, "full_attention"}), read=steps.read_qwen3_5, copy=steps.copy_query_gate,
        expresses=frozenset({"M-RoPE", _BIAS, "qk_norm", _UNIT, "gated_output"}),
        requires=(*_NORMED, frozenset({"gated_output"})), write=steps.write_qwen3_5,
    ),
    Family(
        "qwen3_5_moe_text", ("Qwen3_5MoeAttention",), rotary="none", qk_norm="queries", norm_plus_one=True,
        layer_types=frozenset({None, "full_attention"}), read=steps.read_qwen3_5, copy=steps.copy_query_gate,
    ),
    # Hunyuan V1: QK-norm after the rotation, static NTK from rope_parameters "alpha" (read_ntk_alpha).
    Family(
        "hunyuan_v1_dense", ("HunYuanDenseV1Attention",), rotary="none", qk_norm="rotated_queries",
        norm_names=("query_layernorm", "key_layernorm"), read=steps.read_ntk_alpha,
        expresses=frozenset({_HALF, _BIAS, "qk_norm at rotated_queries"}),
        requires=(frozenset({"qk_norm at rotated_queries"}),), write=steps.write_hunyuan,
    ),
    Family(
        "hunyuan_v1_moe", ("HunYuanMoEV1Attention",), rotary="none", qk_norm="rotated_queries",
        norm_names=("query_layernorm", "key_layernorm"), read=steps.read_ntk_alpha,
    ),
    # Interleaved rotary (pairs 2j, 2j + 1): on a partial slice (GLM-4), the whole head (ERNIE 4.5, Cohere 2's
    # sliding layers; its full layers are NoPE).
    Family(
        "glm4", ("Glm4Attention",), rotary="interleaved",
        expresses=frozenset({"interleaved rotary", "partial rotary", _QKV}),
        write=steps.write_glm4,
    ),
    Family(
        "ernie4_5", ("Ernie4_5Attention",), rotary="interleaved",
        expresses=frozenset({"interleaved rotary", _BIAS}), write=steps.write_ernie4_5,
    ),
    Family(
        "cohere2", ("Cohere2Attention",), rotary="interleaved", read=steps.read_rotary_on_sliding_layers,
        expresses=frozenset({"interleaved rotary", _BIAS, "window", "no rotary"}), write=steps.write_cohere2,
    ),
    Family(
        "lfm3", ("Lfm3Attention",), qk_norm="queries", read=steps.read_head_gate, copy=steps.copy_head_gate,
        expresses=frozenset({_HALF, "proportional rotary", _BIAS, "window", "qk_norm", _UNIT, "gated_output",
                             "part OutputGate"}),
        requires=(*_NORMED, frozenset({"part OutputGate"})), write=steps.write_lfm3,
    ),
    # Families whose sizes, values or gates differ (value norm, K = V, value head size, gates per head).
    Family(
        "gemma3n_text", ("Gemma3nTextAttention",), qk_norm="queries", read=size_steps.read_gemma3n,
        copy=size_steps.require_loaded_sizes, expresses=frozenset({*_GEMMA_VALUES, _HALF}), requires=_GEMMA_REQUIRES,
        write=size_steps.write_gemma3n,
    ),
    Family(
        "gemma4_text", ("Gemma4TextAttention",), qk_norm="queries", read=size_steps.read_gemma4,
        copy=size_steps.require_loaded_sizes,
        expresses=frozenset({*_GEMMA_VALUES, _HALF, "proportional rotary", "values_from_keys"}),
        requires=_GEMMA_REQUIRES, write=size_steps.write_gemma4,
    ),
    Family(
        "mimo_v2_flash", ("MiMoV2FlashAttention",), read=size_steps.read_mimo_v2_flash, copy=size_steps.require_loaded_sizes,
        expresses=frozenset({_HALF, _QKV, "window", "sinks", "value_head_dim", "part ValueScale", "partial rotary"}),
        requires=(frozenset({"value_head_dim", "part ValueScale"}),), write=size_steps.write_mimo_v2_flash,
    ),
    Family(
        "step3p5", ("Step3p7Attention",), qk_norm="queries", norm_plus_one=True, read=size_steps.read_step3p7,
        copy=size_steps.copy_gate, expresses=frozenset({*_GATED_PER_HEAD, "scale"}),
        requires=(*_NORMED, frozenset({"part OutputGate"})), write=size_steps.write_step3p7,
    ),
    Family(
        "laguna", ("LagunaAttention",), qk_norm="queries", read=size_steps.read_laguna, copy=size_steps.copy_gate,
        expresses=_GATED_PER_HEAD, requires=(*_NORMED, frozenset({"part OutputGate"})), write=size_steps.write_laguna,
    ),
    Family(
        "afmoe", ("AfmoeAttention",), qk_norm="queries", read=size_steps.read_afmoe, copy=size_steps.copy_gate,
        expresses=frozenset({_HALF, _BIAS, "window", "qk_norm", _UNIT, "gated_output", "no rotary"}),
        requires=(*_NORMED, frozenset({"gated_output"})), write=size_steps.write_afmoe,
    ),
    Family(
        "muse_glimmer_text", ("MuseGlimmerTextAttention",), qk_norm="queries", norm_names=("qk_norm", "qk_norm"),
        read=size_steps.read_muse, copy=size_steps.copy_gate,
        expresses=frozenset({_HALF, _BIAS, "window", "scale", _UNWEIGHTED, "gated_output", "no rotary"}),
        requires=(frozenset({_UNWEIGHTED}), frozenset({"gated_output"})), write=size_steps.write_muse_glimmer,
    ),
    Family(
        "muse_spark_text", ("MuseSparkTextAttention",), qk_norm="queries", norm_names=("qk_norm", "qk_norm"),
        read=size_steps.read_muse, copy=size_steps.copy_gate,
        expresses=frozenset({_HALF, _BIAS, "window", "scale", _UNWEIGHTED, "gated_output", "no rotary", "part HeadNorm"}),
        requires=(frozenset({_UNWEIGHTED}), frozenset({"gated_output"}), frozenset({"part HeadNorm"})),
        write=size_steps.write_muse_spark,
    ),
    Family(
        "qwen3_moe", ("Qwen3MoeAttention",), qk_norm="queries", read=steps.read_model_window,
        expresses=frozenset({_HALF, _BIAS, "window", "qk_norm", _UNIT}), requires=_NORMED, write=steps.write_qwen3,
    ),
)  # fmt: skip


def _by_class(families: tuple[Family, ...]) -> dict[str, Family]:
    table: dict[str, Family] = {}
    for family in families:
        for name in family.layers:
            if name in table:
                raise ValueError(f"two families claim {name}: {table[name].model_type} and {family.model_type}")
            table[name] = family
    return table


BY_CLASS: Mapping[str, Family] = _by_class(FAMILIES)


def family_of_layer(layer: object) -> Family:
    """The family of a transformers attention layer: its class (or a base class) looked up in the table."""
    for cls in type(layer).__mro__:
        if cls.__name__ in BY_CLASS and cls.__module__.startswith("transformers."):
            return BY_CLASS[cls.__name__]
    raise ValueError(f"layer must be a transformers attention layer of {sorted(BY_CLASS)}, got {type(layer).__name__}")
