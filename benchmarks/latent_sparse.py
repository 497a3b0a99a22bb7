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

import _dsa_bounds as bounds
from _common import BENCHMARKS_MD, emit, load_average, log, machine_lines, measure, ratio, spread_note, table, verdict

import selfattn.masks as masks
from selfattn.latent import LatentCache, MultiHeadLatentAttention
from selfattn.sparse import SparseLatentAttention, SparseLatentCache

SECTION = "latent-sparse-cpu"
DSA_SECTION = "latent-sparse-cpu-dsa-layer"  # --skip decoding,prefill: the DSA layer's rows alone
DSA_TITLE = "## DeepSeek sparse attention in the whole layer: top-k against dense, with the bounds of the work (cpu)"
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
        with torch.no_grad():  # as the steps run
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
#: The second reading: the indexer scaled like the attention heads (DeepSeek-V3.2 has 64 index heads
#: for 128 attention heads, so 8 for this 16-head layer). It does not replace the issue's configuration.
SCALED_INDEX_HEADS = 8

DsaRows = tuple[list[list[str]], list[list[str]], list[list[str]]]  # rows, targets, bounds


def dsa_layers(
    top_k: int, index_heads: int = INDEXER["index_n_heads"]
) -> tuple[SparseLatentAttention, MultiHeadLatentAttention]:
    """transformers' DeepseekV32Attention (seeded weights) loaded whole, and its MLA part alone (dense)."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

    config = transformers.DeepseekV32Config(
        vocab_size=64, num_hidden_layers=1, max_position_embeddings=163840, rope_parameters=dict(ROPE),
        index_topk=top_k, **dict(INDEXER, index_n_heads=index_heads), **SHAPE,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = modeling.DeepseekV32Attention(config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return SparseLatentAttention.from_transformers(layer), MultiHeadLatentAttention.from_transformers(layer)


def _timed_once(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def _projections_seconds(layer: MultiHeadLatentAttention, n: int) -> float:
    """One pass of the absorbed layer's projections over ``n`` tokens: ``q_a, q_b, kv_a, o`` and folding ``kv_b`` in."""
    assert layer.q_a_proj is not None and layer.q_b_proj is not None
    heads, nope, rank, value = layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank, layer.v_head_dim
    per_head = layer.kv_b_proj.weight.view(heads, nope + value, rank)
    w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
    gen = torch.Generator().manual_seed(5)
    x, q_latent = torch.randn(n, layer.hidden_size, generator=gen), torch.randn(n, layer.q_lora_rank, generator=gen)
    q_nope, latent_out = torch.randn(n, heads, nope, generator=gen), torch.randn(n, heads, rank, generator=gen)
    heads_out = torch.randn(n, heads * value, generator=gen)

    def projections() -> None:
        layer.q_a_proj(x), layer.q_b_proj(q_latent), layer.kv_a_proj_with_mqa(x), layer.o_proj(heads_out)
        torch.einsum("qhn,hnr->qhr", q_nope, w_uk), torch.einsum("qhr,hvr->qhv", latent_out, w_uv)

    return _timed_once(projections)[1]


