"""A Hugging Face attention layer as a :class:`~selfattn.MultiHeadAttention`, and the way back.

:func:`from_transformers` reads a transformers (5.x) attention layer and its config (the layer
carries both: ``layer.config``, ``layer.layer_idx``) and builds the selfattn module with the same
weights and recipe; :func:`to_transformers_config` gives the config fields that rebuild a module.
Neither imports transformers: layers are recognised by their class names.

Shape legend:
    b: batch, l: tokens, h: query heads, hk: key/value heads, dh: head size, d: hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch
from torch import nn

from selfattn.positional.base import PositionalEncoding
from selfattn.positional.registry import build
from selfattn.positional.rotary import RotaryPositionalEncoding

# The module class is passed in (MultiHeadAttention.from_transformers passes itself): importing
# selfattn.attention here would make the two modules import each other.
Module = TypeVar("Module", bound=nn.Module)

__all__ = ["LAYERS", "from_transformers", "to_transformers_config"]

# Attention layer class -> model family (the config's model_type).
LAYERS: dict[str, str] = {
    "LlamaAttention": "llama",
    "Qwen3Attention": "qwen3",
    "Gemma2Attention": "gemma2",
    "Gemma3Attention": "gemma3_text",
    "GptOssAttention": "gpt_oss",
    "Llama4TextAttention": "llama4_text",
    "Qwen3NextAttention": "qwen3_next",
    "Qwen2VLAttention": "qwen2_vl_text",
    "Qwen2_5_VLAttention": "qwen2_5_vl_text",
}
_MROPE = {"qwen2_vl_text", "qwen2_5_vl_text"}  # rotary from (time, height, width) positions
# Families whose QK-norm scales by (1 + weight) (Gemma's RMSNorm), not by the weight.
_ONE_PLUS_WEIGHT = {"gemma3_text", "qwen3_next"}
_LAYER_TYPES = (None, "full_attention", "sliding_attention", "chunked_attention")


def layer_family(layer: nn.Module, layers: Mapping[str, str] = LAYERS, kind: str = "attention") -> str:
    """The model family of a transformers layer: its class (or a base class) looked up in ``layers``."""
    for cls in type(layer).__mro__:
        if cls.__name__ in layers and cls.__module__.startswith("transformers."):
            return layers[cls.__name__]
    raise ValueError(f"layer must be a transformers {kind} layer of {sorted(layers)}, got {type(layer).__name__}")


def _rotary(config: Any, layer_type: str | None, *, interleaved: bool) -> RotaryPositionalEncoding:
    """The rotary of ``config`` for a layer of ``layer_type`` (Gemma 3 keeps one ``rope_parameters`` per type)."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, Mapping) and isinstance(parameters.get(layer_type), Mapping):
        parameters = parameters[layer_type]
    fields = {
        name: getattr(config, name, None)
        for name in (
            "head_dim", "hidden_size", "num_attention_heads", "max_position_embeddings",
            "original_max_position_embeddings", "partial_rotary_factor",
        )
    }  # fmt: skip
    fields["rope_parameters"] = parameters
    rotary = RotaryPositionalEncoding.from_config(fields)
    if not interleaved:
        return rotary
    return RotaryPositionalEncoding(
        rotary.head_dim,
        rotary.base,
        True,  # Llama 4 rotates pairs (2j, 2j + 1), as complex numbers
        rotary_dim=rotary.rotary_dim,
        scaling=rotary.scaling,
        scaling_factor=rotary.scaling_factor,
    )


def _mrope(config: Any, heads: int, head_dim: int) -> PositionalEncoding:
    """Qwen2-VL's M-RoPE: ``build("mrope")`` with the config's ``mrope_section`` and base."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"rope_parameters rope_type={kind!r} with M-RoPE: selfattn's M-RoPE has no scaling")
    sections = tuple(parameters.get("mrope_section", ()))
    return build(
        "mrope", num_hiddens=heads * head_dim, num_heads=heads, base=parameters["rope_theta"], sections=sections
    )


def _norm_weight(norm: nn.Module, family: str) -> tuple[torch.Tensor, float]:
    """The weight an ``nn.RMSNorm`` needs to equal ``norm``, and its epsilon."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor):
        raise ValueError(f"q_norm {type(norm).__name__} has no weight and epsilon to read")
    return (1 + weight if family in _ONE_PLUS_WEIGHT else weight), eps


