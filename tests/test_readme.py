"""Every ```python block of README.md and of the docs pages runs as written, each on its own.

A reader copies one block into a fresh interpreter, so each block gets a fresh namespace (no
names leak from the blocks above it) and runs in an empty working directory. Blocks that show
shell commands use ```sh and are not run here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# A fence opens with ```python (or ```py) alone on its line and closes with ``` alone on its line.
_BLOCK = re.compile(r"^```(?:python|py)[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of each ```python block in ``text``."""
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in _BLOCK.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
ALL_BLOCKS = [
    (page.relative_to(ROOT).as_posix(), line, source)
    for page in PAGES
    for line, source in python_blocks(page.read_text(encoding="utf-8"))
]


def test_block_extraction_finds_the_quickstart_and_ignores_shell_blocks() -> None:
    sample = "text\n```sh\nmake test\n```\n```python\nx = 1\n```\n```py\ny = 2\n```\n"
    assert python_blocks(sample) == [(6, "x = 1\n"), (9, "y = 2\n")]
    assert len(BLOCKS) >= 3, "README.md should show at least the quickstart, functional and cache blocks"
    assert any("MultiHeadAttention" in source for _, source in BLOCKS)


@pytest.mark.parametrize(("page", "line", "source"), ALL_BLOCKS, ids=[f"{page}:{line}" for page, line, _ in ALL_BLOCKS])
def test_python_block_runs(page: str, line: int, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{page} (python block at line {line})", "exec")
    exec(code, {"__name__": "__readme__"})
