"""Run the whole tour: compute every section, check it, draw it, and write the report.

``run_tour(out_dir)`` writes ``report.html``, ``figures/*.png`` and ``*.svg`` and
``results.json`` (every number the report shows) and returns the results.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from selfattn.functional import sinusoidal_table
from selfattn.tour import (
    checks,
    claims,
    comparison,
    depth,
    embedding,
    exercises,
    family,
    frameworks,
    harmless,
    offset,
    parallel,
    qualities,
    taylor,
    unseen,
)
from selfattn.tour._common import single_threaded

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FULL",
    "QUICK",
    "TourSizes",
    "comparison_lines",
    "long_range_results",
    "progress_bar",
    "progress_steps",
    "run_tour",
    "summary_lines",
    "verdicts",
]


@dataclass(frozen=True)
class TourSizes:
    """How big each measurement is; ``QUICK`` keeps the tour under a minute on 2 cores.

    Attributes:
        comparison: keyword arguments of :func:`selfattn.tour.comparison.compare` (the sweeps).
        absolute_positions: positions examined for the qualities of section 5.
        depth: keyword arguments of :func:`selfattn.tour.depth.measure` (section 8's deep stacks).
        family_steps: positions of section 7's diagnostics.
        learning: keyword arguments of the trained and timed experiments, by name: ``offset``
            (:func:`selfattn.tour.offset.attend_by_offset`), ``harmless``
            (:func:`selfattn.tour.harmless.with_and_without_p`) and ``parallel``
            (:func:`selfattn.tour.parallel.thread_speedup`).
        embedding_sizes: model sizes at which token recovery after adding P is measured.
        exercises: keyword arguments of the models the tour trains to answer the exercises, by
            name: ``deep_stacks``, ``by_length`` and ``long_range`` (:mod:`selfattn.tour.exercises`).
    """

    comparison: dict[str, Any]
    absolute_positions: int
    depth: dict[str, Any]
    family_steps: int
    learning: dict[str, dict[str, Any]]
    embedding_sizes: tuple[int, ...] = (8, 16, 32, 64)
    exercises: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"deep_stacks": {}, "by_length": {}, "long_range": {}}
    )


FULL = TourSizes(
    comparison={
        "num_steps": (32, 64, 128, 256, 512, 1024, 2048),
        "num_hiddens": (16, 32, 64, 128, 256, 512),
        "kernel_sizes": (3, 5, 7, 9),
        "fixed_hiddens": 64,
        "fixed_steps": 256,
        "repeats": 5,
        "rounds": 5,
    },
    absolute_positions=4000,
    depth={"depth": 16, "seeds": 5},
    family_steps=32,
    learning={"offset": {}, "harmless": {}, "parallel": {}},
    embedding_sizes=(8, 16, 32, 64, 128, 256),
)
QUICK = TourSizes(
    comparison={
        "num_steps": (16, 32, 64, 128),
        "num_hiddens": (8, 16, 32, 64, 128),
        "kernel_sizes": (3, 5, 7),
        "fixed_hiddens": 32,
        "fixed_steps": 64,
        "repeats": 3,
        "rounds": 3,
    },
    absolute_positions=1000,
    depth={"depth": 8, "seeds": 2, "quick": True},
    family_steps=16,
    learning={
        "offset": {"max_train_steps": 200, "eval_samples": 256},
        "harmless": {"train_steps": 60, "eval_samples": 256},
        "parallel": {"repeats": 2, "rounds": 3},
    },
    exercises={
        "deep_stacks": {"depths": (1, 2), "max_steps": 100},
        "by_length": {"train_steps": 150, "eval_samples": 128},
        "long_range": {"distances": (2, 8), "budget": 50, "max_steps": 100},
    },
)

# The chapter's numbers for section 4 and 6.
_PLOT_STEPS, _PLOT_HIDDENS, _PLOT_COLUMNS = 60, 32, (6, 7, 8, 9)
_ROUNDING, _EXPONENT_TOLERANCE = 1e-9, 0.1


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, label: str = "selfattn tour") -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (rich, else tqdm, else none); yields ``advance(description)``.

    Callers usually pass ``enabled=sys.stderr.isatty()``: a bar is noise in a log file.
    """
    if enabled:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            pass
        else:
            columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
                task = bar.add_task(label, total=total)
                yield lambda description: bar.update(task, advance=1, description=description[:48])
            return
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            with tqdm(total=total, file=sys.stderr, desc=label) as tqdm_bar:

                def advance(description: str) -> None:
                    tqdm_bar.set_description(description[:48])
                    tqdm_bar.update(1)

                yield advance
            return
    yield lambda description: None


def _family(sizes: TourSizes, advance: Callable[[str], None]) -> dict[str, object]:
    encodings = {}
    for name in family.family_names():
        encodings[name] = family.encoding_diagnostics(name, num_steps=sizes.family_steps)
        advance(f"7. family: {name}")
    return {"encodings": encodings}


def _learning(sizes: TourSizes, pe: dict[str, Any], advance: Callable[[str], None]) -> dict[str, Any]:
    """The trained and timed experiments behind the claims about learning and parallel speed, one step each."""
    periods = pe["all_column_periods"]
    found = {"offset": offset.attend_by_offset(**sizes.learning["offset"])}
    advance("trained: copy at an offset")
    found["harmless"] = harmless.with_and_without_p(**sizes.learning["harmless"])
    advance("trained: with and without P")
    found["parallel"] = parallel.thread_speedup(**sizes.learning["parallel"])
    advance("timed: threads")
    return found | {
        "binary": {
            "bit_alternation": checks.bit_alternation(3),
            "period_ratios": checks.period_ratios(periods),
            "formula_ratio": 10000 ** (2 / _PLOT_HIDDENS),
        },
        "order": checks.order_sensitivity(),
    }


def _exercises(sizes: TourSizes, advance: Callable[[str], None]) -> dict[str, Any]:
    """The models the tour trains itself to answer the chapter's exercises and its long-range claim."""
    found = {"deep_stacks": exercises.deep_stacks(**sizes.exercises["deep_stacks"])}
    advance("8. trained: deep stacks by depth")
    found["by_length"] = exercises.encodings_by_length(**sizes.exercises["by_length"])
    advance("8. trained: encodings past the training length")
    found["long_range"] = exercises.long_range(**sizes.exercises["long_range"])
    advance("trained: answer at distance n")
    return found


def compute(sizes: TourSizes, advance: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every section's numbers (arrays as numpy), in the chapter's order."""
    tick = advance or (lambda description: None)
    results: dict[str, Any] = {}
    results["self_attention"] = {"shape": checks.self_attention_shape(), "masked": checks.masked_attention_weights()}
    tick("1. self-attention")
    results["permutation"] = checks.permutation_check()
    tick("2. permutation")
    results["comparison"] = comparison.compare(**sizes.comparison, progress=lambda d: tick(f"3. {d}"))
    # The chapter's figure: x1 and x5 share the receptive field of a two-layer CNN with k = 3.
    results["comparison"]["x1_to_x5"] = comparison.path_lengths("cnn", 5, kernel_size=3)
    results["positional_encoding"] = {
        "num_steps": _PLOT_STEPS,
        "num_hiddens": _PLOT_HIDDENS,
        "columns": list(_PLOT_COLUMNS),
        "column_values": checks.table_columns(_PLOT_STEPS, _PLOT_HIDDENS, _PLOT_COLUMNS).numpy(),
        # Read off the plotted values (zero crossings), not off the formula that built them.
        "column_periods": checks.measured_periods(_PLOT_STEPS, _PLOT_HIDDENS, _PLOT_COLUMNS)["zero_crossings"],
        "period_measurements": checks.measured_periods(_PLOT_STEPS, _PLOT_HIDDENS, _PLOT_COLUMNS),
        "phase_offset": checks.phase_offset(*checks.table_columns(_PLOT_STEPS, _PLOT_HIDDENS, (6, 7)).double().T),
        # Which column leads: 7 against 6 and 9 against 8, from the plotted values.
        "phase_leads": [
            checks.phase_lead(*checks.table_columns(_PLOT_STEPS, _PLOT_HIDDENS, pair).double().T.numpy())
            for pair in ((6, 7), (8, 9))
        ],
        "all_column_periods": [
            checks.zero_crossing_period(column)
            for column in sinusoidal_table(4000, _PLOT_HIDDENS, dtype=torch.float64).T[
                :24:2
            ]  # sine columns 0, 2, .., 22
        ],
        "table": sinusoidal_table(_PLOT_STEPS, _PLOT_HIDDENS).numpy(),
        "binary": checks.binary_representations(8),
    }
    tick("4. positional encoding")
    results["absolute"] = {
        "qualities": qualities.absolute_position_qualities(
            _PLOT_HIDDENS, num_seen=_PLOT_STEPS, num_positions=sizes.absolute_positions
        ),
        "precision": qualities.table_precision(_PLOT_HIDDENS),
        "curves": qualities.offset_distance_curves(_PLOT_HIDDENS, num_positions=4 * _PLOT_STEPS),
        "across_lengths": qualities.distance_across_lengths(_PLOT_HIDDENS),
        "small_width": qualities.absolute_position_qualities(8, num_seen=_PLOT_STEPS, num_positions=2000),
        "monotone": checks.monotone_counterexamples(_PLOT_HIDDENS, num_positions=sizes.absolute_positions),
    }
    tick("5. absolute position")
    results["rotation_max_error"] = checks.rotation_max_error(_PLOT_STEPS, _PLOT_HIDDENS, _PLOT_STEPS)
    results["relative"] = {
        "similarity": checks.offset_similarity(_PLOT_HIDDENS, max_delta=_PLOT_STEPS),
        "fitted_rotation": checks.fitted_rotation(_PLOT_HIDDENS),
    }
    tick("6. relative position")
    results["note"] = {
        "taylor": taylor.score_terms(_PLOT_HIDDENS, num_steps=_PLOT_STEPS),
        "embedding": embedding.embedding_survival(sizes.embedding_sizes),
    }
    results["frameworks"] = {
        "precision": frameworks.framework_precision(_PLOT_HIDDENS),
        "odd_width": frameworks.odd_width(_PLOT_HIDDENS + 1),
        "tabs": frameworks.tabs_agree(_PLOT_HIDDENS),
        # The float32 angles' error grows with d: the widest model size the chapter's plots use, and 128.
        "precision_wide": frameworks.framework_precision(128, lengths=(10000,)),
    }
    tick("6. the note and the other pages")
    results["learning"] = _learning(sizes, results["positional_encoding"], tick)
    results["exercises"] = _exercises(sizes, tick)
    results["family"] = _family(sizes, tick)
    with single_threaded():  # 120 stacks of tiny float64 matrices: a second thread costs more than it gives
        results["depth"] = depth.measure(**sizes.depth, progress=tick)  # a tick per encoding and variant
    tick("8. deep stacks")
    return results


def _check(name: str, measured: object, expected: str, ok: bool) -> dict[str, object]:
    return {"name": name, "measured": measured, "expected": expected, "ok": bool(ok)}


def verdicts(results: dict[str, Any]) -> list[dict[str, object]]:
    """Each claim of the chapter against its measured value: ``name, measured, expected, ok``."""
    out = []
    shape = results["self_attention"]["shape"]
    out.append(_check("1. self-attention keeps the shape", shape["shape"], str(shape["expected"]), shape["ok"]))
    masked = results["self_attention"]["masked"]["masked_weight_max"]
    out.append(_check("1. masked keys get zero weight", masked, "0", masked == 0.0))
    perm = results["permutation"]
    out.append(
        _check(
            "2. without P, permuting tokens permutes outputs",
            perm["without_pe_error"],
            "rounding (< 1e-9)",
            perm["without_pe_error"] < _ROUNDING,
        )
    )
    out.append(
        _check(
            "2. with P, it does not", perm["with_pe_change"], "clearly nonzero (> 1e-3)", perm["with_pe_change"] > 1e-3
        )
    )
    comp = results["comparison"]
    for kind in comparison.KINDS:
        entry, claim = comp[kind], comparison.CHAPTER[kind]
        label = claim["label"]
        for axis in ("n", "d"):
            value = entry[f"flops_exponent_{axis}"]
            want = claim[f"exponent_{axis}"]
            out.append(
                _check(
                    f"3. {label}: FLOPs grow as {axis}^{want}",
                    round(value, 4),
                    f"{want} +- 0.1",
                    abs(value - want) <= _EXPONENT_TOLERANCE,
                )
            )
        chain_exponent = entry["sequential_ops_exponent_n"]
        want = 1 if kind == "rnn" else 0
        out.append(
            _check(
                f"3. {label}: sequential operations {claim['sequential_ops']}",
                entry["sequential_ops_by_n"],
                f"grows as n^{want}",
                abs(chain_exponent - want) <= _EXPONENT_TOLERANCE,
            )
        )
        out.append(
            _check(
                f"3. {label}: maximum path length {claim['max_path_length']}",
                entry["path_length_by_n"],
                str(entry["expected_path_length_by_n"]),
                entry["path_length_by_n"] == entry["expected_path_length_by_n"],
            )
        )
        want = 0 if kind == "rnn" else 1
        out.append(
            _check(
                f"3. {label}: parallelism (n / sequential ops) grows as n^{want}",
                round(entry["parallelism_exponent_n"], 4),
                f"{want} +- 0.1",
                abs(entry["parallelism_exponent_n"] - want) <= _EXPONENT_TOLERANCE,
            )
        )
    cnn = comp["cnn"]
    out.append(
        _check(
            "3. CNN: FLOPs grow as k^1",
            round(cnn["flops_exponent_k"], 4),
            "1 +- 0.1",
            abs(cnn["flops_exponent_k"] - 1) <= _EXPONENT_TOLERANCE,
        )
    )
    out.append(
        _check(
            f"3. CNN: path length ceil((n-1)/(k-1)) at n={cnn['n']}",
            cnn["path_length_by_k"],
            str(cnn["expected_path_length_by_k"]),
            cnn["path_length_by_k"] == cnn["expected_path_length_by_k"],
        )
    )
    crossings = comp["crossings"]
    out.append(
        _check(
            "3. self-attention layer FLOPs counted = 8nd^2 + 4n^2 d",
            crossings["layer_formula_error"],
            "relative difference 0",
            crossings["layer_formula_error"] == 0,
        )
    )
    fixed_d = comp["sweep"]["fixed_d"]
    at_n = crossings["core_equals_rnn_at_n"]
    out.append(
        _check(
            f"3. attention's n^2 d core meets the RNN's n d^2 at n = d = {fixed_d}",
            at_n,
            f"{fixed_d} +- 1%",
            at_n is not None and abs(at_n - fixed_d) <= 0.01 * fixed_d,
        )
    )
    pe = results["positional_encoding"]
    periods = pe["column_periods"]
    formula = pe["period_measurements"]["formula"]
    out.append(
        _check(
            "4. columns 6-7 oscillate faster than 8-9 (periods from zero crossings)",
            [round(p, 2) for p in periods],
            "periods of 6, 7 < periods of 8, 9",
            max(periods[:2]) < min(periods[2:]),
        )
    )
    worst = max(abs(p - f) / f for p, f in zip(periods, formula, strict=True))
    out.append(
        _check(
            "4. measured periods agree with 2 pi / w_j",
            worst,
            "relative difference < 1%",
            worst < 0.01,
        )
    )
    every = pe["all_column_periods"]
    out.append(
        _check(
            "4. frequency falls along the columns (measured periods increase)",
            [round(p, 1) for p in every],
            "increasing",
            all(a < b for a, b in itertools.pairwise(every)),
        )
    )
    q = results["absolute"]["qualities"]
    out.append(
        _check(
            f"5. every position has its own row (n={q['num_positions']})",
            q["min_row_distance"],
            "smallest distance > 0",
            q["min_row_distance"] > 1e-6,
        )
    )
    out.append(_check("5. values are bounded", q["max_abs_value"], "<= 1", q["max_abs_value"] <= 1.0 + 1e-12))
    out.append(
        _check(
            "5. |P[i] - P[i+delta]| does not depend on i",
            q["offset_distance_spread_max"],
            "rounding (< 1e-9)",
            q["offset_distance_spread_max"] < _ROUNDING,
        )
    )
    out.append(
        _check(
            f"5. positions past {q['num_seen']} get new rows",
            q["unseen_nearest_distance"],
            "distance to seen rows > 0",
            q["unseen_nearest_distance"] > 1e-6,
        )
    )
    out.append(
        _check(
            "6. M_delta P[i] = P[i+delta]",
            results["rotation_max_error"],
            "rounding (< 1e-9)",
            results["rotation_max_error"] < _ROUNDING,
        )
    )
    spread = results["relative"]["similarity"]["spread"]
    out.append(_check("6. P[i] . P[i+delta] depends on delta only", spread, "rounding (< 1e-9)", spread < _ROUNDING))
    fit = results["relative"]["fitted_rotation"]
    out.append(
        _check(
            "6. least-squares M_delta equals the rotation",
            fit["rotation_error_max"],
            "< 1e-9",
            fit["rotation_error_max"] < _ROUNDING,
        )
    )
    out.append(
        _check(
            "6. least-squares M_delta is the same on every window of i",
            fit["window_spread_max"],
            "< 1e-9",
            fit["window_spread_max"] < _ROUNDING,
        )
    )
    across = results["absolute"]["across_lengths"]
    out.append(
        _check(
            f"5. distance between two steps is the same in sentences of {across['lengths']} tokens",
            across["spread"],
            "0",
            across["spread"] == 0,
        )
    )
    taylor_terms = results["note"]["taylor"]
    worst_sum = max(entry["sum_error"] for entry in taylor_terms["scales"])
    out.append(
        _check(
            "note: the three score terms add up to the layer's scores",
            worst_sum,
            "rounding (< 1e-9)",
            worst_sum < _ROUNDING,
        )
    )
    for name, diag in results["family"]["encodings"].items():
        if diag["class"] == "NoPositionalEncoding":  # declares no position at all
            out.append(
                _check(
                    f"7. {name}: carries no position (permuting tokens permutes outputs)",
                    diag["permutation_change"],
                    "rounding (< 1e-9)",
                    diag["permutation_change"] < _ROUNDING,
                )
            )
            continue
        kind = "relative" if diag["is_relative"] else "absolute"
        out.append(
            _check(
                f"7. {name}: is {kind} (outputs under a shift of {diag['shift']})",
                diag["shift_change"],
                "0" if diag["is_relative"] else "> 0",
                diag["measured_relative"] == diag["is_relative"] and diag["position_aware"],
            )
        )
    precision = results["frameworks"]["precision"]
    out.append(
        _check(
            f"6. every page's code forms its angles in float32: error at {precision['lengths'][-1]:,} positions "
            f"(d={precision['num_hiddens']})",
            {name: f"{errors[-1]:.1e}" for name, errors in precision["errors"].items()},
            "> 1e-5 (far above float32 rounding of P)",
            all(errors[-1] > 1e-5 for errors in precision["errors"].values()),
        )
    )
    runs = results["learning"]["offset"]["variants"]
    target = results["learning"]["offset"]["config"]["target"]
    out.append(
        _check(
            "6. trained: the offset task's controls (no P, P's rows shuffled) stay below the target",
            {name: round(runs[name]["accuracy"], 3) for name in ("none", "shuffled")},
            f"< {target:.0%} (else the task could be solved without attending by offset)",
            all(runs[name]["accuracy"] < target for name in ("none", "shuffled")),
        )
    )
    deep = depth.verdict_numbers(results["depth"])
    layers = results["depth"]["layers"][-1]
    out.append(
        _check(
            f"8. without residuals, the rows of {layers} random attention layers collapse (sinusoidal)",
            deep["collapse_ratio"],
            "mean-row residual / input's < 1e-6",
            deep["collapse_ratio"] < depth.COLLAPSED,
        )
    )
    out.append(
        _check(
            f"8. with residuals, rows and position stay apart after {layers} layers (sinusoidal)",
            [deep["residual_rows_min"], deep["residual_share_min"]],
            "mean-row residual and position share > 1e-3 in every seed",
            min(deep["residual_rows_min"], deep["residual_share_min"]) > 1e-3,
        )
    )
    return out


def _round_array(values: np.ndarray) -> list[Any]:
    """Arrays go to JSON with 6 significant digits: enough for any figure, a fraction of the size."""
    return np.vectorize(lambda v: float(f"{v:.6g}"), otypes=[float])(values).tolist() if values.size else []


def _jsonable(value: object) -> object:
    if isinstance(value, np.ndarray):
        return _round_array(value.astype(float)) if value.dtype.kind == "f" else value.tolist()
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _figures(results: dict[str, Any], directory: Path, advance: Callable[[str], None]) -> dict[str, str]:
    """Draw and save every figure; returns ``{name: path of the png relative to the report}``."""
    from selfattn.tour import figures

    masked = results["self_attention"]["masked"]
    pe = results["positional_encoding"]
    drawings: dict[str, Callable[[], Figure | dict[str, Figure]]] = {
        "attention_weights": lambda: figures.attention_weights_figures(masked["weights"], masked["valid_lens"]),
        "permutation": lambda: figures.permutation_figure(
            results["permutation"]["without_pe_error"], results["permutation"]["with_pe_change"]
        ),
        "comparison": lambda: figures.comparison_figure(results["comparison"]),
        "comparison_stacked": lambda: figures.comparison_figure(results["comparison"], stacked=True),
        "pe_columns": lambda: figures.pe_columns_figure(pe["column_values"], pe["columns"], pe["column_periods"]),
        "pe_heatmap": lambda: figures.pe_heatmap_figures(pe["table"], checks.bit_matrix(8)),
        "absolute": lambda: figures.absolute_figures(results["absolute"]["curves"], results["absolute"]["precision"]),
        "relative": lambda: figures.relative_figure(results["relative"]["similarity"]),
        "note": lambda: figures.note_figures(results["note"]["taylor"], results["note"]["embedding"]),
    }
    for name, diag in results["family"]["encodings"].items():
        drawings[f"family_{name}"] = functools.partial(figures.encoding_panel_figures, diag)
    drawings["depth"] = lambda: figures.deep_stack_figures(results["depth"])
    if (results.get("depth_study") or {}).get("trained"):
        drawings["depth_trained"] = lambda: figures.deep_stack_figures(results["depth_study"], "trained")
    paths = {}
    for name, draw in drawings.items():
        drawn = draw()
        # A figure drawn as separate panels is saved panel by panel, as name-part (see tour._html).
        for saved, fig in drawn.items() if isinstance(drawn, dict) else [("", drawn)]:
            key = f"{name}-{saved}" if saved else name
            png, _svg = figures.save_figure(fig, directory, key)
            paths[key] = f"{directory.name}/{png.name}"
        advance(f"figure {name}")
    return paths


def study_generalization(study: Path | str | None) -> dict[str, Any] | None:
    """Each encoding's accuracy in and beyond the training lengths, per task, from a study folder.

    ``cells`` is the sinusoidal encoding's (the note's claim that a model generalizes to longer
    sentences), ``by_encoding`` every encoding's. None when there is no study (or it trained no
    sinusoidal model): that claim then stays "not shown".
    """
    from selfattn.study.summary import load_study

    loaded = None if study is None else load_study(Path(study))
    if loaded is None:
        return None
    by_encoding: dict[str, dict[str, dict[str, Any]]] = {}
    for task, label, in_distribution, beyond, _ in loaded.rows:
        by_encoding.setdefault(label, {})[task] = {"in": in_distribution, "beyond": beyond}
    if "sinusoidal" not in by_encoding:
        return None
    return {
        "folder": str(loaded.folder),
        "train_len": loaded.train_len,
        "cells": by_encoding["sinusoidal"],
        "by_encoding": by_encoding,
    }


def _unseen_rows(generalization: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`selfattn.tour.unseen.unseen_rows` at the study's training length (the default one without a study)."""
    from selfattn.study.training import StudyConfig

    config = StudyConfig() if generalization is None else StudyConfig(train_len=int(generalization["train_len"]))
    with single_threaded():  # small models: a second thread costs more than it gives
        return unseen.unseen_rows(config=config)


