"""The exercises' tables in docs/tour-and-study.md, printed as markdown from the run files kept here.

    .venv/bin/python results/study-exercises/tables.py [FOLDER]   # default: exercises/ beside this file

Long-range dependencies: per model and distance, the accuracy after the budget and the steps to 90%, each as the
mean over seeds ± the half-width of its 95% interval (Student's t, ``selfattn.study.spread``), and the pairs of
models at one distance whose steps the seeds tell apart. Deep stacks: per encoding, variant and depth, the held-out
accuracy at the end and the position probe's R^2 at the last layer, mean over seeds (min-max beside the accuracy).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from selfattn.study.spread import differs, interval95


def _mean_pm(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    interval = interval95(values)
    mean = scale * float(interval["mean"] or 0.0)
    half = interval["half_width"]
    return f"{mean:.{digits}f}" if half is None else f"{mean:.{digits}f} ± {scale * float(half):.{digits}f}"


def long_range(runs: list[dict[str, Any]]) -> list[str]:
    kinds = sorted({r["kind"] for r in runs}, key=["cnn", "rnn", "self_attention"].index)
    distances = sorted({int(r["distance"]) for r in runs})
    cell: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        cell.setdefault((run["kind"], int(run["distance"])), []).append(run)
    lines = [
        "| model | " + " | ".join(f"n = {n}" for n in distances) + " |",
        "|---|" + "---|" * len(distances),
    ]
    for kind in kinds:
        cells = []
        for n in distances:
            members = cell.get((kind, n), [])
            if not members:
                cells.append("")
                continue
            accuracy = _mean_pm([r["accuracy_at_budget"] for r in members], 100)
            reached = [r["steps_to_target"] for r in members if r["steps_to_target"] is not None]
            steps = (
                "never"
                if not reached
                else _mean_pm(reached)
                if len(reached) == len(members)
                else (f"{statistics.fmean(reached):.0f} ({len(reached)} of {len(members)})")
            )
            cells.append(f"{accuracy}% / {steps}")
        sizes = sorted({cell[(kind, n)][0]["parameters"] for n in distances if (kind, n) in cell})
        size = f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,} to {sizes[-1]:,}"
        lines.append(f"| {kind} ({size}) | " + " | ".join(cells) + " |")
    lines += ["", "Steps to 90% told apart by the seeds (every seed reached it, intervals apart):"]
    for n in distances:
        for first in kinds:
            for second in kinds[kinds.index(first) + 1 :]:
                a, b = cell.get((first, n), []), cell.get((second, n), [])
                steps_a = [r["steps_to_target"] for r in a]
                steps_b = [r["steps_to_target"] for r in b]
                if a and b and None not in steps_a and None not in steps_b and differs(steps_a, steps_b):
                    faster = first if statistics.fmean(steps_a) < statistics.fmean(steps_b) else second
                    lines.append(
                        f"- n = {n}: {faster} sooner ({first} {_mean_pm(steps_a)}, {second} {_mean_pm(steps_b)})"
                    )
    return lines


def by_depth(entries: list[dict[str, Any]]) -> list[str]:
    depths = sorted({int(e["depth"]) for e in entries})
    rows: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for entry in entries:
        rows.setdefault((entry["encoding"], entry["variant"]), {}).setdefault(int(entry["depth"]), []).append(entry)
    lines = [
        "| encoding | variant | " + " | ".join(f"depth {d}" for d in depths) + " |",
        "|---|---|" + "---|" * len(depths),
    ]
    for (encoding, variant), by in rows.items():
        cells = []
        for d in depths:
            members = by.get(d, [])
            if not members:
                cells.append("")
                continue
            accuracy = [100 * m["task_accuracy"] for m in members]
            r2 = statistics.fmean(m["position_r2"] for m in members)
            cells.append(f"{statistics.fmean(accuracy):.0f}% ({min(accuracy):.0f}-{max(accuracy):.0f}), R² {r2:.2f}")
        lines.append(f"| {encoding} | {variant} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent / "exercises"
    runs = [json.loads(p.read_text()) for p in sorted((folder / "long_range").glob("*.json"))]
    print("\n".join(long_range(runs)))
    entries = []
    for path in sorted((folder / "by_depth").glob("*.json")):
        one = json.loads(path.read_text())
        for encoding, by_variant in one["stacks"].items():
            for variant, found in by_variant.items():
                entries += [{**e, "encoding": encoding, "variant": variant} for e in found]
    if entries:
        print()
        print("\n".join(by_depth(entries)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
