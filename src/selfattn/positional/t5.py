"""T5's relative position bias: one learned scalar per (distance bucket, head)."""

from __future__ import annotations

import torch
from torch import nn

from selfattn._validation import require_positive_int
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

    Shape:
        bias ``(1, h, lq, lk)``.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.num_buckets = require_positive_int("num_buckets", num_buckets)
        self.max_distance = require_positive_int("max_distance", max_distance)
        self.bidirectional = bool(bidirectional)
        # Fails here, not at the first call, if the bucket settings are impossible.
        t5_relative_bucket(torch.zeros(1, dtype=torch.long), **self._bucket_options())
        self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads)

    def _bucket_options(self) -> dict:
        return {"bidirectional": self.bidirectional, "num_buckets": self.num_buckets, "max_distance": self.max_distance}

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (batch, {self.num_heads}, length, head_dim), got {tuple(q.shape)}")
        distance = relative_distances(q_positions, k_positions)  # (lq, lk)
        # Bucket each distinct distance once (lq + lk - 1 of them for consecutive positions), then gather.
        low = int(k_positions.min()) - int(q_positions.max())
        high = int(k_positions.max()) - int(q_positions.min())
        distinct = torch.arange(low, high + 1, device=distance.device)  # (n_distances,)
        buckets = t5_relative_bucket(distinct, **self._bucket_options())  # (n_distances,)
        per_distance = self.relative_attention_bias.weight.t()[:, buckets]  # (h, n_distances)
        bias = per_distance[:, distance - low]  # (h, lq, lk)
        return bias.to(q.dtype)[None]  # (1, h, lq, lk)

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        buckets = t5_relative_bucket(k_positions.long() - q_positions.long(), **self._bucket_options())
        return self.relative_attention_bias.weight[buckets, heads]

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )
