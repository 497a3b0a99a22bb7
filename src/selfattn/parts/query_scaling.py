"""Query scaling by position: each query is multiplied by a factor that grows with its position.

Three forms are in use (``p`` is the query's position, ``log`` the natural logarithm):

* :class:`TemperatureTuning`, Llama 4's NoPE layers: ``1 + a * log(1 + floor((p + 1) / f))``;
* :class:`LogFloorScaling`, Mistral 3 / Ministral 3 and Mistral 4 (``llama_4_scaling_beta``):
  ``1 + beta * log(1 + floor(p / L0))``;
* :class:`HeadLogScaling`, Mistral Large 4: ``s_h * log(p + 1) + b_h``, learned per head.

Each acts at the layer's ``"queries"`` slot, before the rotation (the factor is a scalar per
query, so before or after is the same). Factors are computed in float64, then cast.

Shape legend: b batch, h heads, l tokens, d features per head.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_finite, require_positive_finite, require_positive_int, require_tuned_positions
from selfattn.parts.base import Part, token_positions

__all__ = ["HeadLogScaling", "LogFloorScaling", "TemperatureTuning"]


class TemperatureTuning(Part):
    """Multiply the query at position ``p`` by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``.

    Llama 4's NoPE layers (``attn_temperature_tuning``), which sharpen attention at long range.

    Args:
        attn_scale: ``a``, positive.
        floor_scale: ``f``, positive.
    """

    slot = "queries"

    def __init__(self, attn_scale: float, floor_scale: float) -> None:
        super().__init__()
        self.attn_scale = require_positive_finite("temperature_tuning[0] (attn_scale)", attn_scale)
        self.floor_scale = require_positive_finite("temperature_tuning[1] (floor_scale)", floor_scale)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time = token_positions(positions)  # (l,) or (b, 1, l)
        require_tuned_positions(time)
        steps = torch.floor((time.to(torch.float64) + 1) / self.floor_scale)
        return q * (1 + self.attn_scale * torch.log1p(steps)).to(q.dtype)[..., None]  # (b, h, l, d)

    def extra_repr(self) -> str:
        return f"attn_scale={self.attn_scale}, floor_scale={self.floor_scale}"


class LogFloorScaling(Part):
    """Multiply the query at position ``p`` by ``1 + beta * log(1 + floor(p / original_length))``.

    Mistral 3, Ministral 3 and Mistral 4 (``rope_parameters["llama_4_scaling_beta"]`` with
    ``original_max_position_embeddings``).

    Args:
        beta: the slope, a finite number.
        original_length: ``L0``, positive.

    Raises:
        ValueError: in ``forward``, a negative position (the factor's log would be of 0 or less).
    """

    slot = "queries"

    def __init__(self, beta: float, original_length: float) -> None:
        super().__init__()
        self.beta = require_finite("beta", beta)
        self.original_length = require_positive_finite("original_length", original_length)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time = token_positions(positions)  # (l,) or (b, 1, l)
        require_tuned_positions(time, "LogFloorScaling")
        steps = torch.floor(time.to(torch.float64) / self.original_length)
        return q * (1 + self.beta * torch.log1p(steps)).to(q.dtype)[..., None]  # (b, h, l, d)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, original_length={self.original_length}"


class HeadLogScaling(Part):
    """Multiply head ``i``'s query at position ``p`` by ``scale_i * log(p + 1) + bias_i`` (learned per head).

    Mistral Large 4's ``softmax_scaling``: a temperature that grows with the position, one slope and
    one offset per head. Its parameters are named ``scale`` and ``bias`` as in transformers. At
    first ``scale`` is 0 and ``bias`` 1: no change.

    Args:
        num_heads: ``h``.
        device: where the parameters are created.
        dtype: their dtype.

    Shape:
        q ``(b, h, l, d)``, positions ``(l,)`` or ``(b, l)`` -> ``(b, h, l, d)``.
    """

    slot = "queries"

    def __init__(
        self, num_heads: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.scale = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.zero_()
            self.bias.fill_(1.0)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time = token_positions(positions)  # (l,) or (b, 1, l)
        log_position = torch.log1p(time.to(torch.float64)).to(q.dtype)
        if log_position.dim() == 1:
            log_position = log_position[None, None]  # (1, 1, l)
        multiplier = self.scale.to(q.dtype)[:, None] * log_position + self.bias.to(q.dtype)[:, None]  # (b, h, l)
        return q * multiplier[..., None]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
