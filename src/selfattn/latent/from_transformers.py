"""A transformers multi-head latent attention layer as a :class:`~selfattn.latent.MultiHeadLatentAttention`.

Layers are recognised by their class names (transformers is not imported). The parameter names
are the same on both sides, so the weights load with ``load_state_dict(strict=True)``: a layer
with a parameter the selfattn layer lacks (or the other way) is refused by that load, named.

Shape legend:
    h: heads, r: kv_lora_rank, dn: qk_nope_head_dim, dr: qk_rope_head_dim, dv: v_head_dim.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar, cast

import torch
from torch import nn

from selfattn.integrations.from_transformers import layer_family, rope_parameters_of
from selfattn.latent.rotary import ScaledFrequencyRotary
from selfattn.positional.rotary import RotaryPositionalEncoding

Module = TypeVar("Module", bound=nn.Module)

__all__ = ["LAYERS", "from_transformers", "to_transformers_config"]

# Attention layer class -> model family (the config's model_type).
LAYERS: dict[str, str] = {
    "DeepseekV2Attention": "deepseek_v2",
    "DeepseekV3Attention": "deepseek_v3",
    "Mistral4Attention": "mistral4",
    "Glm4MoeLiteAttention": "glm4_moe_lite",
    "LongcatFlashMLA": "longcat_flash",
    "MistralLarge4TextAttention": "mistral_large4",
    "DeepseekV32Attention": "deepseek_v32",  # its MLA part; the DSA indexer is not this layer's
    "GlmMoeDsaAttention": "glm_moe_dsa",
}
# Rope-parameter keys that are not the rotary's own (Mistral 4 keeps its query scaling there).
_NOT_ROTARY = ("llama_4_scaling_beta", "max_position_embeddings", "partial_rotary_factor")


def _refuse_gaps(hf: Any, family: str) -> None:
    """What selfattn's layer does not express, named."""
    if family == "mistral_large4":
        mode = hf.config.kv_sharing_modes[hf.layer_idx]
        if mode in ("reuse", "reuse_but_indexer"):
            raise ValueError(
                f"kv_sharing_modes[{hf.layer_idx}]={mode!r}: Mistral Large 4's cross-layer latent sharing (a layer "
                "reading another layer's latent) is not expressed"
            )


def _sizes(hf: Any) -> dict[str, int | None]:
    """The layer's sizes, checked against its config and its weights (mismatched ranks named)."""
    config = hf.config
    sizes: dict[str, int | None] = {
        "hidden_size": int(config.hidden_size),
        "num_heads": int(config.num_attention_heads),
        "kv_lora_rank": int(hf.kv_lora_rank),
        "qk_nope_head_dim": int(hf.qk_nope_head_dim),
        "qk_rope_head_dim": int(hf.qk_rope_head_dim),
        "v_head_dim": int(hf.v_head_dim),
        "q_lora_rank": None if getattr(hf, "q_lora_rank", None) is None else int(hf.q_lora_rank),
    }
    nope, rope = sizes["qk_nope_head_dim"], sizes["qk_rope_head_dim"]
    assert nope is not None and rope is not None
    qk_head_dim = int(getattr(hf, "qk_head_dim", nope + rope))
    if qk_head_dim != nope + rope:
        raise ValueError(
            f"qk_head_dim={qk_head_dim} is not qk_nope_head_dim + qk_rope_head_dim = {nope} + {rope}: "
            "the query's and key's head sizes must match"
        )
    heads, rank = sizes["num_heads"], sizes["kv_lora_rank"]
    assert heads is not None and rank is not None
    expected = {
        "kv_a_proj_with_mqa": (rank + rope, sizes["hidden_size"]),
        "kv_b_proj": (heads * (nope + int(sizes["v_head_dim"] or 0)), rank),
        "o_proj": (sizes["hidden_size"], heads * int(sizes["v_head_dim"] or 0)),
    }
    if sizes["q_lora_rank"] is not None:
        expected["q_a_proj"] = (sizes["q_lora_rank"], sizes["hidden_size"])
        expected["q_b_proj"] = (heads * (nope + rope), sizes["q_lora_rank"])
    for name, shape in expected.items():
        got = tuple(getattr(hf, name).weight.shape)
        if got != shape:
            raise ValueError(
                f"{name}.weight is {got}, the config's ranks (kv_lora_rank={rank}, q_lora_rank={sizes['q_lora_rank']}, "
                f"qk_nope_head_dim={nope}, qk_rope_head_dim={rope}, v_head_dim={sizes['v_head_dim']}) give {shape}"
            )
    return sizes


