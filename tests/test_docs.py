"""The documentation site builds with every warning treated as an error, as `make docs` does.

The build documents this checkout (``src/`` first on the path) and draws the user guide's
figures with it (``docs/hooks/figures.py``), so a broken docstring reference, a missing page
or a figure command that no longer runs fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
pytest.importorskip(
    "mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed: pip install -e '.[docs]'"
)


# `site`: the site built once per test session (tests/conftest.py), shared with test_docs_coverage.py.


def test_api_reference_is_built_from_the_docstrings(site: Path) -> None:
    functional = (site / "api" / "functional" / "index.html").read_text(encoding="utf-8")
    for name in ("sinusoidal_table", "attention_weights", "causal_mask", "relative_shift"):
        assert f'id="selfattn.functional.{name}"' in functional, name
    # A sentence of a docstring, rendered: the reference is not just a list of names.
    assert "lower-right" in functional
    attention = (site / "api" / "attention" / "index.html").read_text(encoding="utf-8")
    assert 'id="selfattn.MultiHeadAttention"' in attention and 'id="selfattn.KVCache"' in attention
    positional = (site / "api" / "positional" / "index.html").read_text(encoding="utf-8")
    for name in ("SinusoidalPositionalEncoding", "RotaryPositionalEncoding", "ALiBiPositionalBias", "build"):
        assert f'id="selfattn.positional.{name}"' in positional, name


def test_user_guide_figures_are_drawn_at_build_time(site: Path) -> None:
    spec = importlib.util.spec_from_file_location("docs_figures_hook", ROOT / "docs" / "hooks" / "figures.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    guide = (site / "guide" / "index.html").read_text(encoding="utf-8")
    for name in hook.FIGURES:  # the hook's own list of figures
        figure = site / "figures" / name
        assert figure.read_bytes().startswith(PNG_MAGIC), name
        assert figure.stat().st_size > 10_000, f"{name} is too small to be a drawn figure"
        assert f'src="../figures/{name}"' in guide, f"the guide does not show figures/{name}"
    assert not list((ROOT / "docs").rglob("*.png")), "figures are drawn at build time, never committed"


def test_docstring_roles_render_as_code(site: Path) -> None:
    attention = (site / "api" / "attention" / "index.html").read_text(encoding="utf-8")
    assert ":class:" not in attention and ":func:" not in attention
    assert "<code>KVCache</code>" in attention  # from :class:`~selfattn.KVCache`
