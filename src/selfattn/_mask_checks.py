"""The checks of :mod:`selfattn.masks`: a rule's tensors when it is built, and against the call it is placed on.

Every failure is a ``ValueError`` that names the rule (``masks.documents``), the argument and
the value it got, and, for a size, the size the call has. Nothing is clamped: a tensor that
covers more or fewer queries, keys or sequences than the call is refused.

Shape legend: b batch, h heads, lq queries, lk keys of the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import selfattn._validation as _validation

__all__ = ["CallSizes", "require_fits", "require_index_tensor", "require_non_negative"]


@dataclass(frozen=True)
class CallSizes:
    """The sizes a rule is checked against; ``batch`` and ``heads`` are None where the heads are not ``(b, h, l, d)``."""

    batch: int | None
    heads: int | None
    num_queries: int
    num_keys: int


def _shown(value: object) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def require_index_tensor(rule: str, name: str, value: object, shapes: dict[int, str], *, kind: str) -> torch.Tensor:
    """``value`` as a tensor of ``kind`` (``"integer"`` or ``"bool"``) values, of one of ``shapes`` (dims: legend)."""
    if isinstance(value, torch.Tensor) and value.dim() in shapes:
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        if (kind == "bool" and value.dtype == torch.bool) or (kind == "integer" and integer):
            return value
    article = "an" if kind[0] in "aeiou" else "a"
    want = " or ".join(shapes.values())
    raise ValueError(f"masks.{rule}: {name} must be {article} {kind} tensor of shape {want}, got {_shown(value)}")


def require_non_negative(rule: str, name: str, value: torch.Tensor) -> None:
    """No negative entry in ``value`` (eager mode only: the check reads the tensor back)."""
    if _validation.is_compiling() or not value.numel():
        return
    lowest = int(value.min())
    if lowest < 0:
        raise ValueError(f"masks.{rule}: {name} must be non-negative, got {lowest} in {_shown(value)}")


def require_fits(
    rule: str, name: str, value: torch.Tensor, dim: int, size: int | None, what: str, *, broadcast: bool = False
) -> None:
    """``value.shape[dim]`` equals the call's ``size`` of ``what`` (or is 1, with ``broadcast``); None: not known."""
    got = value.shape[dim]
    if size is None or got == size or (broadcast and got == 1):
        return
    either = " (or 1, shared by all)" if broadcast else ""
    raise ValueError(
        f"masks.{rule}: {name} of shape {tuple(value.shape)} has {got} {what} in dimension {dim}, "
        f"the call has {size} {what}{either}"
    )
