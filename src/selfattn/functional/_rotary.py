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

from collections.abc import Mapping
from typing import Any, Literal

import torch

from selfattn._validation import require_bool, require_positive_finite, require_positive_int
from selfattn.functional._rotary_scaling import (
    RotaryParameters,
    check_partial_rotary_factor,
    parse_rotary_scaling,
    scaled_rotary_parameters,
)
from selfattn.functional._sinusoidal import _require_base

__all__ = ["apply_axial_rotary", "apply_rotary", "rotary_angles", "rotary_frequencies", "rotary_parameters"]

RotaryScalingName = Literal["default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"]
# A type name (with ``scaling_factor``) or a Hugging Face ``rope_scaling`` dict.
RotaryScaling = RotaryScalingName | Mapping[str, Any]


def _require_rotary_dim(rotary_dim: int, name: str = "rotary_dim") -> int:
    """``rotary_dim`` (called ``name`` in the error) as a positive even int."""
    rotary_dim = require_positive_int(name, rotary_dim)
    if rotary_dim % 2:
        raise ValueError(f"{name} must be even (features are rotated in pairs), got {rotary_dim}")
    return rotary_dim


def rotary_parameters(
    rotary_dim: int,
    base: float = 10000.0,
    *,
    scaling: RotaryScaling | None = None,
    scaling_factor: float = 1.0,
    seq_len: int | None = None,
) -> RotaryParameters:
    """Inverse frequencies ``(r / 2,)`` (float64) and attention factor of a scaling method.

    The attention factor multiplies cos and sin, i.e. queries and keys (YaRN, LongRoPE; 1 for
    the others). See :mod:`selfattn.functional._rotary_scaling` for every formula.

    Args:
        rotary_dim: number of rotated features ``r`` (even).
        base: the 10000 of the formula (``rope_theta``).
        scaling: ``None``; a type name (``"linear"``, ``"ntk"``, ...) whose ``factor`` is
            ``scaling_factor``; or a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict
            such as ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
            4096}`` (legacy ``"type"`` accepted).
        scaling_factor: the factor of a scaling given by name, ``>= 1``.
        seq_len: the current length, for ``dynamic`` and ``longrope`` (``None``: the trained one).

    Raises:
        ValueError: unknown type or bad parameters, named in the message.
    """
    rotary_dim = _require_rotary_dim(rotary_dim)
    config = parse_rotary_scaling(scaling, scaling_factor)
    if config is not None and "rope_theta" in getattr(scaling, "keys", lambda: ())():
        theta = scaling["rope_theta"]  # type: ignore[index]
        if float(theta) != float(base):
            raise ValueError(f"scaling['rope_theta']={theta!r} disagrees with base={base!r}")
    if seq_len is not None:
        seq_len = require_positive_int("seq_len", seq_len)
    return scaled_rotary_parameters(rotary_dim, _require_base(base), config, seq_len=seq_len)


