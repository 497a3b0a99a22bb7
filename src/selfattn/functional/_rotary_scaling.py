"""Rotary scaling methods for long contexts: each a float64 formula for the inverse frequencies.

Every method starts from the unscaled frequencies ``w_j = base^(-2j / r)`` of the ``r / 2``
rotated pairs (``j = 0`` fastest), the wavelength of pair ``j`` being ``lambda_j = 2 pi / w_j``
tokens. ``f`` is the scaling ``factor`` and ``L0`` the trained context
(``original_max_position_embeddings``).

* ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595):
  ``w_j / f``: every angle shrinks, ``f`` times longer contexts land in the trained range.
* ``ntk`` (static NTK-aware, bloc97 2023): ``base' = base * f^(r / (r - 2))``; the fastest
  pair keeps its frequency and the slowest is divided by exactly ``f``.
* ``dynamic`` (dynamic NTK, emozilla 2023; Hugging Face ``"dynamic"``): the NTK base with a
  factor that grows with the current length ``L``:
  ``base' = base * (f L / L0 - (f - 1))^(r / (r - 2))`` for ``L > L0``; unscaled up to ``L0``.
* ``yarn`` (Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts" plus a temperature): pair ``j``
  turns ``L0 / lambda_j`` times within ``L0``. With ``d(n) = r ln(L0 / (2 pi n)) / (2 ln base)``
  the (fractional) pair index that turns ``n`` times, ``low = floor(d(beta_fast))`` and
  ``high = ceil(d(beta_slow))`` (no rounding when ``truncate`` is False), clamped to
  ``[0, r - 1]``, the ramp ``g_j = clamp((j - low) / (high - low), 0, 1)`` blends
  ``w_j (1 - g_j) + (w_j / f) g_j``: pairs turning more than ``beta_fast`` (32) times keep their
  frequency, pairs turning less than ``beta_slow`` (1) time are interpolated by ``f``. Its
  attention factor multiplies cos and sin (so every score by its square):
  ``attention_factor`` if given, else ``m(f, mscale) / m(f, mscale_all_dim)`` when both are
  nonzero (DeepSeek-V2/V3), else ``m(f, 1) = 0.1 ln f + 1``, with ``m(s, k) = 0.1 k ln s + 1``
  (1 for ``s <= 1``).
* ``llama3`` (Llama 3.1 model card and reference code): pairs whose wavelength is below
  ``L0 / high_freq_factor`` keep their frequency, those above ``L0 / low_freq_factor`` are
  divided by ``f``, and in between ``w_j ((1 - s_j) / f + s_j)`` with
  ``s_j = (L0 / lambda_j - low_freq_factor) / (high_freq_factor - low_freq_factor)``
  (continuous at both edges).
* ``longrope`` (Ding et al. 2024, arXiv:2402.13753; Phi-3): a searched factor per pair,
  ``w_j / short_factor[j]`` while the current length is at most ``L0`` and
  ``w_j / long_factor[j]`` past it; attention factor ``attention_factor`` if given, else
  ``sqrt(1 + ln f / ln L0)`` (1 for ``f <= 1``).

``dynamic`` and ``longrope`` depend on the current length ``L`` (Hugging Face takes the largest
position + 1 of the call); the others are static. Everything is computed in float64.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from selfattn.functional._sinusoidal import sinusoidal_frequencies

__all__ = [
    "ROPE_TYPES",
    "RotaryParameters",
    "RotaryScalingConfig",
    "check_partial_rotary_factor",
    "parse_rotary_scaling",
    "scaled_rotary_parameters",
]

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")

# Keys each type accepts (besides rope_type / type); the first group is required.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("factor", "attention_factor"),
}
# Keys of Hugging Face's ``rope_parameters`` that describe the model, not the scaling.
_MODEL_KEYS = ("rope_theta", "partial_rotary_factor")


class RotaryParameters(NamedTuple):
    """Inverse frequencies ``(r / 2,)`` float64 and the factor that multiplies cos and sin."""

    frequencies: torch.Tensor
    attention_factor: float


@dataclass(frozen=True)
class RotaryScalingConfig:
    """A validated scaling method and its parameters (see the module docstring for the formulas).

    Build it with :func:`parse_rotary_scaling`; :meth:`as_dict` gives it back in Hugging Face's
    ``rope_scaling`` format.
    """

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def depends_on_length(self) -> bool:
        """True for the methods whose frequencies change with the current length (dynamic, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    def as_dict(self) -> dict[str, Any]:
        """The parameters that were given, as a Hugging Face ``rope_scaling`` dict."""
        out: dict[str, Any] = {"rope_type": self.rope_type}
        for key in self.given:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


def _number(rope_type: str, key: str, value: object, *, minimum: float | None = None, strict: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
    if ok and minimum is not None:
        ok = float(value) > minimum if strict else float(value) >= minimum  # type: ignore[arg-type]
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"scaling {rope_type!r}: {key} must be a finite number{bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _length(rope_type: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 <= float(value) < math.inf:
        raise ValueError(
            f"scaling {rope_type!r}: original_max_position_embeddings must be a positive integer, got {value!r}"
        )
    if float(value) != int(value):  # type: ignore[call-overload]
        raise ValueError(
            f"scaling {rope_type!r}: original_max_position_embeddings must be a positive integer, got {value!r}"
        )
    return int(value)  # type: ignore[call-overload, no-any-return]


def _factors(rope_type: str, key: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)) or len(value) == 0:
        raise ValueError(f"scaling {rope_type!r}: {key} must be a list of positive numbers, got {value!r}")
    values = [float(v) for v in value] if isinstance(value, torch.Tensor) else list(value)
    return tuple(_number(rope_type, f"{key}[{i}]", v, minimum=0.0, strict=True) for i, v in enumerate(values))


def _scaling_params(scaling: str | Mapping[str, Any], scaling_factor: float) -> dict[str, Any]:
    """The scaling as a dict with a ``"rope_type"`` (a name with its factor, or a copy of the given dict)."""
    if isinstance(scaling, str):
        if scaling not in ROPE_TYPES:
            raise ValueError(f"scaling must be None, one of {', '.join(ROPE_TYPES)} or a dict; got {scaling!r}")
        params: dict[str, Any] = {"rope_type": scaling}
        if scaling != "default" or scaling_factor != 1.0:
            params["factor"] = float(scaling_factor)
    elif isinstance(scaling, Mapping):
        if scaling_factor != 1.0:
            raise ValueError(
                f"scaling_factor={scaling_factor!r} cannot be combined with a scaling dict; put 'factor' in the dict"
            )
        params = dict(scaling)
        if "rope_type" in params and "type" in params and params["rope_type"] != params["type"]:
            raise ValueError(f"scaling has rope_type={params['rope_type']!r} but type={params['type']!r}")
        if "type" in params:
            params.setdefault("rope_type", params.pop("type"))
        if "rope_type" not in params:
            raise ValueError(f"scaling dict needs a 'rope_type' (or 'type') key, got keys {sorted(params)}")
    else:
        raise ValueError(f"scaling must be None, a type name or a dict, got {type(scaling).__name__}")
    return params


def _checked_values(rope_type: str, params: dict[str, Any], given: tuple[str, ...]) -> dict[str, Any]:
    """Each given parameter of ``rope_type`` checked against its range, and the checks across parameters."""
    values: dict[str, Any] = {}
    if "factor" in given:
        values["factor"] = _number(rope_type, "factor", params["factor"], minimum=1.0)
    if "original_max_position_embeddings" in given:
        values["original_max_position_embeddings"] = _length(rope_type, params["original_max_position_embeddings"])
    if rope_type == "llama3":
        low = _number(rope_type, "low_freq_factor", params["low_freq_factor"], minimum=0.0, strict=True)
        high = _number(rope_type, "high_freq_factor", params["high_freq_factor"], minimum=0.0, strict=True)
        if not high > low:
            raise ValueError(f"scaling 'llama3': high_freq_factor must exceed low_freq_factor, got {high:g} <= {low:g}")
        values.update(low_freq_factor=low, high_freq_factor=high)
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow"):
            if key in given:
                values[key] = _number(rope_type, key, params[key], minimum=0.0, strict=True)
        if values.get("beta_fast", 32.0) < values.get("beta_slow", 1.0):
            raise ValueError(
                f"scaling 'yarn': beta_fast must be at least beta_slow, got {values.get('beta_fast', 32.0):g} "
                f"< {values.get('beta_slow', 1.0):g}"
            )
        for key in ("mscale", "mscale_all_dim"):
            if key in given:
                values[key] = _number(rope_type, key, params[key], minimum=0.0)
        if "truncate" in given:
            if not isinstance(params["truncate"], bool):
                raise ValueError(f"scaling 'yarn': truncate must be True or False, got {params['truncate']!r}")
            values["truncate"] = params["truncate"]
    if "attention_factor" in given:
        values["attention_factor"] = _number(
            rope_type, "attention_factor", params["attention_factor"], minimum=0.0, strict=True
        )
    if rope_type == "longrope":
        if "factor" not in given and "attention_factor" not in given:
            raise ValueError(
                "scaling 'longrope' needs factor or attention_factor (its attention factor comes from one)"
            )
        values["short_factor"] = _factors(rope_type, "short_factor", params["short_factor"])
        values["long_factor"] = _factors(rope_type, "long_factor", params["long_factor"])
        if len(values["short_factor"]) != len(values["long_factor"]):
            raise ValueError(
                f"scaling 'longrope': short_factor has {len(values['short_factor'])} entries but long_factor "
                f"{len(values['long_factor'])}"
            )
    return values


def parse_rotary_scaling(
    scaling: str | Mapping[str, Any] | None, scaling_factor: float = 1.0
) -> RotaryScalingConfig | None:
    """Validate a scaling given by name (with ``scaling_factor``) or as a Hugging Face dict.

    Args:
        scaling: ``None``; a type name (``"linear"``, ``"ntk"``, ...: then ``scaling_factor`` is
            its ``factor``); or a ``rope_scaling`` / ``rope_parameters`` dict with ``"rope_type"``
            (or the legacy ``"type"``) and the parameters of that type. ``"rope_theta"`` and
            ``"partial_rotary_factor"`` entries are allowed (they describe the model; see
            :meth:`RotaryPositionalEncoding.from_config`).
        scaling_factor: the factor for a scaling given by name; must stay 1 with a dict.

    Returns:
        The validated config, or ``None`` for no scaling (``None`` or ``"default"``).

    Raises:
        ValueError: unknown type, missing or unknown keys, or a parameter out of range; the
            message names them.
    """
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, numbers.Real) or not scaling_factor >= 1.0:
        raise ValueError(f"scaling_factor must be a number >= 1, got {scaling_factor!r}")
    if scaling is None:
        if scaling_factor != 1.0:
            raise ValueError(f"scaling_factor={scaling_factor!r} needs scaling= (e.g. 'linear' or 'ntk')")
        return None
    params = _scaling_params(scaling, scaling_factor)
    rope_type = params.pop("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {rope_type!r}; known: {', '.join(ROPE_TYPES)}")
    for key in _MODEL_KEYS:
        params.pop(key, None)
    required, optional = _REQUIRED[rope_type], _OPTIONAL.get(rope_type, ())
    unknown = sorted(key for key in params if key not in required and key not in optional)
    if unknown:  # first: a misspelled key would otherwise read as a missing one
        raise ValueError(
            f"scaling {rope_type!r} does not take {', '.join(unknown)}; it takes {', '.join(required + optional) or 'nothing'}"
        )
    missing = [key for key in required if params.get(key) is None]
    if missing:
        raise ValueError(f"scaling {rope_type!r} needs {', '.join(missing)}")
    given = tuple(key for key in required + optional if params.get(key) is not None)
    if rope_type == "default":
        return None

    values = _checked_values(rope_type, params, given)
    return RotaryScalingConfig(rope_type=rope_type, given=given, **values)


