"""Rotary position embedding (RoFormer): rotate pairs of features by position-dependent angles.

Feature pair ``j`` of a vector at position ``p`` is rotated by ``t = p * w_j`` with
``w_j = base^(-2j / r)`` (``r`` the number of rotated features)::

    (x_a, x_b) -> (x_a cos t - x_b sin t,  x_a sin t + x_b cos t)

so ``<R_m q, R_n k>`` depends on ``m - n`` only. The pairs are ``(x[2j], x[2j + 1])``
(``interleaved=True``, RoFormer and the chapter) or ``(x[j], x[j + r / 2])`` (half-split, as
in GPT-NeoX and Llama checkpoints); a checkpoint needs the convention it was trained with.

Shape legend: ``...`` any leading dimensions, l positions, d features, r rotated features.
"""

from __future__ import annotations

from typing import Literal

import torch

from selfattn._validation import require_positive_int
from selfattn.functional._sinusoidal import sinusoidal_frequencies

__all__ = ["apply_rotary", "rotary_angles", "rotary_frequencies"]

RotaryScaling = Literal["linear", "ntk"]


def _require_scaling(scaling: str | None, scaling_factor: float) -> tuple[str | None, float]:
    if scaling not in (None, "linear", "ntk"):
        raise ValueError(f"scaling must be None, 'linear' or 'ntk', got {scaling!r}")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)) or not scaling_factor >= 1.0:
        raise ValueError(f"scaling_factor must be a number >= 1, got {scaling_factor!r}")
    if scaling is None and scaling_factor != 1.0:
        raise ValueError(f"scaling_factor={scaling_factor!r} needs scaling='linear' or 'ntk'")
    return scaling, float(scaling_factor)


def rotary_frequencies(
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: RotaryScaling | None = None,
    scaling_factor: float = 1.0,
) -> torch.Tensor:
    """Angular frequency of each rotated pair, float64 ``(r / 2,)``, scaling folded in.

    Args:
        rotary_dim: number of rotated features ``r`` (even).
        base: the 10000 of the formula.
        scaling: ``"linear"`` (position interpolation: every angle divided by the factor, so
            ``factor`` times longer contexts map onto the trained range) or ``"ntk"``
            (NTK-aware: ``base`` multiplied by ``factor^(r / (r - 2))``, which stretches the
            low frequencies by about ``factor`` and leaves the highest one unchanged).
        scaling_factor: the context-length multiple, ``>= 1``.
    """
    rotary_dim = require_positive_int("rotary_dim", rotary_dim)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (features are rotated in pairs), got {rotary_dim}")
    scaling, scaling_factor = _require_scaling(scaling, scaling_factor)
    if scaling == "ntk" and rotary_dim > 2:
        base = float(base) * scaling_factor ** (rotary_dim / (rotary_dim - 2))
    freqs = sinusoidal_frequencies(rotary_dim, base=base)  # (r/2,) float64, base^(-2j/r)
    if scaling == "linear":
        freqs = freqs / scaling_factor
    return freqs


def _angle_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else the angles are exact to ~1e-10 at position 10^6.
    return torch.float32 if device.type == "mps" else torch.float64


def rotary_angles(positions: torch.Tensor, frequencies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``positions * frequencies``, ``(..., l, r / 2)``, in float64 (float32 on MPS).

    The integer positions are converted once, straight to the angle dtype, never through the
    input's dtype (bf16 holds integers exactly only up to 256).
    """
    angle_dtype = _angle_dtype(positions.device)
    angles = positions.to(angle_dtype)[..., None] * frequencies.to(positions.device, angle_dtype)  # (..., l, r/2)
    return torch.cos(angles), torch.sin(angles)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate all of ``x`` ``(..., l, r)`` by the ``(..., l, r / 2)`` angles; same dtype as ``cos``."""
    if interleaved:
        first, second = x[..., 0::2], x[..., 1::2]  # (..., l, r/2) each
    else:
        first, second = x.chunk(2, dim=-1)  # (..., l, r/2) each
    rotated_first = first * cos - second * sin
    rotated_second = first * sin + second * cos
    if interleaved:
        return torch.stack((rotated_first, rotated_second), dim=-1).flatten(-2)  # (..., l, r)
    return torch.cat((rotated_first, rotated_second), dim=-1)  # (..., l, r)


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    base: float = 10000.0,
    interleaved: bool = True,
    rotary_dim: int | None = None,
    scaling: RotaryScaling | None = None,
    scaling_factor: float = 1.0,
    frequencies: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` by their positions (RoPE).

    The angles are formed in float64 from the exact integer positions, and the rotation is
    done in float32 (float64 for float64 inputs) before one rounding to ``x``'s dtype, so a
    bf16 result equals the float64 formula rounded to bf16. Features past ``rotary_dim`` pass
    through unchanged (partial rotary, as in GPT-NeoX).

    Args:
        x: ``(..., l, d)`` queries or keys, floating point.
        positions: ``(l,)`` integer positions (or any integer shape broadcastable to
            ``x.shape[:-1]``); negative positions are fine.
        base: the 10000 of the formula.
        interleaved: pairs ``(2j, 2j + 1)`` if True, ``(j, j + r / 2)`` if False.
        rotary_dim: number of rotated features ``r`` (even, ``<= d``); default ``d``.
        scaling: ``None``, ``"linear"`` or ``"ntk"``; see :func:`rotary_frequencies`.
        scaling_factor: context-length multiple for ``scaling``.
        frequencies: precomputed :func:`rotary_frequencies` ``(r / 2,)`` (then ``base`` and
            ``scaling`` are ignored); modules pass their cached buffer here.

    Returns:
        ``(..., l, d)`` in ``x``'s dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point tensor of shape (..., length, features), got {getattr(x, 'shape', x)!r}"
        )
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        got = getattr(positions, "dtype", positions)
        raise ValueError(f"positions must be an integer tensor (never rounded through a float dtype), got {got!r}")
    if positions.dtype == torch.bool or positions.dim() == 0 or positions.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"positions must be integers of shape ({x.shape[-2]},), got {positions.dtype} {tuple(positions.shape)}"
        )
    features = x.shape[-1]
    rotary_dim = features if rotary_dim is None else require_positive_int("rotary_dim", rotary_dim)
    if rotary_dim > features:
        raise ValueError(f"rotary_dim must be at most the number of features {features}, got {rotary_dim}")
    if frequencies is None:
        frequencies = rotary_frequencies(rotary_dim, base=base, scaling=scaling, scaling_factor=scaling_factor)
    elif frequencies.shape != (rotary_dim // 2,) or rotary_dim % 2:
        got = tuple(frequencies.shape)
        raise ValueError(f"frequencies must have shape ({rotary_dim // 2},) for rotary_dim={rotary_dim}, got {got}")

    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rotary_angles(positions.to(x.device), frequencies)  # (..., l, r/2)
    rotated = _rotate(x[..., :rotary_dim].to(compute_dtype), cos.to(compute_dtype), sin.to(compute_dtype), interleaved)
    if rotary_dim == features:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)  # (..., l, d)
