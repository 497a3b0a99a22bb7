"""DeepSeek sparse attention (DSA) on CPU: top-k selected keys on the sparse route against dense causal attention.

Run from the repository root::

    .venv/bin/python benchmarks/sparse_selection.py            # full size (n=16384, top-k 2048): section latent-sparse-cpu-dsa
    .venv/bin/python benchmarks/sparse_selection.py --quick    # n=2048, top-k 256: prints only, unless --output

Each figure is a ratio of medians timed round-robin in one run (dense and sparse in the same rounds):

* **prefill forward**: the attention of one layer over ``n`` tokens, each query attending to its
  top-k keys (``functional.sparse_attention``, the "sparse selection" route) against the same
  queries, keys and values attending densely under the causal mask (``functional.attention``,
  PyTorch's fused kernel). The lightning indexer that picks the keys
  (:class:`~selfattn.sparse.LightningIndexer`, DeepSeek-V3.2's sizes: 64 heads of 128, rope 64,
  from a hidden size of 2048 and a query latent of 768) is timed on its own and shown beside.
* **decoding** one token after ``n`` cached tokens: the indexer's step over its key cache plus
  attention over the picks, against dense attention of the one query over every cached key
  (``functional.attention``; with one key/value head, the heads as rows of one matrix product,
  which is faster than the fused kernel's grouped path).

Two geometries of the attention: the plain multi-head layer transformers' DSA models hand to an
attention function (16 heads, query/key head size 192, value 128: ``expand_kv``'s output), and
the absorbed latent form DeepSeek's own kernels run (16 query heads over one shared key/value
head: key 576 = latent 512 + rope 64, value 512), where each gathered key serves every head.
The picks are the indexer's own (random weights: picks spread over all earlier keys).
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
    log,
    machine_lines,
    measure,
    ms,
    ratio,
    spread_note,
    table,
    verdict,
)

from selfattn.core import dispatch
from selfattn.functional import attention, sparse_attention
from selfattn.functional._sparse import describe_sparse_attention
from selfattn.sparse import IndexerKeyCache, LightningIndexer

SECTION = "latent-sparse-cpu-dsa"
CPU = torch.device("cpu")
HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE = 2048, 768, 64, 128, 64
HEADS = 16
GEOMETRIES = {  # name: (kv heads, query/key head size, value head size)
    "multi-head 192/128": (HEADS, 192, 128),
    "latent 576/512 (16 heads, 1 kv head)": (1, 576, 512),
}
PREFILL_GOAL, DECODE_GOAL = 3.0, 4.0


def _heads(n: int, kv_heads: int, d: int, dv: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(1, HEADS, n, d, generator=gen)
    return q, torch.randn(1, kv_heads, n, d, generator=gen), torch.randn(1, kv_heads, n, dv, generator=gen)


def prefill_rows(n: int, top_k: int, timing: dict, spread: dict) -> tuple[list[list[str]], list[list[str]]]:
    gen = torch.Generator().manual_seed(0)
    indexer = LightningIndexer(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE, top_k).eval()
    hidden, latent = torch.randn(1, n, HIDDEN, generator=gen), torch.randn(1, n, Q_LORA, generator=gen)
    with torch.no_grad():
        started = time.perf_counter()
        picks = indexer(hidden, latent)
        indexer_s = time.perf_counter() - started  # one call: at full size it alone takes minutes
    rows, goals = [], []
    for name, (kv_heads, d, dv) in GEOMETRIES.items():
        q, k, v = _heads(n, kv_heads, d, dv, gen)
        cases = {
            "dense": lambda q=q, k=k, v=v: attention(q, k, v, causal=True),
            "sparse": lambda q=q, k=k, v=v: sparse_attention(q, k, v, picks, causal=True),
        }
        route = dispatch.explain(describe_sparse_attention(q, k, v, picks, causal=True)).route
        log(f"prefill n={n} top-k={top_k} {name}: {route}")
        with torch.no_grad():
            torch.testing.assert_close(cases["sparse"]().shape, cases["dense"]().shape)
            times = measure(cases, device=CPU, spread=spread, **timing)
        speedup = times["dense"] / times["sparse"]
        with_indexer = times["dense"] / (times["sparse"] + indexer_s)
        rows.append([f"{name} ({route})", ms(times["dense"]), ms(times["sparse"]), ms(indexer_s), ratio(speedup), ratio(with_indexer)])
        goals.append([f"DSA prefill forward, {name}, n={n}, top-k {top_k}: dense / sparse >= {PREFILL_GOAL:.0f}x",
                      f"{ratio(speedup)} (with the indexer: {ratio(with_indexer)})", verdict(speedup >= PREFILL_GOAL)])  # fmt: skip
    return rows, goals


def decode_rows(n: int, top_k: int, timing: dict, spread: dict) -> tuple[list[list[str]], list[list[str]]]:
    gen = torch.Generator().manual_seed(1)
    indexer = LightningIndexer(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE, top_k).eval()
    cache = IndexerKeyCache(n + 1)
    cache.extend(torch.randn(1, n, INDEX_DIM, generator=gen), None)  # the cached tokens' index keys
    cache.commit()
    hidden, latent = torch.randn(1, 1, HIDDEN, generator=gen), torch.randn(1, 1, Q_LORA, generator=gen)

    def select() -> torch.Tensor:
        picks = indexer(hidden, latent, cache=cache)
        cache.length = n  # rewind: every round decodes the same token after the same n
        return picks

    rows, goals = [], []
    for name, (kv_heads, d, dv) in GEOMETRIES.items():
        q, k, v = _heads(n + 1, kv_heads, d, dv, gen)
        q = q[:, :, -1:]
        with torch.no_grad():
            picks = select()
        cases = {
            "dense": lambda q=q, k=k, v=v: _dense_step(q, k, v),
            "indexer": select,
            "sparse": lambda q=q, k=k, v=v, picks=picks: sparse_attention(q, k, v, picks),
        }
        log(f"decoding after {n} tokens, top-k {top_k}, {name}")
        with torch.no_grad():
            times = measure(cases, device=CPU, spread=spread, **timing)
        dsa = times["indexer"] + times["sparse"]
        rows.append([name, ms(times["dense"]), ms(times["sparse"]), ms(times["indexer"]),
                     ratio(times["dense"] / times["sparse"]), ratio(times["dense"] / dsa)])  # fmt: skip
        goals.append([f"DSA decoding after {n} tokens, {name}: dense / (indexer + sparse) >= {DECODE_GOAL:.0f}x",
                      f"{ratio(times['dense'] / dsa)} (attention alone: {ratio(times['dense'] / times['sparse'])})",
                      verdict(times["dense"] / dsa >= DECODE_GOAL)])  # fmt: skip
    return rows, goals


def _dense_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query over every cached key: ``functional.attention`` for multi-head, matrix products for one kv head.

    With one key/value head the 16 query heads are one ``(16, d) x (d, n)`` product (absorbed
    latent decoding done densely); the fused kernel's grouped path would copy the keys per head.
    """
    if k.shape[1] > 1:
        return attention(q, k, v)  # one query at the end sees every key
    rows = q.transpose(1, 2)  # (1, 1, 16, d): every head a row of one product
    weights = torch.softmax(rows @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    return (weights @ v).transpose(1, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="n=2048, top-k 256, two repeats; prints only, unless --output"
    )
    parser.add_argument("--n", type=int, help="tokens (default 16384, 2048 with --quick)")
    parser.add_argument("--top-k", type=int, help="keys picked per query (default n / 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, help="timed prefill repeats (default 3, 2 with --quick)")
    parser.add_argument(
        "--parts", default="prefill,decode", help="comma-separated parts to run (default prefill,decode)"
    )
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    args = parser.parse_args(argv)
    args.n = args.n or (2048 if args.quick else 16384)
    args.top_k = args.top_k or args.n // 8
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    repeats = args.repeats or (2 if args.quick else 3)
    args.timing = {"min_repeats": repeats, "max_repeats": repeats, "budget_s": 600.0, "warmup": 1}
    args.decode_timing = {"min_repeats": 3 if args.quick else 5, "max_repeats": 15, "budget_s": 30.0, "warmup": 2}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    spread: dict = {}
    parts = set(args.parts.split(","))
    prefill, prefill_goals = prefill_rows(args.n, args.top_k, args.timing, spread) if "prefill" in parts else ([], [])
    decode, decode_goals = (
        decode_rows(args.n, args.top_k, args.decode_timing, spread) if "decode" in parts else ([], [])
    )
    header = [
        "attention geometry (route)",
        "dense ms",
        "sparse ms",
        "indexer ms",
        "dense / sparse",
        "dense / (sparse + indexer)",
    ]
    lines = [
        f"## DeepSeek sparse attention: top-k {args.top_k} of n={args.n} on the sparse route against dense (cpu)",
        "",
        *machine_lines(CPU),
        f"- load average at end: {load_average()}; run took {time.perf_counter() - started:.0f} s",
        "",
        "**Targets** (ratios of medians timed round-robin in this run):",
        "",
        table(["target", "measured", "status"], prefill_goals + decode_goals),
        "",
    ]
    if prefill:
        lines += [
            f"**Prefill forward**, n={args.n}, b=1, 16 query heads, fp32, causal; the indexer (64 heads of 128 "
            f"from d={HIDDEN}, q latent {Q_LORA}) timed once:",
            "",
            table(header, prefill),
            "",
        ]
    if decode:
        lines += [
            f"**Decoding one token** after {args.n} cached tokens (the indexer's key cache rewound after each round):",
            "",
            table(header, decode),
            "",
        ]
    lines.append(spread_note(spread))
    emit("\n".join(lines), output=args.output, section=SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