def check_partial_rotary_factor(scaling: object, head_dim: int, rotary_dim: int) -> None:
    """A scaling dict's ``partial_rotary_factor`` names how many of ``head_dim`` features rotate, ``int(head_dim *
    factor)`` as transformers computes it: raise unless that is ``rotary_dim`` (the entry describes the model, and
    a rotary given the dict as it is would otherwise rotate features the model does not)."""
    factor = scaling.get("partial_rotary_factor") if isinstance(scaling, Mapping) else None
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < float(factor) <= 1:
        raise ValueError(f"scaling['partial_rotary_factor'] must be in (0, 1], got {factor!r}")
    rotated = int(head_dim * float(factor))
    if rotated != rotary_dim:
        raise ValueError(
            f"scaling['partial_rotary_factor']={factor!r} rotates {rotated} of head_dim={head_dim} features, but "
            f"rotary_dim={rotary_dim}: pass rotary_dim={rotated} (RotaryPositionalEncoding.from_config reads it)"
        )


def _mscale(scale: float, multiplier: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * multiplier * math.log(scale) + 1.0


def _yarn(freqs: torch.Tensor, rotary_dim: int, base: float, config: RotaryScalingConfig) -> RotaryParameters:
    factor = config.factor
    trained = config.original_max_position_embeddings
    assert factor is not None and trained is not None

    def pair_turning(turns: float) -> float:  # fractional pair index that turns `turns` times within L0
        return rotary_dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.beta_fast), pair_turning(config.beta_slow)
    if config.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the published code's guard against a zero-width ramp
    pairs = torch.arange(freqs.shape[0], dtype=torch.float64)
    ramp = ((pairs - low) / (high - low)).clamp(0.0, 1.0)  # 0: keep (extrapolate), 1: divide by f (interpolate)
    scaled = freqs * (1 - ramp) + (freqs / factor) * ramp
    if config.attention_factor is not None:
        attention_factor = config.attention_factor
    elif config.mscale and config.mscale_all_dim:
        attention_factor = _mscale(factor, config.mscale) / _mscale(factor, config.mscale_all_dim)
    else:
        attention_factor = _mscale(factor)
    return RotaryParameters(scaled, float(attention_factor))