def from_transformers(layer: nn.Module, cls: type[Module]) -> Module:
    """The selfattn module equal to a transformers attention layer: same weights, same recipe.

    ``mha(x, x, x, causal=True, positions=position_ids)`` then equals the layer called with its
    model's rotary embedding at ``position_ids`` and its causal (sliding, chunked) mask. See
    :meth:`selfattn.MultiHeadAttention.from_transformers` for the layers and what is read.

    Raises:
        ValueError: an unknown layer class, a layer type or option selfattn cannot express, named.
    """
    family = layer_family(layer)
    hf: Any = layer  # read by attribute names: projections, norms, sinks, the config
    config = hf.config
    layer_types = getattr(config, "layer_types", None)
    layer_type = None if layer_types is None else layer_types[hf.layer_idx]
    if layer_type not in _LAYER_TYPES:
        raise ValueError(f"layer_types[{hf.layer_idx}]={layer_type!r} is not an attention selfattn can express")
    if not getattr(hf, "is_causal", True):
        raise ValueError(
            "use_bidirectional_attention=True: a bidirectional layer (its sliding window counts |i - j| <= w) "
            "is not expressed here"
        )
    head_dim = int(hf.head_dim)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    with_bias = {p.bias is not None for p in (hf.q_proj, hf.k_proj, hf.v_proj)}
    if len(with_bias) > 1:
        raise ValueError("the layer has a bias on only some of q_proj, k_proj, v_proj; selfattn has all or none")
    gated = family == "qwen3_next"  # its q_proj emits each head's query and gate side by side
    options: dict[str, Any] = {
        "bias": with_bias.pop(),
        "output_bias": hf.o_proj.bias is not None,
        "query_size": hf.q_proj.in_features,
        "output_size": hf.o_proj.out_features,
        "num_kv_heads": kv_heads,
        "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "window": getattr(hf, "sliding_window", None),
        "softcap": getattr(hf, "attn_logit_softcapping", None),
        "sinks": isinstance(getattr(hf, "sinks", None), torch.Tensor),
        "gated_output": gated,
    }
    options["key_size"] = options["value_size"] = options["query_size"]
    scale = float(hf.scaling)
    options["scale"] = None if math.isclose(scale, head_dim**-0.5, rel_tol=1e-12) else scale
    if layer_type == "chunked_attention":
        options["chunk_size"] = config.attention_chunk_size
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None
    if getattr(hf, "q_norm", None) is not None:
        (q_weight, eps), (k_weight, _) = _norm_weight(hf.q_norm, family), _norm_weight(hf.k_norm, family)
        options.update(qk_norm=True, qk_norm_eps=eps)
        norm_weights = (q_weight, k_weight)
    elif getattr(hf, "qk_norm", None) is not None:  # Llama 4's L2 norm: an RMSNorm with unit weights
        options.update(qk_norm=True, qk_norm_eps=float(hf.qk_norm.eps))
    if family == "llama4_text" and not hf.use_rope:
        if config.attn_temperature_tuning:
            options["temperature_tuning"] = (float(config.attn_scale), float(config.floor_scale))
    elif family in _MROPE:
        options["position"] = _mrope(config, heads, head_dim)
    else:
        options["position"] = _rotary(config, layer_type, interleaved=family == "llama4_text")
    weight = hf.o_proj.weight
    mha: Any = cls(heads * head_dim, heads, device=weight.device, dtype=weight.dtype, **options)
    if mha.position is not None:
        mha.position.to(weight.device)
    with torch.no_grad():
        q_weight_rows, q_bias_rows = hf.q_proj.weight, hf.q_proj.bias
        if gated:
            halves = q_weight_rows.view(heads, 2, head_dim, -1)  # (h, query | gate, dh, d)
            q_weight_rows, gate_rows = halves[:, 0].flatten(0, 1), halves[:, 1].flatten(0, 1)
            assert mha.W_g is not None
            mha.W_g.weight.copy_(gate_rows)
            if q_bias_rows is not None:
                bias_halves = q_bias_rows.view(heads, 2, head_dim)
                q_bias_rows = bias_halves[:, 0].flatten()
                mha.W_g.bias.copy_(bias_halves[:, 1].flatten())
        for linear, weight_rows, bias_rows in (
            (mha.W_q, q_weight_rows, q_bias_rows),
            (mha.W_k, hf.k_proj.weight, hf.k_proj.bias),
            (mha.W_v, hf.v_proj.weight, hf.v_proj.bias),
            (mha.W_o, hf.o_proj.weight, hf.o_proj.bias),
        ):
            linear.weight.copy_(weight_rows)
            if bias_rows is not None:
                linear.bias.copy_(bias_rows)
        if mha.sinks is not None:
            mha.sinks.copy_(hf.sinks)
        if norm_weights is not None:
            assert mha.q_norm is not None and mha.k_norm is not None
            mha.q_norm.weight.copy_(norm_weights[0])
            mha.k_norm.weight.copy_(norm_weights[1])
    return cast(Module, mha.train(hf.training))


