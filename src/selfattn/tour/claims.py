# ruff: noqa: RUF001  (the quotes are the pages' own words, full-width Chinese punctuation included)
"""Every claim of the chapter's five source pages, how the tour knows it, and whether it holds.

The pages: the PyTorch notebook (``chapter``), the d2l-zh page with MXNet, PyTorch,
TensorFlow and Paddle tabs (``frameworks``), a short English summary with MXNet code
(``summary``), the study note (``note``) and the slides (``slides``). Each claim appears once,
under the page that states it first in that order of reading (chapter, note, slides, summary,
frameworks); ``also_on`` names the other pages that make the same claim.

Each entry: ``{"id", "page", "also_on", "quote", "statement", "evidence", "basis", "number",
"expected", "holds", "verdict"}``.

* ``quote``: the page's own words (whitespace collapsed); ``statement``: what is tested, in
  English.
* ``evidence``: ``measured`` (``number`` is a result of this run that could have come out
  otherwise without a bug in the code: a trained model, a timing, an experiment whose data,
  model or setting decides the outcome), ``derived`` (it follows from how the code is written:
  a count of operations fixed by how each layer is written, integer arithmetic, a definition;
  ``basis`` says from what, and ``number`` only restates it), ``identity`` (an identity of the
  formula, checked numerically to rounding; ``basis`` names the identity) or ``not shown``
  (this run has no measurement that decides it; ``basis`` says what would).
* ``holds``: True or False; None for ``not shown`` and for a ``measured`` timing whose spread
  over repeated rounds straddles its cut (``basis`` gives the spread).
* ``verdict``: the same in words: ``holds``, ``does not hold``, ``undecided (noise)`` or
  ``not shown``.

A claim that does not hold is kept: the point is to report what was found. Claims do not set
``selfattn tour``'s exit status; its checks do (see :func:`selfattn.tour.runner.verdicts`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from selfattn.tour.parallel import UNDECIDED, decide_above

__all__ = ["EVIDENCE", "PAGES", "VERDICTS", "claims", "count_evidence", "count_verdicts"]

PAGES = {
    "chapter": "the chapter's PyTorch notebook",
    "note": "the study note",
    "slides": "the slides",
    "summary": "the English summary page with MXNet code",
    "frameworks": "the d2l-zh page with MXNet / PyTorch / TensorFlow / Paddle tabs",
}
EVIDENCE = ("measured", "derived", "identity", "not shown")
VERDICTS = ("holds", "does not hold", "undecided (noise)", "not shown")


def _claim(
    id_: str,
    page: str,
    quote: str,
    statement: str,
    evidence: str,
    number: object,
    expected: str,
    holds: bool | None,
    *,
    basis: str | None = None,
    also_on: tuple[str, ...] = (),
) -> dict[str, object]:
    for where in (page, *also_on):
        if where not in PAGES:
            raise ValueError(f"page must be one of {', '.join(PAGES)}, got {where!r}")
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence must be one of {', '.join(EVIDENCE)}, got {evidence!r}")
    if evidence != "measured" and not basis:
        raise ValueError(f"a {evidence} claim needs a basis (from what it follows, or what would show it): {id_}")
    if evidence == "not shown" and holds is not None:
        raise ValueError(f"holds must be None when evidence is 'not shown', got {holds!r} for {id_}")
    if holds is None and evidence in ("derived", "identity"):
        raise ValueError(f"a {evidence} claim is decided: holds must be True or False, got None for {id_}")
    if holds is None and evidence == "measured" and not basis:
        raise ValueError(f"an undecided measured claim needs a basis (the spread that straddles the cut): {id_}")
    if evidence == "not shown":
        verdict = "not shown"
    else:
        verdict = "undecided (noise)" if holds is None else ("holds" if holds else "does not hold")
    return {
        "id": id_,
        "page": page,
        "also_on": list(also_on),
        "quote": quote,
        "statement": statement,
        "evidence": evidence,
        "basis": basis,
        "number": number,
        "expected": expected,
        "holds": None if holds is None else bool(holds),
        "verdict": verdict,
    }


def _near(value: float, want: float, tolerance: float = 0.1) -> bool:
    return abs(value - want) <= tolerance


def count_evidence(found: list[dict[str, Any]]) -> dict[str, int]:
    """How many claims are measured, derived, identities checked numerically and not shown."""
    return {kind: sum(c["evidence"] == kind for c in found) for kind in EVIDENCE}


def count_verdicts(found: list[dict[str, Any]]) -> dict[str, int]:
    """How many claims hold, do not hold, are undecided by noise and are not shown."""
    return {kind: sum(c["verdict"] == kind for c in found) for kind in VERDICTS}


_FLOP_BASIS = (
    "torch.utils.flop_counter counts each operation with a formula of its tensor shapes (2 x the product of "
    "the matmul's sizes), so the fitted exponents restate the chapter's own derivation"
)
_CHAIN_BASIS = (
    "the chain of dependent products is counted on the layer's autograd graph: its length is fixed by how the "
    "layer is written (one convolution, one attention, one product per step of the recurrence), as its FLOPs are; "
    "no value of the computation is read"
)
_PATH_BASIS = (
    "counted by propagating +1 per product along fixed rules (which output reads which input); no value of the "
    "computation is read, so only a bug could change the count"
)


def _tri(decision: str, yes: str) -> bool | None:
    """A timing decision (``above``, ``below``, undecided) as True (it is ``yes``), False, or None (noise)."""
    return None if decision == UNDECIDED else decision == yes


def _all(*conditions: bool | None) -> bool | None:
    """False if any condition fails, None (undecided) if none fails but one is undecided, else True."""
    if any(c is False for c in conditions):
        return False
    return None if any(c is None for c in conditions) else True


def _cost_claims(comp: dict[str, Any]) -> list[dict[str, object]]:
    cnn, rnn, sa = comp["cnn"], comp["rnn"], comp["self_attention"]
    n = comp["sweep"]["n"][-1]
    return [
        _claim(
            "cnn-compute", "chapter",
            r"The computational complexity of the convolutional layer is $\mathcal{O}(knd^2)$.",
            "A convolutional layer costs O(knd^2).", "derived",
            {k: round(cnn[f"flops_exponent_{k}"], 3) for k in ("n", "d", "k")},
            "FLOP exponents n^1 d^2 k^1 (+- 0.1)",
            _near(cnn["flops_exponent_n"], 1) and _near(cnn["flops_exponent_d"], 2) and _near(cnn["flops_exponent_k"], 1),
            basis=_FLOP_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "rnn-compute", "chapter", r"the computational complexity of the recurrent layer is $\mathcal{O}(nd^2)$.",
            "A recurrent layer costs O(nd^2).", "derived",
            {k: round(rnn[f"flops_exponent_{k}"], 3) for k in ("n", "d")},
            "FLOP exponents n^1 d^2 (+- 0.1)",
            _near(rnn["flops_exponent_n"], 1) and _near(rnn["flops_exponent_d"], 2),
            basis=_FLOP_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "self-attention-compute", "chapter",
            r"the self-attention has a $\mathcal{O}(n^2d)$ computational complexity.",
            "Self-attention's score and value products cost O(n^2 d).", "derived",
            {k: round(sa[f"flops_exponent_{k}"], 3) for k in ("n", "d")},
            "FLOP exponents n^2 d^1 (+- 0.1)",
            _near(sa["flops_exponent_n"], 2) and _near(sa["flops_exponent_d"], 1),
            basis=_FLOP_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "cnn-sequential", "chapter", r"CNNs are hierarchical, so there are $\mathcal{O}(1)$ sequential operations",
            "A convolutional layer's chain of dependent products does not grow with n.", "derived",
            cnn["sequential_ops_by_n"], "constant in n",
            _near(cnn["sequential_ops_exponent_n"], 0),
            basis=_CHAIN_BASIS, also_on=("note", "summary", "frameworks"),
        ),
        _claim(
            "cnn-path", "chapter", r"the maximum path length is $\mathcal{O}(n/k)$.",
            "A CNN's maximum path length (products from input 1 to output n) is O(n/k).", "derived",
            {f"by k at n={n:,}": cnn["path_length_by_k"]},
            f"ceil((n-1)/(k-1)): {cnn['expected_path_length_by_k']}",
            cnn["path_length_by_k"] == cnn["expected_path_length_by_k"],
            basis=_PATH_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "x1-x5", "chapter",
            r"$\mathbf{x}_1$ and $\mathbf{x}_5$ are within the receptive field of a two-layer CNN with kernel size 3",
            "Output 5 of a stack of k=3 convolutions first depends on input 1 after two layers.", "derived",
            comp["x1_to_x5"], "2 layers", comp["x1_to_x5"]["layers"] == 2,
            basis=_PATH_BASIS, also_on=("note", "frameworks"),
        ),
        _claim(
            "rnn-sequential", "chapter", r"there are $\mathcal{O}(n)$ sequential operations that cannot be parallelized",
            "An RNN's chain of dependent products grows as n.", "derived",
            rnn["sequential_ops_by_n"], "grows as n^1", _near(rnn["sequential_ops_exponent_n"], 1),
            basis=_CHAIN_BASIS, also_on=("note", "summary", "frameworks"),
        ),
        _claim(
            "rnn-path", "chapter", r"the maximum path length is also $\mathcal{O}(n)$.",
            "An RNN's maximum path length is O(n).", "derived",
            rnn["path_length_by_n"], "grows as n^1 (products on the path)", _near(rnn["path_length_exponent_n"], 1),
            basis=_PATH_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "self-attention-sequential", "chapter",
            r"computation can be parallel with $\mathcal{O}(1)$ sequential operations",
            "Self-attention's chain of dependent products does not grow with n.", "derived",
            sa["sequential_ops_by_n"], "constant in n", _near(sa["sequential_ops_exponent_n"], 0),
            basis=_CHAIN_BASIS, also_on=("note", "summary", "frameworks"),
        ),
        _claim(
            "self-attention-path", "chapter", r"the maximum path length is also $\mathcal{O}(1)$.",
            "Self-attention's maximum path length does not grow with n.", "derived",
            sa["path_length_by_n"], "constant in n", _near(sa["path_length_exponent_n"], 0),
            basis=_PATH_BASIS, also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "shortest-path", "chapter", "self-attention has the shortest maximum path length.",
            "At the largest n, self-attention's path is shorter than the CNN's and the RNN's.", "derived",
            {kind: comp[kind]["max_path_length"] for kind in ("cnn", "rnn", "self_attention")},
            "self-attention's the smallest",
            sa["max_path_length"] < min(cnn["max_path_length"], rnn["max_path_length"]),
            basis=_PATH_BASIS, also_on=("note", "frameworks"),
        ),
        _claim(
            "parallelism", "slides", "并行度 $O(n)$ $O(1)$ $O(n)$",
            "Parallelism: CNN O(n), RNN O(1), self-attention O(n).", "derived",
            {k: round(comp[k]["parallelism_exponent_n"], 3) for k in ("cnn", "rnn", "self_attention")},
            "n / sequential ops grows as n^1, n^0, n^1 (+- 0.1)",
            _near(cnn["parallelism_exponent_n"], 1)
            and _near(rnn["parallelism_exponent_n"], 0)
            and _near(sa["parallelism_exponent_n"], 1),
            basis="a definition: n divided by the counted chain length restates the sequential-operations rows; the "
            "thread timing (sequential-prevents-parallel) is the measurement",
        ),
        _claim(
            "one-hop", "summary", "every token reaches every other in one hop.",
            "One self-attention layer connects input 1 to output n, whatever n.", "derived",
            sa["path_layers_by_n"], "1 layer at every n", all(layers == 1 for layers in sa["path_layers_by_n"]),
            basis=_PATH_BASIS,
        ),
    ]  # fmt: skip


def _slower_at_largest_n(comp: dict[str, Any]) -> tuple[bool | None, bool | None, dict[str, Any]]:
    """Self-attention against the RNN: is its time exponent higher, is it slower at the largest n (None: noise)?"""
    sa, rnn = comp["self_attention"], comp["rnn"]
    (sa_low, sa_high), (rnn_low, rnn_high) = sa["time_exponent_spread"], rnn["time_exponent_spread"]
    higher = True if sa_low > rnn_high else (False if sa_high < rnn_low else None)
    ratios = [a[-1] / b[-1] for a, b in zip(sa["seconds_by_n_rounds"], rnn["seconds_by_n_rounds"], strict=True)]
    slower = _tri(decide_above(min(ratios), max(ratios), 1.0), "above")
    number = {
        "time exponent, self-attention (median)": round(sa["time_exponent_n"], 2),
        "time exponent, RNN (median)": round(rnn["time_exponent_n"], 2),
        "spread over the rounds, self-attention": [round(v, 2) for v in sa["time_exponent_spread"]],
        "spread over the rounds, RNN": [round(v, 2) for v in rnn["time_exponent_spread"]],
        f"self-attention time / RNN time at n={comp['sweep']['n'][-1]:,}, by round": [round(r, 2) for r in ratios],
    }
    return higher, slower, number


def _quadratic_slow(comp: dict[str, Any]) -> dict[str, object]:
    higher, slower, number = _slower_at_largest_n(comp)
    n = comp["sweep"]["n"][-1]
    quote = (
        "the quadratic computational complexity with respect to the sequence length makes self-attention "
        "prohibitively slow for very long sequences."
    )
    statement = (
        "Self-attention's wall-clock time grows faster with n than the RNN's, and at the longest sequences timed it "
        "is the slower of the two."
    )
    expected = "every round: self-attention's exponent above the RNN's, and its time above the RNN's at the largest n"
    common = {"also_on": ("note", "slides", "summary", "frameworks")}
    dominated = [kind for kind in ("self_attention", "rnn") if comp[kind]["fixed_costs_dominate"]]
    if dominated:
        return _claim(
            "quadratic-slow", "chapter", quote, statement, "not shown", number, expected, None,
            basis=f"fixed per-call costs dominate the fitted range for {', '.join(dominated)} (the time at the "
            "smallest n is over half the time at the first fitted n): the exponents say little about how the work "
            "grows at these sizes; longer sequences than this run times would decide it",
            **common,
        )  # fmt: skip
    if higher is True and slower is False:
        return _claim(
            "quadratic-slow", "chapter", quote, statement, "not shown", number, expected, None,
            basis=f"the exponent is higher in every round, but at n = {n:,} self-attention is still faster than the "
            "RNN: 'prohibitively slow for very long sequences' needs longer sequences than this run times",
            **common,
        )  # fmt: skip
    holds = _all(higher, slower)
    basis = None
    if holds is None:
        basis = "the rounds disagree (spreads in number): a timing this noisy decides nothing"
    return _claim(
        "quadratic-slow", "chapter", quote, statement, "measured", number, expected, holds, basis=basis, **common
    )


def _timing_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The claims that rest on the thread timing: one decision per layer (parallel.thread_speedup) for all."""
    comp = results["comparison"]
    sa, rnn = comp["self_attention"], comp["rnn"]
    par = results["learning"]["parallel"]
    threads, decision, cut = par["threads"], par["parallel"], par["cut"]
    timed = len(threads) > 1 and par["quiet"]
    number = {
        "threads": threads,
        f"speed-up at {threads[-1]} threads, median of {par['rounds']} rounds (ratio)": {
            kind: round(values[-1], 2) for kind, values in par["speedup"].items()
        },
        "spread over the rounds [min, max]": {k: [round(v, 2) for v in s] for k, s in par["speedup_spread"].items()},
        "decision (parallel: above the cut in every round)": decision,
        "load average before, after (read 5.5 s or more apart)": [round(v, 2) for v in par["load"]],
        "cores": par["cores"],
    }
    untimed = (
        "needs two or more cores for the thread timing; this machine has one"
        if len(threads) == 1
        else f"the machine was busy (load average {max(par['load']):.1f} on {par['cores']} cores): a "
        "second thread waited for a core held by other work, so the timing (in number) says nothing about "
        "parallelism; rerun on an idle machine"
    )
    noise = (
        f"the speed-ups over {par['rounds']} rounds straddle the cut {cut} for at least one layer (spread in number): "
        "a timing this noisy decides nothing"
    )
    parallel = {kind: _tri(decision[kind], "above") for kind in decision}
    exponent_higher, _, _ = _slower_at_largest_n(comp)
    verdicts = {
        "sequential-prevents-parallel": _all(
            None if parallel["rnn"] is None else not parallel["rnn"], parallel["self_attention"]
        ),
        "both-parallel": _all(parallel["cnn"], parallel["self_attention"]),
        "fully-parallel": _all(parallel["self_attention"], sa["path_layers"] == 1, exponent_higher),
    }

    def timed_claim(id_: str, page: str, quote: str, statement: str, expected: str, **extra: Any) -> dict[str, object]:
        holds = verdicts[id_] if timed else None
        basis = untimed if not timed else (noise if holds is None else None)
        return _claim(id_, page, quote, statement, "measured" if timed else "not shown", number, expected, holds,
                      basis=basis, **extra)  # fmt: skip

    return [
        timed_claim(
            "sequential-prevents-parallel", "chapter", "Note that sequential operations prevent parallel computation",
            "A second thread speeds up self-attention (one step) but not the RNN (n sequential steps).",
            f"every round: RNN speed-up below {cut}, self-attention's above it", also_on=("note", "frameworks"),
        ),
        timed_claim(
            "both-parallel", "chapter", "both CNNs and self-attention enjoy parallel computation",
            "A second thread speeds up both the convolution and self-attention.",
            f"every round: speed-up above {cut} for both", also_on=("note", "frameworks"),
        ),
        timed_claim(
            "fully-parallel", "slides", "完全并行、最长序列为1、但对长序列计算复杂度高",
            "Self-attention is fully parallel, connects any two tokens in one layer, and costs much on long "
            "sequences.",
            f"every round: speed-up above {cut}; 1 layer; time exponent above the RNN's "
            f"(self-attention's {sa['time_exponent_n']:.2f}, RNN's {rnn['time_exponent_n']:.2f}, medians)",
        ),
        _quadratic_slow(comp),
    ]  # fmt: skip


