"""Convert a checkpoint between the two rotary pair conventions by permuting W_q / W_k rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from selfattn._validation import require_positive_int

__all__ = ["convert_rotary_layout"]


def _head_permutation(head_dim: int, rotary_dim: int, to: str) -> torch.Tensor:
    """New row ``i`` of one head takes old row ``order[i]``."""
    half = rotary_dim // 2
    if to == "half_split":  # interleaved pair (2j, 2j + 1) -> (j, j + r/2)
        rotated = list(range(0, rotary_dim, 2)) + list(range(1, rotary_dim, 2))
    else:  # half-split pair (j, j + r/2) -> (2j, 2j + 1)
        rotated = [j + offset for j in range(half) for offset in (0, half)]
    return torch.tensor(rotated + list(range(rotary_dim, head_dim)))


def convert_rotary_layout(
    state_dict: Mapping[str, torch.Tensor],
    *,
    num_heads: int,
    to: Literal["half_split", "interleaved"],
    head_dim: int | None = None,
    rotary_dim: int | None = None,
    projections: Sequence[str] = ("W_q", "W_k"),
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` whose query/key projections use the other rotary pair convention.

    Rotary pairs features ``(2j, 2j + 1)`` (interleaved: RoFormer, Meta's Llama checkpoints) or
    ``(j, j + r / 2)`` (half-split: GPT-NeoX, Hugging Face). Moving the output rows of ``W_q``
    and ``W_k`` inside each head from one order to the other makes a model built with the
    other convention compute exactly the same attention (the score is a sum over pairs, so the
    order of pairs does not matter, only which features are paired).

    Args:
        state_dict: e.g. ``MultiHeadAttention.state_dict()`` (any keys; nested ones too).
        num_heads: heads of the query projection; with fewer rows, a key projection has
            ``rows / head_dim`` heads (grouped-query attention).
        to: ``"half_split"`` (from interleaved) or ``"interleaved"`` (from half-split).
        head_dim: features per head; default ``W_q`` rows / ``num_heads``.
        rotary_dim: rotated features per head (partial rotary); default ``head_dim``.
        projections: names of the query/key projections; every ``NAME.weight`` /
            ``NAME.bias`` entry (at any depth, e.g. ``layers.0.attn.W_q.weight``) is permuted.

    Returns:
        A new dict; other entries are the same tensors.

    Raises:
        ValueError: a bad ``to``, no projection found, or sizes that do not divide.
    """
    if to not in ("half_split", "interleaved"):
        raise ValueError(f"to must be 'half_split' or 'interleaved', got {to!r}")
    num_heads = require_positive_int("num_heads", num_heads)
    suffixes = tuple(f"{name}.{kind}" for name in projections for kind in ("weight", "bias"))
    targets = [key for key in state_dict if any(key == s or key.endswith("." + s) for s in suffixes)]
    if not targets:
        raise ValueError(f"state_dict has no {' / '.join(suffixes)} entries to convert; pass projections=")
    if head_dim is None:
        queries = [key for key in targets if key.endswith(f"{projections[0]}.weight")]
        if not queries:
            raise ValueError(f"state_dict has no {projections[0]}.weight to read head_dim from; pass head_dim=")
        rows = state_dict[queries[0]].shape[0]
        if rows % num_heads:
            raise ValueError(f"{queries[0]} has {rows} rows, not divisible by num_heads={num_heads}")
        head_dim = rows // num_heads
    head_dim = require_positive_int("head_dim", head_dim)
    rotary_dim = head_dim if rotary_dim is None else require_positive_int("rotary_dim", rotary_dim)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and at most head_dim={head_dim}, got {rotary_dim}")
    order = _head_permutation(head_dim, rotary_dim, to)
    converted = dict(state_dict)
    for key in targets:
        tensor = state_dict[key]
        rows = tensor.shape[0]
        if rows % head_dim:
            raise ValueError(f"{key} has {rows} rows, not a multiple of head_dim={head_dim}")
        heads = rows // head_dim
        index = (torch.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)  # (heads * dh,)
        converted[key] = tensor.index_select(0, index.to(tensor.device))
    return converted
