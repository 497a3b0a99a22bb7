"""The note's Taylor-expansion argument, measured on real attention scores.

With positions added to the input, the score of query i and key j in one head is

    s_ij = (W_q (x_i + p_i)) . (W_k (x_j + p_j)) / sqrt(dh)
         = x_i' A x_j  +  (x_i' A p_j + p_i' A x_j)  +  p_i' A p_j,     A = W_q' W_k / sqrt(dh)

content-content, content-position and position-position. The study note expands
``f(x + p)`` around ``f(x)`` and calls the second-order cross term the relative part; the
position-position term is where a relative dependence could live. Each term is computed
from the layer's own projections, their sum is checked against the scores the layer
computes, and each term's share of the scores is measured (its squared Frobenius norm over the
sum of the three), together with whether the position-position term depends on the offset
j - i only (its spread along each diagonal).

Shape legend: b batch, h heads, n positions, d model size, dh head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table
from selfattn.tour._common import seeded

__all__ = ["score_terms"]


def _diagonal_spread(scores: torch.Tensor) -> float:
    """Largest spread of an ``(n, n)`` matrix along one diagonal (0 when it depends on j - i only)."""
    n = scores.shape[-1]
    return max(
        float(torch.diagonal(scores, offset=k).max() - torch.diagonal(scores, offset=k).min())
        for k in range(-(n - 1), n)
    )


def score_terms(
    num_hiddens: int = 32,
    num_heads: int = 4,
    num_steps: int = 60,
    embedding_scales: tuple[float, ...] = (1.0, 0.1),
    shift: int = 7,
    seed: int = 0,
    encoding: Callable[[int, int], torch.Tensor] | None = None,
) -> dict[str, object]:
    """Split the first head's scores of ``x + P`` into the three terms and measure each one's share.

    ``x`` is random token content with N(0, scale^2) entries for each scale in
    ``embedding_scales`` (1 is ``nn.Embedding``'s default; 0.1 is content smaller than P).
    The layer's projections are seeded random, as at initialization. Computed in float64.

    Whether a term carries absolute or relative position is measured by moving every position
    by ``shift``: ``*_shift_change`` is the largest change of the term over its range (0 for a
    term that sees offsets only), for the content-position term (the note's A, where p
    appears alone), the position-position term with the layer's A and with A = I.

    ``encoding(n, d)`` gives the table P (float64); None is the chapter's sinusoidal table.
    """
    dh = num_hiddens // num_heads
    with seeded(seed):
        mha = MultiHeadAttention(num_hiddens, num_heads).double().eval()
        content = torch.randn(num_steps, num_hiddens, dtype=torch.float64)  # (n, d)
    if encoding is None:
        P = sinusoidal_table(num_steps + shift, num_hiddens, dtype=torch.float64)  # (n + s, d)
    else:
        P = encoding(num_steps + shift, num_hiddens).to(torch.float64)
    P, shifted = P[:num_steps], P[shift:]  # the same sentence, every position moved by s
    W_q = mha.W_q.weight[:dh]  # (dh, d): the first head's rows
    assert mha.W_k is not None  # a plain layer projects its keys
    W_k = mha.W_k.weight[:dh]
    A = W_q.T @ W_k / math.sqrt(dh)  # (d, d)
    scales: list[dict[str, float]] = []
    result: dict[str, object] = {
        "num_hiddens": num_hiddens,
        "num_heads": num_heads,
        "num_steps": num_steps,
        "scales": scales,
    }
    with torch.no_grad():
        pp = P @ A @ P.T  # (n, n)
        for scale in embedding_scales:
            x = scale * content
            cc = x @ A @ x.T
            cp = x @ A @ P.T + P @ A @ x.T
            h = (x + P)[None]  # (1, n, d)
            _, weights = mha(h, h, h, return_weights=True)  # (1, h, n, n)
            # The layer's own scores, recovered from its weights up to a per-row constant.
            scores = torch.log(weights[0, 0])
            total = cc + cp + pp
            row_shift = (scores - total).mean(dim=-1, keepdim=True)
            sum_error = float((scores - row_shift - total).abs().max())
            norms = [float(term.pow(2).sum()) for term in (cc, cp, pp)]
            whole = sum(norms)
            scales.append(
                {
                    "scale": scale,
                    "content_content": norms[0] / whole,
                    "content_position": norms[1] / whole,
                    "position_position": norms[2] / whole,
                    "sum_error": sum_error,
                }
            )
        x = content
        cp_shifted = x @ A @ shifted.T + shifted @ A @ x.T
        cp = x @ A @ P.T + P @ A @ x.T
        result["content_position_shift_change"] = _relative_change(cp, cp_shifted)
        result["position_position_shift_change"] = _relative_change(pp, shifted @ A @ shifted.T)
        same = P @ P.T
        result["identity_shift_change"] = _relative_change(same, shifted @ shifted.T)
    result["shift"] = shift
    result["position_position_spread"] = _diagonal_spread(pp)
    result["position_position_range"] = float(pp.max() - pp.min())
    result["identity_spread"] = _diagonal_spread(P @ P.T)
    result["position_position_relative_share"] = _offset_share(pp)
    return result


def _relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """Largest change from ``before`` to ``after`` over ``before``'s range (0 when neither varies nor changes)."""
    change = float((before - after).abs().max())
    spread = float(before.max() - before.min())
    if spread == 0:
        return 0.0 if change == 0 else math.inf
    return change / spread


def _offset_share(scores: torch.Tensor) -> float:
    """The share (squared Frobenius norm) of an ``(n, n)`` matrix that depends on the offset j - i only.

    The offset-only part is each diagonal's mean; the rest depends on where the pair sits. The
    matrix is centred first, so a constant (which depends on nothing) counts for neither.
    """
    centred = scores - scores.mean()
    n = centred.shape[-1]
    offset_only = torch.zeros_like(centred)
    for k in range(-(n - 1), n):
        mask = torch.diagonal(torch.ones_like(centred), offset=k)
        torch.diagonal(offset_only, offset=k).copy_(torch.diagonal(centred, offset=k).mean() * mask)
    whole = float(centred.pow(2).sum())
    return float(offset_only.pow(2).sum()) / whole if whole > 0 else 0.0