def long_range_results(study: Path | str | None) -> dict[str, Any] | None:
    """``exercises.json["long_range"]`` of a study folder (``selfattn study --exercises``), with its folder.

    None when there is none: the claim about long-range dependencies then stays "not shown".
    """
    from selfattn.study.exercises import load_exercises

    found = load_exercises(study)
    if found is None:
        return None
    return {
        **found["long_range"],
        "folder": str(study),
        "quick": bool(found.get("quick")),
        "source": _study_source(study, "exercises.json"),
    }


TOUR_TRAINED = "trained by this tour (selfattn tour), one seed"
"""The provenance of the answers the tour trains itself (see :mod:`selfattn.tour.exercises`)."""


def _study_source(study: Path | str | None, name: str) -> str:
    """Where a study's trained answers come from: the command, the folder, the file's date (no commit is recorded)."""
    import datetime

    path = Path(str(study)) / name
    when = datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.timezone.utc)
    return (
        f"selfattn study --exercises, read from {path} (written {when:%Y-%m-%d %H:%M} UTC; the study records no commit)"
    )


def _trained_answers(results: dict[str, Any], study: Path | str | None) -> None:
    """The long-range and deep-stack answers: the study's longer runs when its folder has them, else the tour's own."""
    from selfattn.study.exercises import load_exercises

    trained = results["exercises"]
    from_study = long_range_results(study)
    if from_study is not None and not from_study["quick"]:
        results["long_range"] = from_study
    else:
        results["long_range"] = {**trained["long_range"], "folder": None, "quick": False, "source": TOUR_TRAINED}
    by_depth = depth.study_by_depth(study)
    study_exercises = load_exercises(study) or {}
    if by_depth is not None and not study_exercises.get("quick"):
        name = "exercises.json" if study_exercises else "results.json"
        results["depth_by_depth"] = {**by_depth, "source": _study_source(study, name)}
    else:
        results["depth_by_depth"] = {**trained["deep_stacks"], "source": TOUR_TRAINED}


