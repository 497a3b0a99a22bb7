"""A Hugging Face attention layer as a :class:`~selfattn.MultiHeadAttention`, and the way back.

:func:`from_transformers` reads a transformers (5.x) attention layer and its config (the layer
carries both: ``layer.config``, ``layer.layer_idx``) and builds the selfattn module with the same
weights and parts: the common reading here, each family's differences in its entry of
:data:`~selfattn.integrations.families.FAMILIES`. :func:`to_transformers_config` gives the config
fields that rebuild a module as the first family whose layer expresses it. Neither imports
transformers: layers are recognised by their class names.

Shape legend:
    b: batch, l: tokens, h: query heads, hk: key/value heads, dh: head size, d: hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch
from torch import nn

from selfattn.integrations._family_steps import weight_of
from selfattn.integrations.families import BY_CLASS, FAMILIES, Family, family_of_layer
from selfattn.parts import HeadNorm, OutputGate, Part, TemperatureTuning
from selfattn.positional.base import PositionalEncoding
from selfattn.positional.registry import build
from selfattn.positional.rotary import RotaryPositionalEncoding

# The module class is passed in (MultiHeadAttention.from_transformers passes itself): importing
# selfattn.attention here would make the two modules import each other.
Module = TypeVar("Module", bound=nn.Module)

__all__ = [
    "LAYERS", "from_transformers", "layer_family", "projection_weights", "rope_parameters_of", "to_transformers_config",
]  # fmt: skip

# Attention layer class -> model family (the config's model_type), from the family table.
LAYERS: dict[str, str] = {name: family.model_type for name, family in BY_CLASS.items()}


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
    if isinstance(parameters, Mapping) and "llama_4_scaling_beta" in parameters:  # a query scaling, read apart
        parameters = {name: value for name, value in parameters.items() if name != "llama_4_scaling_beta"}
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
        rotary.head_dim, rotary.base, True, rotary_dim=rotary.rotary_dim, scaling=rotary.scaling,
        scaling_factor=rotary.scaling_factor,
    )  # fmt: skip


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


def _position(family: Family, config: Any, layer_type: str | None, heads: int, head_dim: int) -> Any:
    if family.rotary == "none":
        return None
    if family.rotary == "mrope":
        return _mrope(config, heads, head_dim)
    return _rotary(config, layer_type, interleaved=family.rotary == "interleaved")


def _layer_type(hf: Any, family: Family) -> str | None:
    layer_types = getattr(hf.config, "layer_types", None)
    layer_type = None if layer_types is None else layer_types[hf.layer_idx]
    if layer_type not in family.layer_types:
        raise ValueError(f"layer_types[{hf.layer_idx}]={layer_type!r} is not an attention selfattn can express")
    if not getattr(hf, "is_causal", True):
        raise ValueError(
            "use_bidirectional_attention=True: a bidirectional layer (its sliding window counts |i - j| <= w) "
            "is not expressed here"
        )
    return layer_type


def projection_weights(hf: Any, family: Family) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``W_q, W_k, W_v, W_o``'s weight and bias as the layer holds them (a fused ``qkv_proj`` split by rows)."""
    names = dict(zip(("W_q", "W_k", "W_v", "W_o"), family.projections, strict=True))
    linears: dict[str, Any] = {ours: getattr(hf, theirs, None) for ours, theirs in names.items()}
    if linears["W_k"] is None:
        raise ValueError(
            f"layer {hf.layer_idx} has no {names['W_k']}: it reuses the keys and values of an earlier layer "
            "(Gemma 3n / Gemma 4 kv_sharing_modes 'reuse'): it has no keys of its own to load (a selfattn stack "
            "expresses it with LayerRecipe(shares_kv_with=...); a whole model runs with attn_implementation='selfattn')"
        )
    if linears["W_q"] is not linears["W_k"]:  # Gemma 4's K = V layers have no v_proj
        return {ours: (linear.weight, linear.bias) for ours, linear in linears.items() if linear is not None}
    fused, head_dim = linears["W_q"], int(hf.head_dim)
    query_rows = int(hf.config.num_attention_heads) * head_dim
    kv_rows = (fused.out_features - query_rows) // 2  # (h * dh | hk * dh | hk * dh) rows
    sizes = (query_rows, kv_rows, kv_rows)
    weights = fused.weight.split(sizes)
    biases = (None, None, None) if fused.bias is None else fused.bias.split(sizes)
    split = {ours: (w, b) for ours, w, b in zip(("W_q", "W_k", "W_v"), weights, biases, strict=True)}
    return split | {"W_o": (linears["W_o"].weight, linears["W_o"].bias)}


