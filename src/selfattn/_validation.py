"""Argument checks shared by the public API; every failure is a ``ValueError`` naming the argument."""

from __future__ import annotations

import numbers

import torch

__all__ = ["require_positive_int", "require_non_negative_int", "require_probability", "require_floating"]


def require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def require_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def require_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def require_floating(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        # Integer inputs would silently truncate the encoding to zeros.
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
