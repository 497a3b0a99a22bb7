"""Where the grid's models look when they answer: the attention on each answer token's source, in range and past it.

    .venv/bin/python results/study-synthetic/attention_cause.py CHECKPOINTS [OUT.json]

CHECKPOINTS holds the grid's final checkpoints (``TASK-ENCODING-sSEED.pt``, as the study wrote them). A sample
is ``BOS input SEP answer``: at length ``n`` the query that predicts answer token ``j`` sits at ``n + 1 + j`` and
its source (the input token the answer repeats) at ``1 + j`` for copy (``n`` back) and at ``n - j`` for reverse
(``2 j + 1`` back). For each run the evaluated weights (the weight average) read 32 samples per length,
teacher-forced, with every attention layer run again to return its weights (the forward pass itself unchanged);
per answer position the largest weight any head of any layer puts on the source, averaged over the positions and
samples of a band of lengths. Printed per task, encoding and band: that weight (mean over seeds ± the half-width
of the 95% interval) beside the exact match the run recorded; written to OUT.json when given.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json
from selfattn.models.block import TransformerBlock
from selfattn.study.spread import interval95
from selfattn.study.tasks import get_task, make_batch
from selfattn.study.training import RunSpec, StudyConfig, build_model, evaluated_weights

HERE = Path(__file__).resolve().parent
ENCODINGS = ("alibi", "kerple", "rotary", "none", "t5")
SAMPLES = 32


def _config() -> StudyConfig:
    saved = json.loads((HERE / "config.json").read_text())["study"]
    return StudyConfig(**{f.name: saved[f.name] for f in fields(StudyConfig) if f.name in saved})


def load_evaluated(checkpoints: Path, spec: RunSpec, config: StudyConfig) -> torch.nn.Module:
    """The run's model with the weights it was evaluated with (the weight average), in evaluation mode."""
    model = build_model(spec, config)
    model.load_state_dict(evaluated_weights(checkpoints / f"{spec.key}.pt"))
    return model.eval()


@torch.no_grad()
def source_weight(model: torch.nn.Module, task: str, n: int, generator: torch.Generator) -> float:
    """Mean over samples and answer positions of the largest weight a head of a layer puts on the source."""
    tokens, _, _ = make_batch(get_task(task), [n] * SAMPLES, generator)  # (b, 2n + 2): one length, no padding
    weights: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        weights.append(module.forward(*args, **{**kwargs, "return_weights": True})[1])  # (b, h, l, l)

    blocks = [block.attention for block in model.blocks if isinstance(block, TransformerBlock)]
    handles = [attention.register_forward_hook(record, with_kwargs=True) for attention in blocks]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    j = torch.arange(n)
    queries = n + 1 + j  # the positions that predict answer token j
    sources = 1 + j if task == "copy" else n - j
    stacked = torch.stack(weights)  # (layers, b, h, l, l)
    on_source = stacked[:, :, :, queries, sources]  # (layers, b, h, n)
    return float(on_source.amax(dim=(0, 2)).mean())


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    checkpoints = Path(argv[0])
    config = _config()
    limit = config.train_len
    bands = {
        "1..20": range(4, limit + 1, 4),
        "21..40": range(24, 2 * limit + 1, 4),
        "41..80": range(48, 4 * limit + 1, 8),
    }
    grid = {p.stem: json.loads(p.read_text()) for p in (HERE / "runs").glob("*.json")}
    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    for task in ("copy", "reverse"):
        for encoding in ENCODINGS:
            per_band: dict[str, list[float]] = {band: [] for band in bands}
            exact: dict[str, list[float]] = {band: [] for band in bands}
            for seed in range(5):  # the grid's seeds
                spec = RunSpec(task, encoding, seed)
                model = load_evaluated(checkpoints, spec, config)
                generator = torch.Generator().manual_seed(1000 + seed)
                run = grid[spec.key]
                for band, lengths in bands.items():
                    per_band[band].append(statistics.fmean(source_weight(model, task, n, generator) for n in lengths))
                    low, high = (int(x) for x in band.split(".."))
                    exact[band].append(
                        statistics.fmean(run["accuracy_by_length"][str(k)] for k in range(low, high + 1))
                    )
            row = {
                band: {"source_weight": interval95(per_band[band]), "exact": interval95(exact[band])} for band in bands
            }
            found.setdefault(task, {})[encoding] = row
            cells = "  ".join(
                f"{band}: {row[band]['source_weight']['mean']:.2f} ± {row[band]['source_weight']['half_width']:.2f}"
                f" (exact {100 * row[band]['exact']['mean']:.0f}%)"
                for band in bands
            )
            print(f"{task:8s}{encoding:8s}{cells}", flush=True)
    if len(argv) > 1:
        write_json(Path(argv[1]), found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
