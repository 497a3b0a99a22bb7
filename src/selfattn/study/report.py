"""``DIR/study.html`` and its figures, from ``results.json`` and the runs' final checkpoints.

Every number in the report is read from the results or measured here from a saved model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from selfattn._atomic import write_text
from selfattn.positional.learned import LearnedPositionalEncoding
from selfattn.study.figures import accuracy_figure, answer_use_figure, learned_table_figure, training_checks_figure
from selfattn.study.tasks import get_task
from selfattn.study.training import QUICK, RunSpec, StudyConfig, build_model, encoding_label, evaluated_weights

__all__ = ["learned_table_analysis", "write_report"]

# The page, a Jinja template beside this module (like the tour's).
_TEMPLATES = Path(__file__).with_name("templates")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _members(results: dict[str, Any], task: str, label: str) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["task"] == task and encoding_label(r) == label]


def _mean_at(results: dict[str, Any], task: str, label: str, n: int, key: str = "accuracy_by_length") -> float | None:
    """Mean over seeds of a per-length metric at length ``n`` (None if the runs do not hold it)."""
    values = [float(r[key][str(n)]) for r in _members(results, task, label) if key in r]
    return sum(values) / len(values) if values else None


def _shortfall(results: dict[str, Any], task: str, label: str, inside: float, train_len: int) -> dict[str, Any]:
    """One row of the below-95% table: where in the training range accuracy falls, and how training ended."""
    tenths = [r["loss_by_tenth"] for r in _members(results, task, label) if len(r.get("loss_by_tenth", [])) >= 2]
    return {
        "cell": f"{task} / {label}",
        "inside": inside,
        # A mean below 95% may be one seed that stalled: the seeds tell that apart from a cell that never learns.
        "by_seed": [
            sum(float(r["accuracy_by_length"][str(n)]) for n in range(1, train_len + 1)) / train_len
            for r in sorted(_members(results, task, label), key=lambda r: int(r["seed"]))
        ],
        "first": _mean_at(results, task, label, 1),
        "last": _mean_at(results, task, label, train_len),
        "tokens_last": _mean_at(results, task, label, train_len, "token_accuracy_by_length"),
        "loss_before": sum(t[-2] for t in tenths) / len(tenths) if tenths else None,
        "loss_after": sum(t[-1] for t in tenths) / len(tenths) if tenths else None,
    }


def _cell_texts(summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Per task and encoding, the table's texts (mean ± 95% half-width), and per task the best-and-ties line."""
    from selfattn.study.spread import best_and_ties
    from selfattn.study.summary import _percent

    cells: dict[str, Any] = {}
    ties: dict[str, str] = {}
    for task, by in summary.items():
        for label, s in by.items():
            interval = s.get("interval") or {}
            learned = s.get("steps_to_learn") or []
            cells.setdefault(task, {})[label] = {
                "inside": _percent(interval.get("in_distribution") or {"mean": s["in_distribution"]}),
                "beyond": _percent(interval.get("beyond") or (None if s["beyond"] is None else {"mean": s["beyond"]})),
                "learned": ", ".join("-" if step is None else str(step) for step in learned) or "n/a",
            }
        seeds = {label: s["per_seed"]["beyond"] for label, s in by.items() if (s.get("per_seed") or {}).get("beyond")}
        if len(seeds) > 1:
            best, tied = best_and_ties(seeds, higher_is_better=True)
            if len(tied) == len(seeds) - 1:  # as the terminal's summary: naming a best (a first label) claims one
                ties[task] = "Beyond the training lengths the seeds tell no encoding apart from the others."
            else:
                ties[task] = f"Best beyond the training lengths: {best}" + (
                    f"; not told apart from it by the seeds: {', '.join(tied)}." if tied else "; every other differs."
                )
    return cells, ties