def rotary_frequencies(
    rotary_dim: int,
    base: float = 10000.0,
    *,
    scaling: RotaryScaling | None = None,
    scaling_factor: float = 1.0,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Angular frequency of each rotated pair, float64 ``(r / 2,)``, scaling folded in.

    Same arguments as :func:`rotary_parameters` (which also returns the attention factor):
    ``"linear"`` divides every frequency by the factor (position interpolation); ``"ntk"``
    multiplies ``base`` by ``factor^(r / (r - 2))``; ``"dynamic"``, ``"yarn"``, ``"llama3"``
    and ``"longrope"`` take a dict with their parameters.
    """
    return rotary_parameters(
        rotary_dim, base, scaling=scaling, scaling_factor=scaling_factor, seq_len=seq_len
    ).frequencies


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


def signed_angle_rows(cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``(..., l, 2r)``: cos of every feature's pair, then its sin signed as :func:`_rotate_swapped` adds it.

    With these rows the rotation is ``x * cos_row + swap(x) * signed_sin_row``, which rounds exactly
    as :func:`_rotate` (``a - b`` is ``a + (-b)``, and a sum of two terms does not depend on their order).
    """
    if interleaved:
        cos_row = torch.stack((cos, cos), dim=-1).flatten(-2)  # (..., l, r): c0 c0 c1 c1 ...
        sin_row = torch.stack((-sin, sin), dim=-1).flatten(-2)  # -s0 s0 -s1 s1 ...
    else:
        cos_row, sin_row = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return torch.cat((cos_row, sin_row), dim=-1)


def _rotate_swapped(
    x: torch.Tensor, cos_row: torch.Tensor, sin_row: torch.Tensor, *, interleaved: bool, rotary_dim: int
) -> torch.Tensor:
    """:func:`_rotate_by_angles` from the two halves of :func:`signed_angle_rows` (``(..., l, r)`` each, in
    :func:`rotation_dtype` of ``x``), in fewer operations; same bits."""
    # Each conversion, slice or op left out below is a few microseconds of a decoding step (no-op casts too).
    whole = rotary_dim == x.shape[-1]
    part = x if whole else x[..., :rotary_dim]
    compute_dtype = cos_row.dtype
    if part.dtype != compute_dtype:
        part = part.to(compute_dtype)
    if interleaved:
        swapped = part.reshape(*part.shape[:-1], rotary_dim // 2, 2).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    else:
        swapped = part.roll(rotary_dim // 2, dims=-1)  # (second half, first half): one op for chunk and cat
    rotated = part * cos_row + swapped * sin_row  # not addcmul: a fused multiply-add would round differently
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    if whole:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)  # (..., l, d)


def _check_rotary_inputs(x: torch.Tensor, positions: torch.Tensor) -> None:
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
    if positions.dim() == 1:
        return  # (l,): every row of x at the same positions
    if positions.dim() == 2 and x.dim() == 4 and positions.shape[0] == x.shape[0] != 1:
        # Broadcasting would pair a (b, l) tensor's rows with the heads of x (b, h, l, d), silently when b == h.
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} for x of shape {tuple(x.shape)} (b, h, l, d): pass "
            "positions[:, None] ((b, 1, l)) for one row per sequence, or (1, h, l) for one per head"
        )
    try:
        grown = torch.broadcast_shapes(positions.shape, x.shape[:-1])  # type: ignore[no-untyped-call]  # torch: untyped
        fits = grown == x.shape[:-1]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} must broadcast to x.shape[:-1] = {tuple(x.shape[:-1])}"
        )


