"""What importing selfattn costs: torch alone for the library, nothing heavy for `selfattn --help`,
and no import cycle among its modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from python_subprocess import run_python

SRC = Path(__file__).resolve().parents[1] / "src" / "selfattn"


def test_the_library_works_without_numpy_matplotlib_rich_or_jinja2() -> None:
    done = run_python(
        """
import numpy  # noqa
""",
        blocked=("numpy",),
    )
    assert done.returncode != 0 and "No module named 'numpy'" in done.stderr  # the block works
    done = run_python(
        """
import torch
import selfattn, selfattn.functional, selfattn.positional, selfattn.models, selfattn.cache
from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import build
from selfattn.models import TransformerLM

mha = MultiHeadAttention(16, 2, position=build("rotary", num_hiddens=16, num_heads=2)).eval()
x = torch.randn(2, 5, 16)
cache = KVCache(max_len=8)
with torch.no_grad():
    y = mha(x, x, x, causal=True, cache=cache)
assert y.shape == (2, 5, 16)
print(sorted(m for m in ("numpy", "matplotlib", "rich", "jinja2") if m in sys.modules))
""",
        blocked=("numpy", "matplotlib", "rich", "jinja2"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_help_and_version_import_neither_torch_nor_numpy() -> None:
    done = run_python(
        """
from selfattn.cli.main import main
for argv in (["--help"], ["--version"], ["tour", "--help"], ["compare", "--help"], ["rotary", "--help"]):
    try:
        main(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, argv
heavy = [m for m in ("torch", "numpy", "matplotlib", "rich", "jinja2") if m in sys.modules]
print("heavy:", heavy)
"""
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "heavy: []"


def test_a_command_without_the_cli_extra_says_which_extra_to_install(tmp_path: Path) -> None:
    done = run_python(
        f"""
from selfattn.cli.main import main
sys.exit(main(["encode", "-o", {str(tmp_path / "P.npy")!r}]))
""",
        blocked=("numpy",),
    )
    assert done.returncode == 2
    assert done.stderr == (
        "selfattn encode: error: No module named 'numpy'; install the command line's extra: pip install 'selfattn[cli]'\n"
    )


def test_names_load_on_first_use_and_attention_stays_the_function() -> None:
    done = run_python(
        """
import selfattn
assert "torch" not in sys.modules and selfattn.__version__
import selfattn.models  # loads the submodule selfattn.attention as a side effect
from selfattn import attention, MultiHeadAttention, SinusoidalPositionalEncoding
from selfattn.functional import attention as functional_attention
from selfattn.attention import MultiHeadAttention as home
assert attention is functional_attention and selfattn.attention is functional_attention
assert MultiHeadAttention is home and SinusoidalPositionalEncoding.__module__ == "selfattn.positional.sinusoidal"
assert set(selfattn.__all__) <= set(dir(selfattn)) and "__version__" in dir(selfattn)
assert not {"sys", "types", "importlib", "Any", "TYPE_CHECKING", "annotations"} & set(dir(selfattn)), dir(selfattn)
namespace = {}
exec("from selfattn import *", namespace)
assert set(selfattn.__all__) <= set(namespace)
try:
    selfattn.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("no AttributeError")
"""
    )
    assert done.returncode == 0, done.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """selfattn module -> the selfattn modules it imports, at the top or inside a function, and the packages above
    each (importing ``a.b.c`` runs ``a.b``'s ``__init__`` first); imports for type checkers alone are left out."""
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in _run_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        imported |= {".".join(other.split(".")[:end]) for other in imported for end in range(2, other.count(".") + 1)}
        graph[name] = {
            other for other in imported if other in modules and other != name and not name.startswith(f"{other}.")
        }
    return graph


def _run_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` outside ``if TYPE_CHECKING:`` blocks (never run)."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``, one per strongly connected group of more than one module."""
    order: list[str] = []
    seen: set[str] = set()
    for start in graph:  # finishing order (iterative depth-first search)
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, children = stack[-1]
            child = next((c for c in children if c not in seen), None)
            if child is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(child)
                stack.append((child, iter(sorted(graph[child]))))
    reverse: dict[str, set[str]] = {name: set() for name in graph}
    for name, targets in graph.items():
        for target in targets:
            reverse[target].add(name)
    groups, assigned = [], set()
    for root in reversed(order):  # Kosaraju: each search on the reversed graph is one group
        if root in assigned:
            continue
        group, todo = [], [root]
        assigned.add(root)
        while todo:
            node = todo.pop()
            group.append(node)
            for other in reverse[node] - assigned:
                assigned.add(other)
                todo.append(other)
        if len(group) > 1:
            groups.append(sorted(group))
    return groups


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_selfattn_modules() -> None:
    assert cycles(import_graph()) == []


def test_a_route_imported_before_anything_else_loads() -> None:
    """Importing a route's module first runs ``selfattn.functional``'s ``__init__`` before the route's own imports
    finish: the package's names load on first use, so that leads back to no half-loaded module."""
    for first in ("selfattn.core.routes._decode", "selfattn.core.routes.key_row", "selfattn.core.dispatch"):
        done = run_python(f"import {first}\nfrom selfattn.functional import attention\nprint(attention.__module__)")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "selfattn.functional._attention"


def test_every_name_of_the_functional_package_loads_from_its_home() -> None:
    import importlib

    import selfattn.functional as functional

    homes = functional._HOMES
    assert set(homes) == set(functional.__all__)
    for name, home in homes.items():
        assert getattr(functional, name) is getattr(importlib.import_module(home), name)
    namespace: dict[str, object] = {}
    exec("from selfattn.functional import *", namespace)
    assert set(functional.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no_such_name"):
        functional.no_such_name  # noqa: B018
