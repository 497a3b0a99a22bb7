"""Numerical checks of the chapter's cells and claims; each returns plain numbers or arrays.

Sections 1 (self-attention), 2 (permutation), 4 (the table P) and 6 (relative positions).
Shape legend: b batch, h heads, n positions, d columns of P (or model size).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_frequencies, sinusoidal_table
from selfattn.tour._common import seeded

__all__ = [
    "binary_representations",
    "bit_alternation",
    "bit_matrix",
    "column_periods",
    "fft_period",
    "fitted_rotation",
    "masked_attention_weights",
    "measured_periods",
    "monotone_counterexamples",
    "period_ratios",
    "phase_lead",
    "offset_similarity",
    "order_sensitivity",
    "permutation_check",
    "phase_offset",
    "rotation_max_error",
    "self_attention_shape",
    "table_columns",
    "zero_crossing_period",
    "zero_crossings",
]


def self_attention_shape(
    num_hiddens: int = 100, num_heads: int = 5, batch_size: int = 2, num_queries: int = 4
) -> dict[str, object]:
    """The chapter's first cell: self-attention keeps the input's shape.

    ``projections``: each of the layer's four projections as ``[in_features, out_features, has_bias]``
    (the frameworks page prints its PyTorch layer's).
    """
    mha = MultiHeadAttention(num_hiddens, num_heads, 0.5).eval()
    X = torch.ones(batch_size, num_queries, num_hiddens)
    valid_lens = torch.tensor([3, 2])
    with torch.no_grad():
        shape = tuple(mha(X, X, X, valid_lens).shape)
    expected = (batch_size, num_queries, num_hiddens)
    assert mha.W_k is not None and mha.W_v is not None  # a plain layer projects its keys and values
    projections = {
        name: [layer.in_features, layer.out_features, layer.bias is not None]
        for name, layer in (("W_q", mha.W_q), ("W_k", mha.W_k), ("W_v", mha.W_v), ("W_o", mha.W_o))
    }
    return {"shape": list(shape), "expected": list(expected), "ok": shape == expected, "projections": projections}


def masked_attention_weights(
    num_hiddens: int = 16, num_heads: int = 2, num_steps: int = 8, valid_lens: tuple[int, ...] = (5, 3), seed: int = 0
) -> dict[str, object]:
    """Self-attention weights of a small random input with the chapter's ``valid_lens``.

    Returns the ``(b, h, n, n)`` weights, the largest weight on a masked key (0 when masking
    works) and the largest deviation of a row sum from 1.
    """
    with seeded(seed):
        mha = MultiHeadAttention(num_hiddens, num_heads).eval()
        X = torch.randn(len(valid_lens), num_steps, num_hiddens)
    lens = torch.tensor(valid_lens)
    with torch.no_grad():
        _, weights = mha(X, X, X, lens, return_weights=True)  # (b, h, n, n)
    masked = torch.arange(num_steps)[None, :] >= lens[:, None]  # (b, n): key j is padding
    masked_weights = weights.masked_select(masked[:, None, None, :].expand_as(weights))
    return {
        "weights": weights.numpy(),
        "valid_lens": list(valid_lens),
        "masked_weight_max": float(masked_weights.abs().max()) if masked_weights.numel() else 0.0,
        "row_sum_error": float((weights.sum(-1) - 1).abs().max()),
    }


def permutation_check(
    num_hiddens: int = 32,
    num_heads: int = 4,
    num_steps: int = 10,
    seed: int = 0,
    position_rows: torch.Tensor | None = None,
) -> dict[str, object]:
    """Self-attention commutes with permuting the tokens, until P is added to the input.

    Computed in float64. ``without_pe_error`` is ``max |f(X)[perm] - f(X[perm])|`` for plain
    self-attention f (rounding only); ``with_pe_change`` is the same for ``f(X + P)``, where
    the permuted tokens meet different rows of P. ``swap_equality_error`` tests the study note's
    equation as written, ``f(.., x_m, .., x_n, ..) = f(.., x_n, .., x_m, ..)`` with tokens 1 and
    n - 2 swapped: ``max |f(X) - f(X swapped)|``, output rows compared in place (0 only if f
    ignored which token sits where); ``swap_equivariance_error`` is the same with the output
    rows swapped back (rounding: they swap with the tokens). ``swap_pooled_error`` is the note's
    reading, where f is one value for the whole sentence (its Taylor term ``p_m' d2f/dx_m dx_n p_n``
    treats f as a scalar): the outputs averaged over the positions, ``max |mean f(X) - mean f(X
    swapped)|`` (rounding: a pooled equivariant map is invariant).
    """
    with seeded(seed):
        mha = MultiHeadAttention(num_hiddens, num_heads).double().eval()
        X = torch.randn(1, num_steps, num_hiddens, dtype=torch.float64)
        perm = torch.randperm(num_steps)
    # The chapter's P unless the caller gives other rows (a test gives identical ones: then nothing is broken).
    P = sinusoidal_table(num_steps, num_hiddens, dtype=torch.float64) if position_rows is None else position_rows

    def attend(Z: torch.Tensor) -> torch.Tensor:
        attended: torch.Tensor = mha(Z, Z, Z)
        return attended

    swap = list(range(num_steps))
    swap[1], swap[-2] = swap[-2], swap[1]
    with torch.no_grad():
        without = (attend(X)[:, perm] - attend(X[:, perm])).abs().max()
        swapped = attend(X[:, swap])
        equality = (attend(X) - swapped).abs().max()
        equivariance = (attend(X)[:, swap] - swapped).abs().max()
        pooled = (attend(X).mean(1) - swapped.mean(1)).abs().max()
        with_pe = attend(X + P)
        with_change = (with_pe[:, perm] - attend(X[:, perm] + P)).abs().max()
    return {
        "num_steps": num_steps,
        "permutation": perm.tolist(),
        "without_pe_error": float(without),
        "with_pe_change": float(with_change),
        "swapped": [1, num_steps - 2],
        "swap_equality_error": float(equality),
        "swap_equivariance_error": float(equivariance),
        "swap_pooled_error": float(pooled),
        "output_scale": float(with_pe.abs().max()),
    }


def order_sensitivity(
    num_hiddens: int = 16, num_steps: int = 10, seed: int = 0, kernel_size: int = 3
) -> dict[str, float]:
    """For each layer of section 3, ``max |f(X)[perm] - f(X[perm])|``: 0 when the layer ignores order.

    The slides: "unlike CNN/RNN, self-attention does not record position". A convolution sees
    its neighbours and a recurrence its past, so permuting the tokens changes their outputs by
    more than permuting them; self-attention's outputs only permute. Float64, no P. ``kernel_size`` is the
    convolution's width (1 reads no neighbour, and then the convolution ignores order too).
    """
    from selfattn.tour.comparison import KINDS, make_layer

    with seeded(seed):
        X = torch.randn(1, num_steps, num_hiddens, dtype=torch.float64)
        perm = torch.randperm(num_steps)
        layers = {kind: make_layer(kind, num_hiddens, kernel_size=kernel_size, dtype=torch.float64) for kind in KINDS}
    with torch.no_grad():
        return {kind: float((layer(X)[:, perm] - layer(X[:, perm])).abs().max()) for kind, layer in layers.items()}


def table_columns(
    num_positions: int = 60, num_hiddens: int = 32, columns: tuple[int, ...] = (6, 7, 8, 9)
) -> torch.Tensor:
    """Columns of P as in the chapter's plot: ``(n, len(columns))``."""
    return sinusoidal_table(num_positions, num_hiddens)[:, list(columns)]


def column_periods(num_hiddens: int = 32, columns: tuple[int, ...] = (6, 7, 8, 9)) -> list[float]:
    """Period in positions of each column: ``2 pi / w_j`` for columns ``2j`` and ``2j + 1``."""
    freqs = sinusoidal_frequencies(num_hiddens)
    return [float(2 * math.pi / freqs[c // 2]) for c in columns]


def zero_crossings(values: np.ndarray | torch.Tensor) -> list[float]:
    """Where a column crosses zero, in samples, by linear interpolation around each sign change.

    A sample that is exactly 0 is a crossing itself.
    """
    column = np.asarray(values, dtype=float)
    if column.ndim != 1 or column.size < 3:
        raise ValueError(f"values must be one column of at least 3 samples, got shape {column.shape}")
    crossings = []
    for i in range(column.size - 1):
        a, b = column[i], column[i + 1]
        if a == 0:
            crossings.append(float(i))
        elif a * b < 0:
            crossings.append(float(i + a / (a - b)))
    if column[-1] == 0:
        crossings.append(float(column.size - 1))
    return crossings


def zero_crossing_period(values: np.ndarray | torch.Tensor) -> float:
    """Period in samples of an oscillating column, measured from where it crosses zero.

    Twice the mean spacing of successive crossings (:func:`zero_crossings`). Needs at least
    two crossings, so a column must show half a period.
    """
    crossings = zero_crossings(values)
    if len(crossings) < 2:
        raise ValueError(f"a period needs two zero crossings, found {len(crossings)} in {len(values)} samples")
    return float(2 * (crossings[-1] - crossings[0]) / (len(crossings) - 1))


def phase_offset(first: np.ndarray | torch.Tensor, second: np.ndarray | torch.Tensor) -> float:
    """How far ``second`` lags ``first``, in periods of ``first``, modulo half a period.

    Zero crossings repeat every half period, so the offset is read modulo 0.5: a cosine column
    beside its sine column measures 0.25.
    """
    period = zero_crossing_period(first)
    a, b = zero_crossings(first), zero_crossings(second)
    if not b:
        raise ValueError("the second column never crosses zero")
    return float(((b[0] - a[0]) / period) % 0.5)


def fft_period(values: np.ndarray | torch.Tensor, oversample: int = 64) -> float:
    """Period in samples of the strongest frequency of a column (mean removed, zero-padded FFT)."""
    column = np.asarray(values, dtype=float)
    if column.ndim != 1 or column.size < 4:
        raise ValueError(f"values must be one column of at least 4 samples, got shape {column.shape}")
    size = oversample * column.size
    spectrum = np.abs(np.fft.rfft((column - column.mean()) * np.hanning(column.size), n=size))
    peak = int(np.argmax(spectrum[1:])) + 1
    return float(size / peak)


def measured_periods(
    num_positions: int = 60, num_hiddens: int = 32, columns: tuple[int, ...] = (6, 7, 8, 9), fft_positions: int = 2000
) -> dict[str, list[float]]:
    """Periods of the plotted columns read off the values, not off the formula.

    ``zero_crossings``: from the ``num_positions`` plotted rows; ``fft``: from the same columns
    over ``fft_positions`` rows (an FFT needs many periods to be sharp); ``formula``:
    ``2 pi / w_j``, for comparison only.
    """
    plotted = table_columns(num_positions, num_hiddens, columns).double().numpy()  # (n, columns)
    long = table_columns(fft_positions, num_hiddens, columns).double().numpy()
    return {
        "zero_crossings": [zero_crossing_period(plotted[:, c]) for c in range(len(columns))],
        "fft": [fft_period(long[:, c]) for c in range(len(columns))],
        "formula": column_periods(num_hiddens, columns),
    }


def fitted_rotation(
    num_hiddens: int = 32,
    deltas: tuple[int, ...] = (1, 5, 30),
    windows: tuple[tuple[int, int], ...] = ((0, 20000), (20000, 40000), (40000, 60000)),
    samples: int = 500,
    seed: int = 0,
) -> dict[str, object]:
    """Fit ``M`` with ``P[i + delta] = M P[i]`` by least squares, separately on windows of i.

    No rotation is assumed: ``M`` is a full ``d x d`` matrix fitted from ``samples`` random
    positions of each window (float64). ``rotation_error`` is the largest entry of ``M`` minus
    the chapter's block-diagonal rotation, ``window_spread`` the largest difference between
    the matrices fitted on different windows (0 when the map does not depend on i),
    ``residual`` the largest error of the fit itself.
    """
    generator = np.random.default_rng(seed)
    freqs = sinusoidal_frequencies(num_hiddens).numpy()
    full = sinusoidal_table(max(w[1] for w in windows) + max(deltas), num_hiddens, dtype=torch.float64).numpy()
    rotation_error: dict[str, float] = {}
    window_spread: dict[str, float] = {}
    residual: dict[str, float] = {}
    for delta in deltas:
        angles = delta * freqs[: num_hiddens // 2]
        rotation = np.zeros((num_hiddens, num_hiddens))
        for j, angle in enumerate(angles):
            cos, sin = np.cos(angle), np.sin(angle)
            rotation[2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = [[cos, sin], [-sin, cos]]
        if num_hiddens % 2:  # an odd d's last sine column has no cosine partner: leave it out
            rotation = rotation[:-1, :-1]
        fits = []
        for low, high in windows:
            i = np.sort(generator.choice(np.arange(low, high), size=samples, replace=False))
            before = full[i, : rotation.shape[0]]  # (samples, d)
            after = full[i + delta, : rotation.shape[0]]
            # torch's solver: NumPy's multi-threaded BLAS stalls for seconds on a busy machine.
            solution = torch.linalg.lstsq(torch.from_numpy(before), torch.from_numpy(after), driver="gelsd")
            solution = solution.solution.numpy()  # (d, d): after = before @ M^T
            fit = solution.T
            fits.append(fit)
            residual[str(delta)] = max(residual.get(str(delta), 0.0), float(np.abs(before @ solution - after).max()))
        rotation_error[str(delta)] = max(float(np.abs(fit - rotation).max()) for fit in fits)
        window_spread[str(delta)] = max(float(np.abs(a - b).max()) for a in fits for b in fits)
    return {
        "num_hiddens": num_hiddens,
        "deltas": list(deltas),
        "windows": [list(w) for w in windows],
        "samples": samples,
        "rotation_error": rotation_error,
        "rotation_error_max": max(rotation_error.values()),
        "window_spread": window_spread,
        "window_spread_max": max(window_spread.values()),
        "residual_max": max(residual.values()),
    }


def binary_representations(count: int = 8) -> list[str]:
    """``i`` in binary for ``i < count``, padded to a common width."""
    width = max(1, math.ceil(math.log2(count)))
    return [f"{i:0{width}b}" for i in range(count)]


def bit_matrix(count: int = 8) -> np.ndarray:
    """The bits of ``0 .. count - 1`` as a ``(count, width)`` 0/1 array, highest bit first."""
    return np.array([[int(bit) for bit in bits] for bits in binary_representations(count)])


def bit_alternation(num_bits: int = 3) -> list[float]:
    """Every how many numbers each bit flips, lowest bit first, read off the bits of ``0 .. 2^(num_bits+1) - 1``.

    The chapter: the lowest, second-lowest and third-lowest bits "alternate on every number,
    every two numbers, and every four numbers". Each value is the mean gap between a bit's
    successive flips; twice as many numbers as the chapter prints give the highest bit two flips.
    """
    bits = bit_matrix(2 ** (num_bits + 1))[:, ::-1][:, :num_bits]  # (count, num_bits), lowest first
    flips = np.abs(np.diff(bits, axis=0))  # (count - 1, num_bits): 1 where the bit changed
    return [float(np.diff(np.flatnonzero(flips[:, k])).mean()) for k in range(num_bits)]


def period_ratios(periods: list[float]) -> list[float]:
    """Each measured period over the one before: how much slower each next column pair oscillates."""
    if len(periods) < 2 or min(periods) <= 0:
        raise ValueError(f"need two or more positive periods, got {periods}")
    return [b / a for a, b in itertools.pairwise(periods)]


def phase_lead(first: np.ndarray, second: np.ndarray) -> float:
    """How far ``second`` leads ``first``, in periods, in (-0.5, 0.5]: 0.25 for a cosine beside its sine.

    Both columns share one frequency, read off ``first``'s zero crossings; each column is fitted
    as ``a sin(w i) + b cos(w i)`` and its phase is ``atan2(b, a)``. Positive: ``second`` reaches
    each value earlier (at smaller i) than ``first``.
    """
    first, second = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    omega = 2 * np.pi / zero_crossing_period(first)
    i = np.arange(len(first))
    basis = np.stack([np.sin(omega * i), np.cos(omega * i)], axis=1)  # (n, 2)
    (a1, b1), (a2, b2) = (np.linalg.lstsq(basis, column, rcond=None)[0] for column in (first, second))
    lead = (math.atan2(b2, a2) - math.atan2(b1, a1)) / (2 * np.pi)
    return float(lead - math.ceil(lead - 0.5))  # wrapped into (-0.5, 0.5]


def rotation_max_error(num_positions: int = 60, num_hiddens: int = 32, max_delta: int = 60) -> float:
    """Largest ``|M_delta P[i] - P[i + delta]|`` over positions i, offsets delta and pairs j.

    ``M_delta = [[cos(delta w_j), sin(delta w_j)], [-sin(delta w_j), cos(delta w_j)]]`` acts on
    ``(P[i, 2j], P[i, 2j+1])``; it does not depend on i. Computed in float64.
    """
    table = sinusoidal_table(num_positions + max_delta, num_hiddens, dtype=torch.float64)  # (n + D, d)
    pairs = num_hiddens // 2
    sines, cosines = table[:, 0 : 2 * pairs : 2], table[:, 1 : 2 * pairs : 2]  # (n + D, pairs)
    freqs = sinusoidal_frequencies(num_hiddens)[:pairs]  # (pairs,)
    deltas = torch.arange(max_delta + 1, dtype=torch.float64)  # (D + 1,)
    cos_d, sin_d = torch.cos(torch.outer(deltas, freqs)), torch.sin(torch.outer(deltas, freqs))  # (D + 1, pairs)
    i = torch.arange(num_positions)
    worst = 0.0
    for delta in range(max_delta + 1):
        rotated_sin = cos_d[delta] * sines[i] + sin_d[delta] * cosines[i]  # (n, pairs)
        rotated_cos = -sin_d[delta] * sines[i] + cos_d[delta] * cosines[i]
        err = torch.maximum((rotated_sin - sines[i + delta]).abs(), (rotated_cos - cosines[i + delta]).abs())
        worst = max(worst, float(err.max()))
    return worst


def offset_similarity(
    num_hiddens: int = 32, starts: tuple[int, ...] = (0, 10, 25, 50), max_delta: int = 60
) -> dict[str, object]:
    """``P[i] . P[i + delta]`` for several starting positions i, against delta.

    For even d it equals ``sum_j cos(delta w_j)`` whatever i is: ``spread`` is the largest
    difference between starting positions at one delta, ``closed_form_error`` the largest
    distance to that sum (both rounding only). Computed in float64.
    """
    table = sinusoidal_table(max(starts) + max_delta + 1, num_hiddens, dtype=torch.float64)  # (n, d)
    deltas = torch.arange(max_delta + 1)
    curves = torch.stack([table[start + deltas] @ table[start] for start in starts])  # (starts, D + 1)
    freqs = sinusoidal_frequencies(num_hiddens)[: num_hiddens // 2]
    closed_form = torch.cos(torch.outer(deltas.double(), freqs)).sum(-1)  # (D + 1,)
    result: dict[str, object] = {
        "deltas": deltas.tolist(),
        "starts": list(starts),
        "similarity": curves.numpy(),
        "spread": float((curves.max(0).values - curves.min(0).values).max()),
    }
    if num_hiddens % 2 == 0:
        result["closed_form_error"] = float((curves - closed_form).abs().max())
    return result


def _rows_min_distance(table: torch.Tensor) -> float:
    """The smallest distance between two rows of ``table`` (n, d)."""
    distances = torch.cdist(table, table)  # (n, n)
    distances.fill_diagonal_(math.inf)
    return float(distances.min())


def monotone_counterexamples(num_hiddens: int = 32, num_positions: int = 1000) -> dict[str, object]:
    """Does the fall of the frequencies along the columns make the rows of P distinct? Two tests of the "because".

    ``min_row_distance``: the smallest distance between two of the first ``num_positions`` rows
    of P; ``min_row_distance_permuted``: the same with the column pairs in a shuffled order,
    so that the frequencies no longer fall (the rows' distinctness cannot depend on it);
    ``falling_collision``: ``|p_0 - p_2|`` for two falling angular frequencies ``(2 pi, pi)``,
    whose rows repeat every 2 positions.
    """
    table = sinusoidal_table(num_positions, num_hiddens, dtype=torch.float64)  # (n, d)
    pairs = torch.randperm(num_hiddens // 2, generator=torch.Generator().manual_seed(0))
    columns = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)
    angles = torch.arange(3, dtype=torch.float64)[:, None] * torch.tensor([2 * math.pi, math.pi], dtype=torch.float64)
    falling = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(3, 4)  # rows p_0, p_1, p_2
    return {
        "min_row_distance": _rows_min_distance(table),
        "min_row_distance_permuted": _rows_min_distance(table[:, columns]),
        "falling_frequencies": [2 * math.pi, math.pi],
        "falling_collision": float((falling[0] - falling[2]).abs().max()),
    }