def _comparison_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    return [
        *_cost_claims(results["comparison"]),
        *_timing_claims(results),
        _long_range_claim(results.get("long_range")),
    ]


def _path(kind: str, cell: dict[str, Any], distance: int) -> int:
    """Layers (CNN, self-attention) or steps (RNN) between the answer and the output at ``distance``."""
    return distance if kind == "rnn" else int(cell["layers"])


def _long_range_claim(long_range: dict[str, Any] | None) -> dict[str, object]:
    quote = (
        "a shorter path between any combination of sequence positions makes it easier to learn long-range "
        "dependencies within the sequence"
    )
    statement = "Of two models, the one with the shorter path to an answer at distance n learns it in fewer steps."
    if long_range is None or long_range.get("quick"):
        return _claim(
            "long-range", "chapter", quote, statement, "not shown", None,
            "a CNN, an RNN and self-attention trained on an answer at several distances", None,
            basis="needs trained models: run `selfattn study --exercises` (its folder is read from ./selfattn-study "
            "or $SELFATTN_STUDY) and rerun the tour; the tour's own small comparison (selfattn.tour.exercises.long_range) "
            "was not run"
            + ("; the folder found holds a --quick smoke test, too short to decide it" if long_range else ""),
            also_on=("note", "frameworks"),
        )  # fmt: skip
    settings, by_distance = long_range["settings"], long_range["by_distance"]
    never = math.inf  # a model that never reached the target within max_steps
    slack = settings["check_every"]  # steps are counted at the checks: one check apart is a tie
    distances = sorted({int(n) for cells in by_distance.values() for n in cells})
    wrong, decided = [], 0
    for n in distances:
        cells = {kind: by_distance[kind][str(n)] for kind in by_distance if str(n) in by_distance[kind]}
        for (a, ca), (b, cb) in itertools.permutations(cells.items(), 2):
            if _path(a, ca, n) >= _path(b, cb, n):
                continue  # a's path is the shorter one
            steps_a = never if ca["steps_to_target"] is None else ca["steps_to_target"]
            steps_b = never if cb["steps_to_target"] is None else cb["steps_to_target"]
            if steps_a > steps_b + slack:
                wrong.append(f"n={n}: {a} (path {_path(a, ca, n)}) slower than {b} (path {_path(b, cb, n)})")
            elif steps_a + slack < steps_b:
                decided += 1
    number: dict[str, Any] = {
        kind: {
            f"n={n}": {
                "path": _path(kind, cell, int(n)),
                f"accuracy after {settings['budget']} steps": round(cell["accuracy_at_budget"], 3),
                f"steps to {settings['target']:.0%}": cell["steps_to_target"],
            }
            for n, cell in cells.items()
        }
        for kind, cells in by_distance.items()
    }
    if wrong:
        number["exceptions"] = wrong
    return _claim(
        "long-range", "chapter", quote, statement, "measured", number,
        f"for every n and every two models with different paths, the shorter path reaches {settings['target']:.0%} "
        f"held-out accuracy no later (within {slack} steps; never = after {settings['max_steps']:,}), and sooner for "
        "at least one pair",
        not wrong and decided > 0,
        also_on=("note", "frameworks"),
    )  # fmt: skip


