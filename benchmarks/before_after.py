"""Put two runs of the benchmark scripts side by side: every ratio of the target tables, before and after.

A redesign must keep behaviour and speed: run ``benchmarks/attention.py`` and
``benchmarks/positional.py`` once on the code before it and once after (same machine, same
conditions, each with ``--output`` to its own file), then::

    .venv/bin/python benchmarks/before_after.py BEFORE.md AFTER.md --title "..." --commands "..."

It writes the section ``before-after-cpu`` of BENCHMARKS.md: for each target row of each section
(``attention-cpu``, ``attention-models-cpu``, ``positional-cpu``) the measured value of both runs
and their quotient. Values are ratios measured inside each run (against baselines timed in the
same rounds), so the two runs can be compared even though the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from _common import BENCHMARKS_MD, emit, table

SECTIONS = ("attention-cpu", "attention-models-cpu", "positional-cpu")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def section(text: str, name: str) -> str:
    """The body of section ``name`` of a BENCHMARKS-style markdown file ('' if absent)."""
    match = re.search(rf"<!-- begin: {re.escape(name)} -->(.*?)<!-- end: {re.escape(name)} -->", text, re.S)
    return match.group(1) if match else ""


def target_rows(body: str) -> dict[str, str]:
    """``target -> measured`` from the section's first table whose header is a target or row table."""
    rows: dict[str, str] = {}
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("| ") or cells[0] in ("target", "row") or set(cells[0]) <= {"-"}:
            continue
        if re.fullmatch(r"\*\*.*\*\*|met|not met|-", cells[-1].replace("*", "").strip()) or cells[-1].startswith("**"):
            rows.setdefault(cells[0], cells[1])
    return rows


def encoding_rows(body: str) -> dict[str, str]:
    """``encoding (fwd | fwd+bwd) -> ratio`` from the positional section's table of every encoding."""
    rows: dict[str, str] = {}
    header: list[str] | None = None
    for line in body.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| encoding |"):
            header = cells
        elif header is not None and line.startswith("| ") and len(cells) == len(header):
            for column, cell in zip(header[3:], cells[3:], strict=True):
                rows[f"{cells[0]}: {column}"] = cell
        elif header is not None and not line.startswith("|"):
            header = None
    return rows


def first_number(cell: str) -> float | None:
    match = _NUMBER.search(cell)
    return float(match.group()) if match else None


def compare(before: str, after: str) -> list[list[str]]:
    out = []
    for name in SECTIONS:
        old_body, new_body = section(before, name), section(after, name)
        old, new = target_rows(old_body) | encoding_rows(old_body), target_rows(new_body) | encoding_rows(new_body)
        for target, measured in new.items():
            previous = old.get(target)
            if previous is None:
                continue
            a, b = first_number(previous), first_number(measured)
            quotient = f"{b / a:.2f}" if a and b is not None else "-"
            out.append([name, target, previous, measured, quotient])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--title", default="Before and after a change (cpu)")
    parser.add_argument("--commands", default="", help="how each run was made (one line)")
    parser.add_argument("--output", default=str(BENCHMARKS_MD))
    args = parser.parse_args(argv)
    rows = compare(args.before.read_text(), args.after.read_text())
    parts = [f"## {args.title}", ""]
    if args.commands:
        parts += [f"- runs: {args.commands}", ""]
    parts.append(table(["section", "target", "before", "after", "after / before"], rows))
    parts += [
        "",
        "`after / before` divides the first number of each cell; the cells are ratios or shares measured "
        "inside each run, so a value near 1 means the change kept that ratio.",
    ]
    emit("\n".join(parts), output=args.output, section="before-after-cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
