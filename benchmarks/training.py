"""Training throughput of the study's model: tokens per second per positional encoding.

One training step of ``selfattn study``'s default model (the same code path: TransformerLM,
AdamW, gradient clipping) on a batch of ``copy`` samples at a fixed input length, timed
round-robin over the encodings so a busy machine slows all alike. Ratios are against ``none``
(no positional encoding) measured in the same run.

    python benchmarks/training.py            # writes the "training-cpu" section of BENCHMARKS.md
    python benchmarks/training.py --quick    # smoke run, prints only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _common import (
    BENCHMARKS_MD,
    emit,
    load_average,
    machine_lines,
    measure,
    ms,
    ratio,
    resolve_device,
    spread_note,
    table,
)

from selfattn.study.tasks import get_task, make_batch
from selfattn.study.training import ENCODINGS, RunSpec, StudyConfig, build_model, make_optimizer


def training_step(encoding: str, config: StudyConfig, length: int, device: torch.device):  # type: ignore[no-untyped-def]
    model = build_model(RunSpec("copy", encoding, 0), config).to(device)
    optimizer, average = make_optimizer(model, config, device)  # what train_run steps
    tokens, targets, _ = make_batch(get_task("copy"), [length] * config.batch_size, torch.Generator().manual_seed(0))
    tokens, targets = tokens.to(device), targets.to(device)

    def step() -> None:
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if average is not None:
            average.update_parameters(model)

    return step, tokens.numel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[10, 20], help="input lengths n (tokens: 2n + 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the study uses 1 per rank)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--output", default=None, help="markdown file to update (default BENCHMARKS.md; none with --quick)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    config = StudyConfig()
    timing = (
        {"min_repeats": 2, "max_repeats": 3, "budget_s": 0.5}
        if args.quick
        else {"min_repeats": 10, "max_repeats": 40, "budget_s": 20.0}
    )
    if args.quick:
        config = StudyConfig(num_hiddens=16, num_heads=2, num_layers=1, ffn_hiddens=32, batch_size=4)
        args.lengths = args.lengths[:1]
    output = None if args.quick and args.output is None else (args.output or str(BENCHMARKS_MD))
    started = time.perf_counter()
    header = machine_lines(device)
    cases, sizes = {}, {}
    for n in args.lengths:
        for encoding in ENCODINGS:
            cases[(encoding, n)], sizes[(encoding, n)] = training_step(encoding, config, n, device)
    spread: dict = {}
    seconds = measure(cases, device=device, spread=spread, **timing)
    rows = []
    for encoding in ENCODINGS:
        row = [encoding]
        for n in args.lengths:
            per_second = sizes[(encoding, n)] / seconds[(encoding, n)]
            row += [
                ms(seconds[(encoding, n)]),
                f"{per_second:,.0f}",
                ratio(seconds[(encoding, n)] / seconds[("none", n)]),
            ]
        rows.append(row)
    columns = ["encoding"]
    for n in args.lengths:
        tokens = config.batch_size * get_task("copy").sequence_len(n)
        columns += [f"ms/step n={n} ({tokens} tokens)", f"tokens/s n={n}", f"time vs none n={n}"]
    parts = [
        f"## Training throughput of the study's model ({device.type}{', quick smoke run' if args.quick else ''})",
        "",
        *header,
        f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s",
        (
            f"- model: {config.num_layers} layers, d={config.num_hiddens}, {config.num_heads} heads, MLP {config.ffn_hiddens}; "
            f"batch {config.batch_size} copy samples; one step = forward, backward, clipping, AdamW, weight average"
        ),
        "",
        table(columns, rows),
        "",
        spread_note(spread),
    ]
    emit("\n".join(parts), output=output, section=f"training-{device.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
