"""Output gates: the merged heads multiplied by a gate computed from the layer's input.

Shape legend: b batch, lq queries, h heads, dv value head size, d_in the queries' features.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.parts.base import Part

__all__ = ["OutputGate"]

_ACTIVATIONS = ("sigmoid", "softplus")


class OutputGate(Part, nn.Linear):
    """``merged * act(W_g(queries))``, per output feature or per head, before ``W_o``.

    The gate is an ``nn.Linear`` from the layer's queries, so its parameters are ``weight``
    ``(h * dv, d_in)`` per feature or ``(h, d_in)`` per head (and ``bias``).

    * per feature, sigmoid: Qwen3-Next's and Qwen3.5's full-attention layers (gate rows taken from
      each head's ``q_proj`` rows), Laguna;
    * per head: one gate value multiplies every feature of its head (Step-3.7, LFM3), with a
      sigmoid or a softplus.

    Args:
        in_features: ``d_in``, the queries' feature size.
        num_heads: ``h``.
        head_dim: ``dv``.
        per: ``"feature"`` or ``"head"``.
        activation: ``"sigmoid"`` or ``"softplus"``.
        bias: whether ``W_g`` has a bias.
    """

    slot = "merged"

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        head_dim: int,
        *,
        per: str = "feature",
        activation: str = "sigmoid",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if per not in ("feature", "head"):
            raise ValueError(f"per must be 'feature' or 'head', got {per!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be True or False, got {bias!r}")
        heads, size = require_positive_int("num_heads", num_heads), require_positive_int("head_dim", head_dim)
        outputs = heads * size if per == "feature" else heads
        nn.Linear.__init__(self, require_positive_int("in_features", in_features), outputs, bias, device, dtype)
        self.num_heads, self.head_dim, self.per, self.activation = heads, size, per, activation

    def forward(self, merged: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = nn.functional.linear(queries, self.weight, self.bias)  # (b, lq, h * dv) or (b, lq, h)
        gate = torch.sigmoid(logits) if self.activation == "sigmoid" else nn.functional.softplus(logits)
        if self.per == "feature":
            return merged * gate
        b, lq, _ = merged.shape
        heads = merged.view(b, lq, self.num_heads, self.head_dim)  # (b, lq, h, dv)
        return (heads * gate[..., None]).flatten(2)  # (b, lq, h * dv)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, per={self.per!r}, activation={self.activation!r}"
