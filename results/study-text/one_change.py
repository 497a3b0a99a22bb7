"""One cause at a time: does one setting of the model explain why sinusoidal reads below rotary far past L here
and above it in Press et al.?

    .venv/bin/python results/study-text/one_change.py train GRID OUT NAME=VALUE [NAME=VALUE ...] ENCODING SEED [...]
    .venv/bin/python results/study-text/one_change.py table GRID OUT

GRID is a folder of the text study (``L256``: ``config.json``, ``runs/``). Press et al. trained 16 layers with heads
of 128; the study trains 2 layers with heads of 16. ``train`` trains each (encoding, seed) with GRID's settings but
the integer settings of :class:`~selfattn.study.text.TextConfig` named changed (``num_layers=8``, ``num_heads=1``,
or both, to see how two causes add; rotary's context-extension scalings are not read), into
``OUT/runs/text-ENCODING-sSEED.json`` atomically with the code version and the changed settings (a finished file
is kept; ``OUT/checkpoints/`` lets a killed run resume), and records the settings in ``OUT/config.json``.
``table`` prints, for GRID and OUT, per encoding the perplexity at every evaluated length and by band of positions
at the longest (and the attention's entropy there), mean over the seeds ± the half-width of the 95% interval, and
at each length whether sinusoidal and rotary are told apart (their intervals do not overlap), and for OUT whether each
is told apart from itself in GRID.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json
from selfattn.study.corpus import load_corpus, split_corpus
from selfattn.study.provenance import code_version
from selfattn.study.spread import differs, interval95
from selfattn.study.text import TextConfig, train_text_run
from selfattn.study.training import RunSpec

COMPARED = ("sinusoidal", "rotary")


def _config(grid: Path) -> TextConfig:
    saved = json.loads((grid / "config.json").read_text())["text"]
    names = {f.name for f in fields(TextConfig)}
    return TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names})


def train(grid: Path, out: Path, changes: list[str], cells: list[str]) -> None:
    settings = {f.name for f in fields(TextConfig)}
    changed: dict[str, int] = {}
    for change in changes:
        name, _, value = change.partition("=")
        if name not in settings:
            raise ValueError(f"NAME=VALUE must name a setting of TextConfig, got {change!r}")
        changed[name] = int(value)
    config = replace(_config(grid), **changed)
    corpus = split_corpus(load_corpus(), config.held_out_fraction)
    for folder in (out / "runs", out / "checkpoints"):
        folder.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", {"text": config.as_dict(), "changed_from": str(grid), "changed": list(changed)})
    torch.set_num_threads(1)
    for encoding, seed in zip(cells[::2], cells[1::2], strict=True):
        spec = RunSpec("text", encoding, int(seed))
        target = out / "runs" / f"{spec.key}.json"
        if target.exists():
            continue
        checkpoint = out / "checkpoints" / f"{spec.key}.pt"
        run = {**spec.as_dict(), **train_text_run(spec, config, corpus, checkpoint=checkpoint, scalings=False)}
        run.update(changed)
        run["code_version"] = code_version()
        write_json(target, run)
        print(f"{spec.key}: {' '.join(changes)}, trained in {run['train_cpu_seconds']:.0f} s of CPU", flush=True)


def _runs(folder: Path, encoding: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((folder / "runs").glob(f"text-{encoding}-s*.json"))]


def _cell(values: list[float]) -> str:
    found = interval95(values)
    return f"{found['mean']:.2f} ± {found['half_width']:.2f}"


def table(grid: Path, out: Path) -> int:
    changed = json.loads((out / "config.json").read_text())["changed"]
    grid_values: dict[tuple[str, str], list[float]] = {}
    for folder in (grid, out):
        settings = json.loads((folder / "config.json").read_text())["text"]
        runs = {encoding: _runs(folder, encoding) for encoding in COMPARED}
        lengths = list(runs[COMPARED[0]][0]["perplexity_by_length"])
        print(
            ", ".join(f"{name} {settings[name]}" for name in changed)
            + f" ({folder}; seeds: "
            + ", ".join(f"{e} {len(r)}" for e, r in runs.items())
            + ")"
        )
        for length in lengths:
            values = {e: [r["perplexity_by_length"][length]["perplexity"] for r in rs] for e, rs in runs.items()}
            apart = "apart" if differs(*values.values()) else "not apart"
            cells = []
            for encoding, found in values.items():
                before = grid_values.get((encoding, length))
                moved = "" if before is None else f" [{'' if differs(found, before) else 'not '}apart from GRID]"
                cells.append(f"{encoding} {_cell(found)}{moved}")
            if folder == grid:
                grid_values.update({(e, length): v for e, v in values.items()})
            print(f"  {length:>5}: " + "; ".join(cells) + f" (the two {apart})")
        longest = lengths[-1]
        for encoding, rs in runs.items():
            bands = rs[0]["perplexity_by_length"][longest]["by_position"]
            text = ", ".join(
                f"{band['start']}-{band['stop'] - 1}: "
                + _cell([r["perplexity_by_length"][longest]["by_position"][i]["perplexity"] for r in rs])
                for i, band in enumerate(bands)
            )
            print(f"  {encoding} at {longest}, by position: {text}")
        for encoding, rs in runs.items():
            text = ", ".join(
                f"{band['start']}-{band['stop'] - 1}: "
                + _cell([sum(r["attention"][i]["entropy"]) / len(r["attention"][i]["entropy"]) for r in rs])
                for i, band in enumerate(rs[0]["attention"])
            )
            print(f"  {encoding} attention entropy (nats, mean over layers) at {longest}, by position: {text}")
        for encoding, rs in runs.items():
            final = _cell([r["final_loss"] for r in rs])
            print(f"  {encoding}: final training loss {final}; code {sorted({r['code_version'][:7] for r in rs})}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 6 and argv[0] == "train":
        changes = [arg for arg in argv[3:] if "=" in arg]
        train(Path(argv[1]), Path(argv[2]), changes, argv[3 + len(changes) :])
        return 0
    if len(argv) == 3 and argv[0] == "table":
        return table(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
