"""What the ragged routes share: groups of sequences of one valid length, and when a call is ragged.

Shape legend: b batch, l queries and keys.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall, ModuleInputs
from selfattn.masks import Causal, ValidLengths

__all__ = ["length_groups", "pick_rows", "ragged_declines"]


def ragged_declines(call: AttentionCall) -> str | None:
    """Why neither ragged route can take the call, or None (then ``call.ragged_lengths`` is set); once per call."""
    return call.remember("ragged_declines", _ragged_declines)


def _ragged_declines(call: AttentionCall) -> str | None:
    if call.inputs is None:
        return "not a module call (the ragged routes project per group)"
    if call.inputs.has_cache:
        return "a cache"
    if call.return_weights:
        return "the weights were asked for"
    if call.term is not None:
        return "a score term"
    if not call.visibility.only(Causal, ValidLengths) or call.visibility.valid_lens is None:
        return "not valid_lens (and causal) alone"
    if call.visibility.valid_lens.dim() != 1:
        return "per-query valid_lens"
    if call.visibility.q_first != 0:
        return "not self-attention over whole sequences"
    if call.ragged_lengths is None:
        return "compiling" if call.compiling else "more distinct valid lengths than groups pay for"
    return None


def length_groups(lengths: list[int], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """``(length, rows)`` per distinct length, shortest first: a slice for neighbouring rows, else an index tensor."""
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for length in sorted(set(lengths)):
        rows = [row for row, value in enumerate(lengths) if value == length]
        if rows == list(range(rows[0], rows[-1] + 1)):
            groups.append((length, slice(rows[0], rows[-1] + 1)))
        else:
            groups.append((length, torch.tensor(rows, device=device)))
    return groups


def pick_rows(x: torch.Tensor, take: slice | torch.Tensor) -> torch.Tensor:
    """Rows ``take`` of ``x``'s first dimension: a view for a slice, one ``index_select`` otherwise."""
    return x[take] if isinstance(take, slice) else x.index_select(0, take)


def group_positions(positions: torch.Tensor, length: int, take: slice | torch.Tensor) -> torch.Tensor:
    """The first ``length`` positions of the group's rows: ``(length,)``, ``(b_g, length)`` or M-RoPE's ``(3, b_g, length)``."""
    positions = positions[..., :length]
    if positions.dim() == 1:
        return positions
    return pick_rows(positions.movedim(-2, 0), take).movedim(0, -2)  # the batch axis is the one before the last


def project_keys(
    inputs: ModuleInputs, length: int, take: slice | torch.Tensor, query_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values, projected and split: ``(b_g, hk, length, dh)`` each.

    ``query_rows``: the group's query rows, reused as its key rows in self-attention.
    """
    module = inputs.module
    if query_rows is not None and inputs.keys is inputs.queries:
        key_rows = query_rows
    else:  # (b_g, length, dk): one copy of the valid rows, read by both projections in self-attention
        key_rows = pick_rows(inputs.keys[:, :length], take).contiguous()
    value_rows = key_rows if inputs.values is inputs.keys else pick_rows(inputs.values[:, :length], take)
    k_g = module.project_keys(key_rows, group_positions(inputs.k_positions, length, take))
    v_g = module.project_values(value_rows, key_rows)
    return k_g, v_g
