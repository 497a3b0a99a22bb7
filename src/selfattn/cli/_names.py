"""The names the subcommands offer as choices, as plain data.

The registries that own these names (:data:`selfattn.positional.NAMES`, the study's tasks and text
encodings) live in modules that import torch; ``selfattn study --help`` must answer without it, so
the names are written here and tests/test_cli_ux.py checks they match the registries.
"""

from __future__ import annotations

__all__ = [
    "ENCODINGS",
    "PLOT_ENCODINGS",
    "ROTATED_AXES",
    "ROTATING_ENCODINGS",
    "STUDY_ENCODINGS",
    "TASKS",
    "TEXT_ONLY_ENCODINGS",
    "TEXT_STUDY_ENCODINGS",
]

# selfattn.positional.NAMES, in its order.
ENCODINGS = (
    "none", "sinusoidal", "learned", "rotary", "alibi", "t5", "shaw", "sinusoidal2d", "sinusoidal3d",
    "xpos", "rotary2d", "rotary3d", "kerple", "fire", "mrope",
)  # fmt: skip
# `plot` draws figures on one line of text positions, where M-RoPE (time = height = width = the index)
# is half-split rotary: its scores would be rotary's, so it is not offered (the tour leaves it out too).
PLOT_ENCODINGS = tuple(name for name in ENCODINGS if name != "mrope")
# selfattn.study.tasks.TASKS.
TASKS = ("copy", "reverse", "sort", "addition", "flipflop")
# selfattn.study.text.TEXT_ENCODINGS: the text study's encodings; the grid takes all but the text-only ones.
TEXT_STUDY_ENCODINGS = (
    "none", "sinusoidal", "learned", "rotary", "p-rope", "p-rope-scaled", "xpos", "xpos-scaled", "alibi", "kerple",
    "fire", "t5", "shaw", "t5-short", "alibi-8-heads",
)  # fmt: skip
TEXT_ONLY_ENCODINGS = ("t5-short", "alibi-8-heads")
STUDY_ENCODINGS = tuple(name for name in TEXT_STUDY_ENCODINGS if name not in TEXT_ONLY_ENCODINGS)
# The encodings that rotate each head's features in pairs (selfattn.positional.registry.acts_on(kind)
# == "query_key"), and the axes each of the multi-axis ones splits a head into.
ROTATING_ENCODINGS = ("rotary", "xpos", "rotary2d", "rotary3d", "mrope")
ROTATED_AXES = {"rotary2d": 2, "rotary3d": 3}