def _layer_config(hf: Any) -> Any:
    """The layer's own config where sizes vary per layer (Gemma 4, Step-3.7: ``config.per_layer_config[i]``)."""
    per_layer = getattr(hf.config, "per_layer_config", None)
    return hf.config if per_layer is None else per_layer[hf.layer_idx]


def _common_options(hf: Any, config: Any, layer_type: str | None, weights: dict[str, Any]) -> dict[str, Any]:
    """What every family's layer says the same way: sizes, biases, dropout, window, softcap, sinks, scale.

    Head counts come from the projections' rows (per-layer counts included); a family whose
    ``q_proj`` holds more than the queries corrects ``num_heads`` in its ``read`` step.
    """
    head_dim = int(hf.head_dim)
    with_bias = {weights[name][1] is not None for name in ("W_q", "W_k", "W_v") if name in weights}
    if len(with_bias) > 1:
        raise ValueError("the layer has a bias on only some of q_proj, k_proj, v_proj; selfattn has all or none")
    (q_weight, _), (k_weight, _), (o_weight, o_bias) = weights["W_q"], weights["W_k"], weights["W_o"]
    options: dict[str, Any] = {
        "num_heads": q_weight.shape[0] // head_dim,
        "bias": with_bias.pop(),
        "output_bias": o_bias is not None,
        "query_size": q_weight.shape[1],
        "output_size": o_weight.shape[0],
        "num_kv_heads": k_weight.shape[0] // head_dim,
        "dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
        "window": getattr(hf, "sliding_window", None),
        "softcap": getattr(hf, "attn_logit_softcapping", None),
        "sinks": isinstance(getattr(hf, "sinks", None), torch.Tensor),
    }
    options["key_size"] = options["value_size"] = options["query_size"]
    scale = float(hf.scaling)
    options["scale"] = None if math.isclose(scale, head_dim**-0.5, rel_tol=1e-12) else scale
    if layer_type == "chunked_attention":
        options["chunk_size"] = config.attention_chunk_size
    return options


