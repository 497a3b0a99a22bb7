"""Atomic writes: a reader (or a kill) sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["temporary_name", "write_json", "write_text"]


def temporary_name(path: Path) -> Path:
    """A sibling of ``path`` for writing before :func:`os.replace` (same suffix, for matplotlib)."""
    return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")


def write_text(path: Path, text: str) -> None:
    tmp = temporary_name(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
