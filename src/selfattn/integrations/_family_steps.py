"""The steps of the family table (:mod:`selfattn.integrations.families`) that data cannot say.

``read_*(hf, config, options)`` adds or changes the module's options for a family's layer;
``copy_*(hf, mha)`` copies weights the common copy does not know; ``write_*(mha, fields)`` adds the
config fields that rebuild the module as the family's layer. None imports transformers.

Shape legend: h heads, dh head size, d hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.parts import HeadNorm, LogFloorScaling, OutputGate, ValueScale

__all__ = [
    "integer_field",
    "read_llama4",
    "read_log_floor_scaling",
    "read_no_softcap",
    "read_query_gate",
    "copy_query_gate",
    "write_gemma",
    "write_llama4",
    "write_qwen2_vl",
    "write_qwen3",
    "write_exaone4",
    "write_glm4_moe",
    "write_lfm2",
    "write_minimax_m2",
    "write_ministral3",
    "write_model_window",
    "write_qwen2",
    "write_seed_oss",
    "write_smollm3",
    "read_gemma3n",
    "read_gemma4",
    "read_mimo_v2_flash",
    "read_step3p7",
    "read_laguna",
    "read_afmoe",
    "read_muse",
    "copy_gate",
    "require_loaded_sizes",
    "write_afmoe",
    "write_muse_glimmer",
    "write_mimo_v2_flash",
]


def integer_field(name: str, value: float) -> int:
    """``value`` as the int a transformers config field requires, if it is one up to rounding."""
    nearest = round(value)
    if nearest < 1 or abs(value - nearest) > 1e-9 * nearest:
        raise ValueError(f"{name}={value!r}: transformers' config takes a positive integer there")
    return nearest


# ---------------------------------------------------------------- reading a layer


def read_llama4(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Llama 4: NoPE layers (temperature tuning, no rotary) and the L2 QK-norm of rotary layers (unit weights)."""
    if getattr(hf, "qk_norm", None) is not None:
        options.update(qk_norm=True, qk_norm_eps=float(hf.qk_norm.eps))
    if not hf.use_rope:
        options["position"] = None
        if config.attn_temperature_tuning:
            options["temperature_tuning"] = (float(config.attn_scale), float(config.floor_scale))


