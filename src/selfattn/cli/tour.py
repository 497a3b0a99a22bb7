"""``selfattn tour``: the chapter reproduced and checked, with figures and an HTML report."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from selfattn._atomic import atomic_directory
from selfattn.cli._args import ExamplesFormatter, OneLineErrorParser, add_progress_flag


def add_parser(subparsers: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    parser: OneLineErrorParser = subparsers.add_parser(
        "tour",
        help="walk through the chapter, checking each claim; writes an HTML report",
        description=(
            "Run the chapter's cells and check each claim on real numbers: self-attention, permutation, a measured "
            "CNN/RNN/self-attention comparison, the positional encoding and its absolute and relative properties, "
            "every encoding of selfattn.positional, and the exercises. Writes DIR/report.html, DIR/figures/*.png "
            "and *.svg and DIR/results.json, and prints a summary. Exit status 1 if a check fails."
        ),
        epilog="examples:\n  selfattn tour\n  selfattn tour --quick --out /tmp/report\n"
        "  selfattn tour --out report --no-progress > summary.txt",
        formatter_class=ExamplesFormatter,
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("selfattn-report"),
        help="output folder (default: ./selfattn-report)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller sweeps: a smoke test of every section, not a measurement"
    )
    parser.add_argument(
        "--study", metavar="DIR", type=Path, default=None,
        help="a `selfattn study` output folder: the report also shows its trained models (the grid's results, "
        "the deep stacks, and `selfattn study --exercises`) (default: $SELFATTN_STUDY or ./selfattn-study, if there)",
    )  # fmt: skip
    add_progress_flag(parser)
    parser.set_defaults(handler=run)


@contextlib.contextmanager
def report_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` that takes its place once the report is complete.

    Interrupted or failed, the old report (if any) stays as it was, whole.
    """
    with contextlib.ExitStack() as stack:
        try:
            tmp = stack.enter_context(atomic_directory(out))
        except OSError as error:
            reason = error.strerror or type(error).__name__
            raise ValueError(f"cannot write the report to {str(out)!r}: {reason}") from None
        yield tmp


def check_study_folder(study: Path | None) -> None:
    """Refuse a ``--study`` that is not the output folder of ``selfattn study``, naming the flag."""
    if study is None:
        return
    if not study.is_dir():
        raise ValueError(f"--study {str(study)!r}: no such folder (give the --out folder of `selfattn study`)")
    if not any((study / name).is_file() for name in ("results.json", "exercises.json")):
        raise ValueError(
            f"--study {str(study)!r} holds neither results.json nor exercises.json: it is not the --out folder of a "
            "finished `selfattn study`"
        )


def run(args: argparse.Namespace) -> int:
    from selfattn.tour.runner import run_tour

    check_study_folder(args.study)
    from selfattn.tour.summary import print_summary

    with report_folder(args.out) as folder:
        results = run_tour(
            folder,
            quick=args.quick,
            progress=args.progress and sys.stderr.isatty(),
            study=args.study,
            shown_as=args.out,
        )
    print_summary(results, args.out / "report.html")
    return 0 if all(check["ok"] for check in results["checks"]) else 1
