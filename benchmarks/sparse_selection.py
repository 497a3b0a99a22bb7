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

import _dsa_bounds as bounds
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
from selfattn.core.routes.sparse import sparse_block_size  # after the dispatcher: it imports the routes
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
#: The second reading: the indexer scaled like the attention heads (DeepSeek-V3.2: 64 index heads for
#: 128 attention heads, so 8 for these 16), beside the issue's configuration, not replacing it.
SCALED_INDEX_HEADS = 8
#: Queries whose gathers are timed alone (evenly spread blocks), the time scaled to all of them.
GATHER_SAMPLE = 1024
BOUNDS_HEADER = ["part", "geometry", "quantity", "dense", "sparse", "dense / sparse"]


def _heads(n: int, kv_heads: int, d: int, dv: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``q, k, v``; with one kv head (the latent form) the values are the keys' first ``dv`` features, as the layer hands them."""
    q, k = torch.randn(1, HEADS, n, d, generator=gen), torch.randn(1, kv_heads, n, d, generator=gen)
    return q, k, k[..., :dv] if kv_heads == 1 else torch.randn(1, kv_heads, n, dv, generator=gen)


def prefill_rows(n: int, top_k: int, timing: dict, spread: dict) -> tuple[list[list[str]], ...]:
    gen = torch.Generator().manual_seed(0)
    indexer = LightningIndexer(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE, top_k).eval()
    scaled = LightningIndexer(HIDDEN, Q_LORA, SCALED_INDEX_HEADS, INDEX_DIM, ROPE, top_k).eval()
    hidden, latent = torch.randn(1, n, HIDDEN, generator=gen), torch.randn(1, n, Q_LORA, generator=gen)
    with torch.no_grad():  # one call each: at full size the 64-head indexer alone takes minutes
        started = time.perf_counter()
        picks = indexer(hidden, latent)
        indexer_s = time.perf_counter() - started
        started = time.perf_counter()
        scaled(hidden, latent)
        scaled_s = time.perf_counter() - started
    rows, goals, bound_rows = [], [], []
    for heads, seconds in ((INDEX_HEADS, indexer_s), (SCALED_INDEX_HEADS, scaled_s)):
        macs = bounds.PrefillWork(n, top_k, bounds.Sizes(index_heads=heads)).indexer()
        label = "the issue's configuration" if heads == INDEX_HEADS else "second reading, scaled like the heads"
        bound_rows.append(["prefill", "indexer", f"{heads} heads ({label}): multiply-adds, measured s (timed once)",
                           "", f"{bounds.giga(macs)}, {seconds:.2f} s", ""])  # fmt: skip
    for name, (kv_heads, d, dv) in GEOMETRIES.items():
        q, k, v = _heads(n, kv_heads, d, dv, gen)
        cases = {
            "dense": lambda q=q, k=k, v=v: _dense_causal(q, k, v),
            "sparse": lambda q=q, k=k, v=v: sparse_attention(q, k, v, picks, causal=True),
        }
        route = dispatch.explain(describe_sparse_attention(q, k, v, picks, causal=True)).route
        log(f"prefill n={n} top-k={top_k} {name}: {route}")
        with torch.no_grad():
            torch.testing.assert_close(cases["sparse"]().shape, cases["dense"]().shape)
            times = measure(cases, device=CPU, spread=spread, **timing)
        speedup = times["dense"] / times["sparse"]
        with_indexer = times["dense"] / (times["sparse"] + indexer_s)
        rows.append(
            [
                f"{name} ({route})",
                ms(times["dense"]),
                ms(times["sparse"]),
                ms(indexer_s),
                ratio(speedup),
                ratio(with_indexer),
            ]
        )
        counted = _prefill_macs(n, top_k, kv_heads, d, dv)
        goals.append([f"DSA prefill forward, {name}, n={n}, top-k {top_k}: dense / sparse >= {PREFILL_GOAL:.0f}x",
                      f"{ratio(speedup)} (bound from the work {ratio(counted[0] / counted[1])}; with the indexer: {ratio(with_indexer)})",
                      verdict(speedup >= PREFILL_GOAL)])  # fmt: skip
        with torch.no_grad():
            bound_rows += _prefill_bounds(name, n, top_k, (q, k, v), picks, times)
    return rows, goals, bound_rows


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention as the layer runs it: values padded to the key size, so PyTorch's flash kernel takes it.

    With unequal sizes (192/128) the fused call falls back to PyTorch's math path, which computes
    every pair (3x slower measured at n=2048, 16 heads, one thread) and at n=16384 holds 17 GB of weights; the expanded
    MLA call pads its values for the same reason (``selfattn.latent.functional._expanded_call``).
    """
    if v.shape[-1] == k.shape[-1]:
        return attention(q, k, v, causal=True)
    padded = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
    return attention(q, k, padded, causal=True)[..., : v.shape[-1]]


def _prefill_macs(n: int, top_k: int, kv_heads: int, d: int, dv: int) -> tuple[int, int]:
    """(dense causal, sparse) multiply-adds of the attention alone: ``pairs x heads x (d + dv)``."""
    return bounds.causal_pairs(n) * HEADS * (d + dv), n * top_k * HEADS * (d + dv)


def _prefill_bounds(
    name: str, n: int, top_k: int, qkv: tuple[torch.Tensor, ...], picks: torch.Tensor, times: dict[str, float]
) -> list[list[str]]:
    """Counted work, bytes gathered per query and measured floors of one geometry's prefill (rows of :data:`BOUNDS_HEADER`)."""
    q, k, v = qkv
    kv_heads, d, dv = k.shape[1], k.shape[-1], v.shape[-1]
    dense_macs, sparse_macs = _prefill_macs(n, top_k, kv_heads, d, dv)
    block = sparse_block_size(describe_sparse_attention(q, k, v, picks, causal=True), top_k)
    rate = bounds.sparse_product_rate(top_k, HEADS // kv_heads, d, dv, block)
    gather_s, timed = bounds.gather_seconds(k[0, 0], picks[0], block, sample=GATHER_SAMPLE)
    shared = v.data_ptr() == k.data_ptr()  # the latent's values are its keys' first features: gathered with them
    gather_s *= (n / timed) * kv_heads * (1 if shared else (d + dv) / d)  # every kv head's keys, and values apart
    floor_s = gather_s + sparse_macs / rate
    per_query = bounds.gathered_bytes_per_query(top_k, kv_heads, d, dv, shared=shared)
    return [
        ["prefill", name, "multiply-adds of the attention (the bound at equal speed)", bounds.giga(dense_macs),
         bounds.giga(sparse_macs), ratio(dense_macs / sparse_macs)],
        ["prefill", name, "bytes gathered per query", "", bounds.megabytes(per_query), ""],
        ["prefill", name, f"measured: rate of the dense pass / of the sparse pass's products on gathered rows (block {block})",
         f"{dense_macs / times['dense'] / 1e9:.1f} GMAC/s", f"{rate / 1e9:.1f} GMAC/s", ""],
        ["prefill", name, f"measured floor: gathers alone {gather_s:.1f} s (timed on {timed} queries, scaled) + products "
         f"at their rate {sparse_macs / rate:.1f} s", f"{times['dense']:.1f} s (measured)",
         f"{floor_s:.1f} s (measured {times['sparse']:.1f} s)", f"at best {ratio(times['dense'] / floor_s)}"],
    ]  # fmt: skip


def decode_rows(n: int, top_k: int, timing: dict, spread: dict) -> tuple[list[list[str]], ...]:
    gen = torch.Generator().manual_seed(1)
    indexers = {heads: LightningIndexer(HIDDEN, Q_LORA, heads, INDEX_DIM, ROPE, top_k).eval()
                for heads in (INDEX_HEADS, SCALED_INDEX_HEADS)}  # fmt: skip
    cache = IndexerKeyCache(n + 1)
    cache.extend(torch.randn(1, n, INDEX_DIM, generator=gen), None)  # the cached tokens' index keys
    cache.commit()
    hidden, latent = torch.randn(1, 1, HIDDEN, generator=gen), torch.randn(1, 1, Q_LORA, generator=gen)

    def select(heads: int = INDEX_HEADS) -> torch.Tensor:
        picks = indexers[heads](hidden, latent, cache=cache)
        cache.length = n  # rewind: every round decodes the same token after the same n
        return picks

    rows, goals = [], []
    bound_rows = _decode_floors(n, top_k, indexers, gen)
    for name, (kv_heads, d, dv) in GEOMETRIES.items():
        q, k, v = _heads(n + 1, kv_heads, d, dv, gen)
        q = q[:, :, -1:]
        with torch.no_grad():
            picks = select()
        cases = {
            "dense": lambda q=q, k=k, v=v: _dense_step(q, k, v),
            "indexer": select,
            "indexer 8": lambda: select(SCALED_INDEX_HEADS),
            "sparse": lambda q=q, k=k, v=v, picks=picks: sparse_attention(q, k, v, picks),
        }
        log(f"decoding after {n} tokens, top-k {top_k}, {name}")
        with torch.no_grad():
            times = measure(cases, device=CPU, spread=spread, **timing)
        dsa = times["indexer"] + times["sparse"]
        rows.append([name, ms(times["dense"]), ms(times["sparse"]), ms(times["indexer"]),
                     ratio(times["dense"] / times["sparse"]), ratio(times["dense"] / dsa)])  # fmt: skip
        scaled = times["indexer 8"] + times["sparse"]
        goals.append([f"DSA decoding after {n} tokens, {name}: dense / (indexer + sparse) >= {DECODE_GOAL:.0f}x",
                      f"{ratio(times['dense'] / dsa)} (attention alone: {ratio(times['dense'] / times['sparse'])}; "
                      f"second reading, {SCALED_INDEX_HEADS} index heads: {ratio(times['dense'] / scaled)})",
                      verdict(times["dense"] / dsa >= DECODE_GOAL)])  # fmt: skip
        dense_bytes = n * kv_heads * (d if kv_heads == 1 else d + dv) * 4  # the latent's values are its keys' features
        sparse_bytes = bounds.gathered_bytes_per_query(top_k, kv_heads, d, dv, shared=kv_heads == 1)
        index_key_bytes = n * INDEX_DIM * 4
        bound_rows.append(["decoding", name, "bytes of cache read: dense (every key and value) / sparse (the index keys "
                           "+ the picked rows); the indexer's weights apart (above)", bounds.megabytes(dense_bytes),
                           f"{bounds.megabytes(index_key_bytes)} + {bounds.megabytes(sparse_bytes)}",
                           ratio(dense_bytes / (index_key_bytes + sparse_bytes))])  # fmt: skip
        bound_rows.append(["decoding", name, "measured: dense step / sparse attention alone / indexer (64 heads; 8 heads)",
                           ms(times["dense"]), f"{ms(times['sparse'])} / {ms(times['indexer'])}; {ms(times['indexer 8'])}",
                           ratio(times["dense"] / dsa)])  # fmt: skip
    return rows, goals, bound_rows


def _decode_floors(n: int, top_k: int, indexers: dict[int, LightningIndexer], gen: torch.Generator) -> list[list[str]]:
    """The indexer's share of a decoded token: its weights' bytes, and the measured time of reading them and its keys."""
    rows = []
    for heads, indexer in indexers.items():
        weights = [indexer.wq_b.weight, indexer.wk.weight, indexer.weights_proj.weight]
        weight_bytes = sum(w.numel() for w in weights) * 4
        with torch.no_grad():
            weights_s = bounds.weights_pass_seconds(weights)
            keys, queries = torch.randn(n, INDEX_DIM, generator=gen), torch.randn(heads, INDEX_DIM, generator=gen)
            scores_s = bounds._seconds(lambda keys=keys, queries=queries: torch.relu(queries @ keys.T))
        label = "the issue's configuration" if heads == INDEX_HEADS else "second reading, scaled like the heads"
        rows.append(["decoding", f"indexer, {heads} heads ({label})",
                     f"bytes of its weights (wq_b, wk, weights_proj); measured floor: one pass over them "
                     f"{weights_s * 1e3:.2f} ms + its scores over {n:,} keys {scores_s * 1e3:.2f} ms", "",
                     f"{bounds.megabytes(weight_bytes)}; {(weights_s + scores_s) * 1e3:.2f} ms", ""])  # fmt: skip
    return rows


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
    parser.add_argument("--warmup", type=int, default=1, help="untimed prefill runs of each case first (default 1)")
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
    args.timing = {"min_repeats": repeats, "max_repeats": repeats, "budget_s": 600.0, "warmup": args.warmup}
    args.decode_timing = {"min_repeats": 3 if args.quick else 5, "max_repeats": 15, "budget_s": 30.0, "warmup": 2}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    spread: dict = {}
    parts = set(args.parts.split(","))
    prefill, prefill_goals, prefill_bounds = (
        prefill_rows(args.n, args.top_k, args.timing, spread) if "prefill" in parts else ([], [], [])
    )
    decode, decode_goals, decode_bounds = (
        decode_rows(args.n, args.top_k, args.decode_timing, spread) if "decode" in parts else ([], [], [])
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
    if prefill_bounds or decode_bounds:
        lines += [
            "**What the work allows** (`benchmarks/_dsa_bounds.py`): the work counted, and floors measured in this run "
            '(a floor is the least time the sparse case\'s own parts take on this machine; "at best" = the measured '
            "dense time over it):",
            "",
            table(BOUNDS_HEADER, prefill_bounds + decode_bounds),
            "",
        ]
    lines.append(spread_note(spread))
    emit("\n".join(lines), output=args.output, section=SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
