"""One decoding step of grouped-query attention: ``selfattn.functional.attention`` against PyTorch's kernel.

Run from the repository root::

    .venv/bin/python benchmarks/grouped_decoding.py           # writes section grouped-decoding-cpu of BENCHMARKS.md
    .venv/bin/python benchmarks/grouped_decoding.py --quick   # fewer rounds and sizes, prints only

One query against a cache of keys, no mask, float32, no gradient (a decoding step in inference), for head layouts
of today's models (``b`` batch, ``h`` query heads, ``hk`` key/value heads, ``d`` head size): selfattn's
``attention(q, k, v)`` and ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on the same tensors, timed
round-robin; a ratio is the median over rounds of selfattn's time over the kernel's in the same round. selfattn's
call adds its checks and its guard for a query holding an infinity (the kernel gives such a row zeros), and lays
each key/value head's query heads out as rows of it from ``b * h * lk * d`` = 65,536 on (see
``selfattn.functional._unmasked``), where the kernel's grouped call reads each key once per query head.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, load_average, log, machine_lines, measure, paired_ratio, table

from selfattn.functional import attention

#: (b, h, hk, d): the decoding benchmark's layer, a tiny Llama's, Llama-3-8B's at batch 1 and 4, multi-query.
LAYOUTS = ((1, 4, 2, 32), (1, 8, 2, 64), (4, 8, 2, 64), (1, 8, 1, 64), (1, 32, 8, 128), (4, 32, 8, 128))
KEYS = (64, 256, 1024, 4096)
HEADER = ["threads", "b, h, hk, d", "keys", "b h lk d", "kernel us", "selfattn us", "ratio (95% interval)"]


def rows(threads: int, keys: tuple[int, ...], budget_s: float) -> list[list[str]]:
    torch.set_num_threads(threads)
    out = []
    for batch, heads, kv_heads, head_dim in LAYOUTS:
        for num_keys in keys:
            gen = torch.Generator().manual_seed(num_keys)
            q = torch.randn(batch, 1, heads, head_dim, generator=gen).transpose(1, 2)  # (b, h, 1, d), a projection's
            k, v = (torch.randn(batch, kv_heads, num_keys, head_dim, generator=gen) for _ in range(2))
            cases = {
                "kernel": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                "selfattn": lambda q=q, k=k, v=v: attention(q, k, v),
            }
            with torch.no_grad():
                torch.testing.assert_close(cases["selfattn"](), cases["kernel"](), rtol=1e-4, atol=1e-5)
                times: dict[str, list[float]] = {}
                medians = measure(cases, device=torch.device("cpu"), min_repeats=7, max_repeats=400,
                                  budget_s=budget_s, warmup=3, rounds=times)  # fmt: skip
            x, low, high = paired_ratio(times["selfattn"], times["kernel"])
            out.append([str(threads), f"{batch}, {heads}, {kv_heads}, {head_dim}", str(num_keys),
                        f"{batch * heads * num_keys * head_dim:,}", f"{medians['kernel'] * 1e6:.1f}",
                        f"{medians['selfattn'] * 1e6:.1f}", f"{x:.2f}x ({low:.2f}-{high:.2f})"])  # fmt: skip
            log(" | ".join(out[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="64 and 1,024 keys, one thread, short budgets; prints only"
    )
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file to update (none with --quick)")
    args = parser.parse_args(argv)
    started, load_at_start = time.perf_counter(), load_average()
    keys, budget = ((64, 1024), 0.2) if args.quick else (KEYS, 1.0)
    all_rows = [row for threads in ((1,) if args.quick else (1, 2)) for row in rows(threads, keys, budget)]
    lines = [
        "## Grouped-query decoding step: attention(q, k, v) against the kernel's grouped call (cpu)",
        "",
        *machine_lines(torch.device("cpu"), load_at_start),
        f"- load average at end: {load_average()}; run took {time.perf_counter() - started:.0f} s",
        "",
        "One query, no mask, float32, no gradient; `kernel` is `F.scaled_dot_product_attention(q, k, v, "
        "enable_gqa=True)` on the same tensors. Medians of each call's time over rounds timed round-robin; the ratio "
        "is the median over rounds of selfattn's time over the kernel's in the same round, with its 95% interval "
        "(below 1: selfattn is faster). selfattn adds its checks and its guard for an infinite query, and lays "
        "grouped heads out as rows of their key/value head from `b h lk d` = 65,536 on.",
        "",
        table(HEADER, all_rows),
    ]
    emit("\n".join(lines), output=None if args.quick else args.output, section="grouped-decoding-cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
