"""Atomic outputs: a file or folder is either the old one or the complete new one.

Both context managers hand out a temporary path *beside* the target (same file system, so the
final rename is atomic), move it into place only when the block finishes without an exception,
and remove it otherwise (an exception, or Ctrl-C's ``KeyboardInterrupt``). Before the rename the
new data is flushed to disk (``fsync``), and after it the folder holding the target, so a power
cut leaves the old target or the new one, not an empty file under the new name. A process
killed outright leaves at most a hidden ``.NAME.tmp-*`` entry beside the target, never a
half-written target.

Errors name the target the caller asked for, never the hidden temporary entry.

Example:
    >>> with atomic_write_path("P.npy") as tmp:   # doctest: +SKIP
    ...     numpy.save(tmp, table)                 # tmp keeps the suffix: savers that look at it work
    >>> with atomic_directory("report") as tmp:    # doctest: +SKIP
    ...     (tmp / "results.json").write_text(text)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_directory", "atomic_write_path", "check_folder", "write_json", "write_text"]


def _default_mode(directory: bool) -> int:
    # mkstemp/mkdtemp create owner-only entries; give the result the mode a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX; Windows cannot open a folder)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Some file systems refuse fsync on a folder (EINVAL); the rename itself has happened.
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def check_folder(folder: Path, what: str) -> None:
    """Refuse, in words, a ``folder`` that is a file or lies under one; ``what`` starts the message.

    Without this, the OS says "File exists" or "Not a directory" about some other path.
    """
    for ancestor in (folder, *folder.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ValueError(f"{what}: {str(ancestor)!r} is a file, not a folder")
            return


def _about(target: Path | str, error: OSError, temporary: Path | None = None) -> OSError:
    """``error`` as the caller should see it: about ``target``, never about our temporary entry.

    Without ``temporary`` the error is about ``target`` itself; with it, an error about the
    temporary entry (or something inside it) is renamed to the same place in ``target``.
    """
    if error.errno is None:
        return error
    if temporary is None:
        return OSError(error.errno, error.strerror, str(target))  # the subclass follows errno
    name, prefix = str(error.filename), str(temporary)
    if name == prefix or name.startswith(prefix + os.sep):
        return OSError(error.errno, error.strerror, str(target) + name[len(prefix) :])
    return error


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

    Raises:
        ValueError: ``path`` is a folder, or its folder is a file.
        OSError: the folder does not exist or cannot be written (``filename`` is ``path``).
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"cannot write the file {str(path)!r}: it is a folder")
    check_folder(target.parent, f"cannot write {str(path)!r}")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.stem}.tmp-", suffix=target.suffix, dir=target.parent)
    except OSError as error:
        raise _about(path, error) from None
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            yield tmp
            mode = target.stat().st_mode & 0o7777 if target.is_file() else _default_mode(directory=False)
            os.chmod(tmp, mode)
            _fsync(tmp)
            os.replace(tmp, target)
        except OSError as error:
            raise _about(path, error, tmp) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_write_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: Path | str, data: Any) -> None:
    """Write ``data`` as indented JSON (no NaN or infinity) to ``path`` atomically."""
    write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder, name))
        _fsync_directory(Path(folder))


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
        ValueError: ``path`` or one of its parents exists and is not a folder, or ``path`` is the
            working directory or one of its parents (it cannot be swapped out from under the
            running process).
        OSError: the folder cannot be created or written (``filename`` is ``path``).
    """
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{str(path)!r} exists and is not a folder")
    check_folder(Path(path).parent, f"cannot write {str(path)!r}")
    if target.exists() and Path.cwd().resolve().is_relative_to(target.resolve()):
        raise ValueError(f"{str(path)!r} is the working folder or contains it; write into a new subfolder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as error:
        raise _about(path, error) from None
    try:
        try:
            yield tmp
            os.chmod(tmp, _default_mode(directory=True))
            _fsync_tree(tmp)
        except OSError as error:
            raise _about(path, error, tmp) from None
        if not target.exists():
            os.rename(tmp, target)
            _fsync_directory(target.parent)
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
    _fsync_directory(target.parent)
    previous = old / target.name
    for entry in previous.iterdir():
        if not (target / entry.name).exists():
            os.rename(entry, target / entry.name)
    shutil.rmtree(old, ignore_errors=True)
