"""T5's relative position bias: one learned scalar per (distance bucket, head)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfattn._validation import require_bool, require_positive_int
from selfattn.functional import relative_distances, t5_relative_bucket
from selfattn.positional.base import ScoreEncoding

__all__ = ["T5RelativePositionBias"]


class T5RelativePositionBias(ScoreEncoding):
    """Adds ``bias[bucket(key_pos - query_pos), head]`` to the scores (Raffel et al. 2020).

    The buckets are :func:`~selfattn.functional.t5_relative_bucket`: exact for short
    distances, logarithmic up to ``max_distance``, shared beyond. The table is a parameter
    (``relative_attention_bias.weight``, ``(num_buckets, h)``, as in T5 checkpoints) and the
    bias goes to the fused attention kernel as a float mask. T5 itself does not scale its
    scores by ``1 / sqrt(dh)``; here the bias is added to the scaled scores like every other.

    Args:
        num_heads: number of heads ``h``.
        num_buckets: number of distance buckets.
        max_distance: distance from which every key shares the last bucket.
        bidirectional: separate buckets for keys in the future (encoders); False for decoders.
        device: where the table is created.
        dtype: dtype of the table.

    Shape:
        bias ``(1, h, lq, lk)``, or ``(b, h, lq, lk)`` for per-sequence positions ``(b, l)``.
    """

    is_relative = True  # a function of j - i alone

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.num_buckets = require_positive_int("num_buckets", num_buckets)
        self.max_distance = require_positive_int("max_distance", max_distance)
        self.bidirectional = require_bool("bidirectional", bidirectional)
        # Fails here, not at the first call, if the bucket settings are impossible.
        t5_relative_bucket(torch.zeros(1, dtype=torch.long), **self._bucket_options())
        self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """Draw the table from N(0, 1), as ``nn.Embedding`` does."""
        self.relative_attention_bias.reset_parameters()

    def _bucket_options(self) -> dict[str, Any]:
        return {"bidirectional": self.bidirectional, "num_buckets": self.num_buckets, "max_distance": self.max_distance}

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (batch, {self.num_heads}, length, head_dim), got {tuple(q.shape)}")
        distance = relative_distances(q_positions, k_positions)  # (lq, lk) or (b, lq, lk)
        table = self.relative_attention_bias.weight.t()  # (h, num_buckets)
        if torch.compiler.is_compiling() or distance.shape[-2] == 1 or not distance.numel():
            # No data-dependent range under torch.compile, and none read for one query (a decoding step, whose
            # distances are distinct already; reading the range would wait for the device) or for no pair at all
            # (an empty chunk): bucket every pair.
            bias = table[:, t5_relative_bucket(distance, **self._bucket_options())]  # (h, [b,] lq, lk)
        else:
            # Bucket each distinct distance once (lq + lk - 1 of them for consecutive positions), then gather.
            low = int(k_positions.min()) - int(q_positions.max())
            high = int(k_positions.max()) - int(q_positions.min())
            distinct = torch.arange(low, high + 1, device=distance.device)  # (n_distances,)
            buckets = t5_relative_bucket(distinct, **self._bucket_options())  # (n_distances,)
            bias = table[:, buckets][:, distance - low]  # (h, [b,] lq, lk)
        if bias.dim() == 4:
            return bias.transpose(0, 1).to(q.dtype)  # (b, h, lq, lk)
        return bias.to(q.dtype)[None]  # (1, h, lq, lk)

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        buckets = t5_relative_bucket(k_positions.long() - q_positions.long(), **self._bucket_options())
        return self.relative_attention_bias.weight[buckets, heads]

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )
