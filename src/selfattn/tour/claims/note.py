# ruff: noqa: RUF001  (the quotes are the pages' own words, full-width Chinese punctuation included)
"""The study note's claims: the qualities it asks of P, its symmetry argument, its Taylor terms, and harm.

Most follow from the formula (``identity``) or the code (``derived``); the Taylor term with the
layer's own A, the embeddings after adding P, the task that needs no position and the models
trained past their lengths are ``measured``.
"""

from __future__ import annotations

from typing import Any

from selfattn.tour.claims._base import _claim

__all__ = ["note_claims", "quality_claims"]


def _quality_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The qualities the note asks of an encoding: a unique row each, bounded, the same distance at any length."""
    q = results["absolute"]["qualities"]
    across = results["absolute"]["across_lengths"]
    monotone = results["absolute"]["monotone"]
    return [
        _claim(
            "unique-rows",
            "note",
            "它能为每个时间步（句子中的单词位置）输出一个独一无二的编码",
            "Every position gets its own row of P.",
            "identity",
            {"positions": q["num_positions"], "smallest row distance": q["min_row_distance"]},
            "> 0",
            q["min_row_distance"] > 1e-6,
            also_on=("summary",),
            basis="the rows are the formula's values; column 0 alone, sin(i), takes no value twice at integer i because pi is irrational; the smallest distance checks it on the positions examined",
        ),
        _claim(
            "monotone-makes-distinct",
            "note",
            "由于$w_i$ 单调递减，导致随着维度的增加，函数**角频率**也是单调递减的，这样就可以保证对于任意不同的位置$i，j$ ,  "
            "都有 $p_i \\ne p_j$",
            "Because the frequencies fall along the columns, no two positions share a row.",
            "identity",
            {
                "smallest row distance": monotone["min_row_distance"],
                "the same, column pairs shuffled (frequencies no longer fall)": monotone["min_row_distance_permuted"],
                "|p_0 - p_2| with falling frequencies (2 pi, pi)": monotone["falling_collision"],
            },
            "distinct rows that need the fall: shuffled columns give a smaller distance, and falling frequencies "
            "never give equal rows",
            monotone["min_row_distance_permuted"] < monotone["min_row_distance"] - 1e-9
            and monotone["falling_collision"] > 1e-9,
            basis="a row distance does not depend on the order of the columns, so the fall cannot be what keeps the "
            "rows apart, and falling frequencies (2 pi, pi) give p_0 = p_2; the rows are distinct because each "
            "frequency is incommensurate with 2 pi (sin(i) takes no value twice at integer i), not because they fall",
        ),
        _claim(
            "same-distance-across-lengths",
            "note",
            "不同长度的句子之前，任何两个时间步之间的距离应该保持一致",
            "|P[i] - P[j]| is the same in sentences of different lengths.",
            "derived",
            {"lengths": across["lengths"], "spread": across["spread"], "i/n foil spread": across["fraction_spread"]},
            "spread 0 (a length-dependent foil gives > 0)",
            across["spread"] == 0 and across["fraction_spread"] > 1e-3,
            basis="P is sliced from one table whatever the sentence length, so the distance cannot change; the foil "
            "only shows the check would catch an encoding that depends on the length",
        ),
        _claim(
            "bounded",
            "note",
            "它的值应该是有界的",
            "The values of P are bounded.",
            "derived",
            q["max_abs_value"],
            "<= 1",
            q["max_abs_value"] <= 1 + 1e-12,
            basis="every entry is a sine or a cosine; the largest |P| over the rows examined restates it",
        ),
    ]


def _symmetry_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The note's symmetry of f without positions, and its breaking by a different vector at each position."""
    perm = results["permutation"]
    return [
        _claim(
            "symmetry",
            "note",
            "f(...,x_m, ...,x_n,...)=f(...,x_n, ...,x_m,...)",
            "Without positions, swapping two input tokens leaves f unchanged, f read as the note's Taylor term reads "
            "it: one value for the whole sentence (here self-attention's outputs averaged over the positions).",
            "identity",
            {
                "max |mean f(X) - mean f(X swapped)| (the note's reading)": perm["swap_pooled_error"],
                "read row by row instead, rows in place": perm["swap_equality_error"],
                "row by row, output rows swapped back": perm["swap_equivariance_error"],
            },
            "equal to rounding (< 1e-9) under the note's reading; read row by row the outputs swap instead",
            perm["swap_pooled_error"] < 1e-9,
            basis="averaging a permutation-equivariant map over the positions gives a permutation-invariant one; the "
            "note's second-order term p_m' (d2 f / dx_m dx_n) p_n treats f as a scalar, so this is its reading",
        ),
        _claim(
            "symmetry-broken",
            "note",
            "只要每个位置的编码向量不同，那么这种全对称性就被打破了",
            "Adding a different vector at each position breaks the symmetry.",
            "measured",
            perm["with_pe_change"],
            "max |f(X+P)[perm] - f(X[perm]+P)| > 1e-3",
            perm["with_pe_change"] > 1e-3,
        ),
    ]


def quality_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The note's qualities of P and its symmetry argument, in the order of the note."""
    return [*_quality_claims(results), *_symmetry_claims(results)]


_LONGER_QUOTE = "模型能泛化到更长的句子"
_LONGER_STATEMENT = "A model with the sinusoidal P, trained on lengths up to L, answers correctly on longer inputs."


