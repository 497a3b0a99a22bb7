"""The built documentation site renders every public name, the command line's reference and the routes page.

A name counts as rendered when the site's inventory (``objects.inv``, written by mkdocstrings)
holds it under its public path, or under another path that imports as the very same object (a
re-export such as ``selfattn.attention``, rendered as ``selfattn.functional.attention``).
"""

from __future__ import annotations

import importlib
import zlib
from pathlib import Path
from typing import Any

import pytest

import selfattn

# The modules a user imports; every name of their __all__ must be in the reference.
PUBLIC_MODULES = (
    "selfattn",
    "selfattn.functional",
    "selfattn.positional",
    "selfattn.masks",
    "selfattn.parts",
    "selfattn.latent",
    "selfattn.sparse",
    "selfattn.nn",
    "selfattn.cache",
    "selfattn.models",
    "selfattn.integrations.transformers",
    "selfattn.integrations.from_transformers",
    "selfattn.integrations.families",
    "selfattn.core.explanation",
    "selfattn.study.tasks",
    "selfattn.study.deep_stack",
    "selfattn.study.corpus",
    "selfattn.study.text",
)


def inventory(site: Path) -> set[str]:
    """The object paths of a Sphinx-format ``objects.inv`` (four header lines, then zlib-compressed lines)."""
    header_and_body = (site / "objects.inv").read_bytes().split(b"\n", 4)
    body = zlib.decompress(header_and_body[4]).decode("utf-8")
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def resolve(path: str) -> Any:
    """The object at a dotted path (a module, then attributes), or a sentinel when it does not import."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return object()
        return value
    return object()


def test_the_inventory_reader_reads_names(site: Path) -> None:
    assert "selfattn.MultiHeadAttention" in inventory(site)


def test_every_public_subpackage_is_checked() -> None:
    subpackages = {f"selfattn.{name}" for name in selfattn._SUBPACKAGES if name not in ("attention", "integrations")}
    assert subpackages <= set(PUBLIC_MODULES)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_rendered(site: Path, module_name: str) -> None:
    paths = inventory(site)
    module = importlib.import_module(module_name)
    missing = []
    for name in module.__all__:
        if f"{module_name}.{name}" in paths:
            continue
        target = getattr(module, name)
        others = [path for path in paths if path.rsplit(".", 1)[-1] == name]
        if not any(resolve(path) is target for path in others):
            missing.append(name)
    assert missing == [], f"{module_name}: not in the API reference: {missing}"


def test_the_command_line_page_is_generated_from_argparse(site: Path) -> None:
    from selfattn.cli.main import SUBCOMMANDS

    page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "cli-reference" not in page  # the marker was replaced
    for module in SUBCOMMANDS:
        command = module.__name__.rsplit(".", 1)[-1]
        assert f"selfattn {command}" in page and f"usage: selfattn {command}" in page, command
    assert "--encodings" in page and "--head-dim" in page  # options, as argparse prints them


def test_explain_links_to_a_page_of_the_site(site: Path) -> None:
    from selfattn.core.explanation import ROUTES_PAGE, route_anchor

    page = (site / Path(ROUTES_PAGE).relative_to("docs").with_suffix("") / "index.html").read_text(encoding="utf-8")
    for route in ("fused", "blockwise band", "explicit softcap/sinks"):
        assert f'id="{route_anchor(route)}"' in page, route
