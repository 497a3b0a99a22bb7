"""Sinusoidal encodings of grid positions (images, video): one 1-D table per axis, side by side."""

from __future__ import annotations

import numbers
from typing import cast

import torch
from torch import nn

from selfattn._validation import require_floating, require_non_negative_int, require_positive_int, require_probability
from selfattn.positional.base import InputEncoding
from selfattn.positional.sinusoidal import SinusoidalPositionalEncoding

__all__ = ["SinusoidalPositionalEncoding2D", "SinusoidalPositionalEncoding3D", "SinusoidalPositionalEncodingND"]


class SinusoidalPositionalEncodingND(InputEncoding):
    """``dropout(X + P)`` where ``P[i_1, ..., i_k]`` concatenates a 1-D sinusoidal row per axis.

    The ``d`` channels are split into ``k`` consecutive groups as evenly as possible (the
    first ``d mod k`` groups get one more), so any ``d >= k`` works, odd ones included; group
    ``a`` holds the chapter's 1-D table of its own width at position ``i_a``. Each axis's
    table is a :class:`SinusoidalPositionalEncoding`, so it grows with the grid and is a
    non-persistent buffer.

    Args:
        num_hiddens: channels ``d``.
        num_axes: grid dimensions ``k`` (2 for images, 3 for video).
        dropout: dropout probability on the sum.
        max_len: positions per axis to build up front.
        base: the 10000 of the formula.
        device: where the tables are built.
        dtype: dtype of the tables (default float32).

    Shape:
        X ``(..., n_1, ..., n_k, d)`` -> the same; ``offset`` is one int for every axis or a
        tuple of ``k`` ints, the position of the first cell along each axis.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_axes: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        *,
        base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.num_axes = require_positive_int("num_axes", num_axes)
        if self.num_hiddens < self.num_axes:
            raise ValueError(f"num_hiddens must give each of the {num_axes} axes a channel, got {num_hiddens}")
        self.dropout = nn.Dropout(require_probability("dropout", dropout))
        widths = [num_hiddens // num_axes + (axis < num_hiddens % num_axes) for axis in range(num_axes)]
        self.axes = nn.ModuleList(
            SinusoidalPositionalEncoding(width, max_len=max_len, base=base, device=device, dtype=dtype)
            for width in widths
        )

    def reset_parameters(self) -> None:
        """Rebuild every axis's table (after ``to_empty()`` from the meta device)."""
        for encoding in self.axes:
            assert isinstance(encoding, SinusoidalPositionalEncoding)
            encoding.reset_parameters()

    def _offsets(self, offset: int | tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(offset, numbers.Integral):
            return (require_non_negative_int("offset", offset),) * self.num_axes
        if not isinstance(offset, (tuple, list)) or len(offset) != self.num_axes:
            raise ValueError(f"offset must be an int or a tuple of {self.num_axes} ints, got {offset!r}")
        return tuple(require_non_negative_int("offset", value) for value in offset)

    def table(self, grid: tuple[int, ...], offset: int | tuple[int, ...] = 0) -> torch.Tensor:
        """``P`` for a grid of shape ``(n_1, ..., n_k)`` starting at ``offset``, ``(n_1, ..., n_k, d)``."""
        if len(grid) != self.num_axes:
            raise ValueError(f"grid must have {self.num_axes} sizes, got {tuple(grid)}")
        offsets = self._offsets(offset)
        groups = []
        for axis, (encoding, size, start) in enumerate(zip(self.axes, grid, offsets, strict=True)):
            rows = cast(SinusoidalPositionalEncoding, encoding).table(size, start)  # (n_a, width_a)
            broadcast = [1] * self.num_axes
            broadcast[axis] = size
            groups.append(rows.view(*broadcast, rows.shape[-1]).expand(*grid, rows.shape[-1]))  # (n_1..n_k, width_a)
        return torch.cat(groups, dim=-1)  # (n_1, ..., n_k, d)

    def forward(self, X: torch.Tensor, offset: int | tuple[int, ...] = 0) -> torch.Tensor:
        require_floating("X", X)
        if X.dim() < self.num_axes + 1 or X.shape[-1] != self.num_hiddens:
            axes = ", ".join(f"n_{axis + 1}" for axis in range(self.num_axes))
            raise ValueError(f"X must have shape (..., {axes}, {self.num_hiddens}), got {tuple(X.shape)}")
        grid = tuple(X.shape[-self.num_axes - 1 : -1])
        encoded: torch.Tensor = self.dropout(X + self.table(grid, offset).to(X.dtype))
        return encoded

    def extra_repr(self) -> str:
        widths = [encoding.num_hiddens for encoding in self.axes]
        return f"num_hiddens={self.num_hiddens}, num_axes={self.num_axes}, widths={widths}"


class SinusoidalPositionalEncoding2D(SinusoidalPositionalEncodingND):
    """:class:`SinusoidalPositionalEncodingND` over ``(height, width)``: X ``(..., H, W, d)``."""

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        *,
        base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(num_hiddens, 2, dropout, max_len, base=base, device=device, dtype=dtype)


class SinusoidalPositionalEncoding3D(SinusoidalPositionalEncodingND):
    """:class:`SinusoidalPositionalEncodingND` over ``(time, height, width)``: X ``(..., T, H, W, d)``."""

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        *,
        base: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(num_hiddens, 3, dropout, max_len, base=base, device=device, dtype=dtype)
