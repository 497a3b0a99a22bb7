"""RMSNorm of heads or features: QK-norm in each of its kinds, the value norm, an output norm per head."""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_positive_finite, require_positive_int
from selfattn.parts.base import HEAD_SLOTS, Part, require_slot

__all__ = ["HeadNorm"]


class HeadNorm(Part):
    """``x / rms(x) * w`` over the last ``size`` features, at one slot of the layer.

    The kinds the model families use are this one class at different slots and sizes:

    * per-head QK-norm before the rotation (Qwen3, Gemma 3): ``size = dq`` at ``"queries"`` / ``"keys"``;
    * QK-norm over the whole projection before the head split (OLMo 2, MiniMax-M2):
      ``size = h * dq`` at ``"query_features"`` (``hk * dq`` at ``"key_features"``);
    * QK-norm after the rotation (Hunyuan): ``"rotated_queries"`` / ``"rotated_keys"``;
    * without a weight (Gemma 4's value norm, Llama 4's L2 QK-norm): ``weighted=False``;
    * the value norm at ``"values"``; an output norm per head at ``"output_heads"``.

    A family whose norm multiplies by ``1 + w`` (Gemma) loads ``1 + w`` into ``weight``.

    Args:
        size: features normalised together.
        slot: where the layer applies it (see :mod:`selfattn.parts.base`).
        eps: added to the mean square.
        weighted: whether it has the learned ``weight`` ``(size,)`` (ones at first).
        device: where the weight is created.
        dtype: its dtype.
    """

    def __init__(
        self,
        size: int,
        *,
        slot: str,
        eps: float = 1e-6,
        weighted: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.slot = require_slot("slot", slot, HEAD_SLOTS)
        self.size = require_positive_int("size", size)
        self.eps = require_positive_finite("eps", eps)
        if not isinstance(weighted, bool):
            raise ValueError(f"weighted must be True or False, got {weighted!r}")
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype)) if weighted else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"HeadNorm of size {self.size} at slot {self.slot!r} got {x.shape[-1]} features")
        return nn.functional.rms_norm(x, (self.size,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.size}, slot={self.slot!r}, eps={self.eps}" + (
            "" if self.weight is not None else ", weighted=False"
        )
