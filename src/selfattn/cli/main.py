"""``selfattn`` entry point: argparse with one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``handler``) and a
handler ``run(args) -> int``. Errors a user can cause (a bad value, an unwritable path, a
missing optional dependency) end with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from selfattn.cli import compare, encode, plot, tour
from selfattn.cli import rotary
from selfattn.cli._args import ExamplesFormatter, OneLineErrorParser, stderr_line

SUBCOMMANDS = (tour, encode, plot, compare)
SUBCOMMANDS += (rotary,)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="selfattn",
        description="Self-attention and positional encodings, checked against the textbook chapter.",
        epilog="examples:\n  selfattn tour --quick\n  selfattn encode --kind sinusoidal -n 60 -d 32 -o P.npy\n"
        "  selfattn plot --kind rotary --figure panel -o rotary.png\n  selfattn compare --n 64 128 256 512",
        formatter_class=ExamplesFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args))
    except (ValueError, ImportError) as error:
        stderr_line(f"selfattn {args.command}: error: {error}")
    except OSError as error:
        where = f": {error.filename!r}" if error.filename else ""
        stderr_line(f"selfattn {args.command}: error: {error.strerror or error}{where}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
