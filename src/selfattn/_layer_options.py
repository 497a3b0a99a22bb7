"""The keyword options of :class:`~selfattn.MultiHeadAttention`, validated, and the parts they stand for.

The layer's older keywords are shorthands: ``qk_norm=True`` builds two :class:`~selfattn.parts.HeadNorm`
parts, ``temperature_tuning`` a :class:`~selfattn.parts.TemperatureTuning`, ``gated_output`` an
:class:`~selfattn.parts.OutputGate`. Everything else a family needs arrives as ``parts=``.

Shape legend: h heads, hk key/value heads, dq query/key head size, dv value head size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from selfattn._validation import (
    require_positive_finite,
    require_positive_int,
    require_probability,
    require_temperature_tuning,
)
from selfattn.parts import SLOTS, HeadNorm, OutputGate, Part, TemperatureTuning
from selfattn.positional.base import PositionalEncoding, QueryKeyEncoding, ScoreEncoding

__all__ = ["KEYWORD_PARTS", "OPTION_NAMES", "LayerOptions", "build_projections", "layer_options", "shorthand_parts"]

# The slots a layer reading another layer's keys and values (shared_kv) never runs.
_KEY_VALUE_SLOTS = ("key_features", "keys", "rotated_keys", "values")


DEFAULTS: dict[str, Any] = {
    "bias": False, "output_bias": None, "query_size": None, "key_size": None, "value_size": None,
    "output_size": None, "position": None, "num_kv_heads": None, "value_head_dim": None, "values_from_keys": False,
    "shared_kv": False, "window": None, "block_size": None, "skip_padded_queries": False, "scale": None,
    "softcap": None, "sinks": False, "qk_norm": False, "qk_norm_eps": 1e-6, "gated_output": False, "chunk_size": None,
    "temperature_tuning": None, "parts": None, "device": None, "dtype": None,
}  # fmt: skip
OPTION_NAMES = frozenset(DEFAULTS)


class LayerOptions(NamedTuple):
    """The validated sizes and options a layer keeps as attributes (and ``raw``: the rest, for building)."""

    num_hiddens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dropout: float
    query_size: int
    key_size: int
    value_size: int
    output_size: int
    position: PositionalEncoding | None
    window: int | None
    chunk_size: int | None
    block_size: int | None
    skip_padded_queries: bool
    scale: float | None
    softcap: float | None
    shared_kv: bool
    raw: dict[str, Any]


def _optional(check: Any, name: str, value: Any) -> Any:
    return None if value is None else check(name, value)


def _check_position(position: PositionalEncoding | None, num_heads: int, head_dim: int, value_head_dim: int) -> None:
    """Refuse an encoding that acts on the input, or one built for another head count or head size.

    Score encodings record the heads they bias (``num_heads``: ALiBi, T5, Kerple, FIRE); the
    others the head size they act on (``head_dim``: rotary, xPos, M-RoPE, Shaw), which is also the size of the
    value term a score encoding adds to the values (Shaw's ``values=True``).
    """
    if position is not None and not isinstance(position, (QueryKeyEncoding, ScoreEncoding)):
        raise ValueError(
            f"position must rotate queries/keys or bias the scores, got {type(position).__name__} "
            "(add input encodings to the input instead)"
        )
    built_heads, built_size = getattr(position, "num_heads", None), getattr(position, "head_dim", None)
    name = type(position).__name__
    if isinstance(built_heads, int) and built_heads != num_heads:
        raise ValueError(f"position={name} built for {built_heads} heads, the layer has {num_heads}")
    if isinstance(built_size, int) and built_size != head_dim:
        raise ValueError(
            f"position={name} built for head size {built_size}, the layer's is {head_dim} (num_hiddens / num_heads)"
        )
    if isinstance(position, ScoreEncoding) and position.uses_weights and value_head_dim != head_dim:
        raise ValueError(
            f"position={name} adds a term of head size {head_dim} to the values, but value_head_dim={value_head_dim}: "
            "give the layer value_head_dim=None, or build the encoding without its value term"
        )


def layer_options(num_hiddens: int, num_heads: int, dropout: float, given: Mapping[str, Any]) -> LayerOptions:
    """Validate the constructor's arguments; ``ValueError`` names the first bad one and its value."""
    raw = DEFAULTS | dict(given)
    num_hiddens, num_heads = (
        require_positive_int("num_hiddens", num_hiddens),
        require_positive_int("num_heads", num_heads),
    )
    if num_hiddens % num_heads:
        raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
    kv_heads = num_heads if raw["num_kv_heads"] is None else require_positive_int("num_kv_heads", raw["num_kv_heads"])
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={raw['num_kv_heads']}")
    head_dim = num_hiddens // num_heads
    value_head_dim = _optional(require_positive_int, "value_head_dim", raw["value_head_dim"]) or head_dim
    sizes = {
        name: num_hiddens if raw[name] is None else require_positive_int(name, raw[name])
        for name in ("query_size", "key_size", "value_size")
    }
    output_size = num_hiddens if raw["output_size"] is None else require_positive_int("output_size", raw["output_size"])
    _check_position(raw["position"], num_heads, head_dim, value_head_dim)
    for name in ("bias", "sinks", "qk_norm", "gated_output", "skip_padded_queries", "values_from_keys", "shared_kv"):
        if not isinstance(raw[name], bool):
            raise ValueError(f"{name} must be True or False, got {raw[name]!r}")
    if raw["output_bias"] is not None and not isinstance(raw["output_bias"], bool):
        raise ValueError(f"output_bias must be True, False or None, got {raw['output_bias']!r}")
    if raw["values_from_keys"] and (value_head_dim != head_dim or raw["value_size"] not in (None, sizes["key_size"])):
        raise ValueError(
            f"values_from_keys=True: values are the keys' projection, so value_head_dim={value_head_dim} must be "
            f"the head size {head_dim} and value_size={sizes['value_size']} the key_size {sizes['key_size']}"
        )
    if raw["shared_kv"] and raw["values_from_keys"]:
        raise ValueError("values_from_keys=True needs W_k, and a layer with shared_kv=True projects no keys")
    if raw["temperature_tuning"] is not None:
        raw["temperature_tuning"] = require_temperature_tuning(raw["temperature_tuning"])
    return LayerOptions(
        num_hiddens, num_heads, kv_heads, head_dim, value_head_dim, require_probability("dropout", dropout),
        sizes["query_size"], sizes["key_size"], sizes["value_size"], output_size, raw["position"],
        _optional(require_positive_int, "window", raw["window"]),
        _optional(require_positive_int, "chunk_size", raw["chunk_size"]),
        _optional(require_positive_int, "block_size", raw["block_size"]),
        raw["skip_padded_queries"],
        _optional(require_positive_finite, "scale", raw["scale"]),
        _optional(require_positive_finite, "softcap", raw["softcap"]),
        raw["shared_kv"],
        raw,
    )  # fmt: skip


def build_projections(options: LayerOptions) -> dict[str, nn.Module | nn.Parameter | None]:
    """``W_q, W_k, W_v, W_o`` and ``sinks``: the layer's own weights (``W_v`` None when values are the keys;
    ``W_k`` and ``W_v`` None when both are another layer's, ``shared_kv``)."""
    raw, factory = options.raw, {"device": options.raw["device"], "dtype": options.raw["dtype"]}
    bias, output_bias = raw["bias"], raw["bias"] if raw["output_bias"] is None else raw["output_bias"]
    h, hk, dq, dv = options.num_heads, options.num_kv_heads, options.head_dim, options.value_head_dim
    return {
        "W_q": nn.Linear(options.query_size, h * dq, bias=bias, **factory),
        "W_k": None if options.shared_kv else nn.Linear(options.key_size, hk * dq, bias=bias, **factory),
        "W_v": None
        if raw["values_from_keys"] or options.shared_kv
        else nn.Linear(options.value_size, hk * dv, bias=bias, **factory),
        "W_o": nn.Linear(h * dv, options.output_size, bias=output_bias, **factory),
        "sinks": nn.Parameter(torch.zeros(h, **factory)) if raw["sinks"] else None,
    }


#: The names of the parts the keywords stand for (:func:`shorthand_parts`), built by the layer after its projections.
KEYWORD_PARTS = ("q_norm", "k_norm", "query_scaling", "W_g")


def shorthand_parts(options: LayerOptions) -> dict[str, Part]:
    """The parts the keywords stand for, then ``parts=``, in the order the layer applies them within a slot."""
    raw, factory = options.raw, {"device": options.raw["device"], "dtype": options.raw["dtype"]}
    parts: dict[str, Part] = {}
    if raw["qk_norm"]:
        eps = require_positive_finite("qk_norm_eps", raw["qk_norm_eps"])
        parts["q_norm"] = HeadNorm(options.head_dim, slot="queries", eps=eps, **factory)
        if not options.shared_kv:  # shared keys come normalized by the layer that projected them
            parts["k_norm"] = HeadNorm(options.head_dim, slot="keys", eps=eps, **factory)
    if raw["temperature_tuning"] is not None:
        parts["query_scaling"] = TemperatureTuning(*raw["temperature_tuning"])
    if raw["gated_output"]:
        gate = OutputGate(options.query_size, options.num_heads, options.value_head_dim, bias=raw["bias"], **factory)
        parts["W_g"] = gate
    given = raw["parts"] or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"parts must be a mapping of names to parts, got {type(given).__name__}")
    for name, part in given.items():
        if not isinstance(part, Part) or getattr(part, "slot", None) not in SLOTS:
            raise ValueError(f"parts[{name!r}] must be a selfattn.parts.Part with a slot in {SLOTS}, got {part!r}")
        if name in parts or not name.isidentifier():
            raise ValueError(f"parts[{name!r}]: the name is taken by a keyword's part or is not an identifier")
        if options.shared_kv and part.slot in _KEY_VALUE_SLOTS:
            raise ValueError(
                f"parts[{name!r}] acts at {part.slot!r}, but a layer with shared_kv=True projects no keys or values"
            )
        moves = {key: value for key, value in factory.items() if value is not None}
        parts[name] = part.to(**moves) if moves else part  # the layer's device and dtype, as its own weights
    return parts
