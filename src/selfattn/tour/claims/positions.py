# ruff: noqa: RUF001  (the quotes are the pages' own words, full-width Chinese punctuation included)
"""The chapter's claims about order and positions: permutation, the columns of P, attention by offset, rotation.

The offset claims read a trained layer (:mod:`selfattn.tour.offset`); the others follow from the
formula or from how the code is written, and are labelled so.
"""

from __future__ import annotations

import itertools
from typing import Any

from selfattn.tour.claims._base import _claim

__all__ = ["position_claims"]


def _order_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """Self-attention without positions ignores order; what a positional encoding is."""
    perm = results["permutation"]
    order = results["learning"]["order"]
    return [
        _claim(
            "no-order",
            "chapter",
            "self-attention by itself does not preserve the order of the sequence.",
            "Permuting self-attention's input permutes its output, nothing more.",
            "identity",
            perm["without_pe_error"],
            "max |f(X)[perm] - f(X[perm])| < 1e-9",
            perm["without_pe_error"] < 1e-9,
            also_on=("note",),
            basis="self-attention without positions is a function of the rows of X that commutes with any reordering of them (softmax(XW_q (XW_k)') XW_v); the error is float64 rounding (one number for both claims)",
        ),
        _claim(
            "permutation-equivariant",
            "summary",
            "Self-attention is permutation-equivariant: shuffle the input tokens, and the outputs shuffle the same way.",
            "Shuffling the tokens shuffles self-attention's outputs the same way.",
            "identity",
            perm["without_pe_error"],
            "< 1e-9",
            perm["without_pe_error"] < 1e-9,
            basis="self-attention without positions is a function of the rows of X that commutes with any reordering of them (softmax(XW_q (XW_k)') XW_v); the error is float64 rounding (one number for both claims)",
        ),
        _claim(
            "no-position-unlike-cnn-rnn",
            "slides",
            "跟CNN/RNN不同，自注意力并没有记录位置信息",
            "Unlike a convolution and an RNN, self-attention's output ignores where each token sits.",
            "measured",
            {kind: f"{value:.1e}" for kind, value in order.items()},
            "max |f(X)[perm] - f(X[perm])|: < 1e-9 for self-attention, > 1e-3 for the CNN and the RNN",
            order["self_attention"] < 1e-9 and min(order["cnn"], order["rnn"]) > 1e-3,
        ),
        _claim(
            "learned-or-fixed",
            "chapter",
            "they can either be learned or fixed *a priori*.",
            "Positional encodings can be learned or fixed.",
            "derived",
            None,
            "both kinds exist and run",
            True,
            basis="selfattn.positional has both (LearnedPositionalEncoding, SinusoidalPositionalEncoding; "
            "section 7 runs each); that they can be trained is the study's measurement",
            also_on=("note", "frameworks"),
        ),
        _claim(
            "x-plus-p",
            "chapter",
            r"The positional encoding outputs $\mathbf{X} + \mathbf{P}$ using a positional embedding matrix "
            r"$\mathbf{P} \in \mathbb{R}^{n \times d}$ of the same shape",
            "The encoding adds an n x d matrix P to the input.",
            "derived",
            None,
            "X + P",
            True,
            basis="the definition the tour implements (SinusoidalPositionalEncoding adds its table)",
            also_on=("note", "slides", "summary", "frameworks"),
        ),
    ]


def _column_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """Columns 6 to 9 of P: which oscillate faster, and which leads which."""
    pe = results["positional_encoding"]
    leads = pe["phase_leads"]
    return [
        _claim(
            "columns-frequency",
            "chapter",
            r"the $6^{\textrm{th}}$ and the $7^{\textrm{th}}$ columns of the positional embedding matrix have a "
            r"higher frequency than the $8^{\textrm{th}}$ and the $9^{\textrm{th}}$ columns.",
            "Columns 6 and 7 of P oscillate faster than columns 8 and 9.",
            "identity",
            [round(p, 2) for p in pe["column_periods"]],
            "periods (from zero crossings) of 6, 7 below those of 8, 9",
            max(pe["column_periods"][:2]) < min(pe["column_periods"][2:]),
            also_on=("note", "frameworks"),
            basis="the formula gives columns 2j and 2j+1 the period 2 pi 10000^(2j/d), which grows with j; the zero crossings read it back off the plotted values",
        ),
        _claim(
            "columns-offset",
            "chapter",
            r"The offset between the $6^{\textrm{th}}$ and the $7^{\textrm{th}}$ (same for the $8^{\textrm{th}}$ and "
            r"the $9^{\textrm{th}}$) columns is due to the alternation of sine and cosine functions.",
            "Column 7 (cosine) leads column 6 (sine) by a quarter period, and column 9 leads 8 the same way.",
            "identity",
            {"7 leads 6 by (periods)": round(leads[0], 4), "9 leads 8 by (periods)": round(leads[1], 4)},
            "+0.25 (+- 0.01): a cosine leads its sine by a quarter period",
            all(abs(lead - 0.25) <= 0.01 for lead in leads),
            also_on=("note", "frameworks"),
            basis="cos(x) = sin(x + pi/2): each cosine column leads its sine by a quarter period; read back off the values",
        ),
    ]


