"""Atomic outputs: a file or folder is either the old one or the complete new one.

Both context managers hand out a temporary path *beside* the target (same file system, so the
final rename is atomic), move it into place only when the block finishes without an exception,
and remove it otherwise (an exception, or Ctrl-C's ``KeyboardInterrupt``). A process killed
outright leaves at most a hidden ``.NAME.tmp-*`` entry beside the target, never a half-written
target.

Example:
    >>> with atomic_write_path("P.npy") as tmp:   # doctest: +SKIP
    ...     numpy.save(tmp, table)                 # tmp keeps the suffix: savers that look at it work
    >>> with atomic_directory("report") as tmp:    # doctest: +SKIP
    ...     (tmp / "results.json").write_text(text)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_directory", "atomic_write_path"]


def _default_mode(directory: bool) -> int:
    # mkstemp/mkdtemp create owner-only entries; give the result the mode a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@contextlib.contextmanager
def atomic_write_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; on success it replaces ``path`` atomically.

    The temporary name ends in the target's suffix (``.npy``, ``.png``...), so writers that pick
    a format from the extension behave as they would on the target. An existing target keeps
    its permissions.

    Args:
        path: the file to write.

    Yields:
        The temporary path to write to (it exists, empty).
    """
    target = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{target.stem}.tmp-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        mode = target.stat().st_mode & 0o7777 if target.is_file() else _default_mode(directory=False)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(path: Path | str) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it takes the place of ``path``.

    The old folder, if any, is swapped out by two renames and then removed. Top-level entries
    of the old folder that the new one does not have (files a user put there) are carried over
    into the new folder rather than deleted.

    Args:
        path: the folder to (re)create.

    Yields:
        The temporary folder to fill (it exists, empty).

    Raises:
        ValueError: ``path`` exists and is not a folder, or is the working directory or one of
            its parents (it cannot be swapped out from under the running process).
    """
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{str(path)!r} exists and is not a folder")
    if target.exists() and Path.cwd().resolve().is_relative_to(target.resolve()):
        raise ValueError(f"{str(path)!r} is the working folder or contains it; write into a new subfolder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, _default_mode(directory=True))
        if not target.exists():
            os.rename(tmp, target)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / target.name)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old / target.name, target)  # put the old folder back
            old.rmdir()
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    previous = old / target.name
    for entry in previous.iterdir():
        if not (target / entry.name).exists():
            os.rename(entry, target / entry.name)
    shutil.rmtree(old, ignore_errors=True)
