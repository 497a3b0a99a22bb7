"""The chapter's fixed sinusoidal encoding, added to the input."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from selfattn._validation import (
    require_floating,
    require_non_negative_int,
    require_position,
    require_positive_int,
    require_probability,
)
from selfattn.functional import sinusoidal_table
from selfattn.functional._sinusoidal import sinusoidal_rows
from selfattn.positional.base import InputEncoding, require_positions

__all__ = ["SinusoidalPositionalEncoding"]


class SinusoidalPositionalEncoding(InputEncoding):
    """``dropout(X + P[offset : offset + l])`` with the chapter's table ``P``.

    Unlike the textbook's class, ``max_len`` is only the size of the table built up front:
    longer sequences and any ``offset`` work (the table grows, or far-away rows are computed on
    demand). ``P`` is a non-persistent buffer, so it follows ``.to()`` and stays out of the
    ``state_dict``; the output has the input's dtype.

    Args:
        num_hiddens: model size ``d`` (odd sizes work).
        dropout: dropout probability on the sum.
        max_len: rows to build up front.
        base: the 10000 of the formula.
        device: where ``P`` is built.
        dtype: dtype of ``P`` (default float32); its angles are float64 whatever this is.

    Shape:
        X ``(..., l, d)`` -> ``(..., l, d)``.
    """

    P: torch.Tensor

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
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.max_len = require_positive_int("max_len", max_len)
        self.base = float(base)
        self.dropout = nn.Dropout(require_probability("dropout", dropout))
        # (1, max_len, d), as in the chapter, so `pe.P[0, :n, 6:10]` reads the same.
        table = sinusoidal_table(
            self.max_len, self.num_hiddens, base=self.base, dtype=dtype or torch.float32, device=device
        )
        self.register_buffer("P", table[None], persistent=False)

    def reset_parameters(self) -> None:
        """Rebuild ``P`` (after ``to_empty()`` from the meta device)."""
        self._build_table(self.P.shape[1])

    def _build_table(self, num_positions: int) -> None:
        """(Re)build the cached ``P`` with ``num_positions`` rows, keeping its device and dtype."""
        self.P = sinusoidal_table(
            num_positions, self.num_hiddens, base=self.base, dtype=self.P.dtype, device=self.P.device
        )[None]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # A dtype cast would round the float32 table; rebuild it from float64 angles instead.
        dtype_before = self.P.dtype
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply untyped
        if self.P.dtype != dtype_before:
            self._build_table(self.P.shape[1])
        return self

    def table(self, num_positions: int, offset: int = 0) -> torch.Tensor:
        """Rows ``offset .. offset + num_positions - 1`` of ``P``, ``(num_positions, d)``."""
        num_positions = require_positive_int("num_positions", num_positions)
        offset = require_non_negative_int("offset", offset)
        end, cached = offset + num_positions, self.P.shape[1]
        if cached < end and offset <= cached:
            # A longer sequence than seen so far: grow geometrically so growth is amortized.
            self._build_table(max(end, 2 * cached))
        if end <= self.P.shape[1]:
            return self.P[0, offset:end]
        # Far past the cache (decoding at a large offset): compute just these rows.
        return sinusoidal_table(
            num_positions, self.num_hiddens, base=self.base, offset=offset, dtype=self.P.dtype, device=self.P.device
        )

    def forward(self, X: torch.Tensor, offset: int = 0, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Add rows ``offset .. offset + l - 1`` of ``P``, or rows ``positions`` (``(l,)`` or ``(b, l)``)."""
        require_floating("X", X)
        if X.dim() < 2 or X.shape[-1] != self.num_hiddens:
            raise ValueError(f"X must have shape (..., length, {self.num_hiddens}), got {tuple(X.shape)}")
        if positions is not None:
            positions = require_positions(positions, X, offset)
            if not torch.compiler.is_compiling() and positions.numel():
                last = require_position("positions", int(positions.max()))
                if last >= 2 * self.P.shape[1]:  # far past P (as a large offset): just these rows, P kept
                    far = sinusoidal_rows(positions, self.num_hiddens, base=self.base, dtype=self.P.dtype)
                    far_encoded: torch.Tensor = self.dropout(X + far.to(X.device, X.dtype))
                    return far_encoded
                self.table(last + 1)  # grow P to cover them
            encoded: torch.Tensor = self.dropout(X + self.P[0][positions].to(X.dtype))
            return encoded
        if not X.shape[-2]:  # no rows to add
            require_non_negative_int("offset", offset)
            unchanged: torch.Tensor = self.dropout(X)
            return unchanged
        rows = self.table(X.shape[-2], offset)  # (l, d)
        added: torch.Tensor = self.dropout(X + rows.to(X.dtype))
        return added

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, max_len={self.max_len}, base={self.base:g}"
