"""Position-dependent query scalings of latent attention layers (Mistral Large 4's per-head softmax scaling).

Shape legend: b batch, h heads, l tokens, d features per head.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["HeadLogScaling"]


class HeadLogScaling(nn.Module):
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

    def __init__(
        self, num_heads: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.zero_()
            self.bias.fill_(1.0)

    def forward(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        log_position = torch.log1p(positions.to(torch.float64)).to(q.dtype)  # (l,) or (b, l)
        if log_position.dim() == 1:
            log_position = log_position[None]  # (1, l)
        multiplier = (
            self.scale.to(q.dtype)[None, :, None] * log_position[:, None, :] + self.bias.to(q.dtype)[None, :, None]
        )
        return q * multiplier[..., None]  # (b or 1, h, l, 1)
