"""What DeepSeek sparse attention can gain over dense attention at given sizes: the work counted, and measured floors.

The DSA benchmarks (``latent_sparse.py``, ``sparse_selection.py``) print these beside their
measured ratios, so a reader sees from the work alone what ratio is possible:

* **counted**: multiply-adds of the dense causal pass and of the sparse pass (each query over its
  ``k`` picks), in the expanded multi-head form (query/key 192, value 128) and in the absorbed
  latent form (one shared key 576, value 512, 16 query heads); bytes gathered per query; for a
  decoded token, the bytes of weights and of cache it must read. At equal speed per multiply-add
  (or per byte) the ratio of the counts is the best the sparse pass can reach.
* **measured floors**, in the same run: the machine's matrix-product rate (a large square product,
  and the products the sparse pass does, ``16 x 576`` rows against each query's picks), the time
  of the gathers alone, and the time of reading the weights once (one pass of every projection at
  one token). "At best" is then a measured time of the dense case over the sum of the sparse
  case's measured floors: no implementation of the same arithmetic on this machine can do better.

Sizes are DeepSeek-V3's scaled to fit (:data:`LAYER`); counts are per sequence (prefill) or per
token (decoding), float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOAT32 = 4


@dataclass(frozen=True)
class Sizes:
    """The DSA layer's sizes (``index_heads``: the indexer's, 64 in DeepSeek-V3.2)."""

    hidden: int = 2048
    heads: int = 16
    q_lora: int = 768
    rank: int = 512
    nope: int = 128
    rope: int = 64
    value: int = 128
    index_heads: int = 64
    index_dim: int = 128

    @property
    def key(self) -> int:
        """Query/key head size of the expanded form (``nope + rope``)."""
        return self.nope + self.rope

    def layer_weights(self) -> int:
        """Elements of the attention layer's projections: ``q_a, q_b, kv_a, kv_b, o``."""
        q = self.hidden * self.q_lora + self.q_lora * self.heads * self.key
        kv = self.hidden * (self.rank + self.rope) + self.rank * self.heads * (self.nope + self.value)
        return q + kv + self.heads * self.value * self.hidden

    def indexer_weights(self) -> int:
        """Elements of the indexer's ``wq_b``, ``wk`` and ``weights_proj``."""
        return self.q_lora * self.index_heads * self.index_dim + self.hidden * (self.index_dim + self.index_heads)

    def absorbing(self) -> int:
        """Per-token multiply-adds folding ``W_uk`` into the query and ``W_uv`` into the output, all heads."""
        return self.heads * self.rank * (self.nope + self.value)


LAYER = Sizes()


def causal_pairs(n: int) -> int:
    """Query-key pairs a causal pass over ``n`` tokens computes."""
    return n * (n + 1) // 2


@dataclass(frozen=True)
class PrefillWork:
    """Multiply-adds of one ``n``-token forward pass (projections included), picks ``k`` per query."""

    n: int
    k: int
    sizes: Sizes = LAYER

    def dense_expanded(self) -> int:
        """The layer attending densely, multi-head (what transformers runs; the benchmarks' dense case)."""
        s = self.sizes
        return self.n * s.layer_weights() + causal_pairs(self.n) * s.heads * (s.key + s.value)

    def dense_latent(self) -> int:
        """The layer attending densely, absorbed (16 heads over the 576-wide latent, values 512)."""
        s = self.sizes
        projections = self.n * (s.layer_weights() - s.rank * s.heads * (s.nope + s.value) + s.absorbing())
        return projections + causal_pairs(self.n) * s.heads * (s.rank + s.rope + s.rank)

    def sparse_expanded(self) -> int:
        """Each query over its picks, multi-head."""
        s = self.sizes
        return self.n * s.layer_weights() + self.n * self.k * s.heads * (s.key + s.value)

    def sparse_latent(self) -> int:
        """Each query over its picks, absorbed (the benchmarks' sparse case)."""
        s = self.sizes
        projections = self.n * (s.layer_weights() - s.rank * s.heads * (s.nope + s.value) + s.absorbing())
        return projections + self.n * self.k * s.heads * (s.rank + s.rope + s.rank)

    def indexer(self) -> int:
        """The indexer: its projections, and ``H (D + 1)`` per causal pair (scores, then the weighted sum)."""
        s = self.sizes
        return self.n * s.indexer_weights() + causal_pairs(self.n) * s.index_heads * (s.index_dim + 1)


def gathered_bytes_per_query(k: int, kv_heads: int, key: int, value: int, shared: bool) -> int:
    """Bytes one query's picks gather: ``k`` rows per kv head of the keys, and of the values unless they are the keys."""
    return k * kv_heads * (key if shared else key + value) * FLOAT32


