"""The synthetic grid's tables in docs/tour-and-study.md, printed as markdown from the runs kept here.

    .venv/bin/python results/study-synthetic/tables.py [RUNS_DIR]   # default: runs/ beside this file

Each cell is the mean over seeds of a run's exact match (the whole answer right) averaged over a band of input
lengths, ± the half-width of its 95% interval (Student's t over the seeds, ``selfattn.study.spread``). Under
each table: the encoding best past the training lengths and those the seeds do not tell apart from it
(overlapping intervals); no difference among those is claimed.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from selfattn.study.answer_use import summarize_answer_use
from selfattn.study.provenance import code_versions
from selfattn.study.spread import best_and_ties, interval95
from selfattn.study.training import encoding_label


def _band(run: dict[str, Any], low: int, high: int) -> float:
    """Mean exact match of ``run`` over input lengths ``low..high``."""
    return statistics.fmean(run["accuracy_by_length"][str(n)] for n in range(low, high + 1))


def _cell(values: list[float]) -> str:
    interval = interval95(values)
    half = interval["half_width"]
    mean = 100 * statistics.fmean(values)
    return f"{mean:.1f}" if half is None else f"{mean:.1f} ± {100 * float(half):.1f}"


def _steps_to_learn(runs: list[dict[str, Any]]) -> str:
    """The early-stopping reading: the first check at 99% in range, median over seeds, and how many reached it."""
    reached = [int(r["steps_to_learn"]) for r in runs if r.get("steps_to_learn") is not None]
    if not reached:
        return f"- (0 of {len(runs)})"
    return f"{statistics.median(reached):,.0f} ({len(reached)} of {len(runs)})"


def _beyond_at_checks(runs: list[dict[str, Any]]) -> str:
    """Exact match past the training lengths in the checks made during training (12 lengths over L+1..4L, 16
    samples each), over seeds: at the first check at 99% in range (the early-stopping reading; runs that never
    got there are left out) and at the last check (the compute-matched one)."""
    at_stop = [next(c[2] for c in r["checks"] if c[0] == r["steps_to_learn"]) for r in runs if r.get("steps_to_learn")]
    return f"{_cell(at_stop) if at_stop else '-'} | {_cell([r['checks'][-1][2] for r in runs])}"


def tables(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for task in sorted({r["task"] for r in runs}):
        groups: dict[str, list[dict[str, Any]]] = {}
        for run in (r for r in runs if r["task"] == task):
            groups.setdefault(encoding_label(run), []).append(run)
        limit = int(next(iter(groups.values()))[0]["train_max_len"])
        longest = max(int(n) for n in next(iter(groups.values()))[0]["accuracy_by_length"])
        bands = [(1, limit), (limit + 1, 2 * limit), (2 * limit + 1, longest)]
        heads = [f"{low}-{high}" for low, high in bands]
        lines += [
            f"**{task}** (trained on lengths 1-{limit}; exact match, %, by input length):",
            "",
            f"| encoding | seeds | {' | '.join(heads)} | first length below 50% | steps to 99% in range "
            "| past L in the checks: at 99% in range | at the end |",
            "|---|---|" + "---|" * len(bands) + "---|---|---|---|",
        ]
        for label, members in sorted(
            groups.items(), key=lambda item: -statistics.fmean(_band(r, *bands[1]) for r in item[1])
        ):
            by_length = {
                n: statistics.fmean(r["accuracy_by_length"][str(n)] for r in members) for n in range(1, longest + 1)
            }
            below = next((str(n) for n, value in by_length.items() if value < 0.5), "-")
            cells = [_cell([_band(r, *band) for r in members]) for band in bands]
            lines.append(
                f"| {label} | {len(members)} | {' | '.join(cells)} | {below} | {_steps_to_learn(members)} | {_beyond_at_checks(members)} |"
            )
        for low, high in bands[1:]:
            seeds = {label: [_band(r, low, high) for r in members] for label, members in groups.items()}
            best, ties = best_and_ties(seeds, higher_is_better=True)
            tied = f"; not told apart from it: {', '.join(ties)}" if ties else "; every other is below it"
            lines.append("")
            lines.append(f"Best at lengths {low}-{high}: {best}{tied}.")
        lines.append("")
    lines.append(f"Code: {', '.join(v[:7] for v in code_versions(runs))}; {len(runs)} runs.")
    return lines


def answer_tables(runs: list[dict[str, Any]]) -> list[str]:
    """Answer tokens right by position past L, whole sample | window (``answer_use``), mean ± half-width over seeds."""
    lines: list[str] = []
    for task in sorted({r["task"] for r in runs}):
        groups: dict[str, list[dict[str, Any]]] = {}
        for run in (r for r in runs if r["task"] == task and r.get("answer_use")):
            groups.setdefault(encoding_label(run), []).append(run)
        if not groups:
            continue
        cells = {label: summarize_answer_use(members) for label, members in groups.items()}
        first = next(iter(cells.values()))
        assert first is not None
        heads = [f"{a}-{b}" for a, b in first["bands"]]
        lines += [
            f"**{task}** past L (lengths {int(groups[next(iter(groups))][0]['train_max_len']) + 1} on; answer tokens "
            f"right, %, by position in the answer: all from the whole sample | the tokens with more than "
            f"{first['window'] - 1} before them, from the whole sample | from BOS + their last {first['window'] - 1}):",
            "",
            f"| encoding | {' | '.join(f'{head}: all | far, whole | far, window' for head in heads)} |",
            "|---|" + "---|---|---|" * len(heads),
        ]
        for label, cell in sorted(cells.items(), key=lambda item: -item[1]["full"][0]["mean"]):  # type: ignore[index]
            texts = [
                _interval_text(cell[reading][i])
                for i in range(len(heads))
                for reading in ("full", "far_full", "far_window")
            ]
            lines.append(f"| {label} | {' | '.join(texts)} |")
        lines.append("")
    return lines


def _interval_text(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    half = cell.get("half_width")
    return f"{100 * cell['mean']:.1f}" if half is None else f"{100 * cell['mean']:.1f} ± {100 * half:.1f}"


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent / "runs"
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    print("\n".join([*tables(runs), "", *answer_tables(runs)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
