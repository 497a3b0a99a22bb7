"""Kerple (Chi et al. 2022), log variant: a learned logarithmic penalty on the distance."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.functional import alibi_slopes
from selfattn.positional.base import ScoreEncoding

__all__ = ["KerplePositionalBias"]


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


class KerplePositionalBias(ScoreEncoding):
    """Adds ``-r1_h * log(1 + r2_h * |i - j|)`` to the scores, with learned ``r1_h, r2_h > 0``.

    ``i`` is the query's position, ``j`` the key's. Both parameters of each head are kept
    positive as ``softplus`` of the stored values (``raw_r1``, ``raw_r2``, ``(h,)`` each).
    They start at ``r1 = 1`` and ``r2`` = the head's ALiBi slope, so heads begin at different
    scales. The term depends on ``j - i`` only: the bias is the same under any shift of
    positions. Like every score term, attention evaluates it one block of queries at a time.

    Args:
        num_heads: number of heads ``h``.

    Shape:
        bias ``(1, h, lq, lk)`` for ``(l,)`` positions.
    """

    is_relative = True  # a function of j - i alone

    def __init__(self, num_heads: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.raw_r1 = nn.Parameter(torch.empty(self.num_heads, device=device, dtype=dtype))
        self.raw_r2 = nn.Parameter(torch.empty(self.num_heads, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``r1 = 1`` and ``r2`` = the ALiBi slopes."""
        with torch.no_grad():
            self.raw_r1.copy_(_inverse_softplus(torch.ones(self.num_heads, dtype=torch.float64)))
            self.raw_r2.copy_(_inverse_softplus(alibi_slopes(self.num_heads)))

    @property
    def r1(self) -> torch.Tensor:
        """``(h,)`` scale of the penalty."""
        return F.softplus(self.raw_r1)

    @property
    def r2(self) -> torch.Tensor:
        """``(h,)`` rate inside the logarithm."""
        return F.softplus(self.raw_r2)

    def _rates(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(r1, r2)``, ``(h,)`` each, with softplus computed in ``dtype`` (in a half's own precision the rates
        would be rounded to it before any use)."""
        return F.softplus(self.raw_r1.to(dtype)), F.softplus(self.raw_r2.to(dtype))

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        distance = (k_positions.long() - q_positions.long()).abs().float()
        r1, r2 = self._rates(torch.float32)
        return -r1[heads] * torch.log1p(r2[heads] * distance)

    def to_score_mod(
        self, *, q_positions: torch.Tensor, k_positions: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[Callable[..., torch.Tensor], list[nn.Parameter]]:
        """As :meth:`ScoreEncoding.to_score_mod`, with ``r1`` and ``r2`` computed once outside the ``score_mod``.

        Inside it, ``softplus(raw)[h]`` reads ``raw`` twice, and FlexAttention's compiled
        backward rejects a tensor that requires grad indexed more than once.
        """
        del q
        r1, r2 = self._rates(torch.float32)  # (h,) each, differentiable in the raw parameters

        def score_mod(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            i = q_positions[q_idx] if q_positions.dim() == 1 else q_positions[b, q_idx]
            j = k_positions[kv_idx] if k_positions.dim() == 1 else k_positions[b, kv_idx]
            distance = (j.long() - i.long()).abs().float()
            return score + (-r1[h] * torch.log1p(r2[h] * distance)).to(score.dtype)

        return score_mod, list(self.parameters())

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (batch, {self.num_heads}, length, head_dim), got {tuple(q.shape)}")
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Integer distances; evaluate the term once per distinct distance, then gather.
        distance = (k_positions.long()[..., None, :] - q_positions.long()[..., :, None]).abs()  # (..., lq, lk)
        if distance.shape[-2] == 1:
            # One query (a decoding step): its distances are distinct already, and reading the longest would wait
            # for the device. The same operations per element as the table below, so the same bits.
            shape = (-1,) + (1,) * distance.dim()
            r1, r2 = (rate.view(shape) for rate in self._rates(compute_dtype))  # (h, 1, ...)
            bias = -r1 * torch.log1p(r2 * distance.to(compute_dtype))  # (h, ..., 1, lk)
        else:
            longest = int(distance.max()) if distance.numel() else 0
            steps = torch.arange(longest + 1, device=distance.device, dtype=compute_dtype)  # (n_distances,)
            r1, r2 = (rate[:, None] for rate in self._rates(compute_dtype))  # (h, 1)
            per_distance = -r1 * torch.log1p(r2 * steps)  # (h, n_distances)
            bias = per_distance[:, distance]  # (h, ..., lq, lk)
        bias = bias.movedim(0, -3) if distance.dim() > 2 else bias  # (..., h, lq, lk)
        return (bias if bias.dim() == 4 else bias[None]).to(q.dtype)  # (1 or b, h, lq, lk)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
