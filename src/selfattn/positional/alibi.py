"""ALiBi (Press et al. 2022): a per-head linear penalty on the distance between query and key."""

from __future__ import annotations

import torch

from selfattn._validation import require_bool, require_positive_int
from selfattn.functional import alibi_slopes, relative_distances
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import ScoreEncoding

__all__ = ["ALiBiPositionalBias"]


class ALiBiPositionalBias(KeepsTablePrecision, ScoreEncoding):
    """Adds ``-m_h * (i - j)`` (causal) or ``-m_h * |i - j|`` (bidirectional) to the scores.

    ``i`` is the query's position, ``j`` the key's, ``m_h`` the fixed slope of head ``h``
    (:func:`~selfattn.functional.alibi_slopes`). The bias is not scaled by ``1 / sqrt(dh)``.
    In the causal form keys in the future get a positive bias, which does not matter because
    causal attention masks them; use ``causal=False`` whenever attention may look ahead.
    Nothing is learned, and it goes to the fused attention kernel as a float mask.

    The slopes are a float64 non-persistent buffer that follows ``.to(device)`` but not
    ``.to(dtype)``; the bias is computed in float32 (float64 for float64 queries) and
    returned in the queries' dtype.

    Args:
        num_heads: number of heads ``h``.
        causal: ``-m (i - j)`` if True, ``-m |i - j|`` if False.
        device: where the slopes live.
        dtype: accepted for uniformity; the slopes stay float64.

    Shape:
        bias ``(1, h, lq, lk)``, or ``(b, h, lq, lk)`` for per-sequence positions ``(b, l)``.
    """

    is_relative = True  # a function of j - i alone

    exact_tables = ("slopes",)
    slopes: torch.Tensor

    def __init__(
        self,
        num_heads: int,
        causal: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.causal = require_bool("causal", causal)
        self.register_buffer("slopes", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def reset_parameters(self) -> None:
        """Recompute the slopes (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """(Re)compute the ``(h,)`` slopes in float64 on the buffer's device."""
        self.slopes = alibi_slopes(self.num_heads).to(self.slopes.device)

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (batch, {self.num_heads}, length, head_dim), got {tuple(q.shape)}")
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Integer differences first: the bias is then exactly the same under any shift of positions.
        distance = -relative_distances(q_positions, k_positions)  # (lq, lk) or (b, lq, lk): i - j
        if not self.causal:
            distance = distance.abs()
        slopes = self.slopes.to(compute_dtype)[:, None, None]  # (h, 1, 1)
        distance = distance[None, None] if distance.dim() == 2 else distance[:, None]  # (1 or b, 1, lq, lk)
        bias = -slopes * distance.to(compute_dtype)  # (1 or b, h, lq, lk)
        return bias.to(q.dtype)

    def key_only_term(self, key_offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The term up to a constant per query, as a function of the key alone; None if it is not one.

        ``-m (i - j) = m (j - a) - m (i - a)`` for any anchor ``a``, and a softmax ignores the
        constant ``m (i - a)`` of a query's row, so the causal form is ``m (j - a)``: one row of
        bias serves every query (blockwise attention then needs no ``(lq, lk)`` mask at all).
        The bidirectional form ``-m |i - j|`` is not of this kind.

        Args:
            key_offsets: integer ``j - a``, ``(..., 1 or h, 1, lk)``.
            dtype: float dtype of the result.

        Returns:
            ``m_h (j - a)``, ``(..., h, 1, lk)``, or None for ``causal=False``.
        """
        if not self.causal:
            return None
        slopes = self.slopes.to(dtype)[:, None, None]  # (h, 1, 1)
        return slopes * key_offsets.to(dtype)

    def has_key_only_form(self) -> bool:
        return self.causal

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        distance = q_positions.long() - k_positions.long()  # i - j
        if not self.causal:
            distance = distance.abs()
        return -self.slopes.float()[heads] * distance.float()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, causal={self.causal}"