def _position_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    perm = results["permutation"]
    pe = results["positional_encoding"]
    q = results["absolute"]["qualities"]
    small = results["absolute"]["small_width"]
    across = results["absolute"]["across_lengths"]
    fit = results["relative"]["fitted_rotation"]
    monotone = results["absolute"]["monotone"]
    learning = results["learning"]
    offset = learning["offset"]
    runs = offset["variants"]
    delta, target = offset["config"]["delta"], offset["config"]["target"]
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
    bits = learning["binary"]["bit_alternation"]
    ratios = learning["binary"]["period_ratios"]
    formula_ratio = learning["binary"]["formula_ratio"]
    every = pe["all_column_periods"]
    leads = pe["phase_leads"]
    order = learning["order"]
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


def _source(found: dict[str, Any]) -> str:
    return str(found.get("source", "selfattn study --exercises"))


def _deep_stack_exercise(by_depth: dict[str, Any] | None) -> dict[str, object]:
    quote = (
        "Suppose that we design a deep architecture to represent a sequence by stacking self-attention layers with "
        "positional encoding. What could the possible issues be?"
    )
    statement = (
        "An issue of depth, trained: at the deepest depth trained, the sinusoidal stack without residual connections "
        "does not train (within 0.05 of chance) while the one with residual connections does."
    )
    stacks = (by_depth or {}).get("stacks", {}).get("sinusoidal", {})
    if not {"residual", "no_residual"} <= set(stacks):
        return _claim("exercise-deep-stack", "chapter", quote, statement, "not shown", None, "trained stacks", None,
                      basis="needs sinusoidal stacks trained with and without residual connections")  # fmt: skip
    deepest = max(entry["depth"] for entry in stacks["residual"])
    kept = next(e for e in stacks["residual"] if e["depth"] == deepest)
    bare = next((e for e in stacks["no_residual"] if e["depth"] == deepest), None)
    number = {
        "source": _source(by_depth or {}),
        "chance": round(by_depth["chance"], 3) if by_depth else None,
        **{
            f"depth {e['depth']}, {variant}": {"task accuracy": round(e["task_accuracy"], 3), "steps": e["steps"]}
            for variant in ("residual", "no_residual")
            for e in stacks[variant]
        },
    }
    holds = bare is not None and kept["trains"] and not bare["trains"]
    return _claim("exercise-deep-stack", "chapter", quote, statement, "measured", number,
                  f"at depth {deepest}: residual trains, no residual stays within 0.05 of chance", holds)  # fmt: skip


