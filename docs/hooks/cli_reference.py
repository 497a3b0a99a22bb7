"""MkDocs hook: the command line's reference, generated from its argparse parsers at build time.

docs/cli.md holds the line ``<!-- cli-reference -->``; this hook replaces it with the help of
``selfattn`` and of every subcommand, exactly as ``selfattn COMMAND --help`` prints it, so the
page can never disagree with the installed command.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-reference -->"
WIDTH = "100"  # argparse wraps to $COLUMNS: a fixed width gives the same page on every machine


def _help_text(parser: argparse.ArgumentParser) -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return parser.format_help().rstrip()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def reference() -> str:
    """Markdown: one section per command, its help in a code block."""
    from selfattn.cli.main import build_parser

    parser = build_parser()
    sections = ["## selfattn", "", "```text", _help_text(parser), "```", ""]
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for name, subparser in commands.choices.items():
        sections += [f"## selfattn {name}", "", "```text", _help_text(subparser), "```", ""]
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "cli.md":
        return markdown
    if MARKER not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/cli.md lost its {MARKER} line: the command reference has nowhere to go")
    return markdown.replace(MARKER, reference())
