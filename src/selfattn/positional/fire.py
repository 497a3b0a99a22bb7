"""FIRE (Li et al. 2023): a small MLP of the log-distance, normalized by the query's position."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import require_positive_finite, require_positive_int
from selfattn.positional.base import ScoreEncoding

__all__ = ["FIREPositionalBias"]

_LANES = 8  # partial sums per segment in the backward of _PiecewiseLinear


class FIREPositionalBias(ScoreEncoding):
    """Adds ``f(psi(|i - j|) / psi(max(i, L)))`` to the scores, with ``psi(x) = log(c x + 1)``.

    ``i`` is the query's position, ``j`` the key's, ``f`` an MLP ``1 -> hidden -> h`` (ReLU)
    giving one value per head, ``c > 0`` (stored as ``softplus(raw_c)``, starting at 1) and the
    threshold ``L > 0`` (stored as ``softplus(raw_threshold)``, starting at ``threshold``) are
    learned. Dividing by ``psi(i)`` maps every query's distances into ``[0, 1]``, which is how
    FIRE carries over to longer sequences; below ``L`` the divisor stops shrinking. Because of
    that divisor the term depends on where the query is, not only on ``j - i``:
    ``is_relative`` is False. Keys after the query count by ``|i - j|`` (causal attention
    never sees them).

    ``f`` of a scalar is piecewise linear with at most ``hidden`` kinks, so the term is
    evaluated as one slope and one intercept per entry and head, chosen by ``torch.bucketize``
    of the entry among the sorted kinks: the same values and parameter gradients as the MLP
    (up to rounding), without a ``(..., lq, lk, hidden)`` layer in the forward or backward pass.

    Args:
        num_heads: number of heads ``h``.
        hidden_size: width of the MLP's hidden layer (32 in the paper).
        threshold: initial ``L``.

    Shape:
        bias ``(1, h, lq, lk)`` for ``(l,)`` positions.
    """

    is_relative = False

    # Its MLP is no pointwise expression: inductor stops with "Buffers cannot be created while
    # lowering a pointwise subgraph" (torch 2.11 on an H100), so CUDA runs it blockwise.
    compiles_in_flex: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        hidden_size: int = 32,
        threshold: float = 8.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.hidden_size = require_positive_int("hidden_size", hidden_size)
        self.initial_threshold = require_positive_finite("threshold", threshold)
        self.mlp = nn.Sequential(
            nn.Linear(1, self.hidden_size, **factory), nn.ReLU(), nn.Linear(self.hidden_size, self.num_heads, **factory)
        )
        self.raw_c = nn.Parameter(torch.empty((), **factory))
        self.raw_threshold = nn.Parameter(torch.empty((), **factory))
        self._reset_scalars()  # the MLP's layers drew their weights above, as reset_parameters() does

    def reset_parameters(self) -> None:
        """Fresh MLP weights (PyTorch's default init), ``c = 1`` and ``L = threshold``."""
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        self._reset_scalars()

    def _reset_scalars(self) -> None:
        with torch.no_grad():
            for raw, value in ((self.raw_c, 1.0), (self.raw_threshold, self.initial_threshold)):
                target = torch.tensor(value, dtype=torch.float64)
                raw.copy_(target + torch.log(-torch.expm1(-target)))  # softplus^-1

    def _normalized_distance(
        self, q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``psi(|i - j|) / psi(max(i, L))`` for broadcastable integer positions."""
        # softplus in the compute dtype: in a half's own precision c and L would be rounded to it (0.4% in bfloat16),
        # moving the MLP's input across a kink of its ReLU for distances near one
        c = F.softplus(self.raw_c.to(dtype))
        threshold = F.softplus(self.raw_threshold.to(dtype))
        distance = (k_positions.long() - q_positions.long()).abs().to(dtype)
        query = torch.maximum(q_positions.to(dtype), threshold)
        return torch.log1p(c * distance) / torch.log1p(c * query)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``f`` on every entry of ``x``: ``(...)`` -> ``(..., h)``, in ``x``'s dtype."""
        first, _, second = self.mlp
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)  # built so in __init__
        hidden = F.relu(F.linear(x[..., None], first.weight.to(x.dtype), first.bias.to(x.dtype)))  # (..., hidden)
        return F.linear(hidden, second.weight.to(x.dtype), second.bias.to(x.dtype))  # (..., h)

    def _pieces(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``f`` as a piecewise linear function: sorted kinks ``(k,)``, slopes and intercepts ``(h, k + 1)``.

        ``f(x) = W2 relu(w1 x + b1) + b2`` of a scalar ``x`` has a kink where a hidden unit
        switches, at ``x = -b1 / w1``. Between two kinks the same units are on, so ``f`` is
        ``slope * x + intercept`` there, with slope ``W2[:, on] w1[on]`` and intercept
        ``b2 + W2[:, on] b1[on]``. Which units are on is read from the kinks alone (no gradient
        is lost: at a kink the unit's output is zero); the slopes and intercepts are ordinary
        differentiable functions of the weights, so autograd gives the MLP's exact gradients.
        """
        first, _, second = self.mlp
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)  # built so in __init__
        w1, b1 = first.weight[:, 0].to(dtype), first.bias.to(dtype)  # (hidden,)
        w2, b2 = second.weight.to(dtype), second.bias.to(dtype)  # (h, hidden), (h,)
        with torch.no_grad():
            kinks = torch.where(w1 != 0, -b1 / w1.where(w1 != 0, 1.0), float("inf"))  # (hidden,)
            kinks, order = torch.sort(kinks)
            rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            # Segment s holds kinks[s - 1] < x <= kinks[s] (torch.bucketize): a unit rising at
            # its kink is on past it, a falling one before it, a flat one by its bias.
            segment = torch.arange(order.numel() + 1, device=order.device)[:, None]  # (k + 1, 1)
            on = ((w1 > 0) & (rank < segment)) | ((w1 < 0) & (rank >= segment)) | ((w1 == 0) & (b1 > 0))
            on = on.to(dtype)  # (k + 1, hidden)
        # Sums of (h, k + 1, hidden) products rather than tiny matmuls, which cost far more per call.
        slopes = (on * w1 * w2[:, None, :]).sum(dim=-1)  # (h, k + 1)
        intercepts = (on * b1 * w2[:, None, :]).sum(dim=-1) + b2[:, None]
        return kinks, slopes, intercepts

    def _mlp_piecewise(self, x: torch.Tensor) -> torch.Tensor:
        """``f`` on every entry of ``x`` through :meth:`_pieces`: ``(...)`` -> ``(h, ...)``, in ``x``'s dtype.

        Equal to :meth:`_mlp` (moved to the front) up to rounding, but it reads one slope and
        one intercept per entry and head instead of a ``(..., hidden)`` layer, several times
        faster in the forward and the backward pass.
        """
        kinks, slopes, intercepts = self._pieces(x.dtype)
        segments = torch.bucketize(x.detach(), kinks)  # (...)
        out: torch.Tensor = _PiecewiseLinear.apply(x, segments, slopes, intercepts)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
        return out

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        heads, q_positions, k_positions = torch.broadcast_tensors(heads, q_positions, k_positions)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        per_head = self._mlp(self._normalized_distance(q_positions, k_positions, torch.float32))  # (..., h)
        return per_head.gather(-1, heads.long()[..., None]).squeeze(-1)

    def forward(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (batch, {self.num_heads}, length, head_dim), got {tuple(q.shape)}")
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        x = self._normalized_distance(
            q_positions[..., :, None], k_positions[..., None, :], compute_dtype
        )  # (..., lq, lk)
        bias = self._mlp_piecewise(x)  # (h, lq, lk) or (h, b, lq, lk)
        bias = bias if bias.dim() == 3 else bias.movedim(0, 1)  # (..., h, lq, lk)
        return (bias if bias.dim() == 4 else bias[None]).to(q.dtype)  # (1 or b, h, lq, lk)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, hidden_size={self.hidden_size}"


class _PiecewiseLinear(torch.autograd.Function):
    """``slopes[:, s] * x + intercepts[:, s]`` with ``s`` the segment of each entry: ``(...)`` -> ``(h, ...)``.

    Autograd of the same expression written with ``index_select`` reduces the gradient into
    the ``(h, segments)`` tables through a slow ``index_add``; here one ``scatter_add`` per
    table does it. The backward is made of differentiable ops, so double backward works.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, segments: torch.Tensor, slopes: torch.Tensor, intercepts: torch.Tensor
    ) -> torch.Tensor:
        flat = segments.reshape(-1)  # (entries,)
        shape = (slopes.shape[0], *x.shape)
        slope = slopes.index_select(1, flat).view(shape)  # (h, ...)
        intercept = intercepts.index_select(1, flat).view(shape)
        # The gathered slopes are kept for grad_x (one block's worth in blockwise attention):
        # gathering them again in the backward pass costs as much as the forward's gather.
        ctx.save_for_backward(x, segments, slopes, slope)
        return torch.addcmul(intercept, slope, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, segments, slopes, slope = ctx.saved_tensors
        heads, count = slopes.shape
        flat = segments.reshape(-1)  # (entries,)
        grad_flat = grad.reshape(heads, -1)  # (h, entries)
        grad_x = grad_slopes = grad_intercepts = None
        if ctx.needs_input_grad[0]:
            if torch.is_grad_enabled():  # double backward: the slopes must be gathered in the graph
                slope = slopes.index_select(1, flat).view(grad.shape)  # (h, ...)
            grad_x = (grad * slope).sum(dim=0)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            # Neighbouring entries mostly share a segment; adding them into the same slot one
            # after the other is a chain of dependent adds, so entry e goes to lane e % LANES.
            repeats = (flat.numel() + _LANES - 1) // _LANES
            lane = torch.arange(_LANES, device=flat.device).repeat(repeats)[: flat.numel()]  # (entries,)
            slots = (flat * _LANES + lane).expand(heads, -1)  # (h, entries)

            def per_segment(values: torch.Tensor) -> torch.Tensor:
                sums = values.new_zeros(heads, count * _LANES).scatter_add(1, slots, values)
                return sums.view(heads, count, _LANES).sum(dim=-1)  # (h, segments)

            if ctx.needs_input_grad[2]:
                grad_slopes = per_segment(grad_flat * x.reshape(1, -1))
            if ctx.needs_input_grad[3]:
                grad_intercepts = per_segment(grad_flat)
        return grad_x, None, grad_slopes, grad_intercepts
