"""The steps of the family table (:mod:`selfattn.integrations.families`) that data cannot say.

``read_*(hf, config, options)`` adds or changes the module's options for a family's layer;
``copy_*(hf, mha)`` copies weights the common copy does not know; ``write_*(mha, fields)`` adds the
config fields that rebuild the module as the family's layer. None imports transformers.

Shape legend: h heads, dh head size, d hidden size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from selfattn.parts import LogFloorScaling

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
    "write_cohere2",
    "write_exaone4",
    "write_glm4_moe",
    "write_lfm2",
    "write_minimax_m2",
    "write_ministral3",
    "write_model_window",
    "write_qwen2",
    "write_seed_oss",
    "write_smollm3",
    # rotary variants
    "copy_head_gate",
    "proportional_rope_parameters",
    "read_head_gate",
    "read_mrope",
    "read_ntk_alpha",
    "read_qwen3_5",
    "read_rotary_on_sliding_layers",
    "write_ernie4_5",
    "write_glm4",
    "write_hunyuan",
    "write_lfm3",
    "write_qwen3_5",
    "write_qwen3_vl",
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
    if (mrope.layout, mrope.rotary_dim) != ("sectioned", mrope.head_dim):
        raise ValueError(
            f"Qwen2-VL's M-RoPE has contiguous sections over the whole head; got layout={mrope.layout!r}, "
            f"rotary_dim={mrope.rotary_dim} of head_dim={mrope.head_dim}"
        )
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


# ---------------------------------------------------------------- rotary variants (interleaved M-RoPE, ...)


def read_mrope(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Qwen3-VL / Qwen3.5: the config's M-RoPE in its own layout (interleaved) and rotated size (partial)."""
    from selfattn.positional.mrope import MultimodalRotaryPositionalEncoding

    mrope = MultimodalRotaryPositionalEncoding.from_config(config)
    if mrope.head_dim != int(hf.head_dim):
        raise ValueError(f"config head_dim={mrope.head_dim} but the layer's head_dim={hf.head_dim}")
    options["position"] = mrope


def _write_interleaved_mrope(mha: Any, fields: dict[str, Any], *, partial: bool) -> None:
    mrope = mha.position
    if mrope.layout != "interleaved" or (not partial and mrope.rotary_dim != mrope.head_dim):
        raise ValueError(
            f"{fields['model_type']}'s M-RoPE is interleaved{'' if partial else ' over the whole head'}; got "
            f"layout={mrope.layout!r}, rotary_dim={mrope.rotary_dim} of head_dim={mrope.head_dim}"
        )
    fields["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": list(mrope.sections),
        "mrope_interleaved": True,
        "rope_theta": mrope.base,
        "partial_rotary_factor": mrope.rotary_dim / mrope.head_dim,
    }


