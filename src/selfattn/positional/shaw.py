"""Shaw et al. (2018) relative position representations, on the keys and on the values."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from selfattn._validation import require_non_negative_int, require_positive_int
from selfattn.functional import relative_distances
from selfattn.positional.base import ScoreEncoding

__all__ = ["ShawRelativePositionEncoding"]


class ShawRelativePositionEncoding(ScoreEncoding):
    """Learned embeddings ``a^K``, ``a^V`` of the clipped distance ``clip(j - i, -k, k)``.

    With ``a_ij = w_{clip(j - i, -k, k)}`` (``2k + 1`` embeddings of size ``dh``, shared by the
    heads, as in the paper)::

        e_ij = q_i . (k_j + a^K_ij) / sqrt(dh)        z_i = sum_j alpha_ij (v_j + a^V_ij)

    The ``(lq, lk, dh)`` tensor of embeddings is never built. The key term is
    ``q @ (a^K)^T``, ``(b, h, lq, 2k + 1)``, gathered by distance into ``(b, h, lq, lk)``; the
    value term sums the weights of each distance, ``(b, h, lq, 2k + 1)``, and multiplies by
    ``a^V``. Memory is O(lq * (lk + k)) per head instead of O(lq * lk * dh).

    The value term makes :class:`~selfattn.MultiHeadAttention` take its explicit path
    (``uses_weights``); with ``values=False`` (keys only, which the paper found as good) the
    key term is a plain float bias and reaches the fused kernel.

    Args:
        head_dim: size of each head ``dh``.
        max_distance: the clipping distance ``k`` (16 in the paper's base model; 0 ignores
            positions, leaving one embedding).
        keys: learn ``a^K``, the term in the scores.
        values: learn ``a^V``, the term in the values.
        device: where the embeddings are created.
        dtype: dtype of the embeddings.

    Shape:
        bias ``(b, h, lq, lk)``; value term ``(b, h, lq, dh)``.
    """

    is_relative = True  # a function of j - i alone

    def __init__(
        self,
        head_dim: int,
        max_distance: int = 16,
        *,
        keys: bool = True,
        values: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.head_dim = require_positive_int("head_dim", head_dim)
        self.max_distance = require_non_negative_int("max_distance", max_distance)
        if not (keys or values):
            raise ValueError(f"at least one of keys and values must be True, got keys={keys!r}, values={values!r}")
        num_distances = 2 * self.max_distance + 1
        shape = (num_distances, self.head_dim)
        self.key_embeddings = nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) if keys else None
        self.value_embeddings = nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) if values else None
        self.reset_parameters()

    @property
    def uses_weights(self) -> bool:  # type: ignore[override]  # decided per instance: keys-only has no value term
        return self.value_embeddings is not None

    def reset_parameters(self) -> None:
        """Draw every embedding from N(0, 1 / dh)."""
        for table in (self.key_embeddings, self.value_embeddings):
            if table is not None:
                nn.init.normal_(table, std=self.head_dim**-0.5)

    def clipped_embeddings(self) -> tuple[int, nn.Parameter | None, nn.Parameter | None, float]:
        """``(k, a^K, a^V, 1 / sqrt(dh))``: what blockwise attention needs to compute both terms without gathers.

        The key term is ``(q_i . a^K_clip(j - i)) / sqrt(dh)`` and the value term
        ``sum_j w_ij a^V_clip(j - i)``; a missing table is None.
        """
        return self.max_distance, self.key_embeddings, self.value_embeddings, 1.0 / math.sqrt(self.head_dim)

    def distance_index(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """Row of the embedding tables for each pair, ``clip(j - i, -k, k) + k``, int64 ``([b,] lq, lk)``."""
        distance = relative_distances(q_positions, k_positions)  # (lq, lk)
        return distance.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def _head_index(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        index = self.distance_index(q_positions, k_positions)  # (lq, lk) or (b, lq, lk)
        return index[None, None] if index.dim() == 2 else index[:, None]  # (1 or b, 1, lq, lk)

    def _check_heads(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, lq, ...), got {tuple(getattr(t, 'shape', ()))}")

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        self._check_heads("q", q)
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q must have head size {self.head_dim}, got {tuple(q.shape)}")
        if self.key_embeddings is None:
            return q.new_zeros(1, 1, 1, 1)
        index = self._head_index(q_positions, k_positions)  # (1 or b, 1, lq, lk)
        batch, heads = q.shape[:2]
        by_distance = torch.matmul(q, self.key_embeddings.to(q.dtype).t())  # (b, h, lq, 2k+1)
        scores = torch.gather(by_distance, -1, index.expand(batch, heads, *index.shape[-2:]))  # (b, h, lq, lk)
        return scores * (1.0 / math.sqrt(self.head_dim))

    def value_term(
        self, weights: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:
        self._check_heads("weights", weights)
        if self.value_embeddings is None:
            return super().value_term(weights, q_positions=q_positions, k_positions=k_positions)
        index = self._head_index(q_positions, k_positions)  # (1 or b, 1, lq, lk)
        if weights.shape[-2:] != index.shape[-2:]:
            raise ValueError(
                f"weights must end in {tuple(index.shape[-2:])} (queries, keys), got {tuple(weights.shape)}"
            )
        # Total weight each query puts on each clipped distance.
        per_distance = weights.new_zeros(*weights.shape[:-1], self.value_embeddings.shape[0])  # (b, h, lq, 2k+1)
        per_distance.scatter_add_(-1, index.expand(weights.shape), weights)
        return torch.matmul(per_distance, self.value_embeddings.to(weights.dtype))  # (b, h, lq, dh)

    def to_score_mod(
        self, *, q_positions: torch.Tensor, k_positions: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[Callable[..., torch.Tensor], list[nn.Parameter]]:
        """A FlexAttention ``score_mod`` adding the key term ``q_i . a^K_ij / sqrt(dh)``.

        The queries are needed (``q``, ``(b, h, lq, dh)``): the ``(b, h, lq, 2k + 1)`` products
        with every embedding are computed once and the ``score_mod`` picks one per pair. The
        value term cannot be written as a ``score_mod``.
        """
        if q is None:
            raise ValueError("q is required: Shaw's key term reads the queries")
        self._check_heads("q", q)
        if self.key_embeddings is None:
            return (lambda score, b, h, q_idx, kv_idx: score), []
        by_distance = torch.matmul(q, self.key_embeddings.to(q.dtype).t()) / math.sqrt(
            self.head_dim
        )  # (b, h, lq, 2k+1)

        def score_mod(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            i = q_positions[q_idx] if q_positions.dim() == 1 else q_positions[b, q_idx]
            j = k_positions[kv_idx] if k_positions.dim() == 1 else k_positions[b, kv_idx]
            row = (j.long() - i.long()).clamp(-self.max_distance, self.max_distance) + self.max_distance
            return score + by_distance[b, h, q_idx, row].to(score.dtype)

        return score_mod, [self.key_embeddings]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_distance={self.max_distance}, "
            f"keys={self.key_embeddings is not None}, values={self.value_embeddings is not None}"
        )
