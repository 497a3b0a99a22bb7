"""The size rule for the transformers backend: no function over 80 lines (docstring included), no file over 500."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import selfattn.integrations

BACKEND = ("transformers.py", "_hf_keywords.py")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


@pytest.mark.parametrize("name", BACKEND)
def test_backend_functions_and_files_are_short(name: str) -> None:
    path = Path(selfattn.integrations.__file__).parent / name
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_FILE_LINES
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines (with their docstrings): {long}"
