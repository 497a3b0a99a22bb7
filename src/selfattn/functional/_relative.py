"""Relative-position building blocks: T5 buckets, ALiBi slopes, Music Transformer skewing.

Shape legend: ``...`` any leading dimensions, lq queries, lk keys, h heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from selfattn._validation import require_bool, require_positive_int

__all__ = ["alibi_slopes", "relative_distances", "relative_shift", "t5_relative_bucket"]


def relative_distances(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """``key_pos - query_pos`` for every pair; positive means the key is later.

    Positions are ``(lq,)`` / ``(lk,)``, or per sequence ``(b, lq)`` / ``(b, lk)`` (the two may
    mix); the result is int64 ``(lq, lk)``, or ``(b, lq, lk)`` when either is per sequence.
    """
    for name, positions in (("q_positions", q_positions), ("k_positions", k_positions)):
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dim() not in (1, 2)
            or positions.is_floating_point()
            or positions.dtype == torch.bool  # a mask passed where positions go
        ):
            got = getattr(positions, "dtype", positions)
            raise ValueError(f"{name} must be a (length,) or (batch, length) integer tensor, got {got!r}")
    return k_positions.long()[..., None, :] - q_positions.long()[..., :, None]  # (lq, lk) or (b, lq, lk)


def t5_relative_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> torch.Tensor:
    """The T5 bucket of each ``relative_position = key_pos - query_pos``, identical to the published code.

    Bidirectional: half the buckets are for keys in the past or present, half (offset by
    ``num_buckets / 2``) for keys in the future. Causal: keys in the future share bucket 0
    with distance 0. Within a half of ``n`` buckets, distances below ``n / 2`` get one bucket
    each; larger ones share logarithmically wider buckets up to ``max_distance``, and every
    distance past that lands in the last bucket. The logarithm is taken in float32 and
    truncated toward zero, as in the T5 and Hugging Face code, so pretrained biases line up.

    With the defaults: causal, distances 0-15 are exact, bucket 16 starts at 16 and bucket 31
    at 113; bidirectional, past bucket 15 starts at distance 91.

    Args:
        relative_position: integer tensor of any shape.
        bidirectional: whether keys may lie in the future.
        num_buckets: total number of buckets.
        max_distance: distance from which everything shares the last bucket.

    Returns:
        int64 buckets in ``[0, num_buckets)``, the shape of ``relative_position``.
    """
    if not isinstance(relative_position, torch.Tensor) or relative_position.is_floating_point():
        got = getattr(relative_position, "dtype", relative_position)
        raise ValueError(f"relative_position must be an integer tensor, got {got!r}")
    num_buckets = require_positive_int("num_buckets", num_buckets)
    max_distance = require_positive_int("max_distance", max_distance)
    bidirectional = require_bool("bidirectional", bidirectional)
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half // 2
    if max_exact < 1:
        raise ValueError(f"num_buckets must be at least {4 if bidirectional else 2}, got {num_buckets}")
    if max_distance <= max_exact:
        raise ValueError(f"max_distance must exceed the {max_exact} exact buckets, got {max_distance}")

    relative_position = relative_position.long()
    if bidirectional:
        buckets = (relative_position > 0).long() * half  # future keys use the upper half
        distance = relative_position.abs()
    else:
        buckets = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)  # future keys count as distance 0
    # Clamp before the log so the unused branch of `where` never sees log(0).
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (half - max_exact)).long()  # float32, truncated as published
    large = large.clamp(max=half - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slope of each head, float64 ``(h,)`` (Press et al. 2022).

    For ``h`` a power of two: the geometric sequence ``2^(-8/h), 2^(-16/h), ..., 2^(-8)``.
    Otherwise, with ``c`` the largest power of two below ``h``: the ``c`` slopes of ``c`` heads,
    then every other slope of ``2c`` heads (the ones not already used) for the remaining
    ``h - c``; 6 heads: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8.
    """
    num_heads = require_positive_int("num_heads", num_heads)

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 1 << (num_heads.bit_length() - 1)  # largest power of two <= h
    slopes = geometric(lower) + geometric(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float64)


def relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """Music Transformer "skewing": turn query-by-distance scores into query-by-key scores.

    Column ``r`` of ``scores`` holds query ``i``'s score against the relative embedding of
    distance ``key - query = r - (lk - 1)``, i.e. distances ``-(lk - 1) .. 0`` in order; the
    queries are the last ``lq`` of the ``lk`` keys. The result holds, at ``(i, j)``,
    ``scores[..., i, j - i + lq - 1]``: the score for the distance between query ``i`` and
    key ``j``. Only entries with ``j <= i + lk - lq`` (keys not in the future) are meaningful;
    the rest hold leftovers and must be masked, as causal attention does anyway.

    It costs one padded copy, O(lq * lk), instead of the O(lq * lk * d) tensor of gathered
    embeddings (Huang et al. 2018): pad a zero column on the left, view the rows as one long
    row, and re-cut it ``lq`` entries later into rows of ``lk``.

    Args:
        scores: ``(..., lq, lk)``, e.g. ``q @ E_r^T`` with ``E_r`` ``(lk, d)`` ordered by distance.

    Returns:
        ``(..., lq, lk)``.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() < 2:
        raise ValueError(f"scores must be a tensor of shape (..., lq, lk), got {getattr(scores, 'shape', scores)!r}")
    num_queries, num_keys = scores.shape[-2:]
    padded = F.pad(scores, (1, 0))  # (..., lq, lk + 1): P[i, c] = scores[i, c - 1]
    flat = padded.flatten(-2)  # (..., lq * (lk + 1))
    # Entry i * lk + j of the re-cut row is P[i, j - i + lq]: flat index i * (lk + 1) + (j - i + lq).
    return flat[..., num_queries:].reshape(*scores.shape[:-2], num_queries, num_keys)  # (..., lq, lk)