def _prefill_bounds(
    n: int,
    top_k: int,
    dense_s: float,
    sparse_s: float,
    indexer_s: dict[int, float],
    layer: MultiHeadLatentAttention,
    picks: torch.Tensor,
) -> list[list[str]]:
    """The prefill's counted work and measured floors (``_dsa_bounds``), as rows of :data:`BOUNDS_HEADER`."""
    work = bounds.PrefillWork(n, top_k)
    from selfattn.core.routes.sparse import GATHERED_ELEMENTS  # here: importing the route first would be circular

    block = max(1, GATHERED_ELEMENTS // (top_k * 576))  # the sparse route's queries per block (sparse_block_size)
    square_rate = bounds.square_product_rate()
    sparse_rate = bounds.sparse_product_rate(top_k, 16, 576, 512, block)
    latent = torch.randn(n, 576, generator=torch.Generator().manual_seed(6))
    gather_s, timed = bounds.gather_seconds(latent, picks[0], block, sample=2048)
    gather_s *= n / timed
    projections_s = _projections_seconds(layer, n)
    attention_macs = n * top_k * 16 * (576 + 512)
    floor_s = projections_s + gather_s + attention_macs / sparse_rate
    dense_macs, sparse_macs = work.dense_expanded(), work.sparse_latent()
    rows = [
        ["multiply-adds, dense causal / sparse, expanded (multi-head 192/128)", bounds.giga(work.dense_expanded()),
         bounds.giga(work.sparse_expanded()), ratio(work.dense_expanded() / work.sparse_expanded())],
        ["multiply-adds, dense causal / sparse, latent (absorbed 576/512)", bounds.giga(work.dense_latent()),
         bounds.giga(work.sparse_latent()), ratio(work.dense_latent() / work.sparse_latent())],
        ["multiply-adds as the benchmark runs them: dense expanded / sparse latent (the bound at equal speed)",
         bounds.giga(dense_macs), bounds.giga(sparse_macs), ratio(dense_macs / sparse_macs)],
        ["bytes gathered per query: expanded (16 kv heads, keys and values) / latent (one 576-wide row per pick)",
         bounds.megabytes(bounds.gathered_bytes_per_query(top_k, 16, 192, 128, shared=False)),
         bounds.megabytes(bounds.gathered_bytes_per_query(top_k, 1, 576, 512, shared=True)), ""],
        [f"measured: matrix-product rate, square {bounds.SQUARE} / the sparse pass's products (16 rows x picks, block "
         f"{block})", f"{square_rate / 1e9:.1f} GMAC/s", f"{sparse_rate / 1e9:.1f} GMAC/s", ""],
        ["measured: dense layer's rate (its multiply-adds / its time) / the sparse layer's",
         f"{dense_macs / dense_s / 1e9:.1f} GMAC/s", f"{sparse_macs / sparse_s / 1e9:.1f} GMAC/s", ""],
        [f"measured floor of the sparse layer: projections {projections_s:.1f} s + gathers alone {gather_s:.1f} s "
         f"(timed on {timed} queries, scaled) + its products at their rate {attention_macs / sparse_rate:.1f} s",
         f"{dense_s:.1f} s (measured)", f"{floor_s:.1f} s", f"at best {ratio(dense_s / floor_s)}"],
        ["peak floor: the sparse layer's multiply-adds at the square product rate, nothing gathered",
         f"{dense_s:.1f} s (measured)", f"{sparse_macs / square_rate:.1f} s", f"at best {ratio(dense_s / (sparse_macs / square_rate))}"],
    ]  # fmt: skip
    for heads, seconds in indexer_s.items():
        index_macs = bounds.PrefillWork(n, top_k, bounds.Sizes(index_heads=heads)).indexer()
        label = (
            "the issue's configuration"
            if heads == INDEXER["index_n_heads"]
            else "second reading, scaled like the heads"
        )
        rows.append([
            f"indexer, {heads} heads ({label}): multiply-adds, measured s (shown apart; dense column: the dense layer)",
            f"{bounds.giga(dense_macs)}, {dense_s:.1f} s", f"{bounds.giga(index_macs)}, {seconds:.1f} s",
            f"layer with indexer: measured {ratio(dense_s / (sparse_s + seconds))}, counted {ratio(dense_macs / (sparse_macs + index_macs))}",
        ])  # fmt: skip
    return rows


def _dsa_prefill(timing: dict, spread: dict, threads: int, n: int, top_k: int) -> DsaRows:
    """The DSA layer's attention over the indexer's picks against the same layer attending densely (causal); the indexer alone.

    The sparse case is what :class:`~selfattn.sparse.SparseLatentAttention` runs after its indexer
    (``mask=masks.selected(picks)``, the computation the layer chooses: absorbed, on the "sparse
    selection" route, where the picks are few enough); the dense case is the same layer without
    the picks (expanded, PyTorch's fused causal kernel). The indexer is timed once, at 64 heads
    and (second reading) at :data:`SCALED_INDEX_HEADS`.
    """
    sparse, dense = dsa_layers(top_k)
    scaled, _ = dsa_layers(top_k, SCALED_INDEX_HEADS)
    x = torch.randn(1, n, 2048, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(n)
    with torch.no_grad():  # each timed once: at n=16384 the 64-head indexer alone takes minutes
        picks, indexer_s = _timed_once(lambda: sparse.select(x, positions, None, None))
        scaled_s = _timed_once(lambda: scaled.select(x, positions, None, None))[1]
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
        f"{r['dense']:.2f}", f"{r['sparse']:.2f}", ratio(speedup),
        f"{indexer_s:.2f} ({SCALED_INDEX_HEADS} heads: {scaled_s:.2f})",
    ]  # fmt: skip
    name = f"DSA prefill forward n={n:,}, top-k {top_k:,}, {threads} thread(s): >= 3x faster than dense causal (indexer apart)"
    with_indexer = r["dense"] / (r["sparse"] + indexer_s)
    counted = bounds.PrefillWork(n, top_k)
    status = f"{ratio(speedup)} (bound from the work {ratio(counted.dense_expanded() / counted.sparse_latent())}; with the indexer: {ratio(with_indexer)})"
    with torch.no_grad():
        bound_rows = _prefill_bounds(
            n, top_k, r["dense"], r["sparse"], {64: indexer_s, SCALED_INDEX_HEADS: scaled_s}, dense, picks
        )
    bound_rows = [[str(threads), "prefill", *b] for b in bound_rows]
    return [row], [[name, status, verdict(speedup >= 3.0)]], bound_rows


def _decode_bounds(
    n: int, top_k: int, measured: dict[str, float], layers: dict[int, SparseLatentAttention]
) -> list[list[str]]:
    """A decoded token's counted bytes and multiply-adds, and its measured floors, as rows of :data:`BOUNDS_HEADER`."""
    rows = []
    dense_s = measured["dense"] / STEPS
    gen = torch.Generator().manual_seed(7)
    latent = torch.randn(n, 576, generator=gen)
    picks = torch.randint(0, n, (1, top_k), generator=gen)
    gather_s = bounds.gather_seconds(latent, picks, 1)[0]
    any_layer = next(iter(layers.values()))
    layer_weights = [m.weight for m in (any_layer.q_a_proj, any_layer.q_b_proj, any_layer.kv_a_proj_with_mqa,
                                        any_layer.kv_b_proj, any_layer.o_proj) if m is not None]  # fmt: skip
    layer_s = bounds.weights_pass_seconds(layer_weights)
    rows.append(
        [
            "measured: one pass over the layer's weights at one token (reading them once)",
            "",
            f"{layer_s * 1e3:.2f} ms",
            "",
        ]
    )
    for heads, layer in layers.items():
        work = bounds.DecodeWork(n, top_k, bounds.Sizes(index_heads=heads))
        layer_bytes, index_bytes = work.weight_bytes()
        indexer = layer.indexer
        assert indexer is not None
        index_s = bounds.weights_pass_seconds([indexer.wq_b.weight, indexer.wk.weight, indexer.weights_proj.weight])
        keys, queries = torch.randn(n, 128, generator=gen), torch.randn(heads, 128, generator=gen)
        scores_s = bounds._seconds(lambda keys=keys, queries=queries: torch.relu(queries @ keys.T))
        floor_s = layer_s + index_s + scores_s + gather_s
        sparse_s = measured[f"sparse {heads}"] / STEPS
        label = (
            "the issue's configuration"
            if heads == INDEXER["index_n_heads"]
            else "second reading, scaled like the heads"
        )
        rows += [
            [f"{heads} index heads ({label}): bytes of weights read, layer + indexer (wq_b, wk, weights_proj)",
             bounds.megabytes(layer_bytes), f"{bounds.megabytes(layer_bytes)} + {bounds.megabytes(index_bytes)}", ""],
            [f"{heads} index heads: bytes of cache read (dense: the latents; sparse: the index keys + the picked latents)",
             bounds.megabytes(work.dense_cache_bytes()), bounds.megabytes(work.sparse_cache_bytes()), ""],
            [f"{heads} index heads: all bytes read / all multiply-adds (the bounds at equal speed per byte / per multiply-add)",
             f"{bounds.megabytes(work.dense_bytes())} / {work.dense_macs() / 1e6:,.0f} M",
             f"{bounds.megabytes(work.sparse_bytes())} / {work.sparse_macs() / 1e6:,.0f} M",
             f"{ratio(work.dense_bytes() / work.sparse_bytes())} / {ratio(work.dense_macs() / work.sparse_macs())}"],
            [f"{heads} index heads: measured floor = layer weights {layer_s * 1e3:.2f} + indexer weights {index_s * 1e3:.2f} "
             f"+ index scores over {n:,} keys {scores_s * 1e3:.2f} + gather of {top_k} rows {gather_s * 1e3:.2f} ms",
             f"{dense_s * 1e3:.2f} ms (measured)", f"{floor_s * 1e3:.2f} ms (measured step {sparse_s * 1e3:.2f} ms)",
             f"at best {ratio(dense_s / floor_s)} (measured {ratio(dense_s / sparse_s)})"],
        ]  # fmt: skip
    return rows


def _dsa_decoding(timing: dict, spread: dict, threads: int, n: int, top_k: int) -> DsaRows:
    """One token after ``n`` cached ones: the whole DSA layer (indexer step included) against the dense layer.

    The DSA layer runs with DeepSeek-V3.2's 64 index heads and (second reading, in the same rounds)
    with :data:`SCALED_INDEX_HEADS`.
    """
    sparse, dense = dsa_layers(top_k)
    layers = {INDEXER["index_n_heads"]: sparse, SCALED_INDEX_HEADS: dsa_layers(top_k, SCALED_INDEX_HEADS)[0]}
    gen = torch.Generator().manual_seed(4)
    latent, k_rope = torch.randn(1, 1, n, 512, generator=gen), torch.randn(1, 1, n, 64, generator=gen)
    dense_cache = LatentCache(max_len=n + STEPS)
    dense_cache.update(latent, k_rope)
    index_keys = torch.randn(1, n, INDEXER["index_head_dim"], generator=gen)
    caches = {}
    for heads in layers:
        caches[heads] = SparseLatentCache(max_len=n + STEPS)
        caches[heads].latent.update(latent, k_rope)
        caches[heads].index_keys.extend(index_keys, None)
        caches[heads].index_keys.commit()
    tokens = torch.randn(1, STEPS, 2048, generator=gen)

    def steps(layer: nn.Module, cache: Any) -> None:
        with torch.no_grad():
            for t in range(STEPS):
                layer(tokens[:, t : t + 1], cache=cache)
        latent_cache = cache.latent if isinstance(cache, SparseLatentCache) else cache
        latent_cache._store.length = n  # rewind: the next round overwrites the decoded tokens
        if isinstance(cache, SparseLatentCache):
            cache.index_keys.length = n

    route = sparse.explain(tokens[:, :1], cache=caches[INDEXER["index_n_heads"]]).route
    cases: dict[str, Callable[[], None]] = {"dense": lambda: steps(dense, dense_cache)}
    for heads, layer in layers.items():
        cases[f"sparse {heads}"] = lambda layer=layer, cache=caches[heads]: steps(layer, cache)
    r = measure(cases, device=CPU, spread=spread, **timing)
    full_s, scaled_s = r[f"sparse {INDEXER['index_n_heads']}"], r[f"sparse {SCALED_INDEX_HEADS}"]
    speedup = r["dense"] / full_s
    row = [
        str(threads), f"decoding after {n:,}, top-k {top_k:,}, whole layer, s per token ({route})",
        f"{r['dense'] / STEPS:.4f}",
        f"{full_s / STEPS:.4f} ({SCALED_INDEX_HEADS} index heads: {scaled_s / STEPS:.4f}, {ratio(r['dense'] / scaled_s)})",
        ratio(speedup), "(included)",
    ]  # fmt: skip
    work = bounds.DecodeWork(n, top_k)
    name = f"DSA decoding after {n:,} tokens, {threads} thread(s): >= 4x faster than dense decoding"
    status = f"{ratio(speedup)} (bound from the bytes read {ratio(work.dense_bytes() / work.sparse_bytes())})"
    with torch.no_grad():
        bound_rows = [[str(threads), "decoding", *b] for b in _decode_bounds(n, top_k, r, layers)]
    return [row], [[name, status, verdict(speedup >= 4.0)]], bound_rows


def dsa_rows(timing: dict, spread: dict, threads: int) -> DsaRows:
    """DSA rows: transformers' DeepseekV32Attention loaded whole (:class:`~selfattn.sparse.SparseLatentAttention`).

    Prefill forward of ``DSA_SIZES["n"]`` tokens: attention over the indexer's picks (``mask=
    masks.selected(picks)``, expanded and absorbed) against the same layer attending densely
    (causal), the indexer's own time beside (seconds per call); decoding one token after as many
    cached tokens, the whole layer (indexer step included) against the dense layer with a
    LatentCache (seconds per token). Each part also gives its bounds (``_dsa_bounds``).
    """
    n, top_k = DSA_SIZES["n"], DSA_SIZES["top_k"]
    rows, targets, bound_rows = _dsa_prefill(timing, spread, threads, n, top_k)
    more_rows, more_targets, more_bounds = _dsa_decoding(timing, spread, threads, n, top_k)
    return rows + more_rows, targets + more_targets, bound_rows + more_bounds


DECODING_HEADER = [
    "threads", "cached tokens", "transformers tok/s", "selfattn tok/s", "ratio", "selfattn computation, route",
    "max difference",
]  # fmt: skip
DSA_HEADER = ["threads", "case", "dense s", "sparse s", "ratio", "indexer s"]
BOUNDS_HEADER = ["threads", "part", "quantity", "dense", "sparse", "dense / sparse"]
#: The DSA parts of the benchmark: each gives its rows, targets and bounds.
DSA_PARTS: list[Callable[[dict, dict, int], DsaRows]] = [dsa_rows]


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
    dsa_bounds: list[list[str]] = []
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
                rows, goals, bound_rows = part(args.timing, spread, threads)
                dsa += rows
                targets += goals
                dsa_bounds += bound_rows
    # DSA alone (its runs take the longest) goes to a section of its own, leaving the MLA rows of the last full run.
    dsa_only = "decoding" in args.skip and "prefill" in args.skip
    section = DSA_SECTION if dsa_only else SECTION
    title = (
        DSA_TITLE
        if dsa_only
        else "## Latent and sparse attention: MultiHeadLatentAttention against transformers' DeepseekV3Attention (cpu)"
    )
    lines = [
        title,
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
    ]
    if not dsa_only:
        lines += [
            f"**Decoding one token** after the cache (b=1; {STEPS} tokens per round, both caches rewound after "
            "them); transformers with its DynamicCache (sdpa), selfattn with a LatentCache; the largest difference "
            "of the first step's outputs:",
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
        ]
    lines += [
        "**Cache bytes per token per layer**:",
        "",
        table(["layer", "transformers DynamicCache", "selfattn LatentCache", "576 x 4"], cache_table),
        "",
    ]
    if dsa:
        lines += ["**DeepSeek sparse attention**:", "", table(DSA_HEADER, dsa), ""]
        lines += [
            "**What the work allows** (`benchmarks/_dsa_bounds.py`): the work counted for dense and sparse, and "
            "floors measured in this run (a floor is the least time the sparse case's own parts take on this "
            'machine; "at best" = the measured dense time over it):',
            "",
            table(BOUNDS_HEADER, dsa_bounds),
            "",
        ]
    lines.append(spread_note(spread))
    emit("\n".join(lines), output=args.output, section=section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
