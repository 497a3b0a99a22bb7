"""``selfattn compare``: the measured CNN / RNN / self-attention table (the tour's section 3)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from selfattn._atomic import atomic_write_path
from selfattn.cli._args import (
    ExamplesFormatter,
    OneLineErrorParser,
    add_progress_flag,
    positive_int,
    require_memory,
    require_output,
)


def add_parser(subparsers: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="measure CNN vs RNN vs self-attention: FLOPs, sequential ops, path lengths, time",
        description=(
            "Measure the chapter's comparison on real layers: FLOPs counted by PyTorch's flop counter over sweeps "
            "of n, d and k with fitted exponents, the longest chain of dependent matrix products, the maximum path "
            "length read off gradients, and forward wall-clock time. Prints the table; --json and --plot save it."
        ),
        epilog="examples:\n  selfattn compare\n  selfattn compare --n 64 128 256 512 --d 16 32 64 --k 3 5 7 9\n"
        "  selfattn compare --json comparison.json --plot comparison.png",
        formatter_class=ExamplesFormatter,
    )
    parser.add_argument(
        "--n",
        type=positive_int,
        nargs="+",
        default=[16, 32, 64, 128, 256],
        metavar="N",
        help="sequence lengths (at least two; default 16 32 64 128 256)",
    )
    parser.add_argument(
        "--d",
        type=positive_int,
        nargs="+",
        default=[8, 16, 32, 64],
        metavar="D",
        help="feature sizes (at least two; default 8 16 32 64)",
    )
    parser.add_argument(
        "--k",
        type=positive_int,
        nargs="+",
        default=[3, 5, 7],
        metavar="K",
        help="CNN kernel widths, each >= 2 (default 3 5 7)",
    )
    parser.add_argument("--fixed-d", type=positive_int, default=32, help="d while n varies (default 32)")
    parser.add_argument("--fixed-n", type=positive_int, default=64, help="n while d or k varies (default 64)")
    parser.add_argument("--fixed-k", type=positive_int, default=3, help="k while n or d varies (default 3)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per point (default 3)")
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="times the timing sweep is repeated, for its spread (default 3)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE", help="also draw the log-log figure (.png/.svg)"
    )
    add_progress_flag(parser)
    parser.set_defaults(handler=run)


def _check_size(args: argparse.Namespace) -> None:
    """Refuse a sweep whose largest layer cannot fit in memory, before measuring anything."""
    points = (
        [(n, args.fixed_d, args.fixed_k) for n in args.n]
        + [(args.fixed_n, d, args.fixed_k) for d in args.d]
        + [(args.fixed_n, args.fixed_d, k) for k in args.k]
    )
    # float32 weights of the CNN (k d^2) or of attention (4 d^2) plus its (n, n) weights and (n, d)
    # input, each held about three times over (values, gradients, the flop counter's copies).
    need, (n, d, k) = max((12 * max(k * d * d, 4 * d * d + n * n + n * d), (n, d, k)) for n, d, k in points)
    require_memory(f"the layers at n={n}, d={d}, k={k}", need)


def wall_clock_lines(results: dict[str, Any]) -> list[str]:
    """The forward pass's wall-clock time per layer over the n sweep, and the exponent fitted to it."""
    from selfattn.tour import comparison

    ns = results["sweep"]["n"]
    lines = [f"forward wall-clock on this machine, median ms at n = {' '.join(str(n) for n in ns)}:"]
    for kind in comparison.KINDS:
        entry, label = results[kind], comparison.CHAPTER[kind]["label"]
        times = "".join(f"{seconds * 1e3:<9.3g}" for seconds in entry["seconds_by_n"])
        low, high = entry["time_exponent_spread"]
        lines.append(
            f"{label:<16}{times}~ n^{entry['time_exponent_n']:.2f} (rounds {low:.2f}..{high:.2f}, "
            f"fitted from n={entry['time_fit_from_n']})"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from selfattn.tour import comparison
    from selfattn.tour.runner import comparison_lines, progress_bar

    if args.plot is not None:
        require_output("--plot", args.plot, (".png", ".svg"))
    if args.json is not None:
        require_output("--json", args.json, (".json",))
    for flag, values in (("--n", args.n), ("--d", args.d), ("--k", args.k)):
        if len(set(values)) < 2:
            raise ValueError(f"{flag} needs at least two different values to fit an exponent, got {values}")
    if min(args.n) < 2 or min([*args.k, args.fixed_k]) < 2:
        raise ValueError(
            f"--n and --k values must be at least 2, got --n {args.n} --k {args.k} --fixed-k {args.fixed_k}"
        )
    _check_size(args)
    if args.plot is not None:
        from selfattn.tour import figures  # fail before measuring when matplotlib is missing
    steps = comparison.comparison_steps(sorted(set(args.n)), sorted(set(args.d)), sorted(set(args.k)), args.rounds)
    with progress_bar(steps, args.progress and sys.stderr.isatty(), label="selfattn compare") as advance:
        results = comparison.compare(
            args.n,
            args.d,
            args.k,
            fixed_hiddens=args.fixed_d,
            fixed_steps=args.fixed_n,
            fixed_kernel=args.fixed_k,
            repeats=args.repeats,
            rounds=args.rounds,
            progress=advance,
        )
    print("\n".join([*comparison_lines(results), "", *wall_clock_lines(results)]))
    if args.json is not None:
        with atomic_write_path(args.json) as tmp:
            tmp.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    if args.plot is not None:
        figure = figures.comparison_figure(results)
        with atomic_write_path(args.plot) as tmp:
            figure.savefig(tmp, dpi=110)
        print(f"wrote {args.plot}")
    return 0
