"""Multi-head latent attention written out from its formulas in float64, independent of selfattn's code.

Shape legend: b batch, l tokens, h heads, r kv_lora_rank, dn / dr / dv the nope, rope and value sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_frequencies(rope: int, parameters: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies ``(dr / 2,)`` and attention factor in float64, from the paper's formulas.

    Without ``rope_type="yarn"``: plain ``base^(-2j / dr)`` and factor 1.
    """
    base = parameters.get("rope_theta", 10000.0)
    pairs = torch.arange(0, rope, 2, dtype=torch.float64) / rope
    if parameters.get("rope_type", "default") != "yarn":
        return base**-pairs, 1.0
    factor, original = parameters["factor"], parameters["original_max_position_embeddings"]

    def correction(turns: float) -> float:  # the pair index that turns `turns` times within the trained length
        return rope * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(parameters["beta_fast"])), 0)
    high = min(math.ceil(correction(parameters["beta_slow"])), rope - 1)
    span = high - low + (0.001 if low == high else 0)
    ramp = ((torch.arange(rope // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    extrapolate = 1 - ramp
    frequencies = base**-pairs / factor * (1 - extrapolate) + base**-pairs * extrapolate

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0

    if parameters.get("attention_factor") is not None:
        return frequencies, float(parameters["attention_factor"])
    if parameters.get("mscale") and parameters.get("mscale_all_dim"):
        return frequencies, mscale(parameters["mscale"]) / mscale(parameters["mscale_all_dim"])
    return frequencies, mscale(1.0)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _as_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rope features as complex numbers, one per rotated pair: ``(2j, 2j + 1)`` or ``(j, j + dr / 2)``."""
    if interleaved:
        return torch.complex(x[..., 0::2], x[..., 1::2])
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half], x[..., half:])


def mla_reference(
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
    sizes: dict[str, Any],
) -> torch.Tensor:
    """``(b, l, d)`` output of MLA in float64: every head's keys and values expanded, scores summed term by term.

    Args:
        weights: the layer's state dict (transformers' names).
        x: ``(b, l, d)``.
        positions: ``(b, l)`` integer positions (rotary and query scaling).
        visible: bool ``(b, l, l)``, True where query ``t`` sees key ``s``.
        sizes: ``heads``, ``rank``, ``nope``, ``rope``, ``value``, ``eps``, ``scale``, ``interleaved``,
            ``frequencies`` ``(dr / 2,)``, ``attention_factor``, optional ``query_scaling`` ``(beta, L0)``
            and ``lora_scales`` ``(q, kv)``.
    """
    w = {name: t.double() for name, t in weights.items()}
    x = x.double()
    b, length, _ = x.shape
    heads, rank, nope, rope, value = (sizes[k] for k in ("heads", "rank", "nope", "rope", "value"))

    def linear(name: str, inputs: torch.Tensor) -> torch.Tensor:
        out = inputs @ w[f"{name}.weight"].t()
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    if "q_proj.weight" in w:
        q = linear("q_proj", x)
    else:
        q = linear("q_b_proj", _rms(linear("q_a_proj", x), w["q_a_layernorm.weight"], sizes["eps"]))
    q = q.view(b, length, heads, nope + rope)
    multiplier = torch.ones(b, length, dtype=torch.float64)
    if sizes.get("query_scaling"):
        beta, original = sizes["query_scaling"]
        multiplier = 1 + beta * torch.log(1 + torch.floor(positions.double() / original))
    q = q * multiplier[..., None, None] * (sizes.get("lora_scales") or (1.0, 1.0))[0]
    joined = linear("kv_a_proj_with_mqa", x)
    latent = (
        _rms(joined[..., :rank], w["kv_a_layernorm.weight"], sizes["eps"]) * (sizes.get("lora_scales") or (1, 1))[1]
    )
    up = w["kv_b_proj.weight"].view(heads, nope + value, rank)
    k_nope = torch.einsum("hnr,bsr->bshn", up[:, :nope], latent)
    v = torch.einsum("hvr,bsr->bshv", up[:, nope:], latent)
    scores = torch.einsum("bthn,bshn->bhts", q[..., :nope], k_nope)
    if rope:
        turn = torch.polar(
            torch.full((b, length, rope // 2), sizes["attention_factor"], dtype=torch.float64),
            positions.double()[..., None] * sizes["frequencies"],
        )  # (b, l, dr / 2)
        q_pairs = _as_pairs(q[..., nope:], sizes["interleaved"]) * turn[:, :, None]
        k_pairs = _as_pairs(joined[..., rank:], sizes["interleaved"]) * turn  # (b, s, dr / 2)
        scores = scores + torch.einsum("bthj,bsj->bhts", q_pairs, k_pairs.conj()).real
    scores = (scores * sizes["scale"]).masked_fill(~visible[:, None], float("-inf"))
    attention = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing: zeros
    out = torch.einsum("bhts,bshv->bthv", attention, v).reshape(b, length, heads * value)
    return linear("o_proj", out)
