"""``selfattn`` entry point: argparse with one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``handler``) and a
handler ``run(args) -> int``. Errors a user can cause (a bad value, an unwritable path, a
missing optional dependency, a size that does not fit in memory) end with one line on stderr
and exit status 2, never a traceback; Ctrl-C ends with one line and exit status 130.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Sequence

import selfattn
from selfattn.cli import compare, encode, plot, rotary, study, tour
from selfattn.cli._args import ExamplesFormatter, OneLineErrorParser, stderr_line
from selfattn.cli._interrupt import interrupts_end_the_command

SUBCOMMANDS = (tour, encode, plot, compare, rotary, study)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="selfattn",
        description="Self-attention and positional encodings, checked against the textbook chapter.",
        epilog="examples:\n  selfattn tour --quick\n  selfattn encode --kind sinusoidal -n 60 -d 32 -o P.npy\n"
        "  selfattn plot --kind rotary --figure panel -o rotary.png\n  selfattn compare --n 64 128 256 512",
        formatter_class=ExamplesFormatter,
    )
    parser.add_argument("--version", action="version", version=f"selfattn {selfattn.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


# What the `cli` extra installs (pyproject.toml); torch is the library's own dependency.
_CLI_EXTRA = ("numpy", "matplotlib", "rich", "jinja2")
# The commands that need numpy, imported before torch: torch warns "Failed to initialize NumPy" on its
# own import when numpy is missing, and that warning would come before the one-line install hint.
_NEED_NUMPY = ("tour", "encode", "plot", "compare", "study")
# What torch says when a tensor cannot be allocated or a size does not fit in 64 bits.
_RESOURCE_ERROR = re.compile(r"allocat|out of memory|overflow", re.IGNORECASE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # one line, as every usage error here; --help has the usage
        commands = ", ".join(module.__name__.rsplit(".", 1)[-1] for module in SUBCOMMANDS)
        parser.error(f"choose a COMMAND: {commands} (selfattn --help shows them all)")
    try:
        if args.command in _NEED_NUMPY:
            importlib.import_module("numpy")
        with interrupts_end_the_command() as interrupts:
            status = int(args.handler(args))
        if interrupts.dropped:  # a Ctrl-C the command finished before it could be raised again
            raise KeyboardInterrupt
        return status
    except KeyboardInterrupt:
        stderr_line(f"selfattn {args.command}: interrupted")
        return INTERRUPTED
    except ImportError as error:
        # A bare "No module named 'numpy'" from an install without the extra: say which one.
        hint = (
            "; install the command line's extra: pip install 'selfattn[cli]'"
            if (error.name or "").split(".")[0] in _CLI_EXTRA
            else ""
        )
        stderr_line(f"selfattn {args.command}: error: {error}{hint}")
    except ValueError as error:
        stderr_line(f"selfattn {args.command}: error: {error}")
    except OSError as error:
        where = f": {error.filename!r}" if error.filename else ""
        stderr_line(f"selfattn {args.command}: error: {error.strerror or error}{where}")
    except (MemoryError, OverflowError) as error:
        stderr_line(f"selfattn {args.command}: error: {type(error).__name__}: {str(error) or 'out of memory'}")
    except RuntimeError as error:
        if _caused_by_interrupt(error):  # Ctrl-C in a class body of a lazy import: Python wraps it in a RuntimeError
            stderr_line(f"selfattn {args.command}: interrupted")
            return INTERRUPTED
        if not _RESOURCE_ERROR.search(str(error)):
            raise
        stderr_line(f"selfattn {args.command}: error: {str(error).strip().splitlines()[0]}")
    return 2


#: The exit status of a command ended by Ctrl-C (128 + SIGINT, what a shell reports for it).
INTERRUPTED = 130


def _caused_by_interrupt(error: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is among the causes of ``error`` (``__cause__`` or ``__context__``)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def run() -> None:
    """The process's entry point (``selfattn``, ``python -m selfattn``): :func:`main`'s status as its exit status.

    An interrupted command leaves without the interpreter's finalization. A Ctrl-C that lands in the lazy imports
    torch makes early in a tour (its FLOP counter imports ``torch._dynamo``) left some processes ending by SIGINT
    after ``main`` had caught it and returned 130 (status -2 to the parent: 3 or 4 of 40 interrupts at 0.2 to 1.8 s
    into a quick tour, measured; none of 60 leaving this way). The cleanup an interrupted command owes (its
    temporary folder) ran in its ``finally`` blocks before ``main`` returned.
    """
    status = main()
    if status == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    sys.exit(status)


if __name__ == "__main__":
    run()
