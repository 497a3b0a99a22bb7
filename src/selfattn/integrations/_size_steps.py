"""The steps of the family table for the families whose sizes, values or gates differ.

Gemma 3n and Gemma 4 (a value norm without weight, keys equal to values), MiMo-V2-Flash (a value head
size of its own, scaled values), Step-3.7 and Laguna (a gate per head), AFMoE and Muse (a gate per
feature from ``gate_proj``, NoPE layers, Muse's query multiplier and Spark's output norm). The same
kinds of step as :mod:`selfattn.integrations._family_steps`: ``read_*(hf, config, options)``,
``copy_*(hf, mha)``, ``write_*(mha, fields)``. None imports transformers.

Shape legend: h heads, dh head size, d hidden size.
"""

from __future__ import annotations

from typing import Any

from selfattn.integrations._family_steps import proportional_rope_parameters, weight_of
from selfattn.parts import HeadNorm, OutputGate, ValueScale

__all__ = [
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
    "write_laguna",
    "write_step3p7",
    "write_muse_spark",
    "write_gemma3n",
    "write_gemma4",
]


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


# ---------------------------------------------------------------- the way back: gates per head, output norm


def _require_gate(mha: Any, family: str, pers: tuple[str, ...], activation: str) -> None:
    """The layer's ``g_proj``: a gate without bias, ``per`` one of ``pers``, of ``activation``."""
    gate = mha.W_g
    if (
        not isinstance(gate, OutputGate)
        or gate.bias is not None
        or gate.per not in pers
        or gate.activation != activation
    ):
        raise ValueError(
            f"{family}'s layer gates its output with g_proj, a {activation} gate per {' or per '.join(pers)} without "
            f"bias; got W_g={gate!r}"
        )


def _require_weighted_qk_norm(mha: Any, family: str) -> None:
    norms = (mha.q_norm, mha.k_norm)
    if any(n is None or n.weight is None or n.slot not in ("queries", "keys") for n in norms) or (
        mha.q_norm.eps != mha.k_norm.eps
    ):
        raise ValueError(f"{family}'s layer has a weighted QK-norm per head, before the rotation, with one epsilon")


def _require_one_more_norm(mha: Any, family: str, name: str, slot: str) -> None:
    """Besides the QK-norm, the module has exactly one head norm: ``name`` at ``slot``, unweighted, with the
    QK-norm's epsilon (Gemma's ``v_norm``, Muse Spark's ``o_norm``: one ``rms_norm_eps``, ``with_scale=False``)."""
    norms = {
        child: part for child, part in mha.named_children()
        if isinstance(part, HeadNorm) and child not in ("q_norm", "k_norm")
    }  # fmt: skip
    norm = norms.get(name)
    if norm is None or len(norms) != 1 or norm.weight is not None or (norm.slot, norm.eps) != (slot, mha.q_norm.eps):
        raise ValueError(
            f"{family}'s layer has one more norm, {name}: unweighted, at {slot}, with the QK-norm's epsilon; got "
            f"{', '.join(f'{child} at {part.slot}: {part.describe()}' for child, part in norms.items()) or 'none'}"
        )


def _rotary_per_layer_type(fields: dict[str, Any]) -> None:
    """``rope_parameters`` keyed by layer type, the partial factor inside (Laguna, Step-3.7): the layer's own
    type gets the module's rotary, the other type the same (a one-layer model never reads it)."""
    parameters = dict(fields.pop("rope_parameters"), partial_rotary_factor=fields.pop("partial_rotary_factor", 1.0))
    fields["rope_parameters"] = {"sliding_attention": parameters, "full_attention": dict(parameters)}


def write_laguna(mha: Any, fields: dict[str, Any]) -> None:
    """Laguna: its head count as ``num_attention_heads_per_layer``, a softplus gate per head (``gating=True``) or
    per feature (``gating=False``), a weighted QK-norm, biases on all four projections or none, a rotary per type."""
    _require_gate(mha, "Laguna", ("head", "feature"), "softplus")
    _require_weighted_qk_norm(mha, "Laguna")
    if (mha.W_q.bias is None) != (mha.W_o.bias is None):
        raise ValueError("Laguna's layer has a bias on all four projections or none (attention_bias)")
    _rotary_per_layer_type(fields)
    fields.update(
        num_attention_heads_per_layer=[mha.num_heads], gating=mha.W_g.per == "head", mlp_layer_types=["dense"]
    )