def read_no_softcap(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Gemma 3 keeps ``attn_logit_softcapping`` on the layer but never applies it: no softcap."""
    options["softcap"] = None


def read_query_gate(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Qwen3-Next / Qwen3.5: ``q_proj`` emits each head's query and its gate side by side: a gate per feature."""
    options["gated_output"] = True
    options["num_heads"] //= 2  # q_proj's rows: (h, query | gate, dh)


def copy_query_gate(hf: Any, mha: Any) -> None:
    """Split ``q_proj``'s rows ``(h, query | gate, dh)`` into ``W_q`` and the gate ``W_g``."""
    heads, head_dim = mha.num_heads, mha.head_dim
    halves = hf.q_proj.weight.view(heads, 2, head_dim, -1)  # (h, query | gate, dh, d)
    mha.W_q.weight.copy_(halves[:, 0].flatten(0, 1))
    mha.W_g.weight.copy_(halves[:, 1].flatten(0, 1))
    if hf.q_proj.bias is not None:
        bias_halves = hf.q_proj.bias.view(heads, 2, head_dim)
        mha.W_q.bias.copy_(bias_halves[:, 0].flatten())
        mha.W_g.bias.copy_(bias_halves[:, 1].flatten())


def read_log_floor_scaling(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Mistral 3 / Ministral 3: ``rope_parameters["llama_4_scaling_beta"]`` scales each query by position."""
    parameters = getattr(config, "rope_parameters", None) or {}
    beta = parameters.get("llama_4_scaling_beta")
    if beta is not None:
        scaling = LogFloorScaling(float(beta), float(parameters["original_max_position_embeddings"]))
        options.setdefault("parts", {})["query_scaling"] = scaling


def read_model_window(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Mistral, Phi-3: one sliding window for every layer, read from the config (the layer passes it on)."""
    options["window"] = getattr(config, "sliding_window", None)


def read_exaone4(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """EXAONE 4: the window acts on sliding layers only; with a window set, the full layers are NoPE."""
    options["window"] = hf.sliding_window if hf.is_sliding else None
    if hf.sliding_window is not None and not hf.is_sliding:
        options["position"] = None


def read_no_rope_layers(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """SmolLM3: ``no_rope_layers[i] == 0`` makes layer ``i`` NoPE (the layer's ``use_rope``)."""
    if not getattr(hf, "use_rope", True):
        options["position"] = None


def read_ministral3(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Ministral 3: one window for every layer and Mistral's query scaling by position."""
    read_model_window(hf, config, options)
    read_log_floor_scaling(hf, config, options)


# ---------------------------------------------------------------- the way back


def write_qwen3(mha: Any, fields: dict[str, Any]) -> None:
    if mha.window is not None:
        fields.update(use_sliding_window=True, max_window_layers=0)


def write_gemma(mha: Any, fields: dict[str, Any]) -> None:
    """Gemma 2 and 3: the scale as ``query_pre_attn_scalar``, the softcap; Gemma 3 keeps a rotary per layer type."""
    scale = mha.head_dim**-0.5 if mha.scale is None else mha.scale
    fields.update(
        query_pre_attn_scalar=integer_field("scale ** -2 (query_pre_attn_scalar)", scale**-2),
        attn_logit_softcapping=mha.softcap,
    )
    if fields["model_type"] == "gemma3_text" and "rope_parameters" in fields:
        both = fields["rope_parameters"]
        fields["rope_parameters"] = {"sliding_attention": both, "full_attention": dict(both)}


def write_qwen2_vl(mha: Any, fields: dict[str, Any]) -> None:
    """M-RoPE is Qwen2-VL's, whose layer has a bias on ``W_q, W_k, W_v`` only and heads adding up to ``d``."""
    if mha.W_o.bias is not None or mha.W_q.bias is None or mha.num_hiddens != mha.query_size:
        raise ValueError(
            "M-RoPE is Qwen2-VL's, whose layer has a bias on W_q, W_k, W_v only and heads that add up to the "
            f"hidden size; got output_bias={mha.W_o.bias is not None}, bias={mha.W_q.bias is not None}, "
            f"num_hiddens={mha.num_hiddens}, query_size={mha.query_size}"
        )
    mrope = mha.position
    fields["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": list(mrope.sections),
        "rope_theta": mrope.base,
    }
    del fields["head_dim"], fields["attention_bias"]  # hidden_size / heads; q, k, v biased, o not


def write_llama4(mha: Any, fields: dict[str, Any]) -> None:
    if mha.temperature_tuning is not None and mha.position is not None:
        raise ValueError("Llama 4 tunes the temperature of its NoPE layers only: temperature_tuning with a rotary")
    tuning = mha.temperature_tuning
    fields.update(
        layer_types=["chunked_attention" if mha.chunk_size is not None else "full_attention"],
        attention_chunk_size=mha.chunk_size,
        no_rope_layers=[int(mha.position is not None)],
        use_qk_norm=mha.q_norm is not None,
        attn_temperature_tuning=tuning is not None,
    )
    if tuning is not None:
        fields.update(attn_scale=tuning[0], floor_scale=integer_field("temperature_tuning[1] (floor_scale)", tuning[1]))


def weight_of(norm: Any, name: str) -> tuple[torch.Tensor | None, float]:
    """A transformers norm's weight (None when it has none) and epsilon."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float):
        raise ValueError(f"{name} {type(norm).__name__} has no epsilon to read")
    return (weight if isinstance(weight, torch.Tensor) else None), eps


def write_model_window(mha: Any, fields: dict[str, Any]) -> None:
    """Mistral, Phi-3: one window for the model, no ``layer_types``; Phi-3 has no bias field nor ``head_dim``."""
    fields.pop("layer_types", None)
    fields["sliding_window"] = mha.window
    if fields["model_type"] == "phi3":
        if mha.head_dim * mha.num_heads != mha.query_size:
            raise ValueError(
                f"Phi-3's heads add up to the hidden size: num_hiddens={mha.num_hiddens}, query_size={mha.query_size}"
            )
        fields.pop("attention_bias"), fields.pop("head_dim")


def write_qwen2(mha: Any, fields: dict[str, Any]) -> None:
    """Qwen2: a bias on ``q, k, v`` always (no field); the window through ``use_sliding_window``."""
    del fields["attention_bias"]
    write_qwen3(mha, fields)


def write_seed_oss(mha: Any, fields: dict[str, Any]) -> None:
    fields["attention_out_bias"] = mha.W_o.bias is not None


def write_glm4_moe(mha: Any, fields: dict[str, Any]) -> None:
    """GLM-4.5: ``W_o`` has no bias; the QK-norm is optional (``use_qk_norm``)."""
    fields["use_qk_norm"] = mha.q_norm is not None
    fields.setdefault("partial_rotary_factor", 1.0)


def write_exaone4(mha: Any, fields: dict[str, Any]) -> None:
    """EXAONE 4: a full layer of a model with a window set is NoPE; one without a window rotates."""
    if mha.position is None:
        if mha.window is not None:
            raise ValueError("EXAONE 4 rotates its sliding layers: a windowed layer without a rotary")
        fields.update(sliding_window=4096, layer_types=["full_attention"])  # any window: full layers are NoPE
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})


def write_smollm3(mha: Any, fields: dict[str, Any]) -> None:
    """SmolLM3: ``no_rope_layers`` marks NoPE layers; the window needs ``use_sliding_window``."""
    fields["no_rope_layers"] = [int(mha.position is not None)]
    fields["use_sliding_window"] = mha.window is not None
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})


def write_lfm2(mha: Any, fields: dict[str, Any]) -> None:
    """LFM2: the norm's epsilon is ``norm_eps``; one attention layer."""
    fields["norm_eps"] = fields.pop("rms_norm_eps")
    fields["layer_types"] = ["full_attention"]
    del fields["attention_bias"]


def write_minimax_m2(mha: Any, fields: dict[str, Any]) -> None:
    """MiniMax-M2: the rotated size as ``rotary_dim``."""
    rotary = mha.position
    fields["rotary_dim"] = rotary.rotary_dim
    fields.pop("partial_rotary_factor", None)
    del fields["attention_bias"]


def write_ministral3(mha: Any, fields: dict[str, Any]) -> None:
    """Ministral 3: the query scaling's ``beta`` and ``L0`` live in ``rope_parameters``."""
    scaling = mha.query_scaling
    parameters = dict(fields.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    original = parameters.get("original_max_position_embeddings")
    if original is not None and original != scaling.original_length:
        raise ValueError(
            f"Ministral 3 keeps one original_max_position_embeddings: the rotary's {original} and the query "
            f"scaling's {scaling.original_length} differ"
        )
    parameters.update(
        llama_4_scaling_beta=scaling.beta,
        original_max_position_embeddings=integer_field("original_length", scaling.original_length),
    )
    fields["rope_parameters"] = parameters
    write_model_window(mha, fields)


# ---------------------------------------------------------------- families whose sizes, values or gates differ


def require_loaded_sizes(hf: Any, mha: Any) -> None:
    """Every projection of the layer has the shape of the module's: a per-layer head count or head size the
    loader did not read (Step-3.7's sliding layers, Laguna) is refused, not loaded as a layer of other sizes."""
    pairs = (
        ("W_q", "q_proj"), ("W_k", "k_proj"), ("W_v", "v_proj"), ("W_o", "o_proj"), ("W_g", "g_proj"),
        ("W_g", "gate_proj"),
    )  # fmt: skip
    for name, hf_name in pairs:
        ours, theirs = getattr(mha, name, None), getattr(hf, hf_name, None)
        if ours is not None and theirs is not None and ours.weight.shape != theirs.weight.shape:
            raise ValueError(
                f"layer {hf.layer_idx}: {hf_name} is {tuple(theirs.weight.shape)} but the loader built {name} "
                f"{tuple(ours.weight.shape)} ({mha.num_heads} heads of {mha.head_dim}): a per-layer head count "
                "or size the loader does not read"
            )


def _layer_kv_heads(hf: Any, options: dict[str, Any]) -> None:
    """The layer's own key/value heads (Gemma 4's full layers, MiMo-V2-Flash's sliding ones), from ``k_proj``."""
    options["num_kv_heads"] = hf.k_proj.out_features // int(hf.head_dim)


def _value_norm(hf: Any, options: dict[str, Any]) -> None:
    """Gemma 3n / Gemma 4: ``v_norm``, an RMSNorm of each value head without a weight."""
    weight, eps = weight_of(hf.v_norm, "v_norm")
    if weight is not None:
        raise ValueError("v_norm has a weight: Gemma's value norm has none (with_scale=False)")
    options.setdefault("parts", {})["v_norm"] = HeadNorm(int(hf.head_dim), slot="values", eps=eps, weighted=False)


def _output_gate(hf: Any, options: dict[str, Any], per: str, activation: str) -> None:
    """A gate ``W_g`` from the layer's ``g_proj`` (Step-3.7, Laguna) or ``gate_proj`` (AFMoE, Muse)."""
    source = hf.g_proj if hasattr(hf, "g_proj") else hf.gate_proj
    heads, head_dim = hf.o_proj.in_features // int(hf.head_dim), int(hf.head_dim)
    gate = OutputGate(
        source.in_features, heads, head_dim, per=per, activation=activation, bias=source.bias is not None
    )  # fmt: skip
    if gate.out_features != source.out_features:
        raise ValueError(f"the gate has {source.out_features} outputs: neither per head ({heads}) nor per feature")
    options.setdefault("parts", {})["W_g"] = gate


def _gate_per(hf: Any) -> str:
    return "head" if getattr(hf, "gate_per_head", False) else "feature"


def read_gemma3n(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Gemma 3n: scale 1 and a weighted QK-norm (common reading), the value norm."""
    _value_norm(hf, options)


def read_gemma4(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Gemma 4: as Gemma 3n, with the layer's own key/value heads and, on full layers, values from ``k_proj``."""
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError(
            f"use_bidirectional_attention={config.use_bidirectional_attention!r}: a bidirectional Gemma 4 layer "
            "is not expressed here"
        )
    _layer_kv_heads(hf, options)
    options["values_from_keys"] = hf.v_proj is None
    _value_norm(hf, options)


def read_mimo_v2_flash(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """MiMo-V2-Flash: value heads of their own size, scaled values, the sliding layers' own key/value heads."""
    _layer_kv_heads(hf, options)
    options["value_head_dim"] = int(hf.v_head_dim)
    if float(hf.v_scale) != 1.0:
        options.setdefault("parts", {})["v_scale"] = ValueScale(float(hf.v_scale))


def read_step3p7(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Step-3.7: a sigmoid gate per head from ``g_proj``."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True: a bidirectional Step-3.7 layer is not expressed here")
    if not hf.gate_per_head:
        # transformers 5.24 multiplies (b, l, h, dh) by the gate (b, l, h * dh, 1): its forward fails
        raise ValueError(
            f"gating={config.gating!r}: Step-3.7's gate per feature does not run in transformers (its forward "
            "broadcasts the gate per head); only gating='per-head' / True loads"
        )
    _output_gate(hf, options, "head", "sigmoid")


def read_laguna(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Laguna: its per-layer head count, a softplus gate per head (or per feature) from ``g_proj``."""
    _output_gate(hf, options, _gate_per(hf), "softplus")


def read_afmoe(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """AFMoE: a sigmoid gate per feature from ``gate_proj``; only sliding layers rotate (full layers are NoPE)."""
    _output_gate(hf, options, "feature", "sigmoid")
    if not hf.is_local_attention:
        options["position"] = None


def read_muse(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Muse Glimmer / Spark: ``q *= qk_scale_factor`` as the scale, a sigmoid gate per feature, NoPE layers
    (``layer_rope_theta[i] == 0``) and Spark's output norm per head, without a weight."""
    options["scale"] = float(hf.scaling) * float(hf.qk_scale_factor)
    _output_gate(hf, options, "feature", "sigmoid")
    if not config.layer_rope_theta[hf.layer_idx]:
        options["position"] = None
    if getattr(hf, "o_norm", None) is not None:
        weight, eps = weight_of(hf.o_norm, "o_norm")
        if weight is not None:
            raise ValueError("o_norm has a weight: Muse Spark's output norm has none (with_scale=False)")
        options.setdefault("parts", {})["o_norm"] = HeadNorm(
            int(hf.head_dim), slot="output_heads", eps=eps, weighted=False
        )  # fmt: skip


def copy_gate(hf: Any, mha: Any) -> None:
    """The gate's weights: ``g_proj`` or ``gate_proj`` into ``W_g`` (after checking every size was read)."""
    require_loaded_sizes(hf, mha)
    source = hf.g_proj if hasattr(hf, "g_proj") else hf.gate_proj
    mha.W_g.weight.copy_(source.weight)
    if source.bias is not None:
        mha.W_g.bias.copy_(source.bias)


def _require_gate_without_bias(mha: Any, family: str) -> None:
    if mha.W_g is None or mha.W_g.bias is not None:
        raise ValueError(
            f"{family}'s layer gates its output per feature with gate_proj, which has no bias: got "
            f"{'no gate' if mha.W_g is None else 'a gate with a bias'}"
        )


def write_afmoe(mha: Any, fields: dict[str, Any]) -> None:
    """AFMoE: a weighted QK-norm, a gate without bias, and a rotary exactly on sliding layers."""
    _require_gate_without_bias(mha, "AFMoE")
    if mha.q_norm is None or mha.k_norm is None or mha.q_norm.eps != mha.k_norm.eps:
        raise ValueError("AFMoE's layer has a QK-norm with one epsilon for queries and keys")
    if (mha.window is None) != (mha.position is None):
        raise ValueError(
            f"AFMoE rotates its sliding layers and no others: window={mha.window} with "
            f"position={type(mha.position).__name__ if mha.position is not None else None}"
        )


def write_muse_glimmer(mha: Any, fields: dict[str, Any]) -> None:
    """Muse Glimmer: one unweighted norm of queries and keys, the query multiplier, the gate, NoPE layers."""
    _require_gate_without_bias(mha, "Muse Glimmer")
    norms = (mha.q_norm, mha.k_norm)
    if any(n is None or n.weight is not None for n in norms) or mha.q_norm.eps != mha.k_norm.eps:
        raise ValueError("Muse Glimmer's layer has one unweighted norm of the query and key heads")
    scale = mha.head_dim**-0.5 if mha.scale is None else mha.scale
    rotary = fields.get("rope_parameters", {})
    fields.update(qk_scale_factor=scale / mha.head_dim**-0.5, layer_rope_theta=[rotary.get("rope_theta", 0)])


def write_mimo_v2_flash(mha: Any, fields: dict[str, Any]) -> None:
    """MiMo-V2-Flash: the value head size and scale; sliding layers have sinks and twice the key/value heads;
    a rotary per layer type, its partial factor inside."""
    if (mha.window is None) != (mha.sinks is None) or mha.position is None:
        raise ValueError(
            "MiMo-V2-Flash's sliding layers have sinks and its full layers none, and every layer rotates: got "
            f"window={mha.window}, sinks={mha.sinks is not None}, position={mha.position is not None}"
        )
    if mha.window is not None:
        if mha.num_kv_heads % 2:
            raise ValueError(f"MiMo-V2-Flash's sliding layers have twice its key/value heads, got {mha.num_kv_heads}")
        fields["num_key_value_heads"] = mha.num_kv_heads // 2
    scales = [part.factor for part in mha.parts("values") if isinstance(part, ValueScale)]
    parameters = dict(fields.pop("rope_parameters"), partial_rotary_factor=fields.pop("partial_rotary_factor", 1.0))
    fields.update(
        v_head_dim=mha.value_head_dim,
        attention_value_scale=scales[0] if len(scales) == 1 else 1.0,
        rope_parameters={"sliding_attention": parameters, "full_attention": dict(parameters)},
    )