# What each family's layer expresses beyond heads, sizes, a bias on every projection and dropout;
# the first family (in this order) that expresses a module's options is chosen.
_HALF_SPLIT = "half-split rotary"
_UNIT_NORM = "qk_norm with unit weights"  # what Llama 4 has; a weighted QK-norm with weights 1 too
_QKV_BIAS = "a bias on W_q, W_k, W_v only"
_MROPE_OPTION = "M-RoPE"
_EXPRESSES: dict[str, frozenset[str]] = {
    "llama": frozenset({_HALF_SPLIT}),
    "qwen3": frozenset({_HALF_SPLIT, "window", "qk_norm", _UNIT_NORM}),
    "gemma2": frozenset({_HALF_SPLIT, "window", "scale", "softcap"}),
    "gemma3_text": frozenset({_HALF_SPLIT, "window", "scale", "softcap", "qk_norm", _UNIT_NORM}),
    "gpt_oss": frozenset({_HALF_SPLIT, "window", "sinks"}),
    "llama4_text": frozenset({"interleaved rotary", "chunk_size", _UNIT_NORM, "no rotary", "temperature_tuning"}),
    "qwen3_next": frozenset({_HALF_SPLIT, "qk_norm", _UNIT_NORM, "gated_output", "partial rotary"}),
    "qwen2_vl_text": frozenset({_MROPE_OPTION, _QKV_BIAS}),  # it always has this bias
}


def _options(mha: Any) -> set[str]:
    """The recipe options ``mha`` uses, in the names of :data:`_EXPRESSES`."""
    if mha.key_size != mha.query_size or mha.value_size != mha.query_size or mha.output_size != mha.query_size:
        raise ValueError(
            "a transformers layer reads, and writes, the hidden size: query_size, key_size, value_size and "
            f"output_size must be equal, got {mha.query_size}, {mha.key_size}, {mha.value_size}, {mha.output_size}"
        )
    used = {name for name in ("window", "scale", "softcap", "chunk_size", "temperature_tuning") if getattr(mha, name)}
    used |= {name for name, part in (("sinks", mha.sinks), ("gated_output", mha.W_g)) if part is not None}
    if mha.q_norm is not None and mha.k_norm is not None:
        unit = bool((mha.q_norm.weight == 1).all()) and bool((mha.k_norm.weight == 1).all())
        used.add(_UNIT_NORM if unit and mha.position is not None else "qk_norm")
    if mha.W_o.bias is not None and mha.W_q.bias is None:
        raise ValueError("a bias on W_o only: no transformers attention layer has it")
    if mha.W_q.bias is not None and mha.W_o.bias is None:
        used.add(_QKV_BIAS)
    rotary = mha.position
    if rotary is None:
        used.add("no rotary")
    elif getattr(rotary, "position_axes", 1) == 3:  # M-RoPE
        used.add(_MROPE_OPTION)
    elif not isinstance(rotary, RotaryPositionalEncoding) or rotary.p != 1.0:
        raise ValueError(f"position={rotary!r}: transformers layers rotate queries and keys (full rotary) or nothing")
    else:
        used.add("interleaved rotary" if rotary.interleaved else _HALF_SPLIT)
        used |= {"partial rotary"} if rotary.rotary_dim != rotary.head_dim else set()
    return used


def _integer(name: str, value: float) -> int:
    """``value`` as the int a transformers config field requires, if it is one up to rounding."""
    nearest = round(value)
    if nearest < 1 or abs(value - nearest) > 1e-9 * nearest:
        raise ValueError(f"{name}={value!r}: transformers' config takes a positive integer there")
    return nearest