def _encoding_exercises(by_length: dict[str, Any] | None) -> list[dict[str, object]]:
    learnable = "Can you design a learnable positional encoding method?"
    offsets = (
        "Can we assign different learned embeddings according to different offsets between queries and keys that "
        "are compared in self-attention?"
    )
    learned_statement = (
        "A learned table of positions (one row per position, LearnedPositionalEncoding) learns a task that needs "
        "position at its training length, and answers at chance past it, where no row was trained."
    )
    offset_statement = (
        "Learned embeddings by offset (Shaw's, T5's) learn the same task and keep answering past the training length."
    )
    if by_length is None:
        return [
            _claim(id_, "chapter", quote, statement, "not shown", None, "trained models", None,
                   basis="needs the tour's trained models (selfattn.tour.exercises.encodings_by_length)")
            for id_, quote, statement in (("exercise-learnable", learnable, learned_statement),
                                          ("exercise-offsets", offsets, offset_statement))
        ]  # fmt: skip
    config, chance, runs = by_length["config"], by_length["chance"], by_length["encodings"]
    train_len, longest = config["train_len"], max(config["eval_lens"])

    def cells(name: str) -> tuple[float, float]:
        run = runs[name]["by_length"]
        return run[str(train_len)]["all"], run[str(longest)]["past_train_len"]

    def shown(names: tuple[str, ...]) -> dict[str, object]:
        return {
            "copy back": config["delta"], "trained steps": config["train_steps"], "chance": round(chance, 3),
            **{f"{name}: at {train_len} / past {train_len} (of {longest})": [round(v, 3) for v in cells(name)]
               for name in names},
        }  # fmt: skip

    learned_in, learned_past = cells("learned")
    offset_cells = [cells(name) for name in ("shaw", "t5")]
    return [
        _claim("exercise-learnable", "chapter", learnable, learned_statement, "measured", shown(("learned",)),
               f">= 90% at length {train_len}; past it within 0.1 of chance",
               learned_in >= 0.9 and learned_past <= chance + 0.1),
        _claim("exercise-offsets", "chapter", offsets, offset_statement, "measured", shown(("shaw", "t5")),
               f">= 90% at length {train_len} and >= 80% past it, for both",
               all(inside >= 0.9 and past >= 0.8 for inside, past in offset_cells)),
    ]  # fmt: skip


