"""Packed documents: positions that restart per document, and document ids from cumulative lengths.

Shape legend: b batch, l tokens, k documents.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

import selfattn._validation as _validation

__all__ = ["cumulative_lengths_to_document_ids", "document_positions"]


def document_positions(
    document_ids: torch.Tensor, *, previous: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Positions that restart at 0 where ``document_ids`` ``(b, l)`` changes, ``(b, l)`` int64.

    Args:
        document_ids: ``(b, l)`` integer document labels.
        previous: document id and position ``(b,)`` of the token just before these (a cache's
            newest key): tokens that continue its document continue its positions.
    """
    index = torch.arange(document_ids.shape[-1], device=document_ids.device)  # (l,)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if previous is not None:
        starts[:, 0] = document_ids[:, 0] != previous[0]
    first = torch.where(starts, index, torch.full_like(index, -1)).cummax(dim=-1).values  # (b, l); -1: no start yet
    positions = index - first
    if previous is None:
        return positions
    return torch.where(first < 0, previous[1][:, None] + 1 + index, positions)


def cumulative_lengths_to_document_ids(
    cumulative_lengths: torch.Tensor | Sequence[torch.Tensor | Sequence[int]], batch: int, length: int
) -> torch.Tensor:
    """Document ids ``(b, l)`` from cumulative lengths (flash-attn's ``cu_seqlens``): document ``i`` gets id ``i``.

    Args:
        cumulative_lengths: ``(k + 1,)`` integers ``0 = c_0 < c_1 < ... < c_k = l`` shared by
            every row (document ``i`` holds tokens ``c_i .. c_{i+1} - 1``), or one such
            sequence per row (a list of ``b``, each with its own ``k``; or a ``(b, k + 1)`` tensor).
        batch: ``b``.
        length: the packed length ``l``.

    Raises:
        ValueError: not integers, fewer than 2 entries, not starting at 0, not strictly
            increasing, or not ending at ``length``; a list of the wrong length.
    """
    shared = isinstance(cumulative_lengths, torch.Tensor) and cumulative_lengths.dim() == 1
    if not shared and isinstance(cumulative_lengths, (list, tuple)):
        shared = all(isinstance(item, int) and not isinstance(item, bool) for item in cumulative_lengths)
    if shared:
        rows = [_check_cumulative_lengths("cumulative_lengths", cumulative_lengths, length)]
    else:
        if not isinstance(cumulative_lengths, (torch.Tensor, list, tuple)) or len(cumulative_lengths) != batch:
            got = (
                tuple(cumulative_lengths.shape) if isinstance(cumulative_lengths, torch.Tensor) else cumulative_lengths
            )
            raise ValueError(
                f"cumulative_lengths must be a 1-D integer tensor (k + 1,) shared by every row, or {batch} of them "
                f"(one per row), got {got!r}"
            )
        rows = [
            _check_cumulative_lengths(f"cumulative_lengths[{i}]", row, length)
            for i, row in enumerate(cumulative_lengths)
        ]
    tokens = torch.arange(length, device=rows[0].device)  # (l,)
    ids = torch.stack([torch.searchsorted(row, tokens, right=True) - 1 for row in rows])  # (1 or b, l)
    return ids.expand(batch, length)


def _check_cumulative_lengths(name: str, value: object, length: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be integers, got {value!r}") from None
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if value.dim() != 1 or value.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries (0 and the packed length), got shape {tuple(value.shape)}"
        )
    value = value.long()
    if _validation.is_compiling():
        return value  # value checks would read the tensor back: eager mode only
    listed = value.tolist()
    if listed[0] != 0:
        raise ValueError(f"{name} must start at 0, got {listed}")
    if any(b <= a for a, b in itertools.pairwise(listed)):
        raise ValueError(f"{name} must be strictly increasing (no empty document), got {listed}")
    if listed[-1] != length:
        raise ValueError(f"{name} must end at the packed length {length}, got {listed}")
    return value