def _rotate_by_positions(
    x: torch.Tensor,
    positions: torch.Tensor,
    frequencies: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
    magnitude: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """The rotation itself, inputs already checked; ``magnitude`` (a float or float64 ``(..., l, r / 2)``)
    multiplies cos and sin (an attention factor, xPos's decay)."""
    cos, sin = rotary_angles(positions.to(x.device), frequencies)  # (..., l, r/2)
    if not isinstance(magnitude, float) or magnitude != 1.0:
        magnitude = magnitude.to(cos.device, cos.dtype) if isinstance(magnitude, torch.Tensor) else magnitude
        cos, sin = cos * magnitude, sin * magnitude
    return _rotate_by_angles(x, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)


def rotation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a rotation of ``x`` is computed in: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rotate_by_angles(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` by ``(..., l, r / 2)`` angles (any float dtype:
    they are cast to :func:`rotation_dtype`, a no-op when already there), one rounding to ``x``'s dtype."""
    compute_dtype = rotation_dtype(x)
    rotated = _rotate(x[..., :rotary_dim].to(compute_dtype), cos.to(compute_dtype), sin.to(compute_dtype), interleaved)
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)  # (..., l, d)


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
    attention_factor: float | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` by their positions (RoPE).

    The angles are formed in float64 from the exact integer positions, and the rotation is
    done in float32 (float64 for float64 inputs) before one rounding to ``x``'s dtype, so a
    bf16 result equals the float64 formula rounded to bf16. Features past ``rotary_dim`` pass
    through unchanged (partial rotary, as in GPT-NeoX).

    Args:
        x: ``(..., l, d)`` queries or keys, floating point.
        positions: ``(l,)`` integer positions (or any integer shape broadcastable to
            ``x.shape[:-1]``: ``(b, 1, l)`` one row per sequence; a ``(b, l)`` tensor for 4-D ``x``, whose
            rows broadcasting would pair with the heads, is refused); negative positions are fine.
        base: the 10000 of the formula.
        interleaved: pairs ``(2j, 2j + 1)`` if True, ``(j, j + r / 2)`` if False.
        rotary_dim: number of rotated features ``r`` (even, ``<= d``); default ``d``.
        scaling: ``None``, a type name or a Hugging Face ``rope_scaling`` dict; see
            :func:`rotary_parameters`.
        scaling_factor: context-length multiple for a ``scaling`` given by name.
        frequencies: precomputed :func:`rotary_frequencies` ``(r / 2,)`` (then ``base`` and
            ``scaling`` are ignored); modules pass their cached buffer here.
        attention_factor: multiplies cos and sin; default: the scaling's own (YaRN,
            LongRoPE), or 1 with ``frequencies``.
        seq_len: current length for ``dynamic`` / ``longrope`` scaling; default the largest
            position + 1 (as Hugging Face does).

    Returns:
        ``(..., l, d)`` in ``x``'s dtype.
    """
    _check_rotary_inputs(x, positions)
    interleaved = require_bool("interleaved", interleaved)  # a string read as True paired the wrong features
    features = x.shape[-1]
    rotary_dim = features if rotary_dim is None else require_positive_int("rotary_dim", rotary_dim)
    if rotary_dim > features:
        raise ValueError(f"rotary_dim must be at most the number of features {features}, got {rotary_dim}")
    check_partial_rotary_factor(scaling, features, rotary_dim)
    if frequencies is None:
        if seq_len is None and isinstance(scaling, (str, Mapping)) and positions.numel():
            seq_len = max(int(positions.max()) + 1, 1)
        params = rotary_parameters(rotary_dim, base, scaling=scaling, scaling_factor=scaling_factor, seq_len=seq_len)
        frequencies = params.frequencies
        if attention_factor is None:
            attention_factor = params.attention_factor
    elif rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (features are rotated in pairs), got {rotary_dim}")
    elif not isinstance(frequencies, torch.Tensor) or frequencies.shape != (rotary_dim // 2,):
        got = tuple(frequencies.shape) if isinstance(frequencies, torch.Tensor) else type(frequencies).__name__
        raise ValueError(
            f"frequencies must be a tensor of shape ({rotary_dim // 2},) for rotary_dim={rotary_dim}, got {got}"
        )
    if attention_factor is None:
        attention_factor = 1.0
    else:
        attention_factor = require_positive_finite("attention_factor", attention_factor)
    return _rotate_by_positions(
        x, positions, frequencies, interleaved=interleaved, rotary_dim=rotary_dim, magnitude=float(attention_factor)
    )


def apply_axial_rotary(
    x: torch.Tensor,
    coordinates: torch.Tensor,
    *,
    base: float = 10000.0,
    interleaved: bool = True,
) -> torch.Tensor:
    """Axial (N-D) rotary for images and video: one block of features per axis.

    The ``d`` features are cut into ``A`` equal contiguous blocks of ``b = 2 floor(d / 2A)``
    features, axis 0 first; block ``a`` is rotated as 1-D rotary of size ``b`` (frequencies
    ``base^(-2j / b)``) by coordinate ``a``. Features past ``A b`` pass through unchanged.
    Scores then depend on the coordinate differences only, axis by axis.

    Args:
        x: ``(..., l, d)`` queries or keys.
        coordinates: ``(l, A)`` integer grid coordinates (or broadcastable ``(..., l, A)``).
        base: the 10000 of the formula.
        interleaved: the pair convention inside each block (see :func:`apply_rotary`).

    Returns:
        ``(..., l, d)`` in ``x``'s dtype.
    """
    if not isinstance(coordinates, torch.Tensor) or coordinates.dim() < 2:
        raise ValueError(
            f"coordinates must be an integer tensor of shape (length, axes), got {getattr(coordinates, 'shape', coordinates)!r}"
        )
    axes = coordinates.shape[-1]
    if axes == 0:
        raise ValueError(f"coordinates must have at least one axis, got shape {tuple(coordinates.shape)}")
    features = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0
    block = 2 * (features // (2 * axes))
    if block == 0:
        raise ValueError(f"x has {features} features, too few for {axes} axes (each needs at least 2)")
    _check_rotary_inputs(x, coordinates[..., 0])
    frequencies = rotary_frequencies(block, base)
    pieces = [
        _rotate_by_positions(
            x[..., a * block : (a + 1) * block],
            coordinates[..., a],
            frequencies,
            interleaved=interleaved,
            rotary_dim=block,
        )
        for a in range(axes)
    ]
    if axes * block < features:
        pieces.append(x[..., axes * block :])
    return torch.cat(pieces, dim=-1)  # (..., l, d)