COMPUTE_STEPS = 13
"""Steps :func:`compute` reports beside the comparison's and the family's: six sections, three trained or timed
experiments of the claims about learning (each its own step, so the bar moves), three trained answers to the
exercises, the deep stacks."""


def progress_steps(sizes: TourSizes, *, with_trained_figure: bool = False) -> int:
    """Steps of :func:`run_tour`'s progress bar: :func:`compute`'s (the deep stacks' one per encoding and variant
    among them), ten figures (eleven with a study's trained stacks) plus one per encoding, and the report."""
    sweep = sizes.comparison
    comparison_count = comparison.comparison_steps(
        sweep["num_steps"], sweep["num_hiddens"], sweep["kernel_sizes"], sweep.get("rounds", 3)
    )
    family_count = len(family.family_names())
    stacks = depth.progress_count(**sizes.depth)
    return COMPUTE_STEPS + comparison_count + 2 * family_count + stacks + 10 + with_trained_figure + 1


def _prepare_output(out_dir: Path, shown: Path) -> Path:
    """Create the output folder now, so an unwritable one fails before minutes of work; errors name ``shown``."""
    try:
        (out_dir / "figures").mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".selfattn-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ValueError(f"cannot write the report to {str(shown)!r}: {reason}") from None
    return out_dir


