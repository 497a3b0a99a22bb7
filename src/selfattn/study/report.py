"""``DIR/study.html`` and its figures, from ``results.json`` and the runs' final checkpoints.

Every number in the report is read from the results or measured here from a saved model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from selfattn.positional.learned import LearnedPositionalEncoding
from selfattn.study._io import write_text
from selfattn.study.figures import accuracy_figure, learned_table_figure
from selfattn.study.tasks import get_task
from selfattn.study.training import RunSpec, StudyConfig, build_model, evaluated_weights

__all__ = ["learned_table_analysis", "write_report"]

_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>selfattn study</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 1rem auto; padding: 0 1rem; line-height: 1.45; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .9rem; }
td, th { border-bottom: 1px solid #ddd; padding: .2rem .6rem; text-align: right; }
td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; height: auto; }
.bad { color: #b00; } .note { color: #555; font-size: .9rem; }
</style></head><body>
<h1>selfattn study: trained models answer the chapter's exercises</h1>
<p class="note">{{ runs|length }} runs: tasks {{ config.tasks|join(", ") }}; encodings {{ config.encodings|join(", ") }};
{{ config.seeds }} seed(s){% if config.randomized_positions %}; randomized positions for the absolute and rotary encodings{% endif %}.
Each run trains a {{ config.num_layers }}-layer causal transformer (d={{ config.num_hiddens }}, {{ config.num_heads }} heads)
for {% if config.stop_at %}at most {% endif %}{{ config.steps_text }} steps of {{ config.batch_size }} samples on input lengths 1..{{ config.train_len }}{% if config.mixed_lengths %}
(each sample draws its own length){% else %} (one length per step){% endif %}{% if config.stop_at %}, and stops sooner once
its exact match at the training lengths reaches {{ pct(config.stop_at) }} on a check ({{ config.check_samples }} samples per length,
drawn apart from training and evaluation, every {{ config.check_every }} steps; steps taken: {{ config.steps_taken }}){% endif %},
then measures{% if config.ema_decay is not none and config.ema_decay is defined %}, on an exponential moving average of its weights
(decay {{ config.ema_decay }}),{% endif %} exact match of the answer at every input length 1..{{ config.eval_len }} ({{ config.eval_samples }} samples each).
Training took {{ "%.0f"|format(total_seconds) }} s of wall-clock time in all (sum over runs){% if cpu_seconds %}; training and
evaluation used {{ "%.0f"|format(cpu_seconds) }} s of CPU time ({{ "%.0f"|format(cpu_seconds / runs|length) }} s per run), so on
two otherwise idle cores with one rank each the grid would take about {{ "%.0f"|format(cpu_seconds / 120) }} minutes
(an estimate from CPU time, which a busy machine inflates less than wall-clock time){% endif %}.</p>

{% if shortfalls %}<p class="bad">Below 95% exact match at the training lengths on copy or reverse (the goal of the
default budget: a model that did not learn the task says little about extrapolation). Per cell, means over seeds:</p>
<table><tr><th>task / encoding</th><th>exact match in</th><th>per seed</th><th>at n=1</th><th>at n={{ config.train_len }}</th>
<th>tokens right at n={{ config.train_len }}</th><th>loss, 9th / 10th tenth of training</th></tr>
{% for s in shortfalls %}<tr><td>{{ s.cell }}</td><td>{{ pct(s.inside) }}</td><td>{% for v in s.by_seed %}{{ pct(v) }}{% if not loop.last %}, {% endif %}{% endfor %}</td><td>{{ pct(s.first) }}</td><td>{{ pct(s.last) }}</td>
<td>{{ pct(s.tokens_last) }}</td><td>{% if s.loss_before is not none %}{{ "%.3f"|format(s.loss_before) }} / {{ "%.3f"|format(s.loss_after) }}{% else %}n/a{% endif %}</td></tr>
{% endfor %}</table>
<p>Why, as far as these numbers tell: exact match needs every one of the n answer tokens right, so a small error per
token compounds with length. {% if mostly_right %}In {{ mostly_right|join(", ") }}, at least 80% of the answer tokens at
n={{ config.train_len }} are right while whole answers fail: the model has learned most of the task and loses long answers to a few
tokens. {% endif %}{% if still_falling %}In {{ still_falling|join(", ") }}, the training loss was still falling in the
last tenth of training (by 5% or more): these runs stopped before converging, and more steps (<code>--steps</code>) would
train further, at a proportional cost in time (the default budget per task is sized so the whole grid fits about an hour on 2 cores).
{% endif %}</p>
{% elif checked_budget %}<p>Every encoding reached at least 95% exact match at the training lengths on copy and reverse.</p>{% endif %}

<h2>Relative vs absolute: accuracy against length</h2>
<p>Mean over seeds (line) and min..max (shaded). "in" is the mean exact match over the training lengths 1..{{ config.train_len }},
"beyond" over lengths {{ config.train_len + 1 }}..{{ config.eval_len }}; "&lt;50% at" is the first length where the mean falls below one half;
"steps" is the mean number of steps the runs took{% if config.stop_at %} (fewer steps: the encoding learned the task sooner){% endif %}.</p>
{% for task, rows in tables.items() %}
<h3>{{ task }}</h3>
<img src="figures/{{ figures[task][0] }}" alt="accuracy against length, {{ task }}">
<table><tr><th>encoding</th><th>in</th><th>beyond</th><th>&lt;50% at</th><th>seeds</th><th>steps (mean)</th></tr>
{% for label, s in rows.items() %}<tr><td>{{ label }}</td><td>{{ pct(s.in_distribution) }} ± {{ pct(s.spread.in_distribution) }}</td>
<td>{{ pct(s.beyond) }}{% if s.spread.beyond is not none %} ± {{ pct(s.spread.beyond) }}{% endif %}</td>
<td>{{ s.below_half_at if s.below_half_at is not none else "never" }}</td><td>{{ s.seeds }}</td>
<td>{{ "%.0f"|format(s.steps) if s.steps is defined and s.steps is not none else "n/a" }}</td></tr>
{% endfor %}</table>
{% endfor %}

<h2>Learned vs fixed</h2>
{% if learned %}
<table><tr><th>task</th><th>learned in</th><th>sinusoidal in</th><th>learned beyond</th><th>sinusoidal beyond</th></tr>
{% for row in learned.rows %}<tr><td>{{ row.task }}</td><td>{{ pct(row.learned_in) }}</td><td>{{ pct(row.sinusoidal_in) }}</td>
<td>{{ pct(row.learned_beyond) }}</td><td>{{ pct(row.sinusoidal_beyond) }}</td></tr>{% endfor %}</table>
{% if learned.figure %}<img src="figures/{{ learned.figure }}" alt="learned table vs sinusoid">
<p>Run {{ learned.run }}. The table has {{ learned.max_len }} rows (every evaluated position); training sequences
reach {{ learned.trained_rows }} positions (black lines). Rows inside moved by {{ "%.2f"|format(learned.moved_inside) }}x
their initial norm on average, rows past it by {{ "%.2f"|format(learned.moved_outside) }}x: positions never seen in training keep their
random initial vectors, so the model meets noise where it expects a position. Past the table itself the model cannot run at all:
asking for {{ learned.max_len + 1 }} positions raised <code>{{ learned.past_max_len }}</code></p>{% endif %}
{% else %}<p>Run the study with both <code>learned</code> and <code>sinusoidal</code> to compare them.</p>{% endif %}

{% if deep_stack %}<h2>Deep stacks</h2><p>The deep-stack measurements are in <code>results.json["deep_stack"]</code>
(the tour's report draws them).</p>{% endif %}
</body></html>
"""


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _members(results: dict[str, Any], task: str, label: str) -> list[dict[str, Any]]:
    from selfattn.study.runner import encoding_label

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
    html = (
        jinja2.Environment(autoescape=True)
        .from_string(_TEMPLATE)
        .render(
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
            learned=learned,
            deep_stack=results.get("deep_stack"),
            pct=_pct,
        )
    )
    path = out / "study.html"
    write_text(path, html)
    return path


def load_results(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "results.json").read_text()))
