"""A constant multiplier of the value heads (MiMo-V2-Flash's ``attention_value_scale``).

Shape legend: b batch, hk key/value heads, l tokens, dv value head size.
"""

from __future__ import annotations

import torch

from selfattn._validation import require_finite
from selfattn.parts.base import Part

__all__ = ["ValueScale"]


class ValueScale(Part):
    """Multiply every value by ``factor`` before attention (and before the cache stores it).

    MiMo-V2-Flash scales its values by ``attention_value_scale`` (0.707 by default) right after
    ``v_proj``. Attention's output is linear in the values, so this equals scaling the output of
    each head; it is a part at ``"values"`` so a cache keeps the scaled values, as transformers' does.

    Args:
        factor: the multiplier, finite and not zero.

    Shape:
        ``(b, hk, l, dv)`` -> ``(b, hk, l, dv)``.
    """

    slot = "values"

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = require_finite("factor", factor)
        if self.factor == 0:
            raise ValueError("factor must not be 0 (every value would vanish), got 0.0")

    def forward(self, v: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return v * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"
