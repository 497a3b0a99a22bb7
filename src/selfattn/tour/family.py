"""Section 7: every encoding in :mod:`selfattn.positional`, through the same diagnostics.

For each encoding, on positions ``0 .. n - 1``:

* ``position_scores`` ``(n, n)``: the attention score positions alone would contribute, with
  the same content at every position: ``P_i . P_j / sqrt(d)`` for an encoding added to the
  input, ``<R_i u, R_j u> / sqrt(dh)`` for one that rotates queries and keys (u = ones), and
  the bias itself for a score encoding (first head);
* the offset similarity: that score against ``delta = j - i``, with ``shift_spread``, the
  largest difference between pairs at the same delta (0 when it depends on delta only);
* ``attention``: the first head's weights of a self-attention layer using the encoding on one
  random input, and ``shift_change``, how much its output moves when every position shifts
  by ``shift`` (0 for an encoding that is relative in practice, not just in name);
* ``far_positions``: whether it runs at positions far past those seen here.

Shape legend: b batch, h heads, n positions, d model size, dh head size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from selfattn.attention import MultiHeadAttention
from selfattn.tour._common import seeded

if TYPE_CHECKING:
    from selfattn.positional import PositionalEncoding

__all__ = ["encoding_diagnostics", "encoding_table", "family_names", "has_causal_form", "position_scores"]


def family_names() -> tuple[str, ...]:
    """Names of the encodings :func:`selfattn.positional.build` makes (ImportError when absent).

    M-RoPE is left out: the tour's sequences are text, where it is half-split rotary.
    """
    from selfattn.positional import NAMES

    return tuple(name for name in NAMES if name != "mrope")


def _build(name: str, num_hiddens: int, num_heads: int, **options: Any) -> PositionalEncoding:
    from selfattn.positional import build

    return build(name, num_hiddens=num_hiddens, num_heads=num_heads, **options)


def has_causal_form(name: str) -> bool:
    """Whether the encoding has a causal and a bidirectional form (ALiBi does)."""
    import inspect

    from selfattn.positional import registry

    return "causal" in inspect.signature(registry._REGISTRY[name].cls).parameters


def _as_grid(x: torch.Tensor, encoding: PositionalEncoding) -> torch.Tensor:
    """Give a grid encoding (2-D, 3-D) its extra axes: the sequence runs along its last axis."""
    extra_axes = getattr(encoding, "num_axes", 1) - 1
    return x.reshape(*x.shape[:-2], *([1] * extra_axes), *x.shape[-2:])  # (b, 1.., n, d)


def _add_input_encoding(encoding: PositionalEncoding, x: torch.Tensor, offset: int) -> torch.Tensor:
    """``x + P`` for a sequence ``(b, n, d)``, through the grid axes if the encoding has them."""
    encoded: torch.Tensor = encoding(_as_grid(x, encoding), offset=offset)
    return encoded.reshape(x.shape)  # (b, n, d)


def _contribution(
    encoding: PositionalEncoding, positions: torch.Tensor, num_hiddens: int, num_heads: int, dtype: torch.dtype
) -> torch.Tensor:
    """What the encoding does at ``positions`` (n,) on content that is the same everywhere.

    Input encodings: the rows of P ``(n, d)``; query/key encodings: an all-ones head after
    rotation ``(n, dh)``; score encodings: every head's bias for queries of ones ``(h, n, n)``.
    """
    num_steps = positions.shape[0]
    if encoding.acts_on == "input":
        zeros = torch.zeros(1, num_steps, num_hiddens, dtype=dtype)
        return _add_input_encoding(encoding, zeros, int(positions[0]))[0]  # (n, d)
    same = torch.ones(1, num_heads, num_steps, num_hiddens // num_heads, dtype=dtype)  # (1, h, n, dh)
    if encoding.acts_on == "query_key":
        rotated: torch.Tensor = encoding(same, positions)
        return rotated[0, 0]  # (n, dh)
    bias: torch.Tensor = encoding(same, q_positions=positions, k_positions=positions)  # broadcastable to (1, h, n, n)
    return bias.expand(1, num_heads, num_steps, num_steps)[0].clone()  # (h, n, n)


def position_scores(encoding: PositionalEncoding, num_steps: int, num_hiddens: int, num_heads: int) -> torch.Tensor:
    """The ``(n, n)`` score contribution of positions alone (see the module docstring), float64."""
    contribution = _contribution(encoding, torch.arange(num_steps), num_hiddens, num_heads, torch.float64)
    if encoding.acts_on == "scores":
        return contribution[0]  # first head's bias
    from selfattn.positional.base import QueryKeyEncoding

    keys = contribution
    if isinstance(encoding, QueryKeyEncoding):  # keys may be encoded differently (xPos)
        same = torch.ones(1, 1, num_steps, contribution.shape[-1], dtype=torch.float64)
        keys = encoding.encode_keys(same, torch.arange(num_steps))[0, 0]  # (n, dh)
    return contribution @ keys.T / math.sqrt(contribution.shape[-1])  # (n, n)


def _offset_profile(scores: torch.Tensor) -> tuple[list[int], list[float], float]:
    """Mean score per diagonal ``delta = j - i`` and the largest spread along one diagonal."""
    n = scores.shape[0]
    deltas, means, spread = [], [], 0.0
    for delta in range(-(n - 1), n):
        diagonal = torch.diagonal(scores, offset=delta)
        if bool(diagonal.isnan().all()):  # future keys under a causal mask
            continue
        deltas.append(delta)
        means.append(float(diagonal.mean()))
        spread = max(spread, float(diagonal.max() - diagonal.min()))
    return deltas, means, spread


def encoding_diagnostics(
    name: str,
    *,
    num_hiddens: int = 32,
    num_heads: int = 4,
    num_steps: int = 24,
    shift: int = 7,
    far_offset: int = 5000,
    causal: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """All of the module docstring's diagnostics for the encoding called ``name``.

    Everything runs in float64 with seeded random weights (learned encodings are shown as
    initialized: their pattern is noise until trained). ``causal`` picks causal attention;
    an encoding with both forms (ALiBi) is built in the form that matches, and with causal
    attention the scores of future keys, which the mask removes, are left out (NaN).
    """
    options = {"causal": causal} if has_causal_form(name) else {}
    with seeded(seed):
        encoding = _build(name, num_hiddens, num_heads, **options).double().eval()
        attention = (
            MultiHeadAttention(num_hiddens, num_heads, position=None if encoding.acts_on == "input" else encoding)
            .double()
            .eval()
        )
        x = torch.randn(1, num_steps, num_hiddens, dtype=torch.float64)

    def attend(offset: int, tokens: torch.Tensor = x) -> tuple[torch.Tensor, torch.Tensor]:
        outputs: tuple[torch.Tensor, torch.Tensor]
        if encoding.acts_on == "input":
            h = _add_input_encoding(encoding, tokens, offset)
            outputs = attention(h, h, h, return_weights=True, causal=causal)
        else:
            outputs = attention(tokens, tokens, tokens, return_weights=True, offset=offset, causal=causal)
        return outputs

    with torch.no_grad():
        scores = position_scores(encoding, num_steps, num_hiddens, num_heads)
        if causal:
            future = torch.ones(num_steps, num_steps, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("nan"))
        deltas, by_delta, spread = _offset_profile(scores)
        output, weights = attend(0)
        shifted, _ = attend(shift)
        # Without positions, attention commutes with permuting the tokens. A cyclic shift, not
        # a reversal: a reversal keeps every |i - j|, so it cannot see a symmetric bias.
        order = torch.arange(num_steps).roll(1)
        permuted, _ = attend(0, x[:, order])
        permutation_change = float((permuted - output[:, order]).abs().max() / output.abs().max().clamp_min(1e-300))
        try:
            attend(far_offset)
            far_positions = "ok"
        except ValueError as error:  # an encoding with a fixed table (learned) refuses, by design
            far_positions = str(error).split(":")[0]
    shift_change = float((shifted - output).abs().max() / output.abs().max().clamp_min(1e-300))
    return {
        "name": name,
        "class": type(encoding).__name__,
        "acts_on": encoding.acts_on,
        "is_relative": bool(encoding.is_relative),
        "num_steps": num_steps,
        "position_scores": scores.numpy(),
        "deltas": deltas,
        "score_by_delta": by_delta,
        "shift_spread": spread,
        "attention": weights[0, 0].numpy(),
        "shift": shift,
        "shift_change": shift_change,
        "measured_relative": shift_change < 1e-9,
        "causal": causal,
        "form": ("causal" if causal else "bidirectional") if options else None,
        "permutation_change": permutation_change,
        "position_aware": permutation_change > 1e-9,
        "far_offset": far_offset,
        "far_positions": far_positions,
    }


def encoding_table(
    name: str,
    *,
    num_steps: int,
    num_hiddens: int,
    num_heads: int = 1,
    offset: int = 0,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> torch.Tensor:
    """What the encoding called ``name`` contributes at positions ``offset .. offset + n - 1``.

    * added to the input: the rows of P, ``(n, d)`` (grid encodings along their last axis);
    * rotating queries and keys: an all-ones head ``(n, dh)`` after rotation;
    * in the scores: the bias of every head for queries of ones, ``(h, n, n)``.

    ``sinusoidal`` is computed by :func:`~selfattn.functional.sinusoidal_table` directly, so a
    float64 table is exact; ``options`` (such as ``base``) go to the encoding's constructor.
    """
    from selfattn._validation import require_non_negative_int, require_positive_int
    from selfattn.functional import sinusoidal_table

    num_steps = require_positive_int("num_steps", num_steps)
    offset = require_non_negative_int("offset", offset)
    if name == "sinusoidal" and set(options) <= {"base"}:
        return sinusoidal_table(num_steps, num_hiddens, offset=offset, dtype=dtype, **options)
    encoding = _build(name, num_hiddens, num_heads, **options).to(dtype).eval()
    with torch.no_grad():
        return _contribution(encoding, torch.arange(offset, offset + num_steps), num_hiddens, num_heads, dtype)