def _longer_sentences(cells: dict[str, Any], trained: dict[str, Any] | None) -> dict[str, object]:
    """The note's generalization claim: from the study's grid when it learned a task, else from the tour's own model."""
    if cells:
        beyond = [cell["beyond"] for cell in cells.values()]
        return _claim(
            "longer-sentences", "note", _LONGER_QUOTE, _LONGER_STATEMENT, "measured",
            {task: {"in training lengths": round(c["in"], 3), "beyond": c["beyond"]} for task, c in cells.items()},
            "exact match beyond the training lengths >= 50% on average over the tasks learned (>= 90% within them)",
            sum(beyond) / len(beyond) >= 0.5,
        )  # fmt: skip
    by_length = (trained or {}).get("by_length")
    if by_length is not None:
        config = by_length["config"]
        train_len, longest = config["train_len"], max(config["eval_lens"])
        run = by_length["encodings"]["sinusoidal"]["by_length"]
        inside, past = run[str(train_len)]["all"], run[str(longest)]["past_train_len"]
        number = {
            f"accuracy at the training length {train_len}": round(inside, 3),
            f"accuracy at positions {train_len}..{longest - 1} of {longest}-token inputs": round(past, 3),
            "chance": round(by_length["chance"], 3),
            "steps trained (tour)": config["train_steps"],
        }
        expected = f"copy {config['delta']} back: >= 90% at the training length, >= 50% past it"
        if inside >= 0.9:
            return _claim("longer-sentences", "note", _LONGER_QUOTE, _LONGER_STATEMENT, "measured", number, expected,
                          past >= 0.5)  # fmt: skip
    return _claim(
        "longer-sentences", "note", _LONGER_QUOTE, _LONGER_STATEMENT, "not shown", None,
        "accuracy beyond the training lengths of a model that learned the task within them", None,
        basis="needs a trained model that learned its task within the training lengths (>= 90%): the tour's own "
        "one did not in this run; `selfattn study` trains longer (its folder is read from ./selfattn-study or "
        "$SELFATTN_STUDY)",
    )  # fmt: skip


def _score_claims(terms: dict[str, Any]) -> list[dict[str, object]]:
    """The note's Taylor terms: where p appears alone (absolute), and the cross term (relative)."""
    return [
        _claim(
            "absolute-term",
            "note",
            "其中，$A$ 包含了单词的绝对位置信息",
            "The terms where p appears alone (content-position scores x_i' A p_j) change when every position "
            "moves: they carry absolute position.",
            "measured",
            {f"change under a shift of {terms['shift']} (fraction of range)": terms["content_position_shift_change"]},
            "> 1e-3",
            terms["content_position_shift_change"] > 1e-3,
        ),
        _claim(
            "taylor-relative-term",
            "note",
            "$B$ 包含了单词的相对位置信息",
            "In a layer, the cross term p_i' A p_j (A from the layer's own W_q, W_k) depends mostly on the offset j - i.",
            "measured",
            {
                "layer's A: share of the term that depends on the offset only": round(
                    terms["position_position_relative_share"], 3
                ),
                "layer's A: spread along one offset": terms["position_position_spread"],
                "A = I: spread along one offset (an identity of P)": terms["identity_spread"],
            },
            "offset-only share above 50% with the layer's A (with A = I the term is purely relative, an identity "
            "of P, which is what the note's argument uses)",
            terms["position_position_relative_share"] > 0.5,
        ),
    ]


def _embeddings_survive(survival: dict[str, Any]) -> dict[str, object]:
    """The note: adding P changes the embeddings, "not necessarily" interference."""
    return _claim(
        "embeddings-survive",
        "note",
        "位置编码肯定要影响词嵌入的，但不见得是干扰",
        "Adding P changes the embeddings, but the token can still be read back from E[t] + P[i] (the note says "
        "'not necessarily' interference: shown at one embedding scale, not at every one).",
        "measured",
        {
            **{f"N(0,1), d={d}": round(r, 4) for d, r in zip(survival["sizes"], survival["recovered"], strict=True)},
            f"unit-norm embeddings, d={survival['sizes'][-1]}": round(survival["recovered_unit"][-1], 4),
        },
        "nearest-token recovery > 99% at the largest d with N(0,1) embeddings; with unit-norm embeddings "
        "(disclosed, not decisive for 'not necessarily') P can drown the token",
        survival["recovered"][-1] > 0.99,
    )


def _not_harmful(harmless: dict[str, Any]) -> dict[str, object]:
    """The note: P is "at least not harmful", on a task that needs no position, read along the whole curve."""
    with_p, without_p = harmless["with_p"]["accuracy"], harmless["without_p"]["accuracy"]
    # How far the model with P trails the one without, at the worst check of the curves.
    lag, lag_step = max(
        (b - a, step)
        for (step, a), (_, b) in zip(harmless["with_p"]["curve"], harmless["without_p"]["curve"], strict=True)
    )
    return _claim(
        "not-harmful",
        "note",
        "至少不会是消极的",
        "On a task that needs no position (the majority token), a model trained with P does as well as without "
        "at every check of training, not only at the end, where both can reach the ceiling.",
        "measured",
        {
            "with P, at the end": round(with_p, 3),
            "without P, at the end": round(without_p, 3),
            f"largest lag of P (points, at step {lag_step})": round(100 * lag, 1),
            "steps": harmless["config"]["train_steps"],
            "chance": round(harmless["chance"], 3),
        },
        "at every check: accuracy with P >= without P - 0.02",
        lag <= 0.02,
    )


def note_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The note's claims about generalization, its Taylor terms, the embeddings and harm, in the note's order."""
    study = results.get("study_generalization")
    # Only tasks the models learned say anything about generalizing past the training lengths.
    cells = {
        task: c for task, c in (study or {}).get("cells", {}).items() if c["in"] >= 0.9 and c["beyond"] is not None
    }
    return [
        _longer_sentences(cells, results.get("exercises")),
        *_score_claims(results["note"]["taylor"]),
        _embeddings_survive(results["note"]["embedding"]),
        _not_harmful(results["learning"]["harmless"]),
    ]
