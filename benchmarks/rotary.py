"""Rotary: what float64 angles cost next to float32 ones, and what re-rotating a dynamic cache costs.

    .venv/bin/python benchmarks/rotary.py            # writes the "rotary" section of BENCHMARKS.md
    .venv/bin/python benchmarks/rotary.py --quick    # smoke run: small sizes, prints only

1. ``apply_rotary`` on ``(1, 8, n, 64)`` float32 queries: selfattn (float64 angles from exact
   positions, rotation in float32) against the usual float32-angle rotation written here, and
   the largest error of each against the float64 formula at those positions.
2. Token-by-token decoding of a small layer with a KV cache: plain rotary, dynamic NTK with the
   cached keys kept, and dynamic NTK with them re-rotated every step (``cached_keys``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCHMARKS_MD,
    emit,
    load_average,
    machine_lines,
    measure,
    ms,
    ratio,
    spread_note,
    table,
)

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import apply_rotary, rotary_frequencies
from selfattn.positional import RotaryPositionalEncoding


def float32_angle_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq32: torch.Tensor) -> torch.Tensor:
    """The common implementation: angles, cos and sin all in float32 (interleaved pairs)."""
    angles = positions.float()[:, None] * inv_freq32[None, :]  # (n, d/2)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)


def exact_error(rotated: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> float:
    exact = apply_rotary(x.double(), positions)  # float64 throughout
    return float((rotated.double() - exact).abs().max())


def run_apply(args: argparse.Namespace) -> str:
    rows, spread = [], {}
    inv_freq32 = rotary_frequencies(64).float()
    for n in args.sizes:
        x = torch.randn(1, 8, n, 64)
        for start in (0, 10**6 - n):
            positions = torch.arange(start, start + n)
            cases = {
                ("selfattn", n, start): lambda x=x, p=positions: apply_rotary(x, p),
                ("float32 angles", n, start): lambda x=x, p=positions: float32_angle_rotary(x, p, inv_freq32),
            }
            times = measure(cases, device=torch.device("cpu"), spread=spread, **args.timing)
            ours_err = exact_error(apply_rotary(x, positions), x, positions)
            theirs_err = exact_error(float32_angle_rotary(x, positions, inv_freq32), x, positions)
            t_ours, t_theirs = times[("selfattn", n, start)], times[("float32 angles", n, start)]
            rows.append(
                [
                    str(n),
                    f"{start}..{start + n - 1}",
                    ms(t_ours),
                    ms(t_theirs),
                    ratio(t_ours / t_theirs),
                    f"{ours_err:.1e}",
                    f"{theirs_err:.1e}",
                ]
            )
    header = [
        "n",
        "positions",
        "selfattn ms",
        "float32 angles ms",
        "selfattn / float32",
        "selfattn error",
        "float32-angle error",
    ]
    return "\n".join(["### apply_rotary, (1, 8, n, 64) float32", "", table(header, rows), "", spread_note(spread), ""])


def decode_seconds(scaling: dict[str, object] | None, mode: str, steps: int) -> float:
    torch.manual_seed(0)
    rope = RotaryPositionalEncoding(32, interleaved=False, scaling=scaling, cached_keys=mode)  # type: ignore[arg-type]
    layer = MultiHeadAttention(256, 8, position=rope).eval()
    x = torch.randn(1, steps, 256)
    cache = KVCache(steps)
    started = time.perf_counter()
    with torch.no_grad():
        for t in range(steps):
            layer(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache)
    return time.perf_counter() - started


def run_decode(args: argparse.Namespace) -> str:
    steps, trained = args.decode_steps, args.decode_steps // 8
    dynamic = {"rope_type": "dynamic", "factor": 8.0, "original_max_position_embeddings": trained}
    contenders = {
        "plain rotary": (None, "keep"),
        "dynamic, keep cached keys": (dynamic, "keep"),
        "dynamic, re-rotate cached keys": (dynamic, "rerotate"),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.decode_rounds):  # round-robin, so load from elsewhere hits all alike
        for name, (scaling, mode) in contenders.items():
            times[name].append(decode_seconds(scaling, mode, steps))
    medians = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    base = medians["plain rotary"]
    rows = [[name, ms(t / steps), ratio(t / base)] for name, t in medians.items()]
    return "\n".join(
        [
            f"### Decoding {steps} tokens (d=256, 8 heads, dynamic NTK factor 8 past {trained} tokens)",
            "",
            table(["contender", "ms per token", "vs plain rotary"], rows),
            "",
            (
                f"Median of {args.decode_rounds} round-robin rounds. Re-rotation turns the whole cache once per step "
                "while the frequencies change (every step past the trained length for dynamic NTK)."
            ),
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats; prints only, unless --output")
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.decode_steps, args.decode_rounds = [256], 64, 1
        args.timing = {"min_repeats": 2, "max_repeats": 3, "budget_s": 0.5}
    else:
        args.sizes, args.decode_steps, args.decode_rounds = [1024, 8192], 512, 3
        args.timing = {"min_repeats": 5, "max_repeats": 15, "budget_s": 4.0}
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    started = time.perf_counter()
    parts = [f"## Rotary (cpu{', quick smoke run' if args.quick else ''})", "", *machine_lines(torch.device("cpu"))]
    body = [run_apply(args), run_decode(args)]
    parts += [f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s", ""]
    emit("\n".join(parts + body), output=args.output, section="rotary")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
