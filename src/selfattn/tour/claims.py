"""Every claim of the chapter's five source pages beside what the tour measured.

The pages (in the chapter's folder): the PyTorch notebook (``chapter``), the MXNet,
TensorFlow and Paddle page (``frameworks page``), a short English summary with MXNet code
(``summary page``), the study note (``note``) and the slides (``slides``). Each claim is one
entry ``{"id", "source", "statement", "measured", "expected", "holds"}``; ``holds`` says
whether the measurement agrees with the statement (``None`` when the tour cannot decide it),
and a claim that does not hold is kept, since the point is to report what was found.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SOURCES", "claims"]

SOURCES = {
    "chapter": "PyTorch notebook of the chapter",
    "frameworks page": "the chapter's MXNet / TensorFlow / Paddle page",
    "summary page": "English summary with MXNet code",
    "note": "study note",
    "slides": "slides",
}


def _claim(
    id_: str, source: str, statement: str, measured: object, expected: str, holds: bool | None
) -> dict[str, object]:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    return {
        "id": id_,
        "source": source,
        "statement": statement,
        "measured": measured,
        "expected": expected,
        "holds": None if holds is None else bool(holds),
    }


def _near(value: float, want: float, tolerance: float = 0.1) -> bool:
    return abs(value - want) <= tolerance


def claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The claims of the source pages against ``results`` (as :func:`selfattn.tour.runner.compute` returns)."""
    comp = results["comparison"]
    cnn, rnn, sa = comp["cnn"], comp["rnn"], comp["self_attention"]
    n = comp["sweep"]["n"][-1]
    perm = results["permutation"]
    pe = results["positional_encoding"]
    periods = pe["column_periods"]
    q = results["absolute"]["qualities"]
    small = results["absolute"]["small_width"]
    across = results["absolute"]["across_lengths"]
    fit = results["relative"]["fitted_rotation"]
    terms = results["note"]["taylor"]
    survival = results["note"]["embedding"]
    precision = results["frameworks"]["precision"]
    odd = results["frameworks"]["odd_width"]
    crossings = comp["crossings"]
    out = [
        _claim(
            "self-attention-shape",
            "chapter",
            "Self-attention outputs a sequence of the same shape as its input.",
            results["self_attention"]["shape"]["shape"],
            str(results["self_attention"]["shape"]["expected"]),
            results["self_attention"]["shape"]["ok"],
        ),
        _claim(
            "cnn-compute",
            "chapter",
            "A convolutional layer costs O(knd^2).",
            {
                "n": round(cnn["flops_exponent_n"], 3),
                "d": round(cnn["flops_exponent_d"], 3),
                "k": round(cnn["flops_exponent_k"], 3),
            },
            "FLOP exponents n^1 d^2 k^1 (+- 0.1)",
            _near(cnn["flops_exponent_n"], 1)
            and _near(cnn["flops_exponent_d"], 2)
            and _near(cnn["flops_exponent_k"], 1),
        ),
        _claim(
            "rnn-compute",
            "chapter",
            "A recurrent layer costs O(nd^2).",
            {"n": round(rnn["flops_exponent_n"], 3), "d": round(rnn["flops_exponent_d"], 3)},
            "FLOP exponents n^1 d^2 (+- 0.1)",
            _near(rnn["flops_exponent_n"], 1) and _near(rnn["flops_exponent_d"], 2),
        ),
        _claim(
            "self-attention-compute",
            "chapter",
            "Self-attention costs O(n^2 d) (the score and value matrix products).",
            {"n": round(sa["flops_exponent_n"], 3), "d": round(sa["flops_exponent_d"], 3)},
            "FLOP exponents n^2 d^1 (+- 0.1)",
            _near(sa["flops_exponent_n"], 2) and _near(sa["flops_exponent_d"], 1),
        ),
        _claim(
            "cnn-sequential",
            "chapter",
            "CNNs are hierarchical: O(1) sequential operations.",
            cnn["sequential_ops_by_n"],
            "constant in n",
            _near(cnn["sequential_ops_exponent_n"], 0),
        ),
        _claim(
            "rnn-sequential",
            "chapter",
            "An RNN has O(n) sequential operations that cannot be parallelized.",
            rnn["sequential_ops_by_n"],
            "grows as n^1",
            _near(rnn["sequential_ops_exponent_n"], 1),
        ),
        _claim(
            "self-attention-sequential",
            "chapter",
            "Self-attention computes in parallel with O(1) sequential operations.",
            sa["sequential_ops_by_n"],
            "constant in n",
            _near(sa["sequential_ops_exponent_n"], 0),
        ),
        _claim(
            "cnn-path",
            "chapter",
            "A CNN's maximum path length is O(n/k); x1 and x5 share the receptive field of two k=3 layers.",
            {"by k at n=" + f"{n:,}": cnn["path_length_by_k"], "layers from x1 to x5": comp["x1_to_x5"]["layers"]},
            f"ceil((n-1)/(k-1)): {cnn['expected_path_length_by_k']}; 2 layers",
            cnn["path_length_by_k"] == cnn["expected_path_length_by_k"] and comp["x1_to_x5"]["layers"] == 2,
        ),
        _claim(
            "rnn-path",
            "chapter",
            "An RNN's maximum path length is O(n).",
            rnn["path_length_by_n"],
            "grows as n^1 (products on the path)",
            _near(rnn["path_length_exponent_n"], 1),
        ),
        _claim(
            "self-attention-path",
            "chapter",
            "Self-attention connects every pair of tokens directly: maximum path length O(1).",
            sa["path_length_by_n"],
            "constant in n",
            _near(sa["path_length_exponent_n"], 0),
        ),
        _claim(
            "quadratic-slow",
            "chapter",
            "The quadratic cost in n makes self-attention slow for very long sequences.",
            {
                "time exponent (median)": round(sa["time_exponent_n"], 2),
                "spread": [round(v, 2) for v in sa["time_exponent_spread"]],
                "attention core / RNN FLOPs at the largest n (ratio)": round(crossings["core_over_rnn_by_n"][-1], 2),
            },
            "time grows faster than the RNN's at large n",
            sa["time_exponent_n"] > rnn["time_exponent_n"],
        ),
        _claim(
            "no-order",
            "chapter",
            "Self-attention by itself does not preserve the order of the sequence.",
            perm["without_pe_error"],
            "permuting the input permutes the output (difference < 1e-9)",
            perm["without_pe_error"] < 1e-9,
        ),
        _claim(
            "columns-frequency",
            "chapter",
            "Columns 6 and 7 of P have a higher frequency than columns 8 and 9.",
            [round(p, 2) for p in periods],
            "measured periods of 6, 7 below those of 8, 9",
            max(periods[:2]) < min(periods[2:]),
        ),
        _claim(
            "columns-offset",
            "chapter",
            "The offset between columns 6 and 7 comes from alternating sine and cosine (a quarter period).",
            round(pe["phase_offset"], 4),
            "phase offset 0.25 of a period (+- 0.01)",
            abs(pe["phase_offset"] - 0.25) <= 0.01,
        ),
        _claim(
            "frequency-falls",
            "chapter",
            "The encoding decreases frequencies along the encoding dimension, like higher bits of a binary number.",
            [round(p, 1) for p in pe["all_column_periods"]],
            "measured periods increase column pair by column pair",
            all(a < b for a, b in zip(pe["all_column_periods"], pe["all_column_periods"][1:], strict=False)),
        ),
        _claim(
            "space-efficient",
            "chapter",
            "Continuous representations are more space-efficient than binary ones.",
            {"positions": small["num_positions"], "smallest row distance with d=8": small["min_row_distance"]},
            "8 numbers tell apart more than the 256 positions 8 bits can (distance > 0)",
            small["num_positions"] > 256 and small["min_row_distance"] > 1e-6,
        ),
        _claim(
            "rotation",
            "chapter",
            "P[i+delta] is a linear projection of P[i] (the rotation M_delta).",
            results["rotation_max_error"],
            "rounding (< 1e-9)",
            results["rotation_max_error"] < 1e-9,
        ),
        _claim(
            "rotation-independent-of-i",
            "chapter",
            "The 2x2 projection matrix does not depend on the position i.",
            {"fit minus rotation": fit["rotation_error_max"], "between windows of i": fit["window_spread_max"]},
            "least-squares fits equal the rotation on every window (< 1e-9)",
            fit["rotation_error_max"] < 1e-9 and fit["window_spread_max"] < 1e-9,
        ),
        _claim(
            "relative-for-free",
            "summary page",
            "A network can learn to shift attention by delta tokens with one linear transformation.",
            fit["residual_max"],
            "one fitted d x d map reproduces P[i+delta] from P[i] (residual < 1e-9)",
            fit["residual_max"] < 1e-9,
        ),
        _claim(
            "unique-rows",
            "note",
            "Each time step gets a unique encoding.",
            {"positions": q["num_positions"], "smallest row distance": q["min_row_distance"]},
            "> 0",
            q["min_row_distance"] > 1e-6,
        ),
        _claim(
            "same-distance-across-lengths",
            "note",
            "The distance between two time steps is the same across sentences of different lengths.",
            {"lengths": across["lengths"], "spread": across["spread"], "i/n foil spread": across["fraction_spread"]},
            "spread 0 (and a length-dependent encoding would fail it)",
            across["spread"] == 0 and across["fraction_spread"] > 1e-3,
        ),
        _claim(
            "same-distance-anywhere",
            "note",
            "(as the tour used to read it) The distance between positions i and i+delta does not depend on i.",
            q["offset_distance_spread_max"],
            "rounding (< 1e-9)",
            q["offset_distance_spread_max"] < 1e-9,
        ),
        _claim(
            "longer-sentences",
            "note",
            "The model generalizes to longer sentences.",
            {
                "new rows' nearest distance to seen rows": q["unseen_nearest_distance"],
                "nearest pair": q["unseen_nearest_pair"],
            },
            "not measurable on P alone: shown only that rows past the seen length are new and bounded",
            None,
        ),
        _claim(
            "bounded",
            "note",
            "The values are bounded.",
            q["max_abs_value"],
            "<= 1",
            q["max_abs_value"] <= 1 + 1e-12,
        ),
        _claim(
            "symmetry",
            "note",
            "Without positions the Transformer is fully symmetric: f(..., x_m, ..., x_n, ...) = f(..., x_n, ..., x_m, ...).",
            perm["without_pe_error"],
            "outputs permute with the inputs (< 1e-9); adding P breaks it (> 1e-3)",
            perm["without_pe_error"] < 1e-9 and perm["with_pe_change"] > 1e-3,
        ),
        _claim(
            "taylor-relative-term",
            "note",
            "In the expansion of f(x + p), the cross term holds the relative position information.",
            {
                "position-position share (content scale 1)": round(terms["scales"][0]["position_position"], 3),
                "its spread along one offset": terms["position_position_spread"],
                "its range": terms["position_position_range"],
            },
            "the position-position scores depend on the offset only (spread < 1e-9)",
            terms["position_position_spread"] < 1e-9,
        ),
        _claim(
            "embeddings-survive",
            "note",
            "Adding P changes the word embeddings, but not destructively.",
            dict(zip([f"d={d}" for d in survival["sizes"]], [round(r, 4) for r in survival["recovered"]], strict=True)),
            "nearest-token recovery of E[t] + P[i] close to 1 (N(0,1) embeddings)",
            survival["recovered"][-1] > 0.99,
        ),
        _claim(
            "parallelism",
            "slides",
            "Parallelism: CNN O(n), RNN O(1), self-attention O(n).",
            {k: round(comp[k]["parallelism_exponent_n"], 3) for k in ("cnn", "rnn", "self_attention")},
            "n / sequential ops grows as n^1, n^0, n^1 (+- 0.1)",
            _near(cnn["parallelism_exponent_n"], 1)
            and _near(rnn["parallelism_exponent_n"], 0)
            and _near(sa["parallelism_exponent_n"], 1),
        ),
        _claim(
            "odd-width-mxnet",
            "frameworks page",
            "The MXNet code slices X[:, :num_hiddens // 2] for the cosine columns, so an odd num_hiddens works.",
            {name: entry["builds"] for name, entry in odd.items()},
            "MXNet builds a table for odd d; PyTorch, TensorFlow and Paddle fail",
            odd["mxnet"]["builds"] and not any(odd[n]["builds"] for n in ("pytorch", "tensorflow", "paddle")),
        ),
        _claim(
            "float32-angles",
            "frameworks page",
            "Every page forms the angles i / 10000^(2j/d) in float32.",
            {name: f"{errors[-1]:.1e}" for name, errors in precision["errors"].items()},
            f"largest error at {precision['lengths'][-1]:,} positions well above float32 rounding of P (> 1e-5)",
            all(errors[-1] > 1e-5 for errors in precision["errors"].values()),
        ),
    ]
    for entry in out:
        measured = entry["measured"]
        if isinstance(measured, float) and not math.isfinite(measured):
            entry["measured"] = None
    return out
