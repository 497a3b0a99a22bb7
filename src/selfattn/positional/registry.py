"""Build any positional encoding by name from the model size and the number of heads."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from selfattn._validation import require_positive_int
from selfattn.positional.alibi import ALiBiPositionalBias
from selfattn.positional.base import PositionalEncoding
from selfattn.positional.fire import FIREPositionalBias
from selfattn.positional.identity import NoPositionalEncoding
from selfattn.positional.kerple import KerplePositionalBias
from selfattn.positional.learned import LearnedPositionalEncoding
from selfattn.positional.mrope import MultimodalRotaryPositionalEncoding
from selfattn.positional.rotary import RotaryPositionalEncoding
from selfattn.positional.rotary_nd import RotaryPositionalEncoding2D, RotaryPositionalEncoding3D
from selfattn.positional.shaw import ShawRelativePositionEncoding
from selfattn.positional.sinusoidal import SinusoidalPositionalEncoding
from selfattn.positional.sinusoidal_nd import SinusoidalPositionalEncoding2D, SinusoidalPositionalEncoding3D
from selfattn.positional.t5 import T5RelativePositionBias
from selfattn.positional.xpos import XPosEncoding

__all__ = ["NAMES", "build"]


class _Entry(NamedTuple):
    cls: type[PositionalEncoding]
    size: str | None  # the one size argument it takes: "num_hiddens", "num_heads" or "head_dim"
    defaults: Mapping[str, Any] = MappingProxyType({})


_REGISTRY: dict[str, _Entry] = {
    "none": _Entry(NoPositionalEncoding, None),
    "sinusoidal": _Entry(SinusoidalPositionalEncoding, "num_hiddens"),
    "learned": _Entry(LearnedPositionalEncoding, "num_hiddens", MappingProxyType({"max_len": 1000})),
    "rotary": _Entry(RotaryPositionalEncoding, "head_dim"),
    "alibi": _Entry(ALiBiPositionalBias, "num_heads"),
    "t5": _Entry(T5RelativePositionBias, "num_heads"),
    "shaw": _Entry(ShawRelativePositionEncoding, "head_dim"),
    "sinusoidal2d": _Entry(SinusoidalPositionalEncoding2D, "num_hiddens"),
    "sinusoidal3d": _Entry(SinusoidalPositionalEncoding3D, "num_hiddens"),
    "xpos": _Entry(XPosEncoding, "head_dim"),
    "rotary2d": _Entry(RotaryPositionalEncoding2D, "head_dim"),
    "rotary3d": _Entry(RotaryPositionalEncoding3D, "head_dim"),
    "kerple": _Entry(KerplePositionalBias, "num_heads"),
    "fire": _Entry(FIREPositionalBias, "num_heads"),
    "mrope": _Entry(MultimodalRotaryPositionalEncoding, "head_dim"),
}

NAMES: tuple[str, ...] = tuple(_REGISTRY)


def build(name: str, *, num_hiddens: int, num_heads: int, **options: Any) -> PositionalEncoding:
    """The encoding called ``name``, sized for attention with ``num_hiddens`` and ``num_heads``.

    Each encoding takes the size it needs: the model size ``d`` (sinusoidal, learned, N-D
    sinusoidal), the number of heads (ALiBi, T5, Kerple, FIRE) or the head size ``d / h`` (rotary, M-RoPE, Shaw).
    ``options`` go to the constructor; ``learned`` defaults to ``max_len=1000``. Input
    encodings (``none``, ``sinusoidal``, ``learned``, ``sinusoidal2d``, ``sinusoidal3d``) are
    added to the input by the caller; the others go to
    ``MultiHeadAttention(..., position=...)``. Check ``encoding.acts_on`` to tell them apart.

    Args:
        name: one of :data:`NAMES`.
        num_hiddens: model size ``d``.
        num_heads: number of heads ``h``; must divide ``d``.
        **options: constructor options of that encoding (e.g. ``max_distance=8`` for Shaw).

    Returns:
        The encoding module.
    """
    if name not in _REGISTRY:
        raise ValueError(f"name must be one of {', '.join(NAMES)}; got {name!r}")
    num_hiddens = require_positive_int("num_hiddens", num_hiddens)
    num_heads = require_positive_int("num_heads", num_heads)
    if num_hiddens % num_heads:
        raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
    entry = _REGISTRY[name]
    all_sizes = {"num_hiddens": num_hiddens, "num_heads": num_heads, "head_dim": num_hiddens // num_heads}
    sizes = {} if entry.size is None else {entry.size: all_sizes[entry.size]}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [
        p.name for p in inspect.signature(entry.cls).parameters.values() if p.kind in named and p.name not in sizes
    ]
    for key in options:
        if key not in accepted:
            options_named = [name for name in accepted if name not in ("device", "dtype")]  # every encoding takes these
            takes = f"it takes {', '.join(options_named)}" if options_named else "it takes no options"
            raise ValueError(f"option {key}={options[key]!r} is not accepted by {name!r}; {takes}")
    return entry.cls(**sizes, **{**entry.defaults, **options})


def acts_on(name: str) -> str:
    """Where the encoding called ``name`` acts (``"input"``, ``"query_key"`` or ``"scores"``), without building it."""
    if name not in _REGISTRY:
        raise ValueError(f"name must be one of {', '.join(NAMES)}; got {name!r}")
    return _REGISTRY[name].cls.acts_on
