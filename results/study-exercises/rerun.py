"""Rerun single long-range runs of the exercises kept here and check each against the kept seeds.

    .venv/bin/python results/study-exercises/rerun.py train OUT self_attention 6 5 [rnn 8 5 ...]
    .venv/bin/python results/study-exercises/rerun.py check OUT

``train`` trains each (model, distance, seed) with the kept settings (``exercises/config.json``) on the code
checked out, writing ``OUT/MODEL-nDISTANCE-sSEED.json`` atomically with its code version (a finished file is
kept). ``check`` prints, per rerun, its accuracy after the budget and its steps to the target beside the kept
runs': the same seed's reading, the seeds' range and the 95% prediction interval for one new run
(``selfattn.study.spread.prediction95``; steps only where every kept seed reached the target), and whether the
rerun falls inside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from selfattn._atomic import write_json
from selfattn.study.long_range import train_at_distance
from selfattn.study.provenance import code_version
from selfattn.study.spread import prediction95

HERE = Path(__file__).resolve().parent / "exercises"


def train(out: Path, cells: list[str]) -> None:
    settings = json.loads((HERE / "config.json").read_text())["long_range"]
    out.mkdir(parents=True, exist_ok=True)
    for kind, distance, seed in zip(cells[::3], cells[1::3], cells[2::3], strict=True):
        target = out / f"{kind}-n{distance}-s{seed}.json"
        if target.exists():
            continue
        run = {**train_at_distance(kind, int(distance), seed=int(seed), **settings), "code_version": code_version()}
        write_json(target, run)
        print(f"{target.stem}: {run['seconds']:.0f} s", flush=True)


def _line(label: str, found: float | None, kept: dict[int, float | None], seed: int) -> tuple[str, bool]:
    values = [v for v in kept.values() if v is not None]
    same = f" (the kept seed {seed}: {kept[seed]})" if seed in kept else ""
    if found is None or len(values) < len(kept) or len(values) < 2:
        return f"  {label}: {found}{same}; kept {sorted(kept.values(), key=lambda v: (v is None, v))}", True
    interval = prediction95(values)
    assert interval is not None
    inside = interval["low"] - 1e-9 <= found <= interval["high"] + 1e-9
    return (
        f"  {label}: {found:.3g}{same}; seeds {min(values):.3g}-{max(values):.3g}; one new run: "
        f"{interval['low']:.3g}-{interval['high']:.3g}" + ("" if inside else "  OUTSIDE"),
        inside,
    )


def check(out: Path) -> int:
    outside = 0
    for path in sorted(out.glob("*.json")):
        rerun: dict[str, Any] = json.loads(path.read_text())
        cell, seed = path.stem.rsplit("-s", 1)
        kept = {
            int(p.stem.rsplit("-s", 1)[1]): json.loads(p.read_text()) for p in (HERE / "long_range").glob(f"{cell}-s*")
        }
        print(
            f"{path.stem} (code {rerun['code_version'][:7]}{'+dirty' if rerun['code_version'].endswith('+dirty') else ''}):"
        )
        for label, key in (
            ("accuracy after the budget", "accuracy_at_budget"),
            ("steps to the target", "steps_to_target"),
        ):
            line, inside = _line(label, rerun[key], {s: run[key] for s, run in kept.items()}, int(seed))
            outside += not inside
            print(line)
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