def _bit_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The bits of a binary number, which the chapter sets beside the columns of P."""
    bits = results["learning"]["binary"]["bit_alternation"]
    return [
        _claim(
            "bits-alternate",
            "chapter",
            "the lowest bit, the second-lowest bit, and the third-lowest bit alternate on every number, every two "
            "numbers, and every four numbers, respectively.",
            "In 0..15, the three lowest bits flip every 1, 2 and 4 numbers.",
            "derived",
            bits,
            "[1, 2, 4] numbers between flips",
            bits == [1.0, 2.0, 4.0],
            also_on=("note", "frameworks"),
            basis="integer arithmetic: bit b of i flips every 2^b numbers, so each higher bit flips half as often",
        ),
        _claim(
            "higher-bit-lower-frequency",
            "chapter",
            "In binary representations, a higher bit has a lower frequency than a lower bit.",
            "Each higher bit flips less often than the one below it.",
            "derived",
            bits,
            "gaps between flips increase",
            all(a < b for a, b in itertools.pairwise(bits)),
            also_on=("note", "summary", "frameworks"),
            basis="integer arithmetic: bit b of i flips every 2^b numbers, so each higher bit flips half as often",
        ),
    ]


def _fall_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The frequencies fall column pair by column pair; real-valued columns hold more than bits."""
    binary = results["learning"]["binary"]
    ratios, formula_ratio = binary["period_ratios"], binary["formula_ratio"]
    every = results["positional_encoding"]["all_column_periods"]
    small = results["absolute"]["small_width"]
    return [
        _claim(
            "frequency-falls",
            "chapter",
            "the positional encoding decreases frequencies along the encoding dimension",
            "P's measured periods grow column pair by column pair, each by the factor 10000^(2/d).",
            "identity",
            {
                "periods of sine columns 0, 2, .. (positions)": [round(p, 1) for p in every],
                "each over the one before (median)": round(sorted(ratios)[len(ratios) // 2], 4),
                "10000^(2/d)": round(formula_ratio, 4),
            },
            "periods increase; every ratio within 2% of 10000^(2/d)",
            all(a < b for a, b in itertools.pairwise(every)) and all(abs(r / formula_ratio - 1) < 0.02 for r in ratios),
            also_on=("note", "summary", "frameworks"),
            basis="the formula's frequencies 1/10000^(2j/d) fall by the factor 10000^(2/d) per column pair; the periods are read back off the values",
        ),
        _claim(
            "space-efficient",
            "chapter",
            "such continuous representations are more space-efficient than binary representations.",
            "d float columns tell apart more positions than d bits.",
            "derived",
            {"positions examined": small["num_positions"], "smallest row distance with d=8": small["min_row_distance"]},
            "8 columns tell apart more than the 256 positions 8 bits can",
            small["num_positions"] > 256 and small["min_row_distance"] > 1e-6,
            basis="from the number format: 8 real-valued columns can hold far more than 8 bits; the distance shown "
            "only confirms it for the 2,000 positions the tour chose",
            also_on=("note", "frameworks"),
        ),
    ]


def _offset_facts(offset: dict[str, Any]) -> dict[str, Any]:
    """What the offset claims share: whether only the layer with P learned it, and the numbers by variant."""
    runs = offset["variants"]
    target = offset["config"]["target"]
    learned_offset = runs["sinusoidal"]["steps_to_target"] is not None and all(
        runs[name]["accuracy"] < target for name in ("none", "shuffled")
    )
    offset_number = {
        name: {
            "accuracy": round(run["accuracy"], 3),
            "steps to " + f"{target:.0%}": run["steps_to_target"],
            "weight on key i-delta": round(run["weight_on_offset"], 3),
        }
        for name, run in runs.items()
    }
    offset_expected = (
        f"with P: {target:.0%} within {offset['config']['max_train_steps']} steps; no P and shuffled P: below it"
    )
    return {"learned_offset": learned_offset, "offset_number": offset_number, "offset_expected": offset_expected}


def _offset_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """What a trained layer does with P: attend by offset, keep the position, inject it."""
    perm = results["permutation"]
    fit = results["relative"]["fitted_rotation"]
    offset = results["learning"]["offset"]
    runs, delta = offset["variants"], offset["config"]["delta"]
    facts = _offset_facts(offset)
    learned_offset, offset_number, offset_expected = (
        facts["learned_offset"], facts["offset_number"], facts["offset_expected"]
    )  # fmt: skip
    return [
        _claim(
            "attend-by-relative",
            "chapter",
            "the above positional encoding also allows a model to easily learn to attend by relative positions.",
            f"One attention layer given E[x] + P learns to output the token at offset {delta}; without P, or with P's "
            "rows shuffled, it does not.",
            "measured",
            offset_number,
            offset_expected,
            learned_offset,
            also_on=("note", "frameworks"),
        ),
        _claim(
            "shift-by-five",
            "summary",
            "So the network can learn to “shift attention by 5 tokens” with one linear transformation — relative "
            "positions come for free.",
            f"A trained attention layer puts most of its attention on the token {delta} back (the linear map that "
            f"sends P[i] to P[i+{delta}] is a property of P, an identity; the measurement is the trained layer).",
            "measured",
            {
                "weight on key i-delta, with P (trained)": round(runs["sinusoidal"]["weight_on_offset"], 3),
                "the same, no P and shuffled P": {
                    name: round(runs[name]["weight_on_offset"], 3) for name in ("none", "shuffled")
                },
                "least-squares map residual (identity of P)": fit["residual_max"],
            },
            offset_expected + "; trained weight on key i-delta above 0.5 with P",
            learned_offset and runs["sinusoidal"]["weight_on_offset"] > 0.5 and fit["residual_max"] < 1e-9,
        ),
        _claim(
            "remember-position",
            "slides",
            "位置编码在输入中加入位置信息, 使得自注意力能够记忆位置信息",
            "With P added, a trained attention layer's output still tells where each token sits (a linear probe "
            "reads the position off it) and the layer uses it (copy at an offset); without P, or with P's rows "
            "shuffled, neither.",
            "measured",
            {
                name: {"position probe R^2": round(run["position_r2"], 3), "offset task": round(run["accuracy"], 3)}
                for name, run in runs.items()
            },
            "probe R^2 >= 0.5 with P, <= 0.1 without P and with shuffled P; " + offset_expected,
            learned_offset
            and runs["sinusoidal"]["position_r2"] >= 0.5
            and all(runs[name]["position_r2"] <= 0.1 for name in ("none", "shuffled")),
        ),
        _claim(
            "inject-position",
            "chapter",
            "we can inject absolute or relative positional information by adding positional encoding to the input "
            "representations.",
            "Adding P makes the output depend on where each token sits, and lets a trained layer attend by offset.",
            "measured",
            {
                "output change under a permutation, with P": perm["with_pe_change"],
                "offset task, with P": offset_number["sinusoidal"]["accuracy"],
            },
            "> 1e-3; offset task learned",
            perm["with_pe_change"] > 1e-3 and learned_offset,
            also_on=("note", "slides", "summary", "frameworks"),
        ),
    ]


def _rotation_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """P at i + delta is a rotation of P at i, the same for every i."""
    fit = results["relative"]["fitted_rotation"]
    return [
        _claim(
            "rotation",
            "chapter",
            r"the positional encoding at position $i + \delta$ can be represented by a linear projection of that at "
            r"position $i$.",
            "M_delta P[i] = P[i+delta] for the 2 x 2 rotations M_delta.",
            "identity",
            results["rotation_max_error"],
            "float64 rounding (< 1e-9)",
            results["rotation_max_error"] < 1e-9,
            also_on=("note", "slides", "summary", "frameworks"),
            basis="the angle-addition formulas: (sin((i+delta)w), cos((i+delta)w)) is (sin(iw), cos(iw)) rotated by delta w, whatever i; the fit and the error only check it to rounding",
        ),
        _claim(
            "rotation-independent-of-i",
            "chapter",
            r"where the $2\times 2$ projection matrix does not depend on any position index $i$.",
            "Least-squares fits of the map from P[i] to P[i+delta] on different windows of i all equal the rotation.",
            "identity",
            {"fit minus rotation": fit["rotation_error_max"], "between windows of i": fit["window_spread_max"]},
            "< 1e-9",
            fit["rotation_error_max"] < 1e-9 and fit["window_spread_max"] < 1e-9,
            also_on=("note", "slides", "summary", "frameworks"),
            basis="the angle-addition formulas: (sin((i+delta)w), cos((i+delta)w)) is (sin(iw), cos(iw)) rotated by delta w, whatever i; the fit and the error only check it to rounding",
        ),
    ]


def position_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The chapter's claims about order and positions, in the order of the chapter."""
    return [
        *_order_claims(results),
        *_column_claims(results),
        *_bit_claims(results),
        *_fall_claims(results),
        *_offset_claims(results),
        *_rotation_claims(results),
    ]
