"""Answer-token accuracy by position in the answer, in range and past it: where in an answer a model goes wrong.

    .venv/bin/python results/study-synthetic/accuracy_by_position.py CHECKPOINTS [OUT.json]

CHECKPOINTS holds the grid's final checkpoints (``TASK-ENCODING-sSEED.pt``). For each run the evaluated weights
(the weight average) read 32 samples at each length of a band (1..20, 21..40), teacher-forced: the answer's tokens
before ``j`` are the right ones, so answer token ``j`` is right or wrong on its own (the run's recorded exact match
generates the whole answer instead). Per band of lengths, the share of answer tokens predicted right at answer
positions 1-10, 11-20, 21-30 and 31-40 (``j + 1``); mean over the 5 seeds ± the half-width of the 95% interval.
On copy answer token ``j`` repeats the input token ``n`` back; on reverse ``2 j + 1`` back.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json
from selfattn.study.spread import interval95
from selfattn.study.tasks import get_task, make_batch
from selfattn.study.training import RunSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_cause import ENCODINGS, SAMPLES, _config, load_evaluated  # this folder's script

POSITION_BANDS = ((1, 10), (11, 20), (21, 30), (31, 40))
LENGTH_BANDS = {"1..20": range(1, 21), "21..40": range(21, 41)}


@torch.no_grad()
def right_by_position(model: torch.nn.Module, task: str, lengths: range, generator: torch.Generator) -> list[float]:
    """Per band of answer positions, the share of answer tokens predicted right (NaN where no answer is that long)."""
    right, seen = torch.zeros(40), torch.zeros(40)
    for n in lengths:
        tokens, targets, _ = make_batch(get_task(task), [n] * SAMPLES, generator)  # (b, 2n + 2)
        predicted = model(tokens).argmax(-1)  # (b, l)
        answer = targets[:, n + 1 : 2 * n + 1]  # (b, n): answer token j predicted at position n + 1 + j
        right[:n] += (predicted[:, n + 1 : 2 * n + 1] == answer).sum(0).float()
        seen[:n] += answer.shape[0]
    return [
        float(right[a - 1 : b].sum() / seen[a - 1 : b].sum()) if seen[a - 1 : b].sum() > 0 else float("nan")
        for a, b in POSITION_BANDS
    ]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    checkpoints, config = Path(argv[0]), _config()
    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    for task in ("copy", "reverse"):
        for encoding in ENCODINGS:
            per_seed: dict[str, list[list[float]]] = {band: [] for band in LENGTH_BANDS}
            for seed in range(5):  # the grid's seeds
                spec = RunSpec(task, encoding, seed)
                model = load_evaluated(checkpoints, spec, config)
                generator = torch.Generator().manual_seed(2000 + seed)
                for band, lengths in LENGTH_BANDS.items():
                    per_seed[band].append(right_by_position(model, task, lengths, generator))
            row: dict[str, Any] = {}
            for band, seeds in per_seed.items():
                row[band] = {
                    f"{a}-{b}": interval95([s[i] for s in seeds]) if seeds[0][i] == seeds[0][i] else None
                    for i, (a, b) in enumerate(POSITION_BANDS)
                }
            found.setdefault(task, {})[encoding] = row
            cells = "  ".join(
                f"{band} "
                + " ".join(
                    "-" if cell is None else f"{100 * cell['mean']:.0f}±{100 * cell['half_width']:.0f}"
                    for cell in row[band].values()
                )
                for band in LENGTH_BANDS
            )
            print(f"{task:8s}{encoding:8s}{cells}", flush=True)
    if len(argv) > 1:
        write_json(Path(argv[1]), found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