def _rotary(
    config: Any, rope: int, *, interleaved: bool, multipliers: torch.Tensor | None = None
) -> RotaryPositionalEncoding | None:
    """The rotary of the ``dr`` rope features, from the config's ``rope_parameters`` (frequencies times ``multipliers``)."""
    if rope == 0:
        return None
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    for key in _NOT_ROTARY:
        parameters.pop(key, None)
    fields = {
        "head_dim": rope,
        "rope_parameters": parameters,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
    }
    half_split = RotaryPositionalEncoding.from_config(fields)
    if multipliers is not None:
        return ScaledFrequencyRotary(
            rope, half_split.base, interleaved, multipliers=multipliers, scaling=half_split.scaling,
            scaling_factor=half_split.scaling_factor,
        )  # fmt: skip
    if not interleaved:
        return half_split
    return RotaryPositionalEncoding(
        rope, half_split.base, True, scaling=half_split.scaling, scaling_factor=half_split.scaling_factor
    )


def _learned_multipliers(rotary_embedding: nn.Module | None, rope: int) -> torch.Tensor | None:
    """``exp(alpha)`` of Mistral Large 4's rotary module, or None without one (or with ``alpha`` all 0)."""
    if rotary_embedding is None:
        return None
    alpha = getattr(rotary_embedding, "alpha", None)
    if not isinstance(alpha, torch.Tensor) or alpha.shape != (rope // 2,):
        raise ValueError(
            f"rotary_embedding {type(rotary_embedding).__name__} has no alpha of shape ({rope // 2},): "
            "pass the model's MistralLarge4TextRotaryEmbedding"
        )
    if not bool(alpha.any()):
        return None
    return alpha.detach().to(torch.float64).exp()


def _norm_eps(hf: Any) -> float:
    """The one epsilon of the layer's RMSNorms (selfattn's layer has one)."""
    norms = [n for n in (getattr(hf, "q_a_layernorm", None), hf.kv_a_layernorm) if n is not None]
    found = {float(getattr(n, "variance_epsilon", getattr(n, "eps", 1e-6))) for n in norms}
    if len(found) != 1:
        raise ValueError(f"q_a_layernorm and kv_a_layernorm have different epsilons {sorted(found)}")
    return found.pop()


def _recipe(hf: Any, family: str, rope: int, rotary_embedding: nn.Module | None) -> dict[str, Any]:
    """Rotary layout, scale, query scaling and LoRA scales of the family."""
    config = hf.config
    always_interleaved = ("deepseek_v2", "longcat_flash", "mistral_large4", "deepseek_v32", "glm_moe_dsa")
    interleaved = family in always_interleaved or bool(getattr(config, "rope_interleave", False))
    if rotary_embedding is not None and family != "mistral_large4":
        raise ValueError(f"rotary_embedding is read for Mistral Large 4's learned frequencies only, not {family}")
    multipliers = _learned_multipliers(rotary_embedding, rope) if rope else None
    options: dict[str, Any] = {
        "position": _rotary(config, rope, interleaved=interleaved, multipliers=multipliers),
        "split_rotated_pairs": interleaved and family != "deepseek_v2",  # V2 rotates complex pairs in place
        "scale": float(hf.scaling),
    }
    if family == "mistral4":
        parameters = config.rope_parameters
        beta = parameters.get("llama_4_scaling_beta")
        if beta:
            options["query_scaling"] = (float(beta), float(parameters["original_max_position_embeddings"]))
    if family == "longcat_flash":
        options["lora_scales"] = (float(hf.mla_scale_q_lora), float(hf.mla_scale_kv_lora))
    if family == "mistral_large4":
        options["head_log_scaling"] = True
    return options


def from_transformers(layer: nn.Module, cls: type[Module], *, rotary_embedding: nn.Module | None = None) -> Module:
    """The selfattn layer equal to a transformers MLA layer: same weights (same names), same recipe.

    Reads DeepseekV2Attention, DeepseekV3Attention, Mistral4Attention, Glm4MoeLiteAttention,
    LongcatFlashMLA and the MLA part of MistralLarge4TextAttention, DeepseekV32Attention and
    GlmMoeDsaAttention (their DSA indexers are not part of this layer: see below): sizes, ``attention_bias``, the RMSNorms' epsilon, the rotary of the rope
    features (``rope_parameters``, YaRN with ``mscale`` included; DeepSeek-V2 and LongCat rotate
    interleaved pairs, the others as ``rope_interleave`` says), the softmax scale (``layer.scaling``:
    ``(dn + dr) ** -0.5`` times YaRN's ``mscale ** 2``), Mistral 4's ``llama_4_scaling_beta`` and
    LongCat's LoRA scales. ``layer(x, position_embeddings=rotary(x, position_ids), attention_mask=causal
    mask)`` then equals ``mla(x, positions=position_ids, key_padding_mask=padding)``.

    DSA layers (DeepSeek-V3.2, GLM-5, Mistral Large 4): the indexer's weights are left out; pass its
    top-k selection as ``mask=`` (a bool ``(b, l, n)``); without one the layer attends densely, as
    transformers' does when ``index_topk`` covers every key.

    Mistral Large 4: its NoPE layers (``no_rope_layers``), its per-head softmax scaling
    (``head_log_scaling``) and, given ``rotary_embedding`` (the model's
    ``MistralLarge4TextRotaryEmbedding``), its learned frequencies ``inv_freq * exp(alpha)`` (read
    once; without it ``alpha`` is taken as 0).

    Raises:
        ValueError: an unknown layer class; a Mistral Large 4 layer that reads another layer's
            latent (``kv_sharing_modes`` "reuse"); a ``qk_head_dim`` other
            than ``dn + dr``; weights whose shapes disagree with the config's ranks; named.
    """
    family = layer_family(layer, LAYERS, "MLA")
    hf: Any = layer
    _refuse_gaps(hf, family)
    sizes = _sizes(hf)
    rope = sizes["qk_rope_head_dim"]
    assert rope is not None
    weight = hf.o_proj.weight
    options = _recipe(hf, family, rope, rotary_embedding)
    mla: Any = cls(
        **sizes,
        bias=hf.o_proj.bias is not None,
        norm_eps=_norm_eps(hf),
        dropout=float(getattr(hf.config, "attention_dropout", 0.0) or 0.0),
        device=weight.device,
        dtype=weight.dtype,
        **options,
    )
    if mla.position is not None:
        mla.position.to(weight.device)
    weights = {name: w for name, w in hf.state_dict().items() if not name.startswith("indexer.")}  # DSA: not ours
    mla.load_state_dict(weights, strict=True)
    return cast(Module, mla.train(hf.training))


def to_transformers_config(module: nn.Module) -> dict[str, Any]:
    """Config fields that rebuild ``module`` as one ``DeepseekV3Attention`` (``model_type="deepseek_v3"``).

    Build the config with ``transformers.AutoConfig.for_model(**fields)``, the layer with
    ``layer_idx=0``, and load ``module.state_dict()`` into it.

    Raises:
        ValueError: what DeepSeek-V3's layer does not have (query scaling, LoRA scales, a window,
            a rotary other than interleaved-read half-split-write, a scale other than its own), named.
    """
    mla: Any = module
    used = [
        name for name in ("query_scaling", "lora_scales", "window", "softmax_scaling") if getattr(mla, name) is not None
    ]
    if used:
        raise ValueError(f"DeepseekV3Attention has no {', '.join(used)}")
    rotary = mla.position
    if rotary is None or rotary.interleaved != mla.split_rotated_pairs:
        raise ValueError(
            "DeepseekV3Attention rotates its rope features, interleaved read with half-split write "
            "(split_rotated_pairs) or half-split: got "
            f"position={rotary!r}, split_rotated_pairs={mla.split_rotated_pairs}"
        )
    scaling = rope_parameters_of(rotary)
    fields: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "hidden_size": mla.hidden_size,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "attention_bias": mla.o_proj.bias is not None,
        "attention_dropout": mla.dropout,
        "rope_interleave": rotary.interleaved,
        "rope_parameters": scaling,
        "num_hidden_layers": 1,
    }
    if mla.kv_a_layernorm.eps != 1e-6:
        raise ValueError(f"norm_eps={mla.kv_a_layernorm.eps}: DeepseekV3Attention's RMSNorms use 1e-6")
    expected = mla.qk_head_dim**-0.5
    mscale_all_dim = scaling.get("mscale_all_dim")
    if scaling.get("rope_type") == "yarn" and mscale_all_dim and scaling.get("factor", 1.0) > 1:
        expected *= (0.1 * mscale_all_dim * math.log(scaling["factor"]) + 1.0) ** 2
    if not math.isclose(mla.scale, expected, rel_tol=1e-12):
        raise ValueError(f"scale={mla.scale}: DeepseekV3Attention's is {expected} for this rotary")
    return fields
