"""The chapter's fixed sinusoidal table, computed in float64 and cast once.

``P[i, 2j] = sin(i * w_j)`` and ``P[i, 2j + 1] = cos(i * w_j)`` with ``w_j = base^(-2j / d)``.
"""

from __future__ import annotations

import math

import torch

from selfattn._validation import require_dtype, require_position, require_positive_int

__all__ = ["sinusoidal_frequencies", "sinusoidal_rows", "sinusoidal_table"]


def _require_base(base: float) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1.0 < base < math.inf:
        raise ValueError(f"base must be a finite number greater than 1, got {base!r}")
    return float(base)


def sinusoidal_frequencies(num_hiddens: int, *, base: float = 10000.0) -> torch.Tensor:
    """Angular frequencies ``w_j = base^(-2j / d)`` for ``j = 0 .. ceil(d / 2) - 1``, float64."""
    num_hiddens = require_positive_int("num_hiddens", num_hiddens)
    base = _require_base(base)
    even_columns = torch.arange(0, num_hiddens, 2, dtype=torch.float64)  # 2j
    return base ** (-even_columns / num_hiddens)


def sinusoidal_table(
    num_positions: int,
    num_hiddens: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rows ``offset .. offset + num_positions - 1`` of the sinusoidal table.

    The angles are formed and reduced in float64 and only the final values are cast to
    ``dtype``, so a float32 table stays within 1e-6 of the exact formula at position 10^6
    (a float32 angle is already ~1e-3 off there). Odd ``num_hiddens`` gives ``ceil(d / 2)`` sine
    columns and ``floor(d / 2)`` cosine columns.

    Args:
        num_positions: number of rows ``n``.
        num_hiddens: number of columns ``d``.
        base: the 10000 of the formula.
        offset: position of the first row; the last row's position must not pass 2**53,
            where float64 stops representing every integer.
        dtype: floating ``torch.dtype`` of the result.
        device: device of the result.

    Returns:
        ``(n, d)`` table.
    """
    num_positions = require_positive_int("num_positions", num_positions)
    offset = require_position("offset", offset, num_positions)
    positions = torch.arange(offset, offset + num_positions, dtype=torch.int64)  # (n,)
    return sinusoidal_rows(positions, num_hiddens, base=base, dtype=dtype, device=device)


def sinusoidal_rows(
    positions: torch.Tensor,
    num_hiddens: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The rows of the sinusoidal table at integer ``positions`` (any shape ``s``, each at most 2**53), ``(*s, d)``,
    formed in float64 as :func:`sinusoidal_table` forms them."""
    dtype = require_dtype("dtype", dtype)
    freqs = sinusoidal_frequencies(num_hiddens, base=base)  # (ceil(d/2),)
    # float64 on the CPU: exact integer positions and an angle good to ~1e-10 at 10^6.
    angles = positions.to("cpu", torch.float64)[..., None] * freqs  # (*s, ceil(d/2))
    rows = torch.empty(*positions.shape, num_hiddens, dtype=torch.float64)
    rows[..., 0::2] = torch.sin(angles)
    rows[..., 1::2] = torch.cos(angles[..., : num_hiddens // 2])
    return rows.to(device=device, dtype=dtype)