@dataclass(frozen=True)
class DecodeWork:
    """What one decoded token reads and computes after ``n`` cached tokens, dense (absorbed) and sparse."""

    n: int
    k: int
    sizes: Sizes = LAYER

    def weight_bytes(self) -> tuple[int, int]:
        """(the layer's, the indexer's) weights, bytes."""
        return self.sizes.layer_weights() * FLOAT32, self.sizes.indexer_weights() * FLOAT32

    def dense_cache_bytes(self) -> int:
        """The whole latent cache (``n x 576``)."""
        return self.n * (self.sizes.rank + self.sizes.rope) * FLOAT32

    def sparse_cache_bytes(self) -> int:
        """The indexer's key cache (``n x D``) and the picked latent rows (``k x 576``)."""
        s = self.sizes
        return (self.n * s.index_dim + min(self.k, self.n) * (s.rank + s.rope)) * FLOAT32

    def dense_bytes(self) -> int:
        return self.weight_bytes()[0] + self.dense_cache_bytes()

    def sparse_bytes(self) -> int:
        return sum(self.weight_bytes()) + self.sparse_cache_bytes()

    def dense_macs(self) -> int:
        s = self.sizes
        return s.layer_weights() + s.absorbing() + self.n * s.heads * (2 * s.rank + s.rope)

    def sparse_macs(self) -> int:
        s = self.sizes
        index = s.indexer_weights() + self.n * s.index_heads * (s.index_dim + 1)
        return s.layer_weights() + s.absorbing() + index + min(self.k, self.n) * s.heads * (2 * s.rank + s.rope)


# ---------------------------------------------------------------------------- measured floors


def _seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


#: Side of the square product that gauges the machine's matrix-product rate (tests lower it).
SQUARE = 2048


def square_product_rate(size: int | None = None) -> float:
    """Multiply-adds per second of a square float32 ``torch.mm`` of side :data:`SQUARE` (the machine's matrix-product rate)."""
    size = size or SQUARE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    return size**3 / _seconds(lambda: torch.mm(a, b, out=out))


def sparse_product_rate(k: int, heads: int, key: int, value: int, block: int, blocks: int = 16) -> float:
    """Multiply-adds per second of the sparse pass's products on gathered rows already in storage.

    Per query, ``heads x key`` query rows against its ``k`` gathered key rows, then the ``heads x
    k`` weights against ``k`` value rows (the value rows being the keys' first ``value`` features,
    as in the latent form), ``block`` queries per batched product, as the route runs them.
    """
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(block, heads, key, generator=gen)
    rows = torch.randn(block, k, key, generator=gen)
    weights = torch.randn(block, heads, k, generator=gen)
    scores, out = torch.empty(block, heads, k), torch.empty(block, heads, value)

    def products() -> None:
        for _ in range(blocks):
            torch.bmm(q, rows.transpose(1, 2), out=scores)
            torch.bmm(weights, rows[..., :value], out=out)

    return blocks * block * heads * k * (key + value) / _seconds(products)


def gather_seconds(
    table: torch.Tensor, picks: torch.Tensor, block: int, sample: int | None = None
) -> tuple[float, int]:
    """``(seconds, queries timed)`` of gathering every query's picked rows of ``table (lk, f)`` into reused storage.

    ``picks (lq, k)`` (``-1`` read as row 0); ``block`` queries per gather, as the sparse route
    gathers. With ``sample``, only that many queries (evenly spread blocks) are timed, and the
    time is scaled to all ``lq`` queries by the caller (the count timed is returned).
    """
    flat = picks.clamp(min=0)
    lq = flat.shape[0]
    starts = list(range(0, lq, block))
    if sample is not None and sample < lq:
        step = max(1, len(starts) // max(1, sample // block))
        starts = starts[::step]
    storage = table.new_empty(block * flat.shape[1], table.shape[-1])

    def gathers() -> None:
        for start in starts:
            rows = flat[start : start + block].reshape(-1)
            torch.index_select(table, 0, rows, out=storage[: rows.numel()])

    timed = sum(min(block, lq - start) for start in starts)
    return _seconds(gathers, repeats=1), timed


def weights_pass_seconds(weights: list[torch.Tensor]) -> float:
    """One token through each weight ``(out, in)`` once: the time to read them (a b=1 product is bound by reading)."""
    inputs = [torch.randn(1, w.shape[-1]) for w in weights]
    return _seconds(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(inputs, weights, strict=True)])


def giga(x: float) -> str:
    return f"{x / 1e9:,.1f} G"


def megabytes(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"
