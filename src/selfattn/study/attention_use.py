"""Where a trained model attends, by query position: the measured side of a collapse past ``L``.

For every layer, head and query position ``i`` of a causal model, with attention weights
``p_ij`` over the keys ``j <= i``:

* **mean distance** ``sum_j p_ij (i - j)``: how far back the query looks on average;
* **entropy** ``-sum_j p_ij log p_ij`` (nats): how spread its attention is; ``log(i + 1)`` is
  uniform attention over every key it sees, 0 one key.

A model that extrapolates keeps both near their values inside ``L`` (a local window stays
local); one that collapses past ``L`` shows it here: attention spreading out (entropy rising
toward ``log(i + 1)``) or jumping to far keys (distance growing with ``i``).

Shape legend: b batch, h heads, l positions, n layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.models import TransformerLM
from selfattn.models.block import TransformerBlock

__all__ = ["attention_bands", "attention_by_position", "attention_on_text"]


@torch.no_grad()
def attention_by_position(model: TransformerLM, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean attended distance and attention entropy by layer, head and query position, averaged over the batch.

    Each block's attention is run a second time on its own inputs with ``return_weights=True``
    (a forward hook), so the model's forward pass itself is unchanged.

    Args:
        model: a causal :class:`~selfattn.models.TransformerLM`.
        tokens: ``(b, l)`` token ids.

    Returns:
        ``{"distance": (n, h, l), "entropy": (n, h, l)}``, float64 on the CPU.
    """
    if not isinstance(model, TransformerLM):
        raise ValueError(f"model must be a TransformerLM, got {type(model).__name__}")
    length = tokens.shape[1]
    positions = torch.arange(length, dtype=torch.float64)
    offsets = (positions[:, None] - positions[None, :]).clamp(min=0)  # (l, l): i - j, 0 above the diagonal
    distances: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        _, found = module.forward(*args, **{**kwargs, "return_weights": True})  # forward itself: no hook again
        # Reduced here, one head at a time in float64: keeping every layer's (b, h, l, l) weights took
        # gigabytes at 16 L = 4,096 bytes.
        per_head = [
            _distance_and_entropy(found[:, head].detach().cpu().double(), offsets) for head in range(found.shape[1])
        ]
        distances.append(torch.stack([distance for distance, _ in per_head]))  # (h, l)
        entropies.append(torch.stack([entropy for _, entropy in per_head]))

    attentions = [block.attention for block in model.blocks if isinstance(block, TransformerBlock)]
    handles = [attention.register_forward_hook(record, with_kwargs=True) for attention in attentions]
    was_training = model.training
    model.eval()
    try:
        model(tokens.to(next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {"distance": torch.stack(distances), "entropy": torch.stack(entropies)}


def _distance_and_entropy(p: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's attention ``p`` ``(b, l, l)``: mean distance back and entropy per query position, ``(l,)`` each."""
    distance = (p * offsets).sum(-1).mean(0)
    logs = torch.where(p > 0, p.clamp(min=torch.finfo(torch.float64).tiny).log(), torch.zeros_like(p))
    return distance, -(p * logs).sum(-1).mean(0)


def attention_bands(measured: dict[str, torch.Tensor], bands: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per band of query positions ``[a, b)``: distance and entropy per layer (mean over heads), and uniform entropy.

    ``uniform_entropy`` is the band's mean ``log(i + 1)``: the entropy of attention spread evenly
    over every key, the ceiling the measured entropy approaches when a model stops focusing.
    """
    length = measured["distance"].shape[-1]
    rows = []
    for start, stop in bands:
        require_positive_int("stop", stop)
        if not 0 <= start < stop <= length:
            raise ValueError(f"band [{start}, {stop}) must lie in [0, {length}]")
        positions = torch.arange(start, stop, dtype=torch.float64)
        rows.append(
            {
                "start": start,
                "stop": stop,
                "distance": measured["distance"][:, :, start:stop].mean(dim=(1, 2)).tolist(),  # (n,)
                "entropy": measured["entropy"][:, :, start:stop].mean(dim=(1, 2)).tolist(),
                "uniform_entropy": float(torch.log1p(positions).mean()),
            }
        )
    return rows


def attention_on_text(
    model: TransformerLM, data: torch.Tensor, length: int, train_len: int, *, windows: int = 2
) -> list[dict[str, Any]]:
    """:func:`attention_bands` on the first ``windows`` non-overlapping windows of ``length`` bytes of ``data``,
    by the bands of :func:`~selfattn.study.context_use.position_bands` (cut at ``train_len``)."""
    from selfattn.study.context_use import position_bands

    windows = require_positive_int("windows", windows)
    if len(data) < windows * length:
        raise ValueError(f"data holds {len(data)} bytes; {windows} windows of {length} need {windows * length}")
    tokens = data[: windows * length].long().view(windows, length)
    return attention_bands(attention_by_position(model, tokens), position_bands(length, train_len))
