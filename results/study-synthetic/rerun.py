"""Rerun single runs of the grid kept here and check that each lands where the grid's seeds say one run lands.

    .venv/bin/python results/study-synthetic/rerun.py train OUT copy alibi 0 [copy rotary 5 ...]
    .venv/bin/python results/study-synthetic/rerun.py check OUT

``train`` trains each (task, encoding, seed) with this grid's settings (``config.json``) on the code checked out
(``alibi`` or ``rotary+rand``), writing ``OUT/KEY.json`` atomically (a finished file is kept; a killed run
restarts from its checkpoint). ``check`` prints, per rerun and band of lengths, its exact match beside the grid's:
the same seed's reading, the seeds' range and the 95% prediction interval for one new run
(``selfattn.study.spread.prediction95``), and whether the rerun falls inside it. A seed the grid holds, rerun on
the grid's code, should reproduce its reading; on other code, or with a new seed, it should land in the
prediction interval (about one rerun in twenty does not, by chance).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from selfattn._atomic import write_json
from selfattn.study.provenance import code_version
from selfattn.study.training import RunSpec, StudyConfig, encoding_label, train_run

HERE = Path(__file__).resolve().parent


def _config() -> StudyConfig:
    saved = json.loads((HERE / "config.json").read_text())["study"]
    return StudyConfig(**{f.name: saved[f.name] for f in fields(StudyConfig) if f.name in saved})


def train(out: Path, cells: list[str]) -> None:
    config = _config()
    out.mkdir(parents=True, exist_ok=True)
    for task, label, seed in zip(cells[::3], cells[1::3], cells[2::3], strict=True):
        spec = RunSpec(task, label.removesuffix("+rand"), int(seed), randomized_positions=label.endswith("+rand"))
        target = out / f"{spec.key}.json"
        if target.exists():
            continue
        run = {**spec.as_dict(), **train_run(spec, config, checkpoint=out / f"{spec.key}.pt")}
        run["code_version"] = code_version()
        write_json(target, run)
        print(f"{spec.key}: trained in {run['train_cpu_seconds']:.0f} s of CPU", flush=True)


def _band(run: dict[str, Any], low: int, high: int) -> float:
    return 100 * statistics.fmean(run["accuracy_by_length"][str(n)] for n in range(low, high + 1))


def check(out: Path) -> int:
    from selfattn.study.spread import prediction95  # not in the grid's code: imported only to check

    grid = [json.loads(p.read_text()) for p in sorted((HERE / "runs").glob("*.json"))]
    outside = 0
    for path in sorted(out.glob("*.json")):
        rerun = json.loads(path.read_text())
        seeds = [r for r in grid if r["task"] == rerun["task"] and encoding_label(r) == encoding_label(rerun)]
        limit = int(rerun["train_max_len"])
        print(f"{path.stem} (code {rerun['code_version'][:7]}; the grid's {seeds[0]['code_version'][:7]}):")
        for low, high in [(1, limit), (limit + 1, 2 * limit), (2 * limit + 1, 4 * limit)]:
            values = [_band(r, low, high) for r in seeds]
            same = next((_band(r, low, high) for r in seeds if r["seed"] == rerun["seed"]), None)
            interval = prediction95(values)
            assert interval is not None
            low_p, high_p = max(0.0, interval["low"]), min(100.0, interval["high"])
            found = _band(rerun, low, high)
            inside = low_p - 1e-9 <= found <= high_p + 1e-9
            outside += not inside
            print(
                f"  {low}-{high}: {found:.1f}"
                + ("" if same is None else f" (the grid's seed {rerun['seed']}: {same:.1f})")
                + f"; seeds {min(values):.1f}-{max(values):.1f}; one new run: {low_p:.1f}-{high_p:.1f}"
                + ("" if inside else "  OUTSIDE")
            )
    print(f"{outside} band(s) outside the prediction interval")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "train":
        train(Path(argv[1]), argv[2:])
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
