"""Positional encodings, grouped by where they act (see :mod:`selfattn.positional.base`).

* added to the input: :class:`SinusoidalPositionalEncoding`, :class:`LearnedPositionalEncoding`,
  :class:`SinusoidalPositionalEncoding2D` / ``3D`` / ``ND``, :class:`NoPositionalEncoding`;
* rotating queries and keys: :class:`RotaryPositionalEncoding`, :class:`XPosEncoding`,
  :class:`RotaryPositionalEncoding2D` / ``3D`` / ``ND`` (axial, for images and video),
  :class:`MultimodalRotaryPositionalEncoding` (M-RoPE, Qwen2-VL's sections or Qwen3-VL's
  interleaved layout: a (time, height, width) position per token, built by
  :func:`multimodal_positions`);
* terms in the attention scores: :class:`ALiBiPositionalBias`, :class:`T5RelativePositionBias`,
  :class:`ShawRelativePositionEncoding` (which also adds a term to the values),
  :class:`KerplePositionalBias`, :class:`FIREPositionalBias`.

:func:`build` makes any of them by name (:data:`NAMES`) from the model size and head count.
"""

from selfattn.positional.alibi import ALiBiPositionalBias
from selfattn.positional.base import InputEncoding, PositionalEncoding, QueryKeyEncoding, ScoreEncoding
from selfattn.positional.fire import FIREPositionalBias
from selfattn.positional.identity import NoPositionalEncoding
from selfattn.positional.kerple import KerplePositionalBias
from selfattn.positional.layout import convert_rotary_layout
from selfattn.positional.learned import LearnedPositionalEncoding
from selfattn.positional.mrope import MultimodalRotaryPositionalEncoding
from selfattn.positional.multimodal_positions import MultimodalPositions, multimodal_positions
from selfattn.positional.registry import NAMES, build
from selfattn.positional.rotary import RotaryPositionalEncoding
from selfattn.positional.rotary_nd import (
    RotaryPositionalEncoding2D,
    RotaryPositionalEncoding3D,
    RotaryPositionalEncodingND,
)
from selfattn.positional.shaw import ShawRelativePositionEncoding
from selfattn.positional.sinusoidal import SinusoidalPositionalEncoding
from selfattn.positional.sinusoidal_nd import (
    SinusoidalPositionalEncoding2D,
    SinusoidalPositionalEncoding3D,
    SinusoidalPositionalEncodingND,
)
from selfattn.positional.t5 import T5RelativePositionBias
from selfattn.positional.xpos import XPosEncoding

__all__ = [
    "NAMES",
    "ALiBiPositionalBias",
    "FIREPositionalBias",
    "InputEncoding",
    "KerplePositionalBias",
    "LearnedPositionalEncoding",
    "MultimodalPositions",
    "MultimodalRotaryPositionalEncoding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "QueryKeyEncoding",
    "RotaryPositionalEncoding",
    "RotaryPositionalEncoding2D",
    "RotaryPositionalEncoding3D",
    "RotaryPositionalEncodingND",
    "ScoreEncoding",
    "ShawRelativePositionEncoding",
    "SinusoidalPositionalEncoding",
    "SinusoidalPositionalEncoding2D",
    "SinusoidalPositionalEncoding3D",
    "SinusoidalPositionalEncodingND",
    "T5RelativePositionBias",
    "XPosEncoding",
    "build",
    "convert_rotary_layout",
    "multimodal_positions",
]
