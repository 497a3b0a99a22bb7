"""Shaw's clipped terms at consecutive positions, computed without gathers over the block.

Shape legend: b batch, h heads, d head size, dv value size, K the clip distance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfattn.functional._block_common import _block_probs, _lead_shape, _Workspace


@dataclass
class _Clipped:
    """A Shaw term (``clipped_embeddings()``) at consecutive positions, computed without gathers over the block.

    Query ``r`` of a block and key ``c`` are ``off + c - r`` apart (``off``: first key position
    minus the block's first query position); their embedding is row ``clip(off + c - r, -K, K) + K``.
    All of a block's queries are at least ``K`` after the keys ``[0, first)`` and at least ``K``
    before the keys ``[last, keys)``, so those keys use the two end rows of the tables. Two
    indicator columns appended to the keys (and values) carry the end rows through the block's
    matrix products: ``[q * scale, c_0, c_2K] . [k_j, 1[j < first], 1[j >= last]]`` adds the key
    term of the far keys to the scores, ``P @ [v, 1[..], 1[..]]`` sums the weights of the far
    keys, and the same columns reduce the score gradient in the backward pass. Only the middle
    keys ``[first, last)`` (at most ``block + 2K - 1`` of them) are gathered by distance.
    """

    max_distance: int
    key_table: torch.Tensor | None  # (2K+1, d)
    value_table: torch.Tensor | None  # (2K+1, dv)
    key_scale: float
    offset: int
    key_param: int | None  # index of key_table among the Function's parameters (None: no gradient)
    value_param: int | None

    def split(self, start: int, end: int, keys: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """``(first, last, index)``: far keys ``[0, first)`` and ``[last, keys)``; ``(block, last - first)`` rows."""
        off, reach, rows = self.offset - start, self.max_distance, end - start
        first = min(max(1 - reach - off, 0), keys)
        last = min(max(reach + rows - 1 - off, first), keys)
        distance = torch.arange(first, last, device=device) - torch.arange(rows, device=device)[:, None] + off
        return first, last, distance.clamp(-reach, reach) + reach  # (block, last - first)


def _with_indicators(x: torch.Tensor, first: int, last: int, buffer: torch.Tensor) -> torch.Tensor:
    """``[x, 1[j < first], 1[j >= last]]`` along the features: ``(..., keys, f)`` -> ``(..., keys, f + 2)``."""
    features = x.shape[-1]
    buffer[..., :features] = x
    buffer[..., features:] = 0
    buffer[..., :first, features] = 1
    buffer[..., last:, features + 1] = 1
    return buffer


def _ends(by_distance: torch.Tensor) -> torch.Tensor:
    """The first and last of ``(..., 2K+1)``: ``(..., 2)``."""
    return by_distance[..., [0, -1]]


def _clipped_probs(
    clipped: _Clipped,
    qc: torch.Tensor,
    kc: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    split: tuple[int, int, torch.Tensor],
    workspace: _Workspace,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax of a block's scores with the clipped key term, and the keys with indicators (None without keys table)."""
    if clipped.key_table is None:
        return _block_probs(qc, kc, None, visible, scale, workspace), None
    first, last, index = split
    lead = _lead_shape(qc, kc)
    by_distance = torch.matmul(qc, clipped.key_table.to(qc.dtype).t()).mul_(clipped.key_scale)  # (b, h, block, 2K+1)
    q_wide = torch.cat([qc * scale, _ends(by_distance)], dim=-1)  # (b, h, block, d + 2)
    k_wide = _with_indicators(
        kc, first, last, workspace.get("k_wide", (*lead, kc.shape[-2], kc.shape[-1] + 2), qc.dtype)
    )
    shape = (*lead, qc.shape[-2], kc.shape[-2])
    scores = torch.matmul(q_wide, k_wide.transpose(-2, -1), out=workspace.get("scores", shape, qc.dtype))
    if last > first:
        scores[..., first:last] += torch.gather(by_distance, -1, index.expand(*by_distance.shape[:-1], -1))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    if scores.device.type == "cpu":
        probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        return probs, k_wide
    return torch.softmax(scores, dim=-1), k_wide


def _per_distance(
    wide: torch.Tensor, weights: torch.Tensor, split: tuple[int, int, torch.Tensor], size: int
) -> torch.Tensor:
    """Sum of ``weights`` per clipped distance, ``(b, h, block, 2K+1)``, from the indicator columns of ``wide``."""
    first, last, index = split
    sums = wide.new_zeros(*wide.shape[:-1], size)
    sums[..., 0] = wide[..., -2]
    sums[..., -1] += wide[..., -1]
    if last > first:
        middle = weights[..., first:last]
        sums.scatter_add_(-1, index.expand(*middle.shape[:-1], -1), middle)
    return sums