def _note_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    terms = results["note"]["taylor"]
    survival = results["note"]["embedding"]
    harmless = results["learning"]["harmless"]
    with_p, without_p = harmless["with_p"]["accuracy"], harmless["without_p"]["accuracy"]
    # How far the model with P trails the one without, at the worst check of the curves.
    lag, lag_step = max(
        (b - a, step)
        for (step, a), (_, b) in zip(harmless["with_p"]["curve"], harmless["without_p"]["curve"], strict=True)
    )
    study = results.get("study_generalization")
    # Only tasks the models learned say anything about generalizing past the training lengths.
    cells = {
        task: c for task, c in (study or {}).get("cells", {}).items() if c["in"] >= 0.9 and c["beyond"] is not None
    }
    longer = _longer_sentences(cells, results.get("exercises"))
    return [
        longer,
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
        _claim(
            "embeddings-survive",
            "note",
            "位置编码肯定要影响词嵌入的，但不见得是干扰",
            "Adding P changes the embeddings, but the token can still be read back from E[t] + P[i] (the note says "
            "'not necessarily' interference: shown at one embedding scale, not at every one).",
            "measured",
            {
                **{
                    f"N(0,1), d={d}": round(r, 4) for d, r in zip(survival["sizes"], survival["recovered"], strict=True)
                },
                f"unit-norm embeddings, d={survival['sizes'][-1]}": round(survival["recovered_unit"][-1], 4),
            },
            "nearest-token recovery > 99% at the largest d with N(0,1) embeddings; with unit-norm embeddings "
            "(disclosed, not decisive for 'not necessarily') P can drown the token",
            survival["recovered"][-1] > 0.99,
        ),
        _claim(
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
        ),
    ]


