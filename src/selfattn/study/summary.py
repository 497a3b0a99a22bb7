"""A study folder in a few lines: for the terminal and for the tour's report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["StudySummary", "load_study", "study_section_html", "summary_lines"]


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


def _percent(cell: dict[str, Any] | None) -> str:
    """``"99.1 ± 0.4%"``: the mean and the half-width of its 95% interval over seeds (the mean alone for one seed)."""
    if cell is None:
        return "n/a"
    half = cell.get("half_width")
    return f"{100 * cell['mean']:.1f}%" if half is None else f"{100 * cell['mean']:.1f} ± {100 * half:.1f}%"


def summary_lines(results: dict[str, Any], folder: Path) -> list[str]:
    """The terminal summary: per task, each encoding's accuracy inside and beyond the training lengths.

    Each cell is the mean over seeds ± the half-width of its 95% interval; under each task, the
    encoding best beyond the training lengths and those whose interval overlaps its (no
    difference is claimed between them, :func:`~selfattn.study.spread.best_and_ties`).
    """
    from selfattn.study.provenance import mixed_versions_warning
    from selfattn.study.spread import best_and_ties

    limit = int(results["config"]["train_len"])
    lines = [
        f"study: {len(results['runs'])} runs, trained on lengths 1..{limit}; exact match in / beyond "
        "(mean ± half-width of the 95% interval over seeds):"
    ]
    for task, by in results["summary"].items():
        cells = []
        for label, s in by.items():
            interval = s.get("interval") or {}
            inside = interval.get("in_distribution") or {"mean": s["in_distribution"]}
            beyond = interval.get("beyond") or (None if s["beyond"] is None else {"mean": s["beyond"]})
            cells.append(f"{label} {_percent(inside)} / {_percent(beyond)}")
        lines.append(f"  {task}: " + ", ".join(cells))
        seeds = {label: s["per_seed"]["beyond"] for label, s in by.items() if (s.get("per_seed") or {}).get("beyond")}
        if len(seeds) > 1:
            best, ties = best_and_ties(seeds, higher_is_better=True)
            if len(ties) == len(seeds) - 1:  # naming a best (a first label, "none" perhaps) would claim one
                lines.append("    beyond the training lengths the seeds tell no encoding apart from the others")
            else:
                tied = f"; not told apart from it by the seeds: {', '.join(ties)}" if ties else ""
                lines.append(f"    best beyond the training lengths: {best}{tied}")
    warning = mixed_versions_warning(list(results["config"].get("code_versions", [])))
    if warning:
        lines.append(warning)
    report = folder / "study.html"
    lines.append(f"report: {report}" if report.exists() else f"results: {folder / 'results.json'}")
    return lines


def study_section_html(folder: Path | None = None) -> str:
    """An HTML section for the tour's report: the study's numbers and figures, or how to make them.

    ``folder`` defaults to ``$SELFATTN_STUDY`` or ``./selfattn-study`` (``selfattn study``'s
    default ``--out``). Figures are inlined, so the tour's report stays one self-contained file.
    """
    import base64
    import html
    import os

    folder = Path(folder or os.environ.get("SELFATTN_STUDY", "selfattn-study"))
    study = load_study(folder)
    head = '<h2 id="study">Trained models: the study</h2>'
    if study is None:
        exercises = (folder / "exercises.json").is_file()
        shown = "; its <code>selfattn study --exercises</code> results are shown above" if exercises else ""
        return (
            f"{head}<p>No study grid found in <code>{html.escape(str(folder))}</code> (no <code>results.json</code>"
            f"{shown}). The exercises are answered with "
            "trained models by <code>selfattn study</code> (the earlier default grid of 84 runs took 45 minutes on "
            "2 CPU cores; the present one, 130 compute-matched runs, has not been timed: "
            "<code>torchrun --standalone --nproc_per_node 2 -m selfattn study</code>; <code>selfattn study --quick</code> "
            "for a smoke test); rerun the tour afterwards, or point <code>SELFATTN_STUDY</code> at its folder.</p>"
        )
    rows = "".join(
        f"<tr><td>{html.escape(task)}</td><td>{html.escape(label)}</td><td>{100 * inside:.1f}%</td>"
        f"<td>{'n/a' if beyond is None else f'{100 * beyond:.1f}%'}</td><td>{'never' if half is None else half}</td></tr>"
        for task, label, inside, beyond, half in study.rows
    )
    images = "".join(
        f'<img style="max-width:100%" alt="{html.escape(path.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
        for path in study.figures
    )
    link = f' Full report: <a href="{html.escape(str(study.report.resolve()))}">study.html</a>.' if study.report else ""
    return (
        f"{head}<p>{study.runs} trained runs from <code>{html.escape(str(folder))}</code>: exact match of the answer "
        f"at the training lengths 1..{study.train_len} (in) and beyond them, and the first length where the mean "
        f"over seeds falls below 50%.{link}</p>"
        "<table><tr><th>task</th><th>encoding</th><th>in</th><th>beyond</th><th>&lt;50% at</th></tr>"
        f"{rows}</table>{images}"
    )
