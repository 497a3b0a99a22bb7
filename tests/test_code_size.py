"""The library's size rule: no file over 500 lines, no function over 80 (docstring included), a short layer constructor.

The applications built on the library (the tour, the study, the command line) are not held to it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import selfattn
from selfattn import MultiHeadAttention

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_LAYER_INIT_LINES = 40
ROOT = Path(selfattn.__file__).parent
APPLICATIONS = ("tour", "study", "cli")
LIBRARY = sorted(
    path for path in ROOT.rglob("*.py") if path.relative_to(ROOT).parts[0] not in APPLICATIONS
)  # fmt: skip


@pytest.mark.parametrize("path", LIBRARY, ids=lambda path: str(path.relative_to(ROOT)))
def test_files_and_functions_are_short(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(text.splitlines())} lines"
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines (with their docstrings): {long}"


def test_the_layer_constructor_is_short() -> None:
    lines = inspect.getsource(MultiHeadAttention.__init__).splitlines()
    assert len(lines) <= MAX_LAYER_INIT_LINES, f"MultiHeadAttention.__init__ has {len(lines)} lines"
