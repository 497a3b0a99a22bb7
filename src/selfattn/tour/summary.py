"""The tour's summary in the terminal, drawn with rich (plain text without it).

The content is :func:`selfattn.tour.runner.summary_lines` and the measured comparison; rich
only lays it out: a headline, the comparison as a table, one row per section, and any failed
check in red.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from selfattn.tour.comparison import CHAPTER, KINDS

__all__ = ["print_summary"]


def _comparison_table(comp: dict[str, Any]) -> Any:
    from rich.table import Table

    n = comp["sweep"]["n"][-1]
    title = f"CNN vs RNN vs self-attention: chapter -> counted and timed (n = {n:,}, k = {comp['cnn']['k']})"
    table = Table(title=title, title_justify="left")
    for header in ("layer", "compute (FLOPs)", "sequential ops", "path (products)", "time ~ n^ [min, max]"):
        table.add_column(header)
    labels = {"cnn": "CNN", "rnn": "RNN", "self_attention": "Self-attention"}
    for kind in KINDS:
        e, claim = comp[kind], CHAPTER[kind]
        low, high = e["time_exponent_spread"]
        table.add_row(
            labels[kind],
            f"{claim['complexity']} -> n^{e['flops_exponent_n']:.2f} d^{e['flops_exponent_d']:.2f}",
            f"{claim['sequential_ops']} -> {e['sequential_ops']:,}",
            f"{claim['max_path_length']} -> {e['max_path_length']:,}",
            f"{e['time_exponent_n']:.2f} [{low:.2f}, {high:.2f}]",
        )
    dominated = [labels[kind] for kind in KINDS if comp[kind]["fixed_costs_dominate"]]
    rounds = comp["sweep"].get("rounds", 1)
    table.caption = f"time: median exponent of {rounds} rounds \\[lowest, highest]" + (
        f"; fixed per-call costs dominate for {', '.join(dominated)} at these sizes" if dominated else ""
    )
    return table


def print_summary(results: dict[str, Any], report: Path | str | None = None, console: Any = None) -> None:
    """Print the summary of a tour's ``results`` (with ``"checks"``) to ``console`` or stdout."""
    from selfattn.tour.runner import summary_lines

    lines = summary_lines(results, report)
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print("\n".join(lines))
        return
    console = console or Console(highlight=False)
    failed = [c for c in results["checks"] if not c["ok"]]
    console.print(escape(lines[0]), style="bold red" if failed else "bold green")
    console.print(_comparison_table(results["comparison"]))
    sections = Table(show_header=True, title="Each section", title_justify="left")
    sections.add_column("section", no_wrap=True)
    sections.add_column("found")
    for line in lines[1:]:
        found = re.match(r"^  (\S+?)\.? (.*)$", line)
        if found is None or line.startswith(("     ", "  3.", "  FAILED", "  claims:", "  does not hold")):
            continue
        sections.add_row(escape(found.group(1).rstrip(":")), escape(found.group(2)))
    if "claims" in results:
        from selfattn.tour.claims import count_evidence, count_verdicts

        claims = results["claims"]
        held = sum(c["holds"] is True for c in claims)
        failing = [c["id"] for c in claims if c["holds"] is False]
        counts, verdicts = count_evidence(claims), count_verdicts(claims)
        sections.add_row(
            "claims",
            f"{held} of {len(claims)} claims of the source pages hold, {len(failing)} {'does' if len(failing) == 1 else 'do'} not"
            + (f" ({', '.join(failing)})" if failing else "")
            + f", {verdicts['undecided (noise)']} undecided (noise), {counts['not shown']} not shown; "
            f"{counts['measured']} measured, {counts['derived']} derived, {counts['identity']} identities checked "
            "numerically (report: closing table; claims do not set the exit status)",
        )
    console.print(sections)
    if failed:
        rows = Table(title="FAILED checks", title_style="bold red", title_justify="left")
        for header in ("check", "measured", "expected"):
            rows.add_column(header)
        for c in failed:
            rows.add_row(escape(c["name"]), escape(str(c["measured"])), escape(c["expected"]))
        console.print(rows)
