"""Axial rotary for images and video: each grid axis rotates its own block of features."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfattn._validation import require_positive_int
from selfattn.functional._rotary import _check_rotary_inputs, _rotate_by_positions, rotary_frequencies
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

__all__ = ["RotaryPositionalEncoding2D", "RotaryPositionalEncoding3D", "RotaryPositionalEncodingND"]


class RotaryPositionalEncodingND(KeepsTablePrecision, QueryKeyEncoding):
    """Axial rotary: the head is cut into one block per axis, each rotated by that axis's coordinate.

    The ``dh`` features form ``A`` equal contiguous blocks of ``b = 2 floor(dh / 2A)`` features,
    axis 0 first; block ``a`` is 1-D rotary of size ``b`` (frequencies ``base^(-2j / b)``)
    driven by coordinate ``a``, exactly :func:`~selfattn.functional.apply_axial_rotary`.
    Features past ``A b`` pass through unchanged. Scores depend on the coordinate differences
    only (shifting every coordinate by the same vector changes nothing).

    Positions are ``(l, A)`` integer coordinates (or ``(..., l, A)``). 1-D positions ``(l,)``,
    such as :class:`~selfattn.MultiHeadAttention` passes, are token indices: with ``grid``
    they are unravelled in raster order (last axis fastest; axis 0 keeps counting past
    ``grid[0]``, as frames or rows keep coming), without it the tokens run along the last axis
    (coordinates ``(0, .., 0, p)``), the convention of the tour's grid encodings.

    Args:
        head_dim: size of each query/key ``dh``; at least ``2 A``.
        num_axes: number of grid axes ``A``.
        base: the 10000 of the formula.
        interleaved: pair convention inside each block (see :func:`~selfattn.functional.apply_rotary`).
        grid: the grid's shape, for 1-D positions in raster order.

    Shape:
        x ``(b, h, l, dh)``, positions ``(l, A)`` or ``(l,)`` -> ``(b, h, l, dh)``.
    """

    exact_tables = ("inv_freq",)
    inv_freq: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        num_axes: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        grid: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = require_positive_int("head_dim", head_dim)
        self.num_axes = require_positive_int("num_axes", num_axes)
        self.block = 2 * (self.head_dim // (2 * self.num_axes))
        if self.block == 0:
            raise ValueError(
                f"head_dim={self.head_dim} is too small for {self.num_axes} axes (each needs at least 2 features)"
            )
        if grid is not None:
            grid = tuple(grid)
            if len(grid) != self.num_axes:
                raise ValueError(f"grid must have {self.num_axes} sizes, got {grid!r}")
            grid = tuple(require_positive_int("grid size", g) for g in grid)
        self.grid = grid
        self.base = float(base)
        self.interleaved = bool(interleaved)
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def reset_parameters(self) -> None:
        """Recompute the tables (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """(Re)compute one block's ``inv_freq`` ``(b / 2,)`` in float64 on the buffer's device."""
        self.inv_freq = rotary_frequencies(self.block, self.base).to(self.inv_freq.device)

    def coordinates(self, positions: torch.Tensor) -> torch.Tensor:
        """``(..., l, A)`` grid coordinates of 1-D token indices ``(..., l)`` (see the class docstring)."""
        if self.grid is None:
            zeros = torch.zeros_like(positions)
            return torch.stack([zeros] * (self.num_axes - 1) + [positions], dim=-1)  # (..., l, A)
        coords = []
        rest = positions
        for size in reversed(self.grid[1:]):
            coords.append(torch.remainder(rest, size))
            rest = torch.div(rest, size, rounding_mode="floor")
        coords.append(rest)
        return torch.stack(coords[::-1], dim=-1)  # (..., l, A)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., length, {self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)!r}")
        length = x.shape[-2]
        is_coordinates = positions.dim() >= 2 and positions.shape[-2:] == (length, self.num_axes)
        if not is_coordinates and positions.dim() >= 1 and positions.shape[-1] == length:
            positions = self.coordinates(positions)  # token indices (..., l) -> (..., l, A)
        if positions.dim() < 2 or positions.shape[-1] != self.num_axes or positions.shape[-2] != x.shape[-2]:
            raise ValueError(
                f"positions must have shape ({x.shape[-2]}, {self.num_axes}) or ({x.shape[-2]},), "
                f"got {tuple(positions.shape)}"
            )
        _check_rotary_inputs(x, positions[..., 0])
        block = self.block
        pieces = [
            _rotate_by_positions(
                x[..., a * block : (a + 1) * block],
                positions[..., a],
                self.inv_freq,
                interleaved=self.interleaved,
                rotary_dim=block,
            )
            for a in range(self.num_axes)
        ]
        if self.num_axes * block < self.head_dim:
            pieces.append(x[..., self.num_axes * block :])
        return torch.cat(pieces, dim=-1)  # (..., l, dh)

    def extra_repr(self) -> str:
        grid = "" if self.grid is None else f", grid={self.grid}"
        return (
            f"head_dim={self.head_dim}, num_axes={self.num_axes}, block={self.block}, base={self.base:g}, "
            f"interleaved={self.interleaved}{grid}"
        )


class RotaryPositionalEncoding2D(RotaryPositionalEncodingND):
    """Axial rotary over an image's ``(row, column)`` coordinates; see :class:`RotaryPositionalEncodingND`."""

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        grid: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(head_dim, 2, base, interleaved, grid=grid, device=device, dtype=dtype)


class RotaryPositionalEncoding3D(RotaryPositionalEncodingND):
    """Axial rotary over a video's ``(frame, row, column)`` coordinates; see :class:`RotaryPositionalEncodingND`."""

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        grid: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(head_dim, 3, base, interleaved, grid=grid, device=device, dtype=dtype)
