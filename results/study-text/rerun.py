"""Rerun single runs of a text grid kept here and check that each lands where the grid's seeds say one run lands.

    .venv/bin/python results/study-text/rerun.py train GRID OUT rotary 3 [alibi 3 ...]
    .venv/bin/python results/study-text/rerun.py check GRID OUT

GRID is a folder of the text study (``L64``: its ``config.json`` and ``runs/``). ``train`` trains each (encoding,
seed) with the grid's settings on the code checked out, writing ``OUT/text-ENCODING-sSEED.json`` atomically (a
finished file is kept). ``check`` prints, per rerun and evaluated length, its perplexity beside the grid's: the same
seed's reading, the seeds' range and the 95% prediction interval for one new run
(``selfattn.study.spread.prediction95``), and whether the rerun falls inside it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from selfattn._atomic import write_json
from selfattn.study.corpus import load_corpus, split_corpus
from selfattn.study.provenance import code_version
from selfattn.study.text import TextConfig, train_text_run
from selfattn.study.training import RunSpec


def _config(grid: Path) -> TextConfig:
    saved = json.loads((grid / "config.json").read_text())["text"]
    names = {f.name for f in fields(TextConfig)}
    settings: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names}
    return TextConfig(**settings)


def train(grid: Path, out: Path, cells: list[str]) -> None:
    config = _config(grid)
    corpus = split_corpus(load_corpus(), config.held_out_fraction)
    out.mkdir(parents=True, exist_ok=True)
    for encoding, seed in zip(cells[::2], cells[1::2], strict=True):
        spec = RunSpec("text", encoding, int(seed))
        target = out / f"{spec.key}.json"
        if target.exists():
            continue
        run = {**spec.as_dict(), **train_text_run(spec, config, corpus, checkpoint=out / f"{spec.key}.pt")}
        run["code_version"] = code_version()
        write_json(target, run)
        print(f"{spec.key}: trained in {run['train_cpu_seconds']:.0f} s of CPU", flush=True)


def check(grid: Path, out: Path) -> int:
    from selfattn.study.spread import prediction95

    outside = 0
    for path in sorted(out.glob("*.json")):
        rerun = json.loads(path.read_text())
        seeds = [json.loads(p.read_text()) for p in sorted((grid / "runs").glob(f"text-{rerun['encoding']}-s*.json"))]
        print(f"{path.stem} (code {rerun['code_version'][:7]}; the grid's {seeds[0]['code_version'][:7]}):")
        for length, cell in rerun["perplexity_by_length"].items():
            values = [s["perplexity_by_length"][length]["perplexity"] for s in seeds]
            same = next((s for s in seeds if s["seed"] == rerun["seed"]), None)
            interval = prediction95(values)
            assert interval is not None
            low, high = max(1.0, interval["low"]), interval["high"]
            found = cell["perplexity"]
            inside = low <= found <= high
            outside += not inside
            print(
                f"  {length}: {found:.3f}"
                + (
                    ""
                    if same is None
                    else f" (the grid's seed: {same['perplexity_by_length'][length]['perplexity']:.3f})"
                )
                + f"; seeds {min(values):.3f}-{max(values):.3f}; one new run: {low:.3f}-{high:.3f}"
                + ("" if inside else "  OUTSIDE")
            )
    print(f"{outside} length(s) outside the prediction interval")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "train":
        train(Path(argv[1]), Path(argv[2]), argv[3:])
        return 0
    if len(argv) == 3 and argv[0] == "check":
        return check(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
