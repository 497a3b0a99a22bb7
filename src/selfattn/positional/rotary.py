"""Rotary position embedding (RoPE), applied to the per-head queries and keys."""

from __future__ import annotations

import torch

from selfattn._validation import require_positive_int
from selfattn.functional import apply_rotary, rotary_frequencies
from selfattn.functional._rotary import RotaryScaling
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

__all__ = ["RotaryPositionalEncoding"]


class RotaryPositionalEncoding(KeepsTablePrecision, QueryKeyEncoding):
    """Rotate each query and key by its position, so their scores depend on distance only.

    Pass it to :class:`~selfattn.MultiHeadAttention` as ``position=``; it is applied to the
    queries and to each new key before the key is cached. See :func:`~selfattn.functional.apply_rotary`
    for the formula and the pair conventions.

    The inverse frequencies are a float64 non-persistent buffer that follows ``.to(device)``
    but not ``.to(dtype)``; angles are formed from the exact integer positions on every call
    (O(l * dh), negligible next to attention), so no cache can go stale under an offset.

    Args:
        head_dim: size of each query/key ``dh``.
        base: the 10000 of the formula.
        interleaved: rotate pairs ``(2j, 2j + 1)`` (RoFormer) if True, ``(j, j + r / 2)``
            (GPT-NeoX, Llama) if False.
        rotary_dim: rotate only the first ``r`` features (even, ``<= head_dim``); default all.
        scaling: ``None``, ``"linear"`` (position interpolation) or ``"ntk"`` (NTK-aware base).
        scaling_factor: how many times longer than the trained context, ``>= 1``.
        device: where the inverse frequencies live.
        dtype: accepted for uniformity; the frequencies stay float64.

    Shape:
        x ``(b, h, l, dh)``, positions ``(l,)`` or per sequence ``(b, 1, l)`` -> ``(b, h, l, dh)``.
    """

    exact_tables = ("inv_freq",)
    inv_freq: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        rotary_dim: int | None = None,
        scaling: RotaryScaling | None = None,
        scaling_factor: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.head_dim = require_positive_int("head_dim", head_dim)
        self.rotary_dim = self.head_dim if rotary_dim is None else require_positive_int("rotary_dim", rotary_dim)
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be at most head_dim={self.head_dim}, got {rotary_dim}")
        self.base = float(base)
        self.interleaved = bool(interleaved)
        self.scaling = scaling
        self.scaling_factor = float(scaling_factor)
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """(Re)compute ``inv_freq`` ``(r / 2,)`` in float64 on the buffer's device."""
        self.inv_freq = rotary_frequencies(
            self.rotary_dim, base=self.base, scaling=self.scaling, scaling_factor=self.scaling_factor
        ).to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., length, {self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        return apply_rotary(
            x, positions, interleaved=self.interleaved, rotary_dim=self.rotary_dim, frequencies=self.inv_freq
        )

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling!r}, scaling_factor={self.scaling_factor:g}"
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"interleaved={self.interleaved}{scaling}"
        )