def write_step3p7(mha: Any, fields: dict[str, Any]) -> None:
    """Step-3.7: a sigmoid gate per head (its gate per feature does not run in transformers), the scale as
    ``query_pre_attn_scalar``, a ``(1 + w)`` QK-norm, biases on all four or none; a sliding layer's heads are
    ``num_sliding_attention_heads``."""
    _require_gate(mha, "Step-3.7", ("head",), "sigmoid")
    _require_weighted_qk_norm(mha, "Step-3.7")
    if (mha.W_q.bias is None) != (mha.W_o.bias is None):
        raise ValueError("Step-3.7's layer has a bias on all four projections or none (attention_bias)")
    scale = mha.head_dim**-0.5 if mha.scale is None else mha.scale
    _rotary_per_layer_type(fields)
    fields.update(
        query_pre_attn_scalar=scale**-2, gating="per-head", mlp_layer_types=["dense"],
        num_sliding_attention_heads=mha.num_heads,
    )  # fmt: skip


def write_muse_spark(mha: Any, fields: dict[str, Any]) -> None:
    """Muse Spark: Muse Glimmer's layer with an unweighted output norm per head (``o_norm``, the norms' epsilon)."""
    write_muse_glimmer(mha, fields)  # first: it checks the QK-norm the output norm is compared with
    _require_one_more_norm(mha, "Muse Spark", "o_norm", "output_heads")
    if mha.query_size % mha.num_heads:
        raise ValueError(f"Muse Spark's config needs hidden_size={mha.query_size} divisible by {mha.num_heads} heads")
    fields["mlp_layer_types"] = ["dense"]


# ---------------------------------------------------------------- the way back: Gemma 3n and Gemma 4


def _require_gemma_values(mha: Any, family: str) -> None:
    """Gemma 3n / Gemma 4: scale exactly 1, a weighted QK-norm, an unweighted value norm with its epsilon,
    biases on all four projections or none."""
    if mha.scale != 1.0:
        raise ValueError(f"{family}'s layer has scale 1.0 (scaling = 1.0); got scale={mha.scale}")
    _require_weighted_qk_norm(mha, family)
    _require_one_more_norm(mha, family, "v_norm", "values")
    if (mha.W_q.bias is None) != (mha.W_o.bias is None):
        raise ValueError(f"{family}'s layer has a bias on all four projections or none (attention_bias)")
    if mha.query_size % mha.num_heads:
        raise ValueError(f"{family}'s config needs hidden_size={mha.query_size} divisible by {mha.num_heads} heads")


def write_gemma3n(mha: Any, fields: dict[str, Any]) -> None:
    """Gemma 3n: one layer that keeps its own keys and values, a rotary per layer type."""
    _require_gemma_values(mha, "Gemma 3n")
    parameters = fields.pop("rope_parameters")
    fields.update(
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0],
        rope_parameters={"sliding_attention": parameters, "full_attention": dict(parameters)},
    )  # fmt: skip


def write_gemma4(mha: Any, fields: dict[str, Any]) -> None:
    """Gemma 4: a full layer is a model of one layer (its sizes as ``global_head_dim`` and
    ``num_global_key_value_heads``, ``attention_k_eq_v`` for values from keys); a sliding layer is the first of
    two, since Gemma 4's last layer is always full; a rotary per layer type (p-RoPE as ``proportional``)."""
    _require_gemma_values(mha, "Gemma 4")
    if mha.W_v is None and mha.window is not None:
        raise ValueError("Gemma 4's sliding layers project their values (v_proj): values_from_keys with a window")
    rotary = mha.position
    parameters = fields.pop("rope_parameters")
    if rotary.p != 1.0:
        parameters = proportional_rope_parameters(rotary)
    sliding = mha.window is not None
    fields.update(
        global_head_dim=mha.head_dim, num_global_key_value_heads=mha.num_kv_heads, attention_k_eq_v=mha.W_v is None,
        num_kv_shared_layers=0, rope_parameters={"sliding_attention": parameters, "full_attention": dict(parameters)},
        num_hidden_layers=2 if sliding else 1,
        layer_types=["sliding_attention", "full_attention"] if sliding else ["full_attention"],
    )  # fmt: skip
