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
        layer_types: the ``layer_types`` entries a layer may have.
        read: more options from the layer and its config: ``read(hf, config, options)``.
        copy: more weights into the module: ``copy(hf, mha)`` (under ``no_grad``).
        expresses: options :func:`~selfattn.integrations.from_transformers.to_transformers_config`
            may write as this family (empty: not a target).
        write: more config fields for the way back: ``write(mha, fields)``.
    """

    model_type: str
    layers: tuple[str, ...]
    rotary: str = "half-split"
    qk_norm: str | None = None
    norm_names: tuple[str, str] = ("q_norm", "k_norm")
    norm_plus_one: bool = False
    layer_types: frozenset[str | None] = _PLAIN_TYPES
    read: Callable[[Any, Any, dict[str, Any]], None] | None = None
    copy: Callable[[Any, Any], None] | None = None
    expresses: frozenset[str] = field(default_factory=frozenset)
    write: Callable[[Any, dict[str, Any]], None] | None = None


_HALF = "half-split rotary"
_UNIT = "qk_norm with unit weights"

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaAttention",), expresses=frozenset({_HALF})),
    Family(
        "qwen3", ("Qwen3Attention",), qk_norm="queries",
        expresses=frozenset({_HALF, "window", "qk_norm", _UNIT}), write=steps.write_qwen3,
    ),
    Family(
        "gemma2", ("Gemma2Attention",),
        expresses=frozenset({_HALF, "window", "scale", "softcap"}), write=steps.write_gemma,
    ),
    Family(
        "gemma3_text", ("Gemma3Attention",), qk_norm="queries", norm_plus_one=True, read=steps.read_no_softcap,
        expresses=frozenset({_HALF, "window", "scale", "qk_norm", _UNIT}), write=steps.write_gemma,
    ),
    Family("gpt_oss", ("GptOssAttention",), expresses=frozenset({_HALF, "window", "sinks"})),
    Family(
        "llama4_text", ("Llama4TextAttention",), rotary="interleaved",
        layer_types=frozenset({None, "full_attention", "chunked_attention"}), read=steps.read_llama4,
        expresses=frozenset({"interleaved rotary", "chunk_size", _UNIT, "no rotary", "temperature_tuning"}),
        write=steps.write_llama4,
    ),
    Family(
        "qwen3_next", ("Qwen3NextAttention",), qk_norm="queries", norm_plus_one=True,
        layer_types=frozenset({None, "full_attention"}), read=steps.read_query_gate, copy=steps.copy_query_gate,
        expresses=frozenset({_HALF, "qk_norm", _UNIT, "gated_output", "partial rotary"}),
    ),
    Family(
        "qwen2_vl_text", ("Qwen2VLAttention",), rotary="mrope",
        expresses=frozenset({"M-RoPE", "a bias on W_q, W_k, W_v only"}), write=steps.write_qwen2_vl,
    ),
    Family("qwen2_5_vl_text", ("Qwen2_5_VLAttention",), rotary="mrope"),
    # Families whose sizes, values or gates differ (value norm, K = V, value head size, gates per head).
    Family(
        "gemma3n_text", ("Gemma3nTextAttention",), qk_norm="queries", read=steps.read_gemma3n,
        copy=steps.require_loaded_sizes,
    ),
    Family(
        "gemma4_text", ("Gemma4TextAttention",), qk_norm="queries", read=steps.read_gemma4,
        copy=steps.require_loaded_sizes,
    ),
    Family(
        "mimo_v2_flash", ("MiMoV2FlashAttention",), read=steps.read_mimo_v2_flash, copy=steps.require_loaded_sizes
    ),
    Family(
        "step3p5", ("Step3p7Attention",), qk_norm="queries", norm_plus_one=True, read=steps.read_step3p7,
        copy=steps.copy_gate,
    ),
    Family("laguna", ("LagunaAttention",), qk_norm="queries", read=steps.read_laguna, copy=steps.copy_gate),
    Family(
        "afmoe", ("AfmoeAttention",), qk_norm="queries", read=steps.read_afmoe, copy=steps.copy_gate,
        expresses=frozenset({_HALF, "window", "qk_norm", _UNIT, "gated_output", "no rotary"}),
        write=steps.write_afmoe,
    ),
    Family(
        "muse_glimmer_text", ("MuseGlimmerTextAttention",), qk_norm="queries", norm_names=("qk_norm", "qk_norm"),
        read=steps.read_muse, copy=steps.copy_gate,
        expresses=frozenset({_HALF, "window", "scale", "qk_norm at queries, unweighted", "gated_output", "no rotary"}),
        write=steps.write_muse_glimmer,
    ),
    Family(
        "muse_spark_text", ("MuseSparkTextAttention",), qk_norm="queries", norm_names=("qk_norm", "qk_norm"),
        read=steps.read_muse, copy=steps.copy_gate,
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
