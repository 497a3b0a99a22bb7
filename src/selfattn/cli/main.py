"""``selfattn`` entry point: argparse with one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``handler``) and a
handler ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from selfattn.cli import tour

SUBCOMMANDS = (tour,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfattn", description="Self-attention and positional encodings, checked.")
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
    except ValueError as error:
        print(f"selfattn {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