def rope_parameters_of(rotary: RotaryPositionalEncoding) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``rotary``: its scaling and its base."""
    scaling = {} if rotary.scaling_config is None else rotary.scaling_config.as_dict()
    return {"rope_type": "default", **scaling, "rope_theta": rotary.base}


def to_transformers_config(module: nn.Module) -> dict[str, Any]:
    """Config fields that rebuild ``module`` (a MultiHeadAttention) as one transformers attention layer.

    ``model_type`` names the first family (Llama, Qwen3, Gemma 2, Gemma 3, gpt-oss, Llama 4 text,
    Qwen3-Next, Qwen2-VL) whose layer expresses every option ``module`` uses (a model of one
    layer); build the config with
    ``transformers.AutoConfig.for_model(**fields)`` and the layer with ``layer_idx=0``. Weights
    are not part of a config: copy them as :func:`from_transformers` reads them (Gemma 3 and
    Qwen3-Next store ``w - 1`` for a QK-norm weight ``w``).

    Raises:
        ValueError: an option no family expresses (a score encoding, p-RoPE, sizes that differ
            from the hidden size), or options no one family has together, named.
    """
    mha: Any = module  # a MultiHeadAttention
    used = _options(mha)
    family = next((name for name, expresses in _EXPRESSES.items() if used <= expresses), None)
    if family is None or ("temperature_tuning" in used and mha.position is not None):
        raise ValueError(f"no transformers attention layer has all of {sorted(used)}")
    if family == "qwen2_vl_text" and (_QKV_BIAS not in used or mha.num_hiddens != mha.query_size):
        raise ValueError(
            "M-RoPE is Qwen2-VL's, whose layer has a bias on W_q, W_k, W_v only and heads that add up to the "
            f"hidden size; got output_bias={mha.W_o.bias is not None}, bias={mha.W_q.bias is not None}, "
            f"num_hiddens={mha.num_hiddens}, query_size={mha.query_size}"
        )
    rotary = mha.position if isinstance(mha.position, RotaryPositionalEncoding) else None
    fields: dict[str, Any] = {
        "model_type": family,
        "hidden_size": mha.query_size,
        "num_attention_heads": mha.num_heads,
        "num_key_value_heads": mha.num_kv_heads,
        "head_dim": mha.head_dim,
        "attention_bias": mha.W_q.bias is not None,
        "attention_dropout": mha.dropout,
        "num_hidden_layers": 1,
    }
    if rotary is not None:
        fields["rope_parameters"] = rope_parameters_of(rotary)
        if rotary.rotary_dim != rotary.head_dim:
            fields["partial_rotary_factor"] = rotary.rotary_dim / rotary.head_dim
    if mha.q_norm is not None:
        fields["rms_norm_eps"] = mha.q_norm.eps
    layer_type = "sliding_attention" if mha.window is not None else "full_attention"
    if family != "llama":
        fields["layer_types"] = [layer_type]
    if mha.window is not None:
        fields["sliding_window"] = mha.window
        if family == "qwen3":
            fields.update(use_sliding_window=True, max_window_layers=0)
    if family in ("gemma2", "gemma3_text"):
        scale = mha.head_dim**-0.5 if mha.scale is None else mha.scale
        fields.update(
            query_pre_attn_scalar=_integer("scale ** -2 (query_pre_attn_scalar)", scale**-2),
            attn_logit_softcapping=mha.softcap,
        )
        if family == "gemma3_text" and rotary is not None:  # one rotary per layer type
            both = rope_parameters_of(rotary)
            fields["rope_parameters"] = {"sliding_attention": both, "full_attention": dict(both)}
    if family == "qwen2_vl_text":
        mrope: Any = mha.position
        fields["rope_parameters"] = {
            "rope_type": "default", "mrope_section": list(mrope.sections), "rope_theta": mrope.base,
        }  # fmt: skip
        del fields["head_dim"], fields["attention_bias"]  # hidden_size / heads; q, k, v biased, o not
    if family == "llama4_text":
        tuning = mha.temperature_tuning
        fields.update(
            layer_types=["chunked_attention" if mha.chunk_size is not None else "full_attention"],
            attention_chunk_size=mha.chunk_size,
            no_rope_layers=[int(rotary is not None)],
            use_qk_norm=mha.q_norm is not None,
            attn_temperature_tuning=tuning is not None,
        )
        if tuning is not None:
            fields.update(attn_scale=tuning[0], floor_scale=_integer("temperature_tuning[1] (floor_scale)", tuning[1]))
    return fields
