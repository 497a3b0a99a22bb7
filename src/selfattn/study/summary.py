"""A study folder in a few lines: for the terminal and for the tour's report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["StudySummary", "load_study", "summary_lines"]


@dataclass(frozen=True)
class StudySummary:
    """What the tour shows of a study.

    Attributes:
        folder: the study's folder.
        report: its ``study.html`` (None if absent).
        rows: ``(task, encoding, in_distribution, beyond, below_half_at)``, one per cell.
        figures: PNG paths of the accuracy-against-length figures and the learned-table figure.
        train_len: the longest training input.
        runs: how many runs the results hold.
    """

    folder: Path
    report: Path | None
    rows: list[tuple[str, str, float, float | None, int | None]]
    figures: list[Path]
    train_len: int
    runs: int


def load_study(folder: Path) -> StudySummary | None:
    """The summary of ``folder/results.json``; None if there is no readable study there."""
    try:
        results = json.loads((Path(folder) / "results.json").read_text())
        summary: dict[str, dict[str, Any]] = results["summary"]
        rows = [
            (task, label, float(s["in_distribution"]), s["beyond"], s["below_half_at"])
            for task, by in summary.items()
            for label, s in by.items()
        ]
        train_len = int(results["config"]["train_len"])
        runs = len(results["runs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    folder = Path(folder)
    names = [f"accuracy_{task}.png" for task in summary] + ["learned_vs_sinusoidal.png"]
    figures = [folder / "figures" / name for name in names if (folder / "figures" / name).exists()]
    report = folder / "study.html"
    return StudySummary(folder, report if report.exists() else None, rows, figures, train_len, runs)


def summary_lines(results: dict[str, Any], folder: Path) -> list[str]:
    """The terminal summary: per task, each encoding's accuracy inside and beyond the training lengths."""
    limit = int(results["config"]["train_len"])
    lines = [f"study: {len(results['runs'])} runs, trained on lengths 1..{limit}; exact match in / beyond:"]
    for task, by in results["summary"].items():
        cells = []
        for label, s in by.items():
            beyond = "n/a" if s["beyond"] is None else f"{100 * s['beyond']:.0f}%"
            cells.append(f"{label} {100 * s['in_distribution']:.0f}%/{beyond}")
        lines.append(f"  {task}: " + ", ".join(cells))
    report = folder / "study.html"
    lines.append(f"report: {report}" if report.exists() else f"results: {folder / 'results.json'}")
    return lines
