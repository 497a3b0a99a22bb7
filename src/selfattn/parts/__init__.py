"""The parts an attention layer is built from, each acting at one slot of its pass.

See :mod:`selfattn.parts.base` for the slots. :class:`~selfattn.MultiHeadAttention` takes parts as
``parts={"name": part}`` (the name is the attribute and the state dict prefix), and its older
keywords are shorthands for parts: ``qk_norm=True`` is ``HeadNorm`` at ``"queries"`` and
``"keys"``, ``temperature_tuning=`` is :class:`TemperatureTuning`, ``gated_output=True`` an
:class:`OutputGate` per feature.
"""

from selfattn.parts.base import HEAD_SLOTS, SLOTS, Part
from selfattn.parts.head_norm import HeadNorm
from selfattn.parts.output_gate import OutputGate
from selfattn.parts.query_scaling import HeadLogScaling, LogFloorScaling, TemperatureTuning
from selfattn.parts.value_scale import ValueScale

__all__ = [
    "HEAD_SLOTS",
    "SLOTS",
    "HeadLogScaling",
    "HeadNorm",
    "LogFloorScaling",
    "OutputGate",
    "Part",
    "TemperatureTuning",
    "ValueScale",
]