def run_tour(
    out_dir: Path | str = "selfattn-report",
    *,
    quick: bool = False,
    progress: bool = True,
    study: Path | str | None = None,
    shown_as: Path | str | None = None,
) -> dict[str, Any]:
    """Run every section, write ``report.html``, ``figures/`` and ``results.json`` into ``out_dir``.

    ``shown_as`` is the folder error messages name instead of ``out_dir`` (the command line
    writes into a hidden temporary folder that takes the user's folder's place at the end).

    ``study`` is a ``selfattn study`` output folder whose trained deep stacks section 8 shows
    (``results["depth_study"]``); by default ``$SELFATTN_STUDY`` or ``./selfattn-study`` when it
    holds a ``results.json``. The tour trains its own small answers to the exercises and to the
    long-range claim (``results["exercises"]``, :mod:`selfattn.tour.exercises`); a study's longer
    runs replace the long-range and deep-stack ones when its folder has them (not a ``--quick``
    one), each answer with its ``source``. Returns the results as written to ``results.json``,
    with ``"checks"`` (the verdicts) added.
    """
    from selfattn.tour import figures  # noqa: F401  (fail now, not after the measurements, without matplotlib)
    from selfattn.tour.report import render_report

    out_dir = _prepare_output(Path(out_dir), Path(out_dir if shown_as is None else shown_as))
    if study is None:  # the study's own default folder, as the report's study section looks for it
        default = Path(os.environ.get("SELFATTN_STUDY", "selfattn-study"))
        found = any((default / name).is_file() for name in ("results.json", "exercises.json"))
        study = default if found else None
    depth_study = depth.study_deep_stack(study)  # fail now, not after the measurements
    sizes = QUICK if quick else FULL
    total = progress_steps(sizes, with_trained_figure=bool((depth_study or {}).get("trained")))
    with progress_bar(total, progress) as advance:
        results = compute(sizes, advance)
        results["quick"] = quick
        results["study_folder"] = None if study is None else str(study)
        results["depth_study"] = depth_study
        _trained_answers(results, study)
        results["study_generalization"] = study_generalization(study)
        results["unseen_rows"] = _unseen_rows(results["study_generalization"])
        results["checks"] = verdicts(results)
        results["claims"] = claims.claims(results)
        figure_paths = _figures(results, out_dir / "figures", advance)
        serializable = _jsonable(results)
        assert isinstance(serializable, dict)  # _jsonable keeps a dict a dict
        (out_dir / "results.json").write_text(json.dumps(serializable, indent=1, allow_nan=False))
        (out_dir / "report.html").write_text(render_report(serializable, figure_paths), encoding="utf-8")
        advance("report written")
    return serializable


