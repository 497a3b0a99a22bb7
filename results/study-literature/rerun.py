"""Rerun single literature runs and check that each lands where the kept seeds say one run lands.

    .venv/bin/python results/study-literature/rerun.py train OUT copy alibi 3 [reverse none 0 ...]
    .venv/bin/python results/study-literature/rerun.py check OUT

``train`` trains each (task, variant, seed) with ``selfattn.study.literature``'s settings on the code checked out,
writing ``OUT/runs/TASK-VARIANT-sSEED.json`` atomically (a finished file is kept; a killed run restarts from its
checkpoint in ``OUT/checkpoints``). ``check`` prints, per rerun, its exact match in range (1..20) and at 21..40
beside the kept runs' (``runs/`` here): the same seed's reading, the seeds' range and the 95% prediction interval
for one new run (``selfattn.study.spread.prediction95``), and whether the rerun falls inside it. A kept seed rerun
on the kept runs' code reproduces its reading; on other code, or with a new seed, it should land in the
prediction interval (about one rerun in twenty does not, by chance).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from selfattn.study.literature import KAZEMNEJAD, _train_variant
from selfattn.study.provenance import code_version
from selfattn.study.spread import prediction95

HERE = Path(__file__).resolve().parent


def train(out: Path, cells: list[str]) -> None:
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints").mkdir(exist_ok=True)
    version = code_version()
    for task, name, seed in zip(cells[::3], cells[1::3], cells[2::3], strict=True):
        run = _train_variant(out, task, name, int(seed), KAZEMNEJAD, version)
        print(f"{task}-{name}-s{seed}: {run['train_cpu_seconds']:.0f} s of CPU to train", flush=True)


def _short(version: str) -> str:
    return version[:7] + ("+dirty" if version.endswith("+dirty") else "")


def _band(run: dict[str, Any], low: int, high: int) -> float:
    return 100 * statistics.fmean(run["accuracy_by_length"][str(n)] for n in range(low, high + 1))


def check(out: Path) -> int:
    limit, longest = KAZEMNEJAD.train_len, KAZEMNEJAD.eval_len
    outside = 0
    for path in sorted((out / "runs").glob("*.json")):
        rerun = json.loads(path.read_text())
        cell, seed = path.stem.rsplit("-s", 1)  # TASK-VARIANT, SEED
        kept = {int(p.stem.rsplit("-s", 1)[1]): json.loads(p.read_text()) for p in (HERE / "runs").glob(f"{cell}-s*")}
        print(
            f"{path.stem} (code {_short(rerun['code_version'])}; the kept runs' "
            f"{_short(next(iter(kept.values()))['code_version'])}):"
        )
        for low, high in ((1, limit), (limit + 1, longest)):
            values = [_band(run, low, high) for run in kept.values()]
            interval = prediction95(values)
            assert interval is not None
            low_p, high_p = max(0.0, interval["low"]), min(100.0, interval["high"])
            found = _band(rerun, low, high)
            inside = low_p - 1e-9 <= found <= high_p + 1e-9
            outside += not inside
            same = f" (the kept seed {seed}: {_band(kept[int(seed)], low, high):.1f})" if int(seed) in kept else ""
            print(
                f"  exact {low}..{high}: {found:.1f}{same}; seeds {min(values):.1f}-{max(values):.1f}; "
                f"one new run: {low_p:.1f}-{high_p:.1f}" + ("" if inside else "  OUTSIDE")
            )
    print(f"{outside} reading(s) outside the prediction interval")
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
