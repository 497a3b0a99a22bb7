"""Latent and sparse attention: selfattn's MultiHeadLatentAttention against transformers' DeepseekV3Attention.

Run from the repository root::

    .venv/bin/python benchmarks/latent_sparse.py            # full run, writes section latent-sparse-cpu of BENCHMARKS.md
    .venv/bin/python benchmarks/latent_sparse.py --quick    # smoke run: short caches, few repeats, prints only

A DeepSeek-V3-shaped layer scaled to fit a CPU (hidden 2048, 16 heads, q_lora 768, kv_lora 512,
nope 128, rope 64, v 128, DeepSeek-V3's YaRN, float32), loaded into selfattn from transformers'
``DeepseekV3Attention`` with the same weights. Every figure is a ratio of medians timed
round-robin in this run against transformers in the same rounds:

* decoding one token after a cache of 4,096 and 16,384 tokens (b=1): transformers' layer with
  its DynamicCache re-expands the whole cached latent through ``kv_b_proj`` each step; selfattn
  decodes absorbed (multi-query attention over the 576-wide latent) from a LatentCache. Both
  caches hold the same latents; the first step's outputs are compared;
* prefill plus backward, n=4096, b=1, against transformers with ``sdpa``;
* cache bytes per token per layer, both.

DeepSeek sparse attention rows join through :data:`DSA_PARTS` (see :func:`dsa_rows`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCHMARKS_MD, emit, load_average, log, machine_lines, measure, ratio, spread_note, table, verdict

import selfattn.masks as masks
from selfattn.latent import LatentCache, MultiHeadLatentAttention
from selfattn.sparse import SparseLatentAttention, SparseLatentCache

SECTION = "latent-sparse-cpu"
CPU = torch.device("cpu")
SHAPE = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)  # fmt: skip
ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip
STEPS = 4  # tokens decoded per timed round (both caches are rewound after them)

Rows = tuple[list[list[str]], list[list[str]]]


def hf_layer(implementation: str) -> tuple[nn.Module, nn.Module, Any]:
    """transformers' DeepseekV3Attention with seeded weights, its rotary module and its config."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

    config = transformers.DeepseekV3Config(
        vocab_size=64, num_hidden_layers=1, max_position_embeddings=163840, rope_parameters=dict(ROPE), **SHAPE
    )
    config._attn_implementation = implementation
    torch.manual_seed(0)
    layer = modeling.DeepseekV3Attention(config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return layer, modeling.DeepseekV3RotaryEmbedding(config), config


# ---------------------------------------------------------------------------- decoding


class _Decoders:
    """Both layers, both caches holding the same ``cached`` latents, and one decoding step of each."""

    def __init__(self, cached: int):
        import transformers

        self.hf, self.rotary, config = hf_layer("sdpa")
        self.mla = MultiHeadLatentAttention.from_transformers(self.hf)
        self.cached = cached
        gen = torch.Generator().manual_seed(1)
        latent = torch.randn(1, 1, cached, 512, generator=gen)
        k_rope = torch.randn(1, 1, cached, 64, generator=gen)
        self.hf_cache = transformers.DynamicCache(config=config)
        self.hf_cache.update(latent, k_rope, 0)
        self.cache = LatentCache(max_len=cached + STEPS)
        self.cache.update(latent, k_rope)
        self.tokens = torch.randn(1, STEPS, 2048, generator=gen)

    def hf_step(self, t: int) -> torch.Tensor:
        x = self.tokens[:, t : t + 1]
        position = torch.tensor([[self.cached + t]])
        out, _ = self.hf(x, position_embeddings=self.rotary(x, position), attention_mask=None, cache=self.hf_cache)
        return out

    def step(self, t: int) -> torch.Tensor:
        return self.mla(self.tokens[:, t : t + 1], cache=self.cache)

    def run_hf(self) -> None:
        with torch.no_grad():
            for t in range(STEPS):
                self.hf_step(t)
        self.hf_cache.crop(-STEPS)

    def run(self) -> None:
        with torch.no_grad():
            for t in range(STEPS):
                self.step(t)
        self.cache._store.length = self.cached  # rewind: the next round overwrites the decoded tokens

    def same_output(self) -> str:
        with torch.no_grad():
            theirs, ours = self.hf_step(0), self.step(0)
        self.hf_cache.crop(-1)
        self.cache._store.length = self.cached
        return f"{float((theirs - ours).abs().max()):.1e}"


def decoding_rows(timing: dict, spread: dict, threads: int, lengths: tuple[int, ...]) -> Rows:
    rows, targets = [], []
    goals = {4096: 20.0, 16384: 50.0}
    for cached in lengths:
        decoders = _Decoders(cached)
        difference = decoders.same_output()
        explained = decoders.mla.explain(decoders.tokens[:, :1], cache=decoders.cache)
        r = measure({"hf": decoders.run_hf, "selfattn": decoders.run}, device=CPU, spread=spread, **timing)
        speedup = r["hf"] / r["selfattn"]
        hf_rate, rate = STEPS / r["hf"], STEPS / r["selfattn"]
        rows.append([
            str(threads), f"{cached:,}", f"{hf_rate:.1f}", f"{rate:.1f}", ratio(speedup),
            f"{explained.computation}, {explained.route}", difference,
        ])  # fmt: skip
        goal = goals.get(cached)
        if goal is not None:
            name = f"decoding after {cached:,} tokens, {threads} thread(s): tokens/s >= {goal:.0f}x of transformers"
            targets.append([name, ratio(speedup), verdict(speedup >= goal)])
        del decoders
    return rows, targets


# ---------------------------------------------------------------------------- prefill + backward


def prefill_rows(timing: dict, spread: dict, threads: int, length: int) -> Rows:
    hf, rotary, config = hf_layer("sdpa")
    mla = MultiHeadLatentAttention.from_transformers(hf).train()
    hf.train()
    from transformers import masking_utils

    x = torch.randn(1, length, 2048, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(length)[None]

    def run_hf() -> None:
        inputs = x.clone().requires_grad_(True)
        mask = masking_utils.create_causal_mask(config, inputs, None, None, position_ids=positions)
        out, _ = hf(inputs, position_embeddings=rotary(inputs, positions), attention_mask=mask)
        out.sum().backward()

    def run() -> None:
        inputs = x.clone().requires_grad_(True)
        mla(inputs).sum().backward()

    explained = mla.explain(x)
    r = measure({"hf": run_hf, "selfattn": run}, device=CPU, spread=spread, **timing)
    relative = r["selfattn"] / r["hf"]
    row = [str(threads), f"{length:,}", f"{r['hf']:.2f}", f"{r['selfattn']:.2f}", ratio(relative)]
    row.append(f"{explained.computation}, {explained.route}")
    name = f"prefill + backward, n={length:,}, {threads} thread(s): time <= 1.0x of transformers sdpa"
    return [row], [[name, ratio(relative), verdict(relative <= 1.0)]]


def cache_rows() -> Rows:
    decoders = _Decoders(16)
    layer = decoders.hf_cache.layers[0]
    hf_bytes = (
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    ) // 16
    ours = decoders.cache.bytes_per_token
    row = ["DeepseekV3Attention, float32", str(hf_bytes), str(ours), f"{576 * 4}"]
    name = "cache bytes per token per layer: 576 x element size (transformers' own latent cache holds the same)"
    return [row], [[name, f"{ours} (transformers {hf_bytes})", verdict(ours == 576 * 4)]]


# ---------------------------------------------------------------------------- DeepSeek sparse attention (hook)


#: DSA sizes: tokens of the prefill (and of the cache decoded after) and picks per query (``--quick`` lowers them).
DSA_SIZES = {"n": 16384, "top_k": 2048}
#: DeepSeek-V3.2's indexer: 64 heads of 128 (rope 64), reading the hidden states and the query latent.
INDEXER = dict(index_n_heads=64, index_head_dim=128)


def dsa_layers(top_k: int) -> tuple[SparseLatentAttention, MultiHeadLatentAttention]:
    """transformers' DeepseekV32Attention (seeded weights) loaded whole, and its MLA part alone (dense)."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

    config = transformers.DeepseekV32Config(
        vocab_size=64, num_hidden_layers=1, max_position_embeddings=163840, rope_parameters=dict(ROPE),
        index_topk=top_k, **INDEXER, **SHAPE,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = modeling.DeepseekV32Attention(config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return SparseLatentAttention.from_transformers(layer), MultiHeadLatentAttention.from_transformers(layer)


def _dsa_prefill(timing: dict, spread: dict, threads: int, n: int, top_k: int) -> Rows:
    """The DSA layer's attention over the indexer's picks against the same layer attending densely (causal); the indexer alone.

    The sparse case is what :class:`~selfattn.sparse.SparseLatentAttention` runs after its indexer
    (``mask=masks.selected(picks)``, the computation the layer chooses: absorbed, on the "sparse
    selection" route, where the picks are few enough); the dense case is the same layer without
    the picks (expanded, PyTorch's fused causal kernel).
    """
    sparse, dense = dsa_layers(top_k)
    x = torch.randn(1, n, 2048, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(n)
    with torch.no_grad():
        started = time.perf_counter()
        picks = sparse.select(x, positions, None, None)
        indexer_s = time.perf_counter() - started  # timed once: at n=16384 it alone takes minutes
    cases = {"dense": lambda: dense(x), "sparse": lambda: dense(x, mask=masks.selected(picks))}
    with torch.no_grad():
        explained = dense.explain(x, mask=masks.selected(picks))
        dense_explained = dense.explain(x)
        r = measure(cases, device=CPU, spread=spread, **timing)
    speedup = r["dense"] / r["sparse"]
    row = [
        str(threads),
        f"prefill forward n={n:,}, top-k {top_k:,}: dense {dense_explained.computation} ({dense_explained.route}), "
        f"sparse {explained.computation} ({explained.route})",
        f"{r['dense']:.2f}", f"{r['sparse']:.2f}", ratio(speedup), f"{indexer_s:.2f}",
    ]  # fmt: skip
    name = f"DSA prefill forward n={n:,}, top-k {top_k:,}, {threads} thread(s): >= 3x faster than dense causal (indexer apart)"
    with_indexer = r["dense"] / (r["sparse"] + indexer_s)
    return [row], [[name, f"{ratio(speedup)} (with the indexer: {ratio(with_indexer)})", verdict(speedup >= 3.0)]]


def _dsa_decoding(timing: dict, spread: dict, threads: int, n: int, top_k: int) -> Rows:
    """One token after ``n`` cached ones: the whole DSA layer (indexer step included) against the dense layer."""
    sparse, dense = dsa_layers(top_k)
    gen = torch.Generator().manual_seed(4)
    latent, k_rope = torch.randn(1, 1, n, 512, generator=gen), torch.randn(1, 1, n, 64, generator=gen)
    sparse_cache, dense_cache = SparseLatentCache(max_len=n + STEPS), LatentCache(max_len=n + STEPS)
    sparse_cache.latent.update(latent, k_rope)
    dense_cache.update(latent, k_rope)
    sparse_cache.index_keys.extend(torch.randn(1, n, INDEXER["index_head_dim"], generator=gen), None)
    sparse_cache.index_keys.commit()
    tokens = torch.randn(1, STEPS, 2048, generator=gen)

    def steps(layer: nn.Module, cache: Any) -> None:
        with torch.no_grad():
            for t in range(STEPS):
                layer(tokens[:, t : t + 1], cache=cache)
        latent_cache = cache.latent if isinstance(cache, SparseLatentCache) else cache
        latent_cache._store.length = n  # rewind: the next round overwrites the decoded tokens
        if isinstance(cache, SparseLatentCache):
            cache.index_keys.length = n

    route = sparse.explain(tokens[:, :1], cache=sparse_cache).route
    r = measure(
        {"dense": lambda: steps(dense, dense_cache), "sparse": lambda: steps(sparse, sparse_cache)},
        device=CPU, spread=spread, **timing,
    )  # fmt: skip
    speedup = r["dense"] / r["sparse"]
    row = [
        str(threads), f"decoding after {n:,}, top-k {top_k:,}, whole layer, s per token ({route})", f"{r['dense'] / STEPS:.4f}",
        f"{r['sparse'] / STEPS:.4f}", ratio(speedup), "(included)",
    ]  # fmt: skip
    name = f"DSA decoding after {n:,} tokens, {threads} thread(s): >= 4x faster than dense decoding"
    return [row], [[name, ratio(speedup), verdict(speedup >= 4.0)]]


def dsa_rows(timing: dict, spread: dict, threads: int) -> Rows:
    """DSA rows: transformers' DeepseekV32Attention loaded whole (:class:`~selfattn.sparse.SparseLatentAttention`).

    Prefill forward of ``DSA_SIZES["n"]`` tokens: attention over the indexer's picks (``mask=
    masks.selected(picks)``, expanded and absorbed) against the same layer attending densely
    (causal), the indexer's own time beside (seconds per call); decoding one token after as many
    cached tokens, the whole layer (indexer step included) against the dense layer with a
    LatentCache (seconds per token).
    """
    n, top_k = DSA_SIZES["n"], DSA_SIZES["top_k"]
    rows, targets = _dsa_prefill(timing, spread, threads, n, top_k)
    more_rows, more_targets = _dsa_decoding(timing, spread, threads, n, top_k)
    return rows + more_rows, targets + more_targets


DECODING_HEADER = [
    "threads", "cached tokens", "transformers tok/s", "selfattn tok/s", "ratio", "selfattn computation, route",
    "max difference",
]  # fmt: skip
DSA_HEADER = ["threads", "case", "dense s", "sparse s", "ratio", "indexer s"]
#: The DSA parts of the benchmark: each gives its rows and targets.
DSA_PARTS: list[Callable[[dict, dict, int], Rows]] = [dsa_rows]


# ---------------------------------------------------------------------------- report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short caches and prefill, few repeats; prints only")
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to run at (default 1,2)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: decoding,prefill,dsa")
    parser.add_argument("--dsa-n", type=int, help=f"DSA tokens (default {DSA_SIZES['n']}, 1024 with --quick)")
    parser.add_argument("--dsa-top-k", type=int, help=f"DSA picks per query (default {DSA_SIZES['top_k']})")
    parser.add_argument("--repeats", type=int, help="timed repeats of each case (default 5, 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each case first (default 1)")
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    args.skip = set(filter(None, args.skip.split(",")))
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    args.lengths = (512, 2048) if args.quick else (4096, 16384)
    args.prefill = 512 if args.quick else 4096
    if args.quick:
        DSA_SIZES.update(n=1024, top_k=128)
    DSA_SIZES.update({k: v for k, v in (("n", args.dsa_n), ("top_k", args.dsa_top_k)) if v})
    repeats = args.repeats or (2 if args.quick else 5)
    args.timing = {"min_repeats": repeats, "max_repeats": repeats, "budget_s": 120.0, "warmup": args.warmup}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    decoding: list[list[str]] = []
    prefill: list[list[str]] = []
    dsa: list[list[str]] = []
    targets: list[list[str]] = []
    spread: dict = {}
    cache_table, goals = cache_rows()
    targets.extend(goals)
    for threads in args.threads:
        torch.set_num_threads(threads)
        if "decoding" not in args.skip:
            log(f"decoding, {threads} thread(s)")
            rows, goals = decoding_rows(args.timing, spread, threads, args.lengths)
            decoding += rows
            targets += goals
        if "prefill" not in args.skip:
            log(f"prefill + backward, {threads} thread(s)")
            rows, goals = prefill_rows(args.timing, spread, threads, args.prefill)
            prefill += rows
            targets += goals
        if "dsa" not in args.skip:
            for part in DSA_PARTS:
                rows, goals = part(args.timing, spread, threads)
                dsa += rows
                targets += goals
    lines = [
        "## Latent and sparse attention: MultiHeadLatentAttention against transformers' DeepseekV3Attention (cpu)",
        "",
        *machine_lines(CPU),
        f"- load average at end: {load_average()}; run took {time.perf_counter() - started:.0f} s",
        "- layer: hidden 2048, 16 heads, q_lora 768, kv_lora 512, nope 128, rope 64, v 128, DeepSeek-V3's YaRN, "
        "float32, the same weights on both sides",
        "",
        "**Targets** (ratios of medians timed round-robin in this run):",
        "",
        table(["target", "measured", "status"], targets),
        "",
        f"**Decoding one token** after the cache (b=1; {STEPS} tokens per round, both caches rewound after them); "
        "transformers with its DynamicCache (sdpa), selfattn with a LatentCache; the largest difference of the "
        "first step's outputs:",
        "",
        table(DECODING_HEADER, decoding),
        "",
        "**Prefill + backward** (b=1, causal, sum of the output backpropagated), seconds:",
        "",
        table(
            ["threads", "n", "transformers sdpa s", "selfattn s", "ratio (time)", "selfattn computation, route"],
            prefill,
        ),
        "",
        "**Cache bytes per token per layer**:",
        "",
        table(["layer", "transformers DynamicCache", "selfattn LatentCache", "576 x 4"], cache_table),
        "",
    ]
    if dsa:
        lines += ["**DeepSeek sparse attention**:", "", table(DSA_HEADER, dsa), ""]
    lines.append(spread_note(spread))
    emit("\n".join(lines), output=args.output, section=SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