def _answer_rows(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per task with the readings: its bands, window and one row per encoding of ``(all, far whole, far window)``
    texts per band."""
    from selfattn.study.summary import _percent

    tables: dict[str, dict[str, Any]] = {}
    for task, by in summary.items():
        rows = {label: s["answer_use"] for label, s in by.items() if s.get("answer_use")}
        if not rows:
            continue
        first = next(iter(rows.values()))
        tables[task] = {
            "bands": [f"{a}-{b}" for a, b in first["bands"]],
            "window": first["window"],
            "rows": {
                label: [
                    tuple(_percent(use[reading][i]) for reading in ("full", "far_full", "far_window"))
                    for i in range(len(first["bands"]))
                ]
                for label, use in rows.items()
            },
        }
    return tables


def learned_table_analysis(out: Path, results: dict[str, Any], figures: Path) -> dict[str, Any] | None:
    """Load the first finished ``learned`` run's model; compare its table with the sinusoid's."""
    candidates = [r for r in results["runs"] if r["encoding"] == "learned" and not r["randomized_positions"]]
    candidates.sort(key=lambda r: (r["task"] != "copy", r["seed"]))
    for run in candidates:
        spec = RunSpec(run["task"], "learned", int(run["seed"]), False)
        checkpoint = out / "checkpoints" / f"{spec.key}.pt"
        if not checkpoint.exists():
            continue
        fields = StudyConfig.__dataclass_fields__
        config = StudyConfig(**{k: v for k, v in results["config"].items() if k in fields})
        initial = build_model(spec, config)
        model = build_model(spec, config)
        model.load_state_dict(evaluated_weights(checkpoint))
        table = cast(LearnedPositionalEncoding, model.encoding).weight.detach().double().numpy()
        start = cast(LearnedPositionalEncoding, initial.encoding).weight.detach().double().numpy()
        from selfattn.functional import sinusoidal_table

        sinusoid = sinusoidal_table(table.shape[0], table.shape[1], dtype=torch.float64).numpy()
        trained_rows = get_task(spec.task).sequence_len(config.train_len)
        moved = np.linalg.norm(table - start, axis=1) / np.linalg.norm(start, axis=1)
        try:
            model(torch.zeros(1, model.max_len + 1, dtype=torch.long))
            past = "nothing: the model ran"
        except ValueError as error:
            past = str(error)
        names = learned_table_figure(table, start, sinusoid, trained_rows, figures)
        return {
            "run": spec.key,
            "figure": names[0],
            "max_len": model.max_len,
            "trained_rows": trained_rows,
            "moved_inside": float(moved[:trained_rows].mean()),
            "moved_outside": float(moved[trained_rows:].mean()) if trained_rows < len(moved) else float("nan"),
            "past_max_len": past,
        }
    return None


def write_report(out: Path, results: dict[str, Any]) -> Path:
    """Write ``out/figures/*`` and ``out/study.html``; return the report's path."""
    import jinja2

    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    config = dict(results["config"])
    config["eval_len"] = config["eval_factor"] * config["train_len"]
    quick = dataclasses.asdict(QUICK)
    config["smoke_test"] = all(config.get(key) == value for key, value in quick.items() if key in config)
    # Each run records its schedule (the per-task budget unless --steps set one for all) and the
    # steps it took (fewer when a check stopped it).
    scheduled = {str(r["task"]): int(r.get("scheduled_steps", r["steps"])) for r in results["runs"]}
    config["steps_text"] = ", ".join(f"{task} {steps}" for task, steps in scheduled.items())
    taken: dict[str, list[int]] = {}
    for run in results["runs"]:
        taken.setdefault(str(run["task"]), []).append(int(run["steps"]))
    config["steps_taken"] = "; ".join(
        f"{task} {min(steps)}..{max(steps)}, median {int(np.median(steps))}"
        if min(steps) < max(steps)
        else f"{task} {steps[0]} in every run"
        for task, steps in taken.items()
    )
    summary = results["summary"]
    figure_names = {task: accuracy_figure(results, task, figures) for task in summary}
    training_figures = {task: training_checks_figure(results, task, figures) for task in summary}
    cells, ties = _cell_texts(summary)
    answers = _answer_rows(summary)
    answer_figures = {task: answer_use_figure(summary[task], task, figures) for task in answers}
    shortfalls = [
        _shortfall(results, task, label, s["in_distribution"], int(config["train_len"]))
        for task in ("copy", "reverse")
        for label, s in summary.get(task, {}).items()
        if s["in_distribution"] < 0.95
    ]
    mostly_right = [f["cell"] for f in shortfalls if f["tokens_last"] is not None and f["tokens_last"] >= 0.8]
    still_falling = [
        f["cell"] for f in shortfalls if f["loss_before"] is not None and f["loss_after"] <= 0.95 * f["loss_before"]
    ]
    learned: dict[str, Any] | None = None
    rows = [
        {
            "task": task,
            "learned_in": by["learned"]["in_distribution"],
            "sinusoidal_in": by["sinusoidal"]["in_distribution"],
            "learned_beyond": by["learned"]["beyond"],
            "sinusoidal_beyond": by["sinusoidal"]["beyond"],
        }
        for task, by in summary.items()
        if "learned" in by and "sinusoidal" in by
    ]
    if rows:
        learned = {"rows": rows, **(learned_table_analysis(out, results, figures) or {})}
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True)
    html = environment.get_template("study.html.j2").render(
        config=config,
        runs=results["runs"],
        total_seconds=sum(float(r["train_seconds"]) for r in results["runs"]),
        cpu_seconds=sum(
            float(r.get("train_cpu_seconds", 0.0)) + float(r.get("eval_cpu_seconds", 0.0)) for r in results["runs"]
        ),
        shortfalls=shortfalls,
        mostly_right=mostly_right,
        still_falling=still_falling,
        checked_budget=bool({"copy", "reverse"} & set(summary)),
        tables=summary,
        figures=figure_names,
        training_figures=training_figures,
        cells=cells,
        ties=ties,
        learned=learned,
        answers=answers,
        answer_figures=answer_figures,
        deep_stack=results.get("deep_stack"),
        pct=_pct,
    )
    path = out / "study.html"
    write_text(path, html)
    return path


def load_results(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "results.json").read_text()))