def comparison_lines(comp: dict[str, Any]) -> list[str]:
    """The measured comparison as a small text table beside the chapter's claims."""
    n = comp["sweep"]["n"][-1]
    lines = [
        f"{'':<16}{'compute (FLOPs)':<29}{'sequential ops':<22}max path, products (n={n:,}, k={comp['cnn']['k']})",
        f"{'':<16}{'chapter  measured':<29}{'chapter  measured':<22}chapter  measured",
    ]
    for kind in comparison.KINDS:
        e, claim = comp[kind], comparison.CHAPTER[kind]
        flops = f"n^{e['flops_exponent_n']:.2f} d^{e['flops_exponent_d']:.2f}"
        lines.append(
            f"{claim['label']:<16}{claim['complexity']:<9}{flops:<20}{claim['sequential_ops']:<9}{e['sequential_ops']:<13,}"
            f"{claim['max_path_length']:<9}{e['max_path_length']:,}"
        )
    return lines


def summary_lines(results: dict[str, Any], out_dir: Path | str | None = None) -> list[str]:
    """A short text summary of the results and checks."""
    checks_ = results["checks"]
    passed = sum(c["ok"] for c in checks_)
    comp = results["comparison"]
    perm = results["permutation"]
    lines = [
        f"selfattn tour: {passed}/{len(checks_)} checks pass" + ("" if out_dir is None else f", report in {out_dir}")
    ]
    lines.append(
        f"  1. self-attention output shape {tuple(results['self_attention']['shape']['shape'])}; "
        f"largest weight on a masked key {results['self_attention']['masked']['masked_weight_max']:.1e}"
    )
    lines.append(
        f"  2. permutation: without P error {perm['without_pe_error']:.1e}, with P change {perm['with_pe_change']:.1e}"
    )
    lines.append("  3. CNN vs RNN vs self-attention, counted and timed on real layers:")
    lines.extend(f"     {line}" for line in comparison_lines(comp))
    q = results["absolute"]["qualities"]
    lines.append(
        f"  4-5. P: smallest distance between rows {q['min_row_distance']:.3f}, |P| <= {q['max_abs_value']:.3f}, "
        f"offset-distance spread {q['offset_distance_spread_max']:.1e}"
    )
    lines.append(
        f"  6. rotation max error {results['rotation_max_error']:.1e}; "
        f"similarity spread over i {results['relative']['similarity']['spread']:.1e}; least-squares M_delta "
        f"minus rotation {results['relative']['fitted_rotation']['rotation_error_max']:.1e}"
    )
    shares = results["note"]["taylor"]["scales"][0]
    lines.append(
        f"  note: score shares content-content {shares['content_content']:.1%}, content-position "
        f"{shares['content_position']:.1%}, position-position {shares['position_position']:.1%}; tokens recovered "
        f"after adding P at d={results['note']['embedding']['sizes'][-1]}: {results['note']['embedding']['recovered'][-1]:.1%}"
    )
    encodings = results["family"]["encodings"]
    relative = [n for n, d in encodings.items() if d["measured_relative"] and d.get("position_aware", True)]
    nothing = [n for n, d in encodings.items() if not d.get("position_aware", True)]
    lines.append(
        f"  7. family: {len(encodings)} encodings; relative (shift-invariant, position-aware): "
        f"{', '.join(relative) or '-'}; no position: {', '.join(nothing) or '-'}"
    )
    lines.append(depth.summary_line(results["depth"]))
    runs = results["learning"]["offset"]["variants"]
    hm = results["learning"]["harmless"]
    lines.append(
        f"  trained: copy at offset {results['learning']['offset']['config']['delta']}: "
        + ", ".join(f"{name} {run['accuracy']:.0%}" for name, run in runs.items())
        + f"; majority token with P {hm['with_p']['accuracy']:.0%}, without {hm['without_p']['accuracy']:.0%}"
    )
    long_range = results.get("long_range")
    if long_range:
        budget = long_range["settings"]["budget"]
        lines.append(
            f"  trained: answer at distance n ({long_range.get('source', 'from selfattn study --exercises')}), "
            f"accuracy after {budget} steps: "
            + "; ".join(
                f"{kind} " + ", ".join(f"n={n} {cell['accuracy_at_budget']:.0%}" for n, cell in cells.items())
                for kind, cells in long_range["by_distance"].items()
            )
        )
    by_length = (results.get("exercises") or {}).get("by_length")
    if by_length:
        config = by_length["config"]
        train_len, longest = config["train_len"], max(config["eval_lens"])
        lines.append(
            f"  8. trained by the tour ({config['train_steps']} steps): copy {config['delta']} back, at length "
            f"{train_len} / past it (of {longest}): "
            + ", ".join(
                f"{name} {run['by_length'][str(train_len)]['all']:.0%}/"
                f"{run['by_length'][str(longest)]['past_train_len']:.0%}"
                for name, run in by_length["encodings"].items()
            )
        )
    par = results["learning"]["parallel"]
    lines.append(
        f"  timed: speed-up at {par['threads'][-1]} threads, median of {par['rounds']} rounds [lowest, highest] "
        + ", ".join(
            f"{kind} {values[-1]:.2f}x [{par['speedup_spread'][kind][0]:.2f}, {par['speedup_spread'][kind][1]:.2f}] "
            f"({par['parallel'][kind]})"
            for kind, values in par["speedup"].items()
        )
        + ("" if par["quiet"] else f" (machine busy, load {max(par['load']):.1f}: not a measure of parallelism)")
    )
    if "claims" in results:
        found = results["claims"]
        counts = claims.count_evidence(found)
        lines.append(
            f"  claims: {len(found)} ({counts['measured']} measured, {counts['derived']} derived, "
            f"{counts['identity']} identities checked numerically, {counts['not shown']} not shown); "
            f"{sum(c['holds'] is True for c in found)} hold, {sum(c['holds'] is False for c in found)} do not, "
            f"{sum(c['verdict'] == 'undecided (noise)' for c in found)} undecided (noise)"
        )
        lines.extend(
            f"  does not hold: {c['id']} ({c['page']}): {c['statement']}" for c in found if c["holds"] is False
        )
    for c in checks_:
        if not c["ok"]:
            lines.append(f"  FAILED: {c['name']}: measured {c['measured']}, expected {c['expected']}")
    return lines
