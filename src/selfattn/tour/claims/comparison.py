"""The claims of section 3: what each layer costs, how it is timed in parallel, and the long-range claim.

The costs and paths are counts fixed by how each layer is written (``derived``); the timings are
``measured`` and decided only where every round falls on one side of the cut; the long-range claim
reads trained models (the tour's own, or ``selfattn study --exercises``).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from selfattn.study.spread import differs
from selfattn.tour.claims._base import _all, _claim, _near, _tri
from selfattn.tour.parallel import decide_above

__all__ = ["comparison_claims", "long_range_claim"]

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


def _cost_claims(comp: dict[str, Any]) -> list[dict[str, object]]:
    """The FLOP rows: exponents fitted to counts that restate the chapter's derivation."""
    cnn, rnn, sa = comp["cnn"], comp["rnn"], comp["self_attention"]
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
    ]  # fmt: skip


def _chain_claims(comp: dict[str, Any]) -> list[dict[str, object]]:
    """The sequential-operations and path-length rows: counts fixed by how each layer is written."""
    cnn, rnn, sa = comp["cnn"], comp["rnn"], comp["self_attention"]
    n = comp["sweep"]["n"][-1]
    return [
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
    ]  # fmt: skip


def _shortest_claims(comp: dict[str, Any]) -> list[dict[str, object]]:
    """Self-attention's path against the others', its parallelism and its one hop."""
    cnn, rnn, sa = comp["cnn"], comp["rnn"], comp["self_attention"]
    return [
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


def comparison_claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """Section 3's claims, in the order of the chapter."""
    return [
        *_cost_claims(results["comparison"]),
        *_chain_claims(results["comparison"]),
        *_shortest_claims(results["comparison"]),
        *_timing_claims(results),
        long_range_claim(results.get("long_range")),
    ]


def _path(kind: str, cell: dict[str, Any], distance: int) -> int:
    """Layers (CNN, self-attention) or steps (RNN) between the answer and the output at ``distance``."""
    return distance if kind == "rnn" else int(cell["layers"])


def _seed_steps(cell: dict[str, Any], never: int) -> list[float]:
    """Each seed's steps to the target, ``never`` for a seed that did not get there; a summary that kept no seeds
    (files written before they were kept) gives its mean alone."""
    by_seed = cell.get("steps_to_target_by_seed")
    if by_seed is None:
        return [never if cell["steps_to_target"] is None else cell["steps_to_target"]]
    return [never if steps is None else steps for steps in by_seed]


def long_range_claim(long_range: dict[str, Any] | None) -> dict[str, object]:
    """The chapter's long-range claim from trained models (``exercises.long_range``'s shape), or not shown."""
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
    slack = settings["check_every"]  # steps are counted at the checks: one check apart is a tie
    # A seed that never got there counts as later than every seed that did by more than a tie (one check).
    never = settings["max_steps"] + 2 * slack
    distances = sorted({int(n) for cells in by_distance.values() for n in cells})
    wrong, decided = [], 0
    for n in distances:
        cells = {kind: by_distance[kind][str(n)] for kind in by_distance if str(n) in by_distance[kind]}
        for (a, ca), (b, cb) in itertools.permutations(cells.items(), 2):
            if _path(a, ca, n) >= _path(b, cb, n):
                continue  # a's path is the shorter one
            seeds_a, seeds_b = _seed_steps(ca, never), _seed_steps(cb, never)
            if min(len(seeds_a), len(seeds_b)) > 1 and not differs(seeds_a, seeds_b):
                continue  # inside the seeds' spread: neither way is claimed
            steps_a, steps_b = statistics.fmean(seeds_a), statistics.fmean(seeds_b)
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
        f"held-out accuracy no later (within {slack} steps, and with several seeds only where the 95% intervals of "
        f"their steps are apart; never = after {settings['max_steps']:,}), and sooner for at least one pair",
        not wrong and decided > 0,
        also_on=("note", "frameworks"),
    )  # fmt: skip
