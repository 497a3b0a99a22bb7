"""xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer"): rotary with a decay per pair."""

from __future__ import annotations

import math

import torch

from selfattn._validation import require_positive_finite
from selfattn.functional._rotary import (
    _check_rotary_inputs,
    _require_rotary_dim,
    _rotate_by_positions,
    rotary_frequencies,
)
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

__all__ = ["XPosEncoding"]


class XPosEncoding(KeepsTablePrecision, QueryKeyEncoding):
    """Rotary whose pair ``j`` also decays with distance: ``zeta_j^((m - n) / scale_base)``.

    Queries at position ``m`` are rotated as by :class:`RotaryPositionalEncoding` and scaled by
    ``zeta_j^(m / scale_base)``, keys at ``n`` by ``zeta_j^(-n / scale_base)``, with
    ``zeta_j = (2j / dh + gamma) / (1 + gamma)`` in ``(0, 1]``; their score is RoPE's times
    ``zeta_j^((m - n) / scale_base)`` pair by pair, which depends on ``m - n`` only.

    **Causal only.** The factor decays for keys behind the query (``n < m``) but *grows* for
    keys ahead of it, so use it with ``causal=True`` as the paper does. The scales are
    ``exp(+-|position| ln(zeta_0) / scale_base)``: they leave a dtype's range at large
    positions, so positions are limited to where the scales stay within the square root of the
    dtype's largest value (|position| <= 18,130 in float32, 18,129 in bf16, 2,266 in float16, 145,042 in
    float64 at the defaults: :meth:`max_position`); past that a ``ValueError`` says so.

    Args:
        head_dim: size of each query/key ``dh`` (even).
        base: the 10000 of the rotary formula.
        interleaved: pair convention, as for :class:`RotaryPositionalEncoding`.
        scale_base: the 512 of the paper.
        gamma: the 0.4 of the paper.
        device: where the tables live.
        dtype: accepted for uniformity; the tables stay float64.

    Shape:
        x ``(b, h, l, dh)``, positions ``(l,)`` or ``(b, 1, l)`` (one row per sequence) -> ``(b, h, l, dh)``.
    """

    exact_tables = ("inv_freq", "zeta")
    inv_freq: torch.Tensor
    zeta: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        scale_base: float = 512.0,
        gamma: float = 0.4,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = _require_rotary_dim(head_dim, "head_dim")
        require_positive_finite("scale_base", scale_base)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < math.inf:
            raise ValueError(f"gamma must be a positive number, got {gamma!r}")
        self.base = float(base)
        self.interleaved = bool(interleaved)
        self.scale_base = float(scale_base)
        self.gamma = float(gamma)
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("zeta", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def reset_parameters(self) -> None:
        """Recompute the tables (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """(Re)compute ``inv_freq`` and ``zeta`` ``(dh / 2,)`` in float64 on the buffers' device."""
        device = self.inv_freq.device
        self.inv_freq = rotary_frequencies(self.head_dim, self.base).to(device)
        pairs = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)  # 2j
        self.zeta = (pairs / self.head_dim + self.gamma) / (1 + self.gamma)

    def max_position(self, dtype: torch.dtype) -> int:
        """The largest ``|position|`` whose scales stay within ``sqrt(finfo(dtype).max)``."""
        steepest = -math.log(float(self.zeta.min()))
        return math.floor(0.5 * math.log(torch.finfo(dtype).max) * self.scale_base / steepest)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, keys: bool = False) -> torch.Tensor:
        """Queries (``keys=False``) or keys (``keys=True``) at ``positions``."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., length, {self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        _check_rotary_inputs(x, positions)
        limit = self.max_position(x.dtype)
        if positions.numel() and int(positions.abs().max()) > limit:
            raise ValueError(
                f"xpos: positions up to {int(positions.abs().max())} scale keys past what {x.dtype} holds safely; "
                f"|positions| must be <= {limit} (scale_base={self.scale_base:g})"
            )
        exponent = positions.to(torch.float64)[..., None] / self.scale_base  # (..., l, 1)
        scale = self.zeta.to(positions.device) ** (-exponent if keys else exponent)  # (..., l, dh/2)
        return _rotate_by_positions(
            x, positions, self.inv_freq, interleaved=self.interleaved, rotary_dim=self.head_dim, magnitude=scale
        )

    def encode_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        keys: torch.Tensor = self(k, positions, keys=True)
        return keys

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, base={self.base:g}, interleaved={self.interleaved}, "
            f"scale_base={self.scale_base:g}, gamma={self.gamma:g}"
        )