def read_qwen3_5(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Qwen3.5 / Qwen3.5-MoE: Qwen3-Next's layer (query gate) with interleaved M-RoPE."""
    read_query_gate(hf, config, options)
    read_mrope(hf, config, options)


def write_qwen3_vl(mha: Any, fields: dict[str, Any]) -> None:
    """Qwen3-VL's text layer: interleaved M-RoPE over the whole head."""
    _write_interleaved_mrope(mha, fields, partial=False)
    del fields["rope_parameters"]["partial_rotary_factor"]


def write_qwen3_5(mha: Any, fields: dict[str, Any]) -> None:
    """Qwen3.5's attention layer: interleaved M-RoPE on the leading ``partial_rotary_factor`` of each head."""
    _write_interleaved_mrope(mha, fields, partial=True)


def _config_rotary(config: Any, head_dim: int, parameters: Any) -> Any:
    """:meth:`RotaryPositionalEncoding.from_config` of ``config`` with ``parameters`` as its ``rope_parameters``."""
    from selfattn.positional.rotary import RotaryPositionalEncoding

    fields = {
        name: getattr(config, name, None)
        for name in ("max_position_embeddings", "original_max_position_embeddings", "partial_rotary_factor")
    }
    return RotaryPositionalEncoding.from_config({**fields, "head_dim": head_dim, "rope_parameters": parameters})


def read_ntk_alpha(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Hunyuan V1: ``rope_type="dynamic"`` with ``alpha`` is static NTK, ``base * alpha^(dh / (dh - 2))``.

    transformers' Hunyuan rotary turns that pair into its own ``ntk_alpha`` (over the whole head,
    ``factor`` unread): selfattn's ``ntk`` scaling with factor ``alpha``. Without ``alpha`` the
    rotary is the common reading of ``rope_parameters``.
    """
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    alpha = parameters.get("alpha")
    if parameters.get("rope_type") == "dynamic" and alpha:
        head_dim = int(hf.head_dim)
        rotary = _config_rotary(
            config, head_dim, {"rope_type": "ntk", "factor": alpha, "rope_theta": parameters["rope_theta"]}
        )
        if rotary.rotary_dim != head_dim:
            raise ValueError(
                f"partial_rotary_factor={config.partial_rotary_factor!r} with alpha: Hunyuan's ntk_alpha rotary "
                "spans the whole head"
            )
    else:
        rotary = _config_rotary(config, int(hf.head_dim), parameters or None)
    options["position"] = rotary


def write_hunyuan(mha: Any, fields: dict[str, Any]) -> None:
    """Hunyuan V1: static NTK as ``dynamic`` with ``alpha``; its QK-norm acts after the rotation, weighted."""
    if mha.q_norm is None or mha.q_norm.weight is None or (mha.W_o.bias is None and mha.W_q.bias is not None):
        raise ValueError("Hunyuan's layer has a weighted QK-norm after the rotation, and biases on all four or none")
    rotary = mha.position
    parameters = fields["rope_parameters"]
    if parameters.get("rope_type") == "ntk":
        if rotary.rotary_dim != rotary.head_dim:
            raise ValueError("Hunyuan's ntk_alpha rotary spans the whole head: partial rotary with ntk scaling")
        fields["rope_parameters"] = {
            "rope_type": "dynamic",
            "alpha": parameters["factor"],
            "factor": 1.0,
            "rope_theta": parameters["rope_theta"],
        }
    del fields["layer_types"]


def read_rotary_on_sliding_layers(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """Cohere 2: only the sliding-window layers rotate; the full layers have no position encoding (NoPE)."""
    if hf.sliding_window is None:
        options["position"] = None


def write_glm4(mha: Any, fields: dict[str, Any]) -> None:
    """GLM-4: a bias on ``W_q, W_k, W_v`` (``attention_bias``) or none, never on ``W_o``."""
    if mha.W_o.bias is not None:
        raise ValueError("GLM-4's layer has no bias on W_o (o_proj); got output_bias=True")
    del fields["layer_types"]


def read_head_gate(hf: Any, config: Any, options: dict[str, Any]) -> None:
    """LFM3: ``g_proj`` (d -> h, no bias), a sigmoid gate per head on the attention output: part ``W_g``."""
    from selfattn.parts import OutputGate

    if getattr(hf, "g_proj", None) is None:
        return
    heads = int(hf.q_proj.out_features) // int(hf.head_dim)
    if hf.g_proj.out_features != heads:
        raise ValueError(f"g_proj has {hf.g_proj.out_features} outputs; a gate per head has num_heads={heads}")
    gate = OutputGate(hf.g_proj.in_features, heads, int(hf.head_dim), per="head", bias=hf.g_proj.bias is not None)
    options.setdefault("parts", {})["W_g"] = gate


def copy_head_gate(hf: Any, mha: Any) -> None:
    if getattr(hf, "g_proj", None) is not None:
        mha.W_g.weight.copy_(hf.g_proj.weight)
        if hf.g_proj.bias is not None:
            mha.W_g.bias.copy_(hf.g_proj.bias)


def proportional_rope_parameters(rotary: Any) -> dict[str, Any]:
    """transformers' ``rope_type="proportional"`` parameters of a half-split p-RoPE over the whole head.

    The inverse of :meth:`RotaryPositionalEncoding.from_config`'s reading: ``partial_rotary_factor``
    is chosen so transformers' ``int(partial_rotary_factor * dh // 2)`` gives back the rotated pairs.
    """
    config = rotary.scaling_config
    if rotary.interleaved or rotary.rotary_dim != rotary.head_dim or (config and config.rope_type != "linear"):
        raise ValueError(
            "rope_type 'proportional' is half-split p-RoPE over the whole head with at most a linear factor; got "
            f"{rotary!r}"
        )
    half = rotary.head_dim // 2
    partial = rotary.rotated_pairs / half
    if int(partial * rotary.head_dim // 2) != rotary.rotated_pairs:  # the product rounded below the integer
        partial = math.nextafter(partial, 1.0)
    return {
        "rope_type": "proportional",
        "rope_theta": rotary.base,
        "partial_rotary_factor": partial,
        "factor": 1.0 if config is None else config.factor,
    }


def write_lfm3(mha: Any, fields: dict[str, Any]) -> None:
    """LFM3: a sigmoid gate per head (``use_attention_gate``), a rotary per layer type (p-RoPE as proportional)."""
    gate = mha.W_g
    if gate is None or (gate.per, gate.activation, gate.bias is None) != ("head", "sigmoid", True):
        raise ValueError(f"LFM3's layer has a sigmoid gate per head without bias (g_proj); got W_g={gate!r}")
    rotary = mha.position
    parameters = fields["rope_parameters"] if rotary.p == 1.0 else proportional_rope_parameters(rotary)
    layer_type = fields["layer_types"][0]
    other = "full_attention" if layer_type == "sliding_attention" else "sliding_attention"
    fields.update(
        use_attention_gate=True,
        rope_parameters={layer_type: parameters, other: {"rope_type": "default", "rope_theta": rotary.base}},
    )
    fields.pop("partial_rotary_factor", None)


def write_ernie4_5(mha: Any, fields: dict[str, Any]) -> None:
    """ERNIE 4.5: one ``use_bias`` for all four projections (``attention_bias`` is not its field)."""
    if (mha.W_q.bias is None) != (mha.W_o.bias is None):
        raise ValueError("ERNIE 4.5's layer has a bias on all four projections or none (use_bias)")
    fields["use_bias"] = fields.pop("attention_bias")
    del fields["layer_types"]


def write_cohere2(mha: Any, fields: dict[str, Any]) -> None:
    """Cohere 2: its sliding layers rotate (interleaved), its full layers are NoPE; nothing else."""
    if (mha.position is None) != (mha.window is None):
        raise ValueError(
            "Cohere 2 rotates exactly its sliding layers: a window needs the rotary and a full layer has none, got "
            f"window={mha.window}, position={type(mha.position).__name__ if mha.position is not None else None}"
        )
    if mha.position is None:
        fields.update(sliding_window=4096, layer_types=["full_attention"])  # any window: the full layer is NoPE
        fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
