"""Retrain kept exercise runs on the code checked out and say whether each equals its kept file.

    PYTHONPATH=src .venv/bin/python results/study-exercises/same_code.py long_range/self_attention-n6-s0 ...

Each name is a kept run (``exercises/long_range/...``, ``exercises/by_depth/...``) as the study names its jobs;
the run is trained again with the kept settings (``exercises/config.json``) and compared with the kept file in
everything but wall and CPU times and a code version. Run from a worktree at a commit, it tells whether that
commit wrote the kept files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from selfattn.study.exercises import ExerciseConfig, _by_depth_jobs, _long_range_jobs

KEPT = Path(__file__).resolve().parent / "exercises"
NOT_COMPARED = {"seconds", "train_seconds", "cpu_seconds", "code_version"}


def _compared(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _compared(v) for k, v in value.items() if k not in NOT_COMPARED}
    if isinstance(value, list):
        return [_compared(v) for v in value]
    return value


def main(names: list[str]) -> int:
    torch.set_num_threads(1)
    saved = json.loads((KEPT / "config.json").read_text())
    config = ExerciseConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    unknown = set(names)
    for name, job in [*_long_range_jobs(config), *_by_depth_jobs(config)]:
        if name not in names:
            continue
        unknown.discard(name)
        found = json.loads(json.dumps(job()))  # as written: tuples become lists
        kept = json.loads((KEPT / f"{name}.json").read_text())
        print(f"{name}: {'equal to' if _compared(found) == _compared(kept) else 'DIFFERENT from'} the kept file")
    for name in sorted(unknown):
        print(f"{name}: no such job in the kept settings")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