def _norm_parts(hf: Any, family: Family, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The layer's QK-norm as parts ``q_norm`` / ``k_norm`` at the family's slot; returns the weights to copy."""
    weights: dict[str, torch.Tensor] = {}
    if family.qk_norm is None or getattr(hf, family.norm_names[0], None) is None:
        return weights
    slots = {"queries": "keys", "query_features": "key_features", "rotated_queries": "rotated_keys"}
    parts = options.setdefault("parts", {})
    pairs = zip(("q_norm", "k_norm"), family.norm_names, (family.qk_norm, slots[family.qk_norm]), strict=True)
    for name, hf_name, slot in pairs:
        weight, eps = weight_of(getattr(hf, hf_name), hf_name)
        size = int(hf.head_dim) if weight is None else weight.shape[0]
        parts[name] = HeadNorm(size, slot=slot, eps=eps, weighted=weight is not None)
        if weight is not None:
            weights[name] = 1 + weight if family.norm_plus_one else weight
    return weights


def from_transformers(layer: nn.Module, cls: type[Module]) -> Module:
    """The selfattn module equal to a transformers attention layer: same weights, same parts.

    ``mha(x, x, x, causal=True, positions=position_ids)`` then equals the layer called with its
    model's rotary embedding at ``position_ids`` and its causal (sliding, chunked) mask. See
    :meth:`selfattn.MultiHeadAttention.from_transformers` for the layers and what is read.

    Raises:
        ValueError: an unknown layer class, a layer type or option selfattn cannot express, named.
    """
    family = family_of_layer(layer)
    hf: Any = layer  # read by attribute names: projections, norms, sinks, the config
    layer_type = _layer_type(hf, family)
    head_dim = int(hf.head_dim)
    weights = projection_weights(hf, family)
    config = _layer_config(hf)
    options = _common_options(hf, config, layer_type, weights)
    options["position"] = _position(family, config, layer_type, options["num_heads"], head_dim)
    norm_weights = _norm_parts(hf, family, options)
    if family.read is not None:
        family.read(hf, config, options)
    heads = options.pop("num_heads")
    device, dtype = weights["W_o"][0].device, weights["W_o"][0].dtype
    mha: Any = cls(heads * head_dim, heads, device=device, dtype=dtype, **options)
    if mha.position is not None:
        mha.position.to(device)
    with torch.no_grad():
        for name, (weight, bias) in weights.items():
            ours = getattr(mha, name)
            if ours is not None and ours.weight.shape == weight.shape:
                ours.weight.copy_(weight)
                if bias is not None:
                    ours.bias.copy_(bias)
            elif ours is not None and family.copy is None:  # no step of the family copies it: never leave it random
                raise ValueError(
                    f"layer {hf.layer_idx}: {name} is {tuple(ours.weight.shape)} but the layer's is "
                    f"{tuple(weight.shape)}: a size the loader does not read"
                )
        if mha.sinks is not None:
            mha.sinks.copy_(hf.sinks)
        for name, norm_weight in norm_weights.items():
            getattr(mha, name).weight.copy_(norm_weight)
        if family.copy is not None:
            family.copy(hf, mha)
    mha.transformers_model_type = family.model_type  # the way back writes this family first
    return cast(Module, mha.train(hf.training))


# The names of the options each family's entry lists in ``expresses``.
_HALF_SPLIT = "half-split rotary"
_UNIT_NORM = "qk_norm with unit weights"  # what Llama 4 has; a weighted QK-norm with weights 1 too
_QKV_BIAS = "a bias on W_q, W_k, W_v only"
BIAS = "a bias on W_q, W_k, W_v and W_o"
_MROPE_OPTION = "M-RoPE"


def _options(mha: Any) -> set[str]:
    """The recipe options ``mha`` uses, in the names the family table's ``expresses`` lists."""
    if mha.key_size != mha.query_size or mha.value_size != mha.query_size or mha.output_size != mha.query_size:
        raise ValueError(
            "a transformers layer reads, and writes, the hidden size: query_size, key_size, value_size and "
            f"output_size must be equal, got {mha.query_size}, {mha.key_size}, {mha.value_size}, {mha.output_size}"
        )
    used = {name for name in ("window", "scale", "softcap", "chunk_size", "temperature_tuning") if getattr(mha, name)}
    used |= {name for name, part in (("sinks", mha.sinks), ("gated_output", mha.W_g)) if part is not None}
    if mha.q_norm is not None:
        weights = [norm.weight for norm in (mha.q_norm, mha.k_norm) if norm is not None and norm.weight is not None]
        if (mha.q_norm.slot, len(weights), mha.k_norm is None) != ("queries", 2, False):
            used.add(f"qk_norm at {mha.q_norm.slot}" + (", unweighted" if mha.q_norm.weight is None else ""))
        else:
            unit = all(bool((weight == 1).all()) for weight in weights)
            used.add(_UNIT_NORM if unit and mha.position is not None else "qk_norm")
    used |= {f"part {type(part).__name__}" for name, part in mha.named_children() if _unlisted(name, part)}
    used |= {"value_head_dim"} if mha.value_head_dim != mha.head_dim else set()
    used |= {"shared_kv"} if mha.shared_kv else {"values_from_keys"} if mha.W_v is None else set()
    if mha.W_o.bias is not None and mha.W_q.bias is None:
        raise ValueError("a bias on W_o only: no transformers attention layer has it")
    if mha.W_q.bias is not None:
        used.add(_QKV_BIAS if mha.W_o.bias is None else BIAS)
    rotary = mha.position
    if rotary is None:
        used.add("no rotary")
    elif getattr(rotary, "position_axes", 1) == 3:  # M-RoPE
        used.add(_MROPE_OPTION)
    elif (
        isinstance(rotary, RotaryPositionalEncoding) and rotary.p != 1.0 and not rotary.interleaved
        and rotary.rotary_dim == rotary.head_dim
    ):  # fmt: skip
        used.add("proportional rotary")  # transformers' rope_type "proportional": the first pairs of each half
    elif not isinstance(rotary, RotaryPositionalEncoding) or rotary.p != 1.0:
        raise ValueError(f"position={rotary!r}: transformers layers rotate queries and keys (full rotary) or nothing")
    else:
        used.add("interleaved rotary" if rotary.interleaved else _HALF_SPLIT)
        used |= {"partial rotary"} if rotary.rotary_dim != rotary.head_dim else set()
    return used


def _required(family: Family, used: set[str]) -> bool:
    """Whether ``used`` holds one option of each of ``family.requires`` (a layer that always has them)."""
    return all(used & alternatives for alternatives in family.requires)


def _unlisted(name: str, part: nn.Module) -> bool:
    """Whether ``part`` is a part no keyword stands for (the QK-norm is judged apart, above)."""
    if not isinstance(part, Part) or name in ("q_norm", "k_norm"):
        return False
    if isinstance(part, TemperatureTuning) and name == "query_scaling":
        return False
    return not (
        name == "W_g" and isinstance(part, OutputGate) and (part.per, part.activation) == ("feature", "sigmoid")
    )


def rope_parameters_of(rotary: RotaryPositionalEncoding) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of ``rotary``: its scaling and its base."""
    scaling = {} if rotary.scaling_config is None else rotary.scaling_config.as_dict()
    return {"rope_type": "default", **scaling, "rope_theta": rotary.base}


def _trained_length_fields(rotary: RotaryPositionalEncoding) -> dict[str, int]:
    """The top-level fields from which transformers reads a length-dependent scaling's trained length: ``dynamic``
    from ``max_position_embeddings``, Phi-3's ``longrope`` from ``original_max_position_embeddings`` (its default,
    4,096, wins over the dict's): without them a rebuilt model scales otherwise past that length."""
    config = rotary.scaling_config
    if config is None or config.original_max_position_embeddings is None:
        return {}
    name = {"dynamic": "max_position_embeddings", "longrope": "original_max_position_embeddings"}.get(config.rope_type)
    return {} if name is None else {name: config.original_max_position_embeddings}


def to_transformers_config(module: nn.Module) -> dict[str, Any]:
    """Config fields that rebuild ``module`` (a MultiHeadAttention) as one transformers attention layer.

    ``model_type`` names the family the module was loaded from (``module.transformers_model_type``)
    if its layer expresses every option ``module`` uses, else the first family of the table that
    does (a model of one layer); build the config with
    ``transformers.AutoConfig.for_model(**fields)`` and the layer with ``layer_idx=0``. Weights
    are not part of a config: copy them as :func:`from_transformers` reads them (Gemma 3 and
    Qwen3-Next store ``w - 1`` for a QK-norm weight ``w``).

    Raises:
        ValueError: an option no family expresses (a score encoding, p-RoPE, sizes that differ
            from the hidden size), or options no one family has together, named.
    """
    mha: Any = module  # a MultiHeadAttention
    used = _options(mha)
    loaded = [f for f in FAMILIES if f.model_type == getattr(mha, "transformers_model_type", None)]
    family = next((f for f in (*loaded, *FAMILIES) if f.expresses and used <= f.expresses and _required(f, used)), None)
    if family is None or ("temperature_tuning" in used and mha.position is not None):
        raise ValueError(f"no transformers attention layer has all of {sorted(used)}")
    rotary = mha.position if isinstance(mha.position, RotaryPositionalEncoding) else None
    fields: dict[str, Any] = {
        "model_type": family.model_type,
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
        fields.update(_trained_length_fields(rotary))
    if mha.q_norm is not None:
        fields["rms_norm_eps"] = mha.q_norm.eps
    if family.model_type != "llama":
        fields["layer_types"] = ["sliding_attention" if mha.window is not None else "full_attention"]
    if mha.window is not None:
        fields["sliding_window"] = mha.window
    if family.write is not None:
        family.write(mha, fields)
    return fields
