"""Add the readings a text grid's runs were trained without, from their final checkpoints, and rebuild its tables.

    .venv/bin/python results/study-text/reevaluate.py GRID CHECKPOINTS

GRID is a folder of the text study (``L64``: ``config.json``, ``runs/``, ``results.json``); CHECKPOINTS holds the
runs' final checkpoints (``text-ENCODING-sSEED.pt``, as the study wrote them). For each run without them, the
sliding-window reading (``sliding_gain``) and, for rotary, each scaling's context gain (``scaling_context_gain``)
are computed on the trained weights (:func:`selfattn.study.text.evaluate_context_gain`,
:func:`~selfattn.study.text.evaluate_scaling_gains`) and written into the run's file atomically, with the code
version that computed them under ``reevaluated``; nothing the run already holds changes. Then ``results.json``
gets their summaries and ``text.md`` and the figures are redrawn. A stopped call resumes: finished runs are kept.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json, write_text
from selfattn.study.corpus import load_corpus, split_corpus
from selfattn.study.provenance import code_version, code_versions
from selfattn.study.text import TextConfig, build_text_model, evaluate_context_gain, evaluate_scaling_gains
from selfattn.study.text_tables import summarize_text_runs, text_figures, text_table


def _config(grid: Path) -> TextConfig:
    saved = json.loads((grid / "config.json").read_text())["text"]
    names = {f.name for f in fields(TextConfig)}
    settings: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names}
    return TextConfig(**settings)


def reevaluate(grid: Path, checkpoints: Path) -> None:
    config = _config(grid)
    _, held_out = split_corpus(load_corpus(), config.held_out_fraction)
    version = code_version()
    for path in sorted((grid / "runs").glob("text-*.json")):
        run = json.loads(path.read_text())
        if run["encoding"] == "learned" or "sliding_gain" in run:
            continue
        started = time.process_time()
        model = build_text_model(run["encoding"], config)
        model.load_state_dict(torch.load(checkpoints / f"{path.stem}.pt", map_location="cpu")["model"])
        model.eval()
        run["sliding_gain"] = evaluate_context_gain(model, held_out, config, sliding=True)
        run["scaling_context_gain"] = (
            evaluate_scaling_gains(model, held_out, config) if run["encoding"] == "rotary" else {}
        )
        run["reevaluated"] = {"code_version": version, "keys": ["sliding_gain", "scaling_context_gain"]}
        write_json(path, run)
        print(f"{path.stem}: {time.process_time() - started:.0f} s of CPU", flush=True)
    rebuild(grid, config)


def rebuild(grid: Path, config: TextConfig) -> None:
    """``results.json``, ``text.md`` and figures from every run file in ``runs/``, seeds beyond the grid's included."""
    results = json.loads((grid / "results.json").read_text())
    encodings = results["config"]["encodings"]
    kept = [json.loads(path.read_text()) for path in (grid / "runs").glob("text-*.json")]
    kept.sort(key=lambda run: (encodings.index(run["encoding"]), run["seed"]))  # the grid's order
    results["runs"] = runs = [{k: v for k, v in run.items() if k != "loss_curve"} for run in kept]
    seeds = Counter(run["encoding"] for run in runs)
    if len(set(seeds.values())) > 1:  # more seeds for some encodings than the grid's
        results["config"]["seeds_by_encoding"] = dict(seeds)
    results["config"]["code_versions"] = code_versions(runs)
    results["config"]["sliding_stride"] = config.sliding_stride
    results.update(summarize_text_runs(runs))
    write_json(grid / "results.json", results)
    write_text(grid / "text.md", "\n".join(text_table(results) + text_figures(results, grid / "figures")) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    reevaluate(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
