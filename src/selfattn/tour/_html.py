"""HTML of the report's figures, shared by the report's templates and the sections written in Python (depth)."""

from __future__ import annotations

import html

__all__ = ["figure_html", "panel_names"]


def panel_names(figures: dict[str, str], name: str) -> list[str]:
    """The figures drawn as separate panels of ``name`` (saved as ``name-part``), in the order drawn."""
    return [key for key in figures if key.startswith(f"{name}-")]


def _svg(png: str) -> str:
    return png[: -len(".png")] + ".svg"


def figure_html(figures: dict[str, str], name: str, caption: str, *, panel_width: int = 300) -> str:
    """A ``<figure>`` for ``name``: one image, or its panels in a row that wraps.

    Panels sit side by side while each gets at least ``panel_width`` px and wrap one under the
    other below that, so a narrow window shows each panel at a readable size instead of
    shrinking all of them. Empty when the figure was not drawn.
    """
    e = html.escape
    if name in figures:
        png = figures[name]
        return (
            f'<figure id="fig-{e(name)}"><a href="{e(_svg(png))}"><img src="{e(png)}" alt="{e(caption)}"></a>'
            f'<figcaption>{e(caption)} (<a href="{e(_svg(png))}">SVG</a>)</figcaption></figure>'
        )
    parts = panel_names(figures, name)
    if not parts:
        return ""
    labels = [part[len(name) + 1 :].replace("_", " ") for part in parts]
    images = "".join(
        f'<a href="{e(_svg(figures[part]))}"><img src="{e(figures[part])}" alt="{e(caption)}: {e(label)}"></a>'
        for part, label in zip(parts, labels, strict=True)
    )
    svgs = ", ".join(
        f'<a href="{e(_svg(figures[part]))}">{e(label)}</a>' for part, label in zip(parts, labels, strict=True)
    )
    return (
        f'<figure id="fig-{e(name)}" class="panels"><div class="panel-row" style="--panel: {panel_width}px">'
        f"{images}</div><figcaption>{e(caption)} (SVG: {svgs})</figcaption></figure>"
    )
