"""Argument types and the one-line-error parser shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from selfattn._atomic import check_folder
from selfattn.cli._names import ENCODINGS, ROTATED_AXES, ROTATING_ENCODINGS

__all__ = [
    "add_progress_flag",
    "ExamplesFormatter",
    "OneLineErrorParser",
    "add_kind_argument",
    "check_heads",
    "non_negative_int",
    "base_number",
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


#: The largest integer a flag takes: torch's int64 (a larger one failed later in a message naming no flag).
_MAX_INT = 2**63 - 1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return _at_most_int64(value, text)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return _at_most_int64(value, text)


def _at_most_int64(value: int, text: str) -> int:
    if value > _MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1 (torch's int64), got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def base_number(text: str) -> float:
    """``--base``: the 10000 of the sinusoids' and rotary's wavelengths, a finite number greater than 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number greater than 1, got {text!r}") from None
    if not 1 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number greater than 1, got {text!r}")
    return value


def add_kind_argument(parser: argparse.ArgumentParser, names: tuple[str, ...] = ENCODINGS) -> None:
    """``--kind``: the encoding, one of ``names`` (plain data: listing them does not import torch)."""
    parser.add_argument(
        "--kind",
        choices=names,
        default="sinusoidal",
        metavar="KIND",
        help="the encoding: %(choices)s (default: %(default)s)",
    )


def check_heads(kind: str, num_hiddens: int, num_heads: int) -> None:
    """Refuse ``-d`` / ``--heads`` that the encoding ``kind`` cannot split, naming the flags (not the library's names)."""
    if num_hiddens % num_heads:
        raise ValueError(
            f"-d {num_hiddens} is not divisible by --heads {num_heads} (each head takes -d / --heads features)"
        )
    head = num_hiddens // num_heads
    if kind in ROTATING_ENCODINGS and head % 2:
        raise ValueError(
            f"-d {num_hiddens} with --heads {num_heads} gives heads of {head} features; {kind} rotates features in "
            "pairs, so -d / --heads must be even"
        )
    axes = ROTATED_AXES.get(kind, 1)
    if kind in ROTATING_ENCODINGS and head < 2 * axes:
        raise ValueError(
            f"-d {num_hiddens} with --heads {num_heads} gives heads of {head} features; {kind} rotates {axes} axes "
            f"of at least 2 features each, so -d / --heads must be at least {2 * axes}"
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