def _code_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    odd = results["frameworks"]["odd_width"]
    tabs = results["frameworks"]["tabs"]
    shape = results["self_attention"]["shape"]
    others = [name for name in odd if name != "summary page (mxnet)"]
    masked = results["self_attention"]["masked"]
    return [
        _claim(
            "weighted-average",
            "summary",
            "The output for each token is a weighted average of all tokens, with weights determined by query-key "
            "compatibility.",
            "Each output row is the attention weights (non-negative, summing to 1) times the value rows.",
            "derived",
            {"largest |row sum - 1| of the weights (section 1)": masked["row_sum_error"]},
            "rows sum to 1 (to rounding)",
            masked["row_sum_error"] < 1e-5,
            basis="the softmax over the scores makes each row of weights non-negative and sum to 1, by construction",
        ),
        _claim(
            "elementary-block",
            "summary",
            "This is the elementary block of every Transformer encoder and decoder layer.",
            "Every Transformer encoder and decoder layer is built around self-attention.",
            "not shown",
            None,
            "a statement about an architecture",
            None,
            basis="a statement about the Transformer's design (Vaswani et al. 2017), which no run can measure; the "
            "tour's own stacks (section 8) are selfattn.models.TransformerBlock, one self-attention each",
        ),
        _claim(
            "n-grams",
            "chapter",
            "one-dimensional CNNs can process local features such as $n$-grams in text.",
            "One convolution of width k reads the k tokens up to each position: a k-gram.",
            "derived",
            {"layers of width 3 before input 1 reaches output 5": results["comparison"]["x1_to_x5"]["layers"]},
            "a window of k tokens per layer",
            results["comparison"]["x1_to_x5"]["layers"] == 2,
            basis="the receptive field of a width-k convolution is k tokens by construction (nn.Conv1d); the count "
            "of layers restates it",
        ),
        _claim(
            "self-attention-shape",
            "chapter",
            "The output tensor has the same shape.",
            "Self-attention outputs a tensor of its input's shape.",
            "derived",
            shape["shape"],
            str(shape["expected"]),
            shape["ok"],
            basis="how the layer is written: one output row per query, W_o maps back to d features",
            also_on=("note", "summary", "frameworks"),
        ),
        _claim(
            "same-input",
            "chapter",
            "In self-attention, the queries, keys, and values all come from the same place.",
            "Queries, keys and values are the same input.",
            "derived",
            None,
            "attention(X, X, X)",
            True,
            basis="the definition: the tour calls the layer with X three times",
            also_on=("note", "slides", "summary", "frameworks"),
        ),
        _claim(
            "odd-width-summary",
            "summary",
            "self.P[:, :, 1::2] = np.cos(X[:, :num_hiddens // 2])",
            "The summary page's MXNet code (this quote is a line of its code, not a sentence) builds P for an odd "
            "num_hiddens; every tab of the chapter and the frameworks page fails there.",
            "derived",
            {name: entry["builds"] for name, entry in odd.items()},
            "the summary page's recipe builds a table for odd d; the others raise",
            bool(odd["summary page (mxnet)"]["builds"]) and not any(odd[name]["builds"] for name in others),
            basis="each recipe's slicing decides it (X[:, :num_hiddens // 2] fits the d // 2 cosine columns; the "
            "others' X has one column too many); run on the tour's own rewrites of the pages' code in NumPy and "
            "PyTorch, since MXNet, TensorFlow and Paddle are not installed",
        ),
        _claim(
            "tabs-agree",
            "frameworks",
            'class PositionalEncoding(nn.Block): """位置编码"""',
            "The page's MXNet, PyTorch, TensorFlow and Paddle tabs (this quote is the first tab's code, not a "
            "sentence) build the same P, as rewritten by the tour in NumPy and PyTorch (MXNet, TensorFlow and Paddle "
            "are not installed).",
            "identity",
            dict(zip([f"n={n:,}" for n in tabs["lengths"]], tabs["max_difference"], strict=True)),
            "largest difference between two tabs < 1e-4 (float32 rounding)",
            max(tabs["max_difference"]) < 1e-4,
            basis="the four tabs write the same formula; the rewrites differ only in float32 or float64 rounding",
        ),
    ]


def claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The claims of the source pages against ``results`` (as :func:`selfattn.tour.runner.compute` returns)."""
    out = _code_claims(results) + _comparison_claims(results) + _position_claims(results) + _note_claims(results)
    out += [
        _deep_stack_exercise(results.get("depth_by_depth")),
        *_encoding_exercises((results.get("exercises") or {}).get("by_length")),
    ]
    order = list(PAGES)
    out.sort(key=lambda claim: order.index(str(claim["page"])))  # stable: page by page, in reading order
    for entry in out:
        number = entry["number"]
        if isinstance(number, float) and not math.isfinite(number):
            entry["number"] = None
    return out
