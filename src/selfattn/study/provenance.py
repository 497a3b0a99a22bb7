"""Which code made a run: recorded with every run, so that a results folder says whether its runs compare.

Numbers from two code versions (say, before and after a fix to the attention core) are not one
experiment. Every run records :func:`code_version`; the merged results list the versions their
runs came from, and the tables warn when there is more than one.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["code_version", "code_versions", "mixed_versions_warning"]

_PACKAGE = Path(__file__).resolve().parents[1]  # src/selfattn (or site-packages/selfattn)


def _git(*arguments: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(_PACKAGE), *arguments], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_version() -> str:
    """The git commit of the installed ``selfattn`` source, with ``+dirty`` when its files differ from it.

    Outside a git checkout (an installed wheel): ``selfattn <version>``.
    """
    commit = _git("rev-parse", "HEAD")
    if not commit:
        from selfattn import __version__

        return f"selfattn {__version__}"
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", str(_PACKAGE))
    return f"{commit}+dirty" if changed else commit


def code_versions(runs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The distinct code versions of ``runs`` (``"unrecorded"`` for runs made before versions were kept)."""
    return sorted({str(run.get("code_version", "unrecorded")) for run in runs})


def mixed_versions_warning(versions: list[str]) -> str | None:
    """A line for the tables when the runs come from more than one code version; None when they are one."""
    if len(versions) <= 1:
        return None
    return (
        f"WARNING: these runs come from {len(versions)} code versions ({', '.join(versions)}): they are not one "
        "experiment; rerun without --resume (or into a new folder) to compare them"
    )
