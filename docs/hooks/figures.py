"""MkDocs hook: draw the user guide's figures with the installed ``selfattn`` at build time.

Each figure is one ``selfattn`` command line (the same ones a reader can run), drawn into a
temporary folder and added to the site as ``figures/NAME``; nothing is committed. A command that
fails stops the build, so the guide never shows a stale or missing figure.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.figures")

# figure file -> the selfattn command that draws it (its output path is appended).
FIGURES: dict[str, list[str]] = {
    "pe_columns.png": ["plot", "--kind", "sinusoidal", "--figure", "columns", "-n", "60", "-d", "32"],
    "pe_table.png": ["plot", "--kind", "sinusoidal", "--figure", "table", "-n", "60", "-d", "32"],
    "sinusoidal_panel.png": ["plot", "--kind", "sinusoidal", "--figure", "panel"],
    "rotary_panel.png": ["plot", "--kind", "rotary", "--figure", "panel"],
    "t5_panel.png": ["plot", "--kind", "t5", "--figure", "panel"],
    "shaw_panel.png": ["plot", "--kind", "shaw", "--figure", "panel"],
    "comparison.png": [
        "compare", "--n", "32", "64", "128", "256", "--d", "16", "32", "64", "--k", "3", "5",
        "--repeats", "3", "--no-progress", "--plot",
    ],
}  # fmt: skip


# figure file -> a figure the study drew from its runs, kept under results/ with them (hours of training, so
# copied at build time rather than drawn).
STUDY_FIGURES: dict[str, str] = {
    "text-L64-perplexity-by-position.png": "results/study-text/L64/figures/perplexity_by_position.png",
    "text-L64-context-gain.png": "results/study-text/L64/figures/context_gain.png",
    "text-L128-perplexity-by-position.png": "results/study-text/L128/figures/perplexity_by_position.png",
    "text-L128-context-gain.png": "results/study-text/L128/figures/context_gain.png",
    "text-L256-perplexity-by-position.png": "results/study-text/L256/figures/perplexity_by_position.png",
    "text-L256-context-gain.png": "results/study-text/L256/figures/context_gain.png",
    "grid-answer-use-copy.png": "results/study-synthetic/figures/answer_use_copy.png",
    "grid-answer-use-reverse.png": "results/study-synthetic/figures/answer_use_reverse.png",
}


def draw(name: str, argv: list[str], folder: Path) -> bytes:
    """Run ``selfattn ARGV FOLDER/NAME`` in this process and return the file's bytes."""
    from selfattn.cli.main import main

    target = folder / name
    argv = [*argv, str(target)] if argv[-1] == "--plot" else [*argv, "-o", str(target)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        status = main(argv)
    if status != 0 or not target.is_file():
        raise PluginError(f"`selfattn {' '.join(argv)}` exited {status}: {printed.getvalue().strip()}")
    return target.read_bytes()


def on_files(files: Files, config: Any) -> Files:
    with tempfile.TemporaryDirectory(prefix="selfattn-docs-") as folder:
        for name, argv in FIGURES.items():
            log.info("drawing figures/%s: selfattn %s", name, " ".join(argv))
            files.append(File.generated(config, f"figures/{name}", content=draw(name, argv, Path(folder))))
    root = Path(config["config_file_path"]).parent
    for name, kept in STUDY_FIGURES.items():
        if not (root / kept).is_file():
            raise PluginError(f"figures/{name}: the study's figure {kept} is missing")
        files.append(File.generated(config, f"figures/{name}", content=(root / kept).read_bytes()))
    return files


# Docstrings name other objects with Sphinx roles (:class:`~selfattn.KVCache`), which Markdown
# renders as ":class:" followed by code; show the code alone, shortened as Sphinx's "~" asks.
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)
