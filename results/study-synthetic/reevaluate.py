"""Add the answer readings the grid was trained without, from its final checkpoints, and rebuild its report.

    .venv/bin/python results/study-synthetic/reevaluate.py GRID CHECKPOINTS [SHARD/SHARDS]
    .venv/bin/python results/study-synthetic/reevaluate.py GRID --rebuild

GRID is this folder (``config.json``, ``runs/``, ``results.json``); CHECKPOINTS holds the runs' final checkpoints
(``TASK-ENCODING-sSEED.pt``, as the study wrote them). For each run without them, answer tokens right by position
past L with the whole sample and with ``BOS`` and a window of L's length (``answer_use``,
:func:`selfattn.study.training.answer_readings`, the readings a run of the current code records itself) are computed
on the weights the run was evaluated with and written into the run's file atomically, with the code version that
computed them under ``reevaluated``; nothing the run already holds changes. Runs with randomized positions get
None (the readings need positions of their own). ``SHARD/SHARDS`` (e.g. ``0/2``) takes every SHARDS-th run, so two
processes share the work; a stopped call resumes. ``--rebuild`` then writes ``results.json`` (its summary gains
``answer_use``) and ``study.html`` with its figures.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path

import torch

from selfattn._atomic import write_json
from selfattn.study.provenance import code_version, code_versions
from selfattn.study.report import write_report
from selfattn.study.runner import summarize
from selfattn.study.tasks import get_task
from selfattn.study.training import (
    RunSpec,
    StudyConfig,
    answer_readings,
    build_model,
    encoding_label,
    evaluated_weights,
)


def _config(grid: Path) -> StudyConfig:
    saved = json.loads((grid / "config.json").read_text())["study"]
    return StudyConfig(**{f.name: saved[f.name] for f in fields(StudyConfig) if f.name in saved})


def reevaluate(grid: Path, checkpoints: Path, shard: int, shards: int) -> None:
    config, version = _config(grid), code_version()
    for path in sorted((grid / "runs").glob("*.json"))[shard::shards]:
        run = json.loads(path.read_text())
        if "answer_use" in run:
            continue
        started = time.process_time()
        spec = RunSpec(run["task"], run["encoding"], run["seed"], bool(run.get("randomized_positions")))
        readings = None
        if not spec.randomized_positions:
            model = build_model(spec, config)
            model.load_state_dict(evaluated_weights(checkpoints / f"{spec.key}.pt"))
            readings = answer_readings(model.eval(), get_task(spec.task), spec, config)
        run["answer_use"] = readings
        run["reevaluated"] = {"code_version": version, "keys": ["answer_use"]}
        write_json(path, run)
        print(f"{path.stem}: {time.process_time() - started:.0f} s of CPU", flush=True)


def rebuild(grid: Path) -> None:
    """``results.json``, ``study.html`` and figures from every run file in ``runs/``, seeds beyond the grid's included."""
    results = json.loads((grid / "results.json").read_text())
    config = results["config"]
    kept = [json.loads(path.read_text()) for path in (grid / "runs").glob("*.json")]
    order = {name: i for i, name in enumerate(config["encodings"])}
    kept.sort(
        key=lambda r: (
            config["tasks"].index(r["task"]),
            order[r["encoding"]],
            bool(r["randomized_positions"]),
            r["seed"],
        )
    )  # the grid's order; fmt: skip
    results["runs"] = runs = [{k: v for k, v in run.items() if k != "loss_curve"} for run in kept]
    cells = Counter(f"{run['task']}/{encoding_label(run)}" for run in runs)
    extra = {cell: n for cell, n in cells.items() if n != config["seeds"]}
    config.pop("seeds_by_cell", None)
    if extra:  # seeds added to some cells after the grid
        config["seeds_by_cell"] = extra
    config["code_versions"] = code_versions(runs)
    results["summary"] = summarize(runs)
    write_json(grid / "results.json", results)
    write_report(grid, results)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "--rebuild":
        rebuild(Path(argv[0]))
        return 0
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    shard, shards = (int(part) for part in (argv[2] if len(argv) == 3 else "0/1").split("/"))
    torch.set_num_threads(1)
    reevaluate(Path(argv[0]), Path(argv[1]), shard, shards)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