def _llama3(freqs: torch.Tensor, config: RotaryScalingConfig) -> torch.Tensor:
    factor, low, high = config.factor, config.low_freq_factor, config.high_freq_factor
    trained = config.original_max_position_embeddings
    assert factor is not None and low is not None and high is not None and trained is not None
    wavelengths = 2 * math.pi / freqs
    smooth = (trained / wavelengths - low) / (high - low)
    blended = freqs * ((1 - smooth) / factor + smooth)
    out = torch.where(wavelengths > trained / low, freqs / factor, blended)
    return torch.where(wavelengths < trained / high, freqs, out)


def scaled_rotary_parameters(
    rotary_dim: int, base: float, config: RotaryScalingConfig | None, *, seq_len: int | None = None
) -> RotaryParameters:
    """Frequencies and attention factor of ``config`` for ``rotary_dim`` features (float64).

    ``seq_len`` is the current length for the length-dependent methods (``dynamic``,
    ``longrope``); ``None`` means the trained length ``L0`` (unscaled ``dynamic``, the
    ``short_factor`` of ``longrope``). Arguments are assumed valid (see :func:`parse_rotary_scaling`).
    """
    freqs = sinusoidal_frequencies(rotary_dim, base=base)  # (r/2,) float64, base^(-2j/r)
    if config is None:
        return RotaryParameters(freqs, 1.0)
    kind, factor = config.rope_type, config.factor
    if kind == "linear":
        assert factor is not None
        return RotaryParameters(freqs / factor, 1.0)
    if kind in ("ntk", "dynamic"):
        assert factor is not None
        growth = factor
        if kind == "dynamic":
            trained = config.original_max_position_embeddings
            assert trained is not None
            length = trained if seq_len is None else max(int(seq_len), trained)
            growth = factor * length / trained - (factor - 1)
        if rotary_dim == 2:  # base * factor^(r / (r - 2)) has no value at r = 2, and one pair turns at base^0 = 1
            raise ValueError(
                f"scaling {kind!r} multiplies the base, which rotary_dim=2 does not read (its one pair turns at "
                "base^0 = 1 whatever the base): it needs rotary_dim >= 4"
            )
        if growth != 1.0:
            freqs = sinusoidal_frequencies(rotary_dim, base=base * growth ** (rotary_dim / (rotary_dim - 2)))
        return RotaryParameters(freqs, 1.0)
    if kind == "yarn":
        return _yarn(freqs, rotary_dim, base, config)
    if kind == "llama3":
        return RotaryParameters(_llama3(freqs, config), 1.0)
    # longrope
    assert config.short_factor is not None and config.long_factor is not None
    trained = config.original_max_position_embeddings
    assert trained is not None
    if len(config.short_factor) != freqs.shape[0]:
        raise ValueError(
            f"scaling 'longrope': short_factor and long_factor need one entry per rotated pair "
            f"({freqs.shape[0]} for rotary_dim={rotary_dim}), got {len(config.short_factor)}"
        )
    long = seq_len is not None and seq_len > trained
    per_pair = torch.tensor(config.long_factor if long else config.short_factor, dtype=torch.float64)
    if config.attention_factor is not None:
        attention_factor = config.attention_factor
    elif factor is None or factor <= 1.0:  # factor is given when attention_factor is not (parse checks)
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(trained))
    return RotaryParameters(freqs / per_pair, float(attention_factor))
