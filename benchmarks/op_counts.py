"""Which operators one forward+backward of each positional row runs, and how often: a check of two commits that
does not depend on the machine's speed.

Timings on a shared machine drift by tens of percent between processes; when two commits' timings
disagree, the operators they run decide whether one does more work. Run the script once per
commit (each with its own ``src`` first on ``PYTHONPATH``), each writing a JSON file, then compare::

    PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/op_counts.py --output before.json
    .venv/bin/python benchmarks/op_counts.py --output after.json
    .venv/bin/python benchmarks/op_counts.py --compare before.json after.json [--section]

With ``--section`` the comparison is also written as the section ``op-counts-cpu`` of BENCHMARKS.md.

The rows are ``benchmarks/positional.py``'s own (its ``contender``: ``MultiHeadAttention`` with
the encoding in place, training mode), at b=2, d=512, 8 heads and a small n (the operators do not
depend on n except through the block count of the blockwise path, which ``--n`` sets).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import positional
from _common import BENCHMARKS_MD, emit, machine_lines

SECTION = "op-counts-cpu"

DEFAULT_ROWS = "(no encoding),rotary,alibi,t5,kerple,fire,shaw (keys only)"


def op_counts(label: str, name: str | None, options: dict, n: int) -> dict[str, int]:
    """``aten::``/``selfattn::`` operator -> calls in one forward+backward of row ``label`` (after one warm-up)."""
    torch.manual_seed(0)
    encoding = None if name is None else positional.make_encoding(name, options, n)
    _, call = positional.contender(encoding, torch.device("cpu"))
    x = torch.randn(positional.BATCH, n, positional.NUM_HIDDENS, requires_grad=True)
    call(x).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(x).sum().backward()
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith(("aten::", "selfattn::")))
    return dict(sorted(counts.items()))


def compare(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> str:
    """One line per row: total calls before and after, and each operator whose count differs."""
    lines = []
    for label in before:
        if label not in after:
            lines.append(f"{label}: only in the first file")
            continue
        old, new = before[label], after[label]
        changed = {
            op: (old.get(op, 0), new.get(op, 0)) for op in sorted({*old, *new}) if old.get(op, 0) != new.get(op, 0)
        }
        shown = ", ".join(f"{op} {a} -> {b}" for op, (a, b) in changed.items()) or "the same operators, the same counts"
        lines.append(f"{label}: {sum(old.values())} -> {sum(new.values())} calls; {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated row labels (default {DEFAULT_ROWS!r})")
    parser.add_argument("--n", type=int, default=512, help="sequence length (default 512)")
    parser.add_argument("--output", help="JSON file to write (default: print)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two files written before")
    parser.add_argument(
        "--section", action="store_true", help=f"with --compare: write section {SECTION} of {BENCHMARKS_MD.name}"
    )
    args = parser.parse_args(argv)
    if args.compare:
        files = [json.loads(Path(path).read_text()) for path in args.compare]
        report = "\n".join(
            [
                "## Operators of one forward+backward per positional row, two commits (cpu)",
                "",
                *machine_lines(torch.device("cpu")),
                f"- files: `{args.compare[0]}` (before) and `{args.compare[1]}` (after), each written by this script",
                "",
                "Per row: operator calls before -> after, and every operator whose count changed "
                "(the rows of `benchmarks/positional.py`, b=2, d=512, 8 heads, training mode):",
                "",
                *(f"- {line}" for line in compare(*files).splitlines()),
                "",
            ]
        )
        emit(report, output=str(BENCHMARKS_MD) if args.section else None, section=SECTION)
        return 0
    wanted = args.rows.split(",")
    counts = {
        label: op_counts(label, name, options, args.n) for label, name, options in positional.specs() if label in wanted
    }
    text = json.dumps(counts, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
