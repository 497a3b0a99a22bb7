"""Argument checks shared by the public API; every failure is a ``ValueError`` naming the argument."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "MAX_EXACT_POSITION",
    "ArgumentTypeError",
    "require_bool",
    "require_dtype",
    "require_finite",
    "require_floating",
    "require_non_negative_int",
    "require_position",
    "require_positive_finite",
    "require_positive_int",
    "require_probability",
    "require_tensor",
    "require_temperature_tuning",
    "require_tuned_positions",
]

# float64 represents every integer up to 2**53 exactly; past it, positions (and the angles
# computed from them) silently merge.
MAX_EXACT_POSITION = 2**53


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` that ``except ValueError`` also catches."""


def require_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``: a string, a number or a tensor is refused, not read as truthy."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def require_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def require_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def require_position(name: str, value: object, count: int = 1) -> int:
    """A first position ``value`` such that ``value .. value + count - 1`` are exact in float64."""
    value = require_non_negative_int(name, value)
    if count - 1 > MAX_EXACT_POSITION:  # the count alone passes it: no first position would do
        raise ValueError(
            f"{count} positions from {name} {value} pass 2**53 (positions past it are not exact in float64)"
        )
    if value + count - 1 > MAX_EXACT_POSITION:
        raise ValueError(
            f"{name} must be at most 2**53 - {count - 1} (positions past 2**53 are not exact in float64), got {value}"
        )
    return value


def require_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")
    return float(value)


def require_positive_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a positive finite number, got {type(value).__name__} {value!r}")
    if not 0.0 < float(value) < math.inf:  # NaN fails it too; comparisons, not isfinite: dynamo traces them
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def require_finite(name: str, value: object) -> float:
    """A finite real number (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -math.inf < float(value) < math.inf:
        raise ValueError(f"{name} must be a finite number, got {value!r}")  # (comparisons: as above)
    return float(value)


def require_temperature_tuning(value: object) -> tuple[float, float]:
    """Llama 4's ``(attn_scale, floor_scale)``, both positive and finite (the layer's and the recipe's one check)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"temperature_tuning must be (attn_scale, floor_scale), got {value!r}")
    return (
        require_positive_finite("temperature_tuning[0] (attn_scale)", value[0]),
        require_positive_finite("temperature_tuning[1] (floor_scale)", value[1]),
    )


def require_tuned_positions(positions: torch.Tensor, scaling: str = "temperature_tuning") -> None:
    """Positions a query scaled by position may have: ``log(1 + floor((p + 1) / floor_scale))`` needs ``p >= 0``.

    A negative position (Llama 4 has none) would give ``log(0)`` or the log of a negative number: NaN.
    ``scaling`` names the scaling in the message.
    """
    if is_compiling() or not positions.numel():
        return  # the check reads the tensor back: eager mode only
    lowest = int(positions.min())
    if lowest < 0:
        formula = {
            "temperature_tuning": "log(1 + floor((p + 1) / floor_scale))",
            "LogFloorScaling": "log(1 + floor(p / original_length))",
        }.get(scaling, "its log")
        raise ValueError(
            f"positions must be non-negative with {scaling} (its factor {formula} is defined for p >= 0), "
            f"got a position of {lowest}"
        )


def require_dtype(name: str, value: object, *, floating: bool = True) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise ArgumentTypeError(
            f"{name} must be a torch.dtype such as torch.float32, got {type(value).__name__} {value!r}"
        )
    if floating and not value.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype, got {value}")
    return value


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_floating(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        # Integer inputs would silently truncate the encoding to zeros.
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")


def is_compiling() -> bool:
    """Whether a compiler is tracing: value checks and data-dependent choices read tensors back, so skip them.

    Call it as ``_validation.is_compiling()``: tests patch this one function to trace the graph a
    compiler would see in eager mode.
    """
    return bool(torch.compiler.is_compiling())


def in_func_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running: autograd Functions without functorch rules cannot."""
    return _peek_interpreter_stack() is not None


_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack  # bound once: a decoding step reads it
