"""Argument types and the one-line-error parser shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn

from selfattn._atomic import check_folder

__all__ = [
    "add_progress_flag",
    "ExamplesFormatter",
    "LazyChoices",
    "OneLineErrorParser",
    "kind_names",
    "add_kind_argument",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "require_memory",
    "require_output",
    "stderr_line",
]


class ExamplesFormatter(argparse.HelpFormatter):
    """Wraps descriptions to the terminal but keeps an ``examples:`` epilog line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are a single line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


class LazyChoices:
    """An argparse ``choices`` read from a module only when argparse checks or shows them.

    The names of encodings and tasks live in modules that import torch; building every
    subcommand's parser (``selfattn --help``) must not. Give the argument a ``metavar`` (argparse
    lists ``choices`` in its usage line otherwise) and name them in the help with ``%(choices)s``.
    """

    def __init__(self, load: Callable[[], Iterable[str]]) -> None:
        self._load = load
        self._names: tuple[str, ...] | None = None

    def _loaded(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = tuple(self._load())
        return self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()


def _registry_names() -> Iterable[str]:
    from selfattn.positional import NAMES

    return NAMES


def kind_names() -> LazyChoices:
    """Encodings :func:`selfattn.positional.build` knows, loaded when first needed."""
    return LazyChoices(_registry_names)


def add_kind_argument(parser: argparse.ArgumentParser) -> None:
    """``--kind``: the encoding, one of the registry's names (listed lazily: torch loads only when asked)."""
    parser.add_argument(
        "--kind",
        choices=kind_names(),
        default="sinusoidal",
        metavar="KIND",
        help="the encoding: %(choices)s (default: %(default)s)",
    )


def stderr_line(message: str) -> None:
    """Print one line to stderr (newlines in the message are folded)."""
    print(" ".join(str(message).split()), file=sys.stderr)


def require_output(flag: str, path: Path, suffixes: tuple[str, ...]) -> Path:
    """Check an output path before any work: a known extension, and a folder that takes a new file."""
    if path.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} must end in {' or '.join(suffixes)}, got {str(path)!r}")
    folder = path.parent
    check_folder(folder, f"{flag} {str(path)!r}")
    if not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: the folder {str(folder)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder, not a file")
    try:  # the file is written beside its target first (atomic_write_path): try that now, not after the work
        fd, probe = tempfile.mkstemp(prefix=".selfattn-write-test-", dir=folder)
    except OSError as error:
        raise ValueError(
            f"{flag} {str(path)!r}: cannot write into {str(folder)!r}: {error.strerror or error}"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--no-progress``: the bar is drawn only when stderr is a terminal anyway."""
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (it is shown only when stderr is a terminal)",
    )


def _available_memory() -> int | None:
    """Bytes of memory a new allocation can have: Linux's MemAvailable, else all RAM, else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _human(num_bytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if num_bytes < 1024 or unit == "PiB":
            return f"{num_bytes:.0f} {unit}" if unit == "bytes" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def require_memory(what: str, num_bytes: int) -> None:
    """Refuse, before allocating, work that would need more memory than is available now."""
    available = _available_memory()
    if available is not None and num_bytes > available:
        raise ValueError(f"{what} would need about {_human(num_bytes)} of memory; {_human(available)} is available")
