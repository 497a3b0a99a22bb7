"""Section 3: CNN, RNN and self-attention compared by measurement, not by quotation.

Each of the chapter's three columns is measured on a real PyTorch layer that maps a sequence
of n tokens of size d to another one:

* compute: FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` over sweeps of n, d
  and k, with the fitted power-law exponents;
* sequential operations: the longest chain of dependent matrix products (convolutions,
  matrix multiplications) in the layer's autograd graph;
* maximum path length: the fewest matrix products on any dependency chain from input 1 to
  output n, in the smallest stack of the layer that connects them, read off the operations
  the layers really run (:mod:`selfattn.tour.paths`);
* parallelism: positions per step of the dependency chain (the slides' extra row);
* wall-clock time of a forward pass on this machine, the sweep repeated to show its spread.

Shape legend: b batch, n positions, d features, k kernel width.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import Node
from torch.utils.flop_counter import FlopCounterMode

from selfattn._validation import require_positive_int
from selfattn.attention import MultiHeadAttention
from selfattn.tour._common import fit_exponent, seeded, single_threaded
from selfattn.tour.paths import stack_path_length

__all__ = [
    "CHAPTER",
    "KINDS",
    "CausalConv1d",
    "RecurrentLayer",
    "SelfAttentionLayer",
    "compare",
    "comparison_steps",
    "count_flops",
    "make_layer",
    "max_path_length",
    "path_lengths",
    "sequential_ops",
    "time_forward",
]

KINDS = ("cnn", "rnn", "self_attention")

#: The chapter's table, with the exponents its compute column implies.
CHAPTER: dict[str, dict[str, object]] = {
    "cnn": {
        "label": "CNN (kernel k)",
        "complexity": "O(knd^2)",
        "sequential_ops": "O(1)",
        "max_path_length": "O(n/k)",
        "exponent_n": 1,
        "exponent_d": 2,
        "exponent_k": 1,
    },
    "rnn": {
        "label": "RNN",
        "complexity": "O(nd^2)",
        "sequential_ops": "O(n)",
        "max_path_length": "O(n)",
        "exponent_n": 1,
        "exponent_d": 2,
        "exponent_k": 0,
    },
    "self_attention": {
        "label": "Self-attention",
        "complexity": "O(n^2 d)",
        "sequential_ops": "O(1)",
        "max_path_length": "O(1)",
        "exponent_n": 2,
        "exponent_d": 1,
        "exponent_k": 0,
    },
}

# Autograd nodes of the kernels that do a layer's real work; everything else (views, adds,
# activations) is elementwise or free, and does not lengthen the chain the chapter counts.
_PRODUCT_NODES = ("Mm", "Addmm", "Bmm", "Baddbmm", "Mv", "Addmv", "Convolution", "ScaledDotProduct", "Linear")
_PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


class CausalConv1d(nn.Module):
    """A width-k convolution over positions, padded on the left: output i sees inputs i-k+1 .. i.

    Left padding keeps the output length n and makes the receptive field of a stack of L
    layers exactly ``1 + L (k - 1)`` positions ending at the output, as in the chapter's figure.

    Shape: ``(b, n, d) -> (b, n, d)``.
    """

    def __init__(self, num_hiddens: int, kernel_size: int):
        super().__init__()
        self.kernel_size = require_positive_int("kernel_size", kernel_size)
        self.conv = nn.Conv1d(num_hiddens, num_hiddens, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_first = F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))  # (b, d, n + k - 1)
        convolved: torch.Tensor = self.conv(channels_first)  # (b, d, n)
        return convolved.transpose(1, 2)  # (b, n, d)


class RecurrentLayer(nn.Module):
    """``nn.RNN`` (tanh) returning every hidden state; ``hidden`` is the state before position 0.

    Shape: ``(b, n, d) -> (b, n, d)``.
    """

    def __init__(self, num_hiddens: int):
        super().__init__()
        self.rnn = nn.RNN(num_hiddens, num_hiddens, batch_first=True)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        states: torch.Tensor = self.rnn(x, hidden)[0]
        return states


class SelfAttentionLayer(nn.Module):
    """:class:`~selfattn.MultiHeadAttention` with queries, keys and values all equal to x.

    ``explicit=True`` takes attention's matmul-softmax-matmul path. PyTorch's flop counter
    has no formula for the fused CPU flash kernel (it counts it as 0 FLOPs), so counting needs
    the explicit path; both paths do the same products.

    Shape: ``(b, n, d) -> (b, n, d)``.
    """

    def __init__(self, num_hiddens: int, num_heads: int = 1, *, explicit: bool = False):
        super().__init__()
        self.attention = MultiHeadAttention(num_hiddens, num_heads)
        self.explicit = explicit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.explicit:
            outputs: torch.Tensor = self.attention(x, x, x, return_weights=True)[0]
            return outputs
        attended: torch.Tensor = self.attention(x, x, x)
        return attended


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def make_layer(
    kind: str, num_hiddens: int, *, kernel_size: int = 3, explicit: bool = False, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """One sequence-to-sequence layer of the given kind, ``(b, n, d) -> (b, n, d)``."""
    _check_kind(kind)
    require_positive_int("num_hiddens", num_hiddens)
    if kind == "cnn":
        layer: nn.Module = CausalConv1d(num_hiddens, kernel_size)
    elif kind == "rnn":
        layer = RecurrentLayer(num_hiddens)
    else:
        layer = SelfAttentionLayer(num_hiddens, explicit=explicit)
    return layer.to(dtype)


def count_flops(kind: str, num_steps: int, num_hiddens: int, *, kernel_size: int = 3) -> dict[str, int]:
    """FLOPs of one forward pass on a ``(1, n, d)`` input, counted by PyTorch's flop counter.

    Returns ``{"total": ...}``; for self-attention also ``"attention"`` (the score and value
    matmuls, the chapter's ``O(n^2 d)``) and ``"projections"`` (``W_q, W_k, W_v, W_o``).
    """
    num_steps = require_positive_int("num_steps", num_steps)
    with seeded(0):
        layer = make_layer(kind, num_hiddens, kernel_size=kernel_size, explicit=True)
        x = torch.randn(1, num_steps, num_hiddens)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), single_threaded():
        layer(x)
    total = int(counter.get_total_flops())
    if kind != "self_attention":
        return {"total": total}
    by_module = counter.get_flop_counts()
    projections = sum(
        int(sum(ops.values())) for name, ops in by_module.items() if name.rsplit(".", 1)[-1] in _PROJECTIONS
    )
    return {"total": total, "attention": total - projections, "projections": projections}


def _longest_product_chain(output: torch.Tensor) -> int:
    """Matrix products on the longest dependency chain of ``output``'s autograd graph.

    Iterative post-order walk (an RNN's graph is thousands of nodes deep).
    """
    root = output.grad_fn
    if root is None:
        raise ValueError("output has no autograd graph (grad_fn is None): compute it with gradients enabled")
    longest: dict[Node, int] = {}
    stack: list[tuple[Node | None, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if node is None or node in longest:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in longest)
            continue
        is_product = type(node).__name__.startswith(_PRODUCT_NODES)
        longest[node] = int(is_product) + max((longest[child] for child in children), default=0)
    return longest[root]


def sequential_ops(kind: str, num_steps: int, num_hiddens: int = 8, *, kernel_size: int = 3) -> int:
    """Length of the layer's dependency chain: matrix products that must run one after another.

    Products that do not depend on each other (the n recurrent input projections, the three
    attention projections) may run in parallel and count once.
    """
    num_steps = require_positive_int("num_steps", num_steps)
    with seeded(0):
        layer = make_layer(kind, num_hiddens, kernel_size=kernel_size, explicit=True)
        x = torch.randn(1, num_steps, num_hiddens, requires_grad=True)
    with single_threaded():
        return _longest_product_chain(layer(x))


def _path_stack(kind: str, num_hiddens: int, kernel_size: int) -> Callable[[int], list[nn.Module]]:
    """``layers(depth)``: the first ``depth`` layers of one seeded float64 stack (grown on demand)."""
    stack: list[nn.Module] = []

    def layers(depth: int) -> list[nn.Module]:
        with seeded(len(stack) + 1):
            while len(stack) < depth:
                stack.append(make_layer(kind, num_hiddens, kernel_size=kernel_size, explicit=True, dtype=torch.float64))
        return stack[:depth]

    return layers


def path_lengths(kind: str, num_steps: int, *, kernel_size: int = 3, num_hiddens: int = 4) -> dict[str, int]:
    """The shortest path from input 1 to output n, measured two ways on real float64 layers.

    * ``layers``: the smallest depth of a stack of this layer at which output n depends on
      input 1 at all;
    * ``products``: in that stack, the fewest matrix products on any dependency chain from
      input 1 to output n.

    Both are read off the operations the stack really runs
    (:func:`selfattn.tour.paths.product_path_length`), not off gradients: a gradient through
    thousands of recurrent steps underflows to an exact zero and would hide a real path. An
    RNN reaches in one layer, through its input projection and then one recurrent product per
    step.
    """
    _check_kind(kind)
    num_steps = require_positive_int("num_steps", num_steps)
    if num_steps < 2:
        raise ValueError(f"num_steps must be at least 2 to have a path from input 1 to output n, got {num_steps}")
    if kind == "cnn" and (isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 2):
        raise ValueError(f"kernel_size must be an integer >= 2 for a path to span the sequence, got {kernel_size!r}")
    with seeded(0):
        x = torch.randn(1, num_steps, num_hiddens, dtype=torch.float64)
    layers = _path_stack(kind, num_hiddens, kernel_size)
    with single_threaded():
        depth, products = stack_path_length(lambda index: layers(index + 1)[index], x, max_depth=num_steps - 1)
    return {"layers": depth, "products": int(products)}


def max_path_length(kind: str, num_steps: int, *, kernel_size: int = 3, num_hiddens: int = 4) -> int:
    """Matrix products on the shortest path from input 1 to output n (see :func:`path_lengths`)."""
    return path_lengths(kind, num_steps, kernel_size=kernel_size, num_hiddens=num_hiddens)["products"]


def time_forward(kind: str, num_steps: int, num_hiddens: int, *, kernel_size: int = 3, repeats: int = 3) -> float:
    """Median wall-clock seconds of one forward pass (no autograd) on a ``(1, n, d)`` input.

    Timed on one thread: the layers here are small enough that waking a second thread costs
    more than it saves, and on a shared machine it makes the timings jump.
    """
    repeats = require_positive_int("repeats", repeats)
    with seeded(0):
        layer = make_layer(kind, num_hiddens, kernel_size=kernel_size)
        x = torch.randn(1, num_steps, num_hiddens)
    times = []
    with torch.no_grad(), single_threaded():
        layer(x)  # warm-up: first calls pay for allocation and kernel selection
        for _ in range(repeats):
            start = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def comparison_steps(
    num_steps: Sequence[int], num_hiddens: Sequence[int], kernel_sizes: Sequence[int], rounds: int = 3
) -> int:
    """Number of progress steps :func:`compare` reports for this sweep."""
    return len(KINDS) * ((3 + rounds) * len(num_steps) + len(num_hiddens)) + 2 * len(kernel_sizes)


def crossing(xs: Sequence[float], ratios: Sequence[float]) -> float | None:
    """Where ``ratios`` (positive, against ``xs``) first reaches 1, interpolated on log-log axes.

    ``None`` when it stays on one side of 1 over the whole range.
    """
    points = list(zip(xs, ratios, strict=False))
    for (x0, r0), (x1, r1) in itertools.pairwise(points):
        if r0 == 1:
            return float(x0)
        if (r0 - 1) * (r1 - 1) < 0 or r1 == 1:
            t = -math.log(r0) / (math.log(r1) - math.log(r0))
            return float(math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0))))
    return None


def _check_sweep(name: str, values: Sequence[int], minimum: int) -> list[int]:
    values = [require_positive_int(name, v) for v in values]
    if len(set(values)) < 2:
        raise ValueError(f"{name} needs at least two different values to fit an exponent, got {values}")
    if min(values) < minimum:
        raise ValueError(f"{name} values must be at least {minimum}, got {values}")
    return sorted(set(values))


_T = TypeVar("_T")


def _each(values: Sequence[int], measure: Callable[[int], _T], what: str, tick: Callable[[str], None]) -> list[_T]:
    """``[measure(v) for v in values]``, reporting progress after each."""
    measured = []
    for value in values:
        measured.append(measure(value))
        tick(what.format(value))
    return measured


def _measure_layer(
    kind: str,
    ns: list[int],
    ds: list[int],
    ks: list[int],
    d0: int,
    n0: int,
    k0: int,
    repeats: int,
    rounds: int,
    path_hiddens: int,
    tick: Callable[[str], None],
) -> dict[str, object]:
    """One row of the chapter's table, measured over the sweeps (see :func:`compare`)."""
    by_n = _each(ns, lambda n: count_flops(kind, n, d0, kernel_size=k0), f"{kind}: FLOPs at n={{}}", tick)
    by_d = _each(ds, lambda d: count_flops(kind, n0, d, kernel_size=k0), f"{kind}: FLOPs at d={{}}", tick)
    chains = _each(ns, lambda n: sequential_ops(kind, n, kernel_size=k0), f"{kind}: dependency chain at n={{}}", tick)
    paths = _each(
        ns,
        lambda n: path_lengths(kind, n, kernel_size=k0, num_hiddens=path_hiddens),
        f"{kind}: path length at n={{}}",
        tick,
    )
    # Whole sweeps repeated, so drift on a busy machine shows as spread between rounds.
    seconds_rounds = [
        _each(
            ns,
            lambda n: time_forward(kind, n, d0, kernel_size=k0, repeats=repeats),
            f"{kind}: time at n={{}} (round {r + 1})",
            tick,
        )
        for r in range(rounds)
    ]
    seconds = [statistics.median(times) for times in zip(*seconds_rounds, strict=True)]
    timed = min(len(ns), max(3, math.ceil(len(ns) / 2)))  # the larger half of the n sweep, 3 points or more
    exponents = [fit_exponent(ns[-timed:], times[-timed:]) for times in seconds_rounds]
    products = [p["products"] for p in paths]
    core = "attention" if kind == "self_attention" else "total"
    entry: dict[str, object] = {
        "chapter": CHAPTER[kind],
        "flops_by_n": [f[core] for f in by_n],
        "flops_by_d": [f[core] for f in by_d],
        "flops_exponent_n": fit_exponent(ns, [f[core] for f in by_n]),
        "flops_exponent_d": fit_exponent(ds, [f[core] for f in by_d]),
        "sequential_ops_by_n": chains,
        "sequential_ops": chains[-1],
        "sequential_ops_exponent_n": fit_exponent(ns, chains),
        # Positions whose outputs one step of the dependency chain produces.
        "parallelism_by_n": [n / chain for n, chain in zip(ns, chains, strict=True)],
        "parallelism_exponent_n": fit_exponent(ns, [n / chain for n, chain in zip(ns, chains, strict=True)]),
        "path_length_by_n": products,
        "path_layers_by_n": [p["layers"] for p in paths],
        "max_path_length": products[-1],
        "path_layers": paths[-1]["layers"],
        "path_length_exponent_n": fit_exponent(ns, products),
        "n": ns[-1],
        "k": k0 if kind == "cnn" else None,
        "seconds_by_n": seconds,
        "seconds_by_n_rounds": seconds_rounds,
        # Small layers are dominated by fixed per-call costs: fit the time on the larger n only.
        "time_exponent_n": statistics.median(exponents),
        "time_exponents": exponents,
        "time_exponent_spread": [min(exponents), max(exponents)],
        "time_fit_from_n": ns[-timed],
        # The whole time at the smallest n bounds the fixed per-call cost from above.
        "fixed_cost_share": seconds[0] / seconds[-timed],
        "fixed_costs_dominate": seconds[0] / seconds[-timed] > 0.5,
    }
    if kind == "self_attention":
        layer_by_n, layer_by_d = [f["total"] for f in by_n], [f["total"] for f in by_d]
        entry.update(
            layer_flops_by_n=layer_by_n,
            layer_flops_by_d=layer_by_d,
            layer_flops_exponent_n=fit_exponent(ns, layer_by_n),
            layer_flops_exponent_d=fit_exponent(ds, layer_by_d),
        )
    if kind == "cnn":
        flops_by_k = _each(ks, lambda k: count_flops("cnn", n0, d0, kernel_size=k)["total"], "cnn: FLOPs at k={}", tick)
        paths_by_k = _each(
            ks,
            lambda k: path_lengths("cnn", ns[-1], kernel_size=k, num_hiddens=path_hiddens)["products"],
            "cnn: path at k={}",
            tick,
        )
        entry.update(
            flops_by_k=flops_by_k,
            flops_exponent_k=fit_exponent(ks, flops_by_k),
            path_length_by_k=paths_by_k,
            expected_path_length_by_k=[math.ceil((ns[-1] - 1) / (k - 1)) for k in ks],
        )
    return entry


def _compute_crossings(results: dict[str, Any], ns: list[int], ds: list[int], d0: int, n0: int) -> dict[str, object]:
    """Attention against the RNN in counted FLOPs: where the core crosses, what the whole layer costs."""
    rnn, sa = results["rnn"], results["self_attention"]
    core_over_rnn_n = [a / r for a, r in zip(sa["flops_by_n"], rnn["flops_by_n"], strict=True)]
    core_over_rnn_d = [a / r for a, r in zip(sa["flops_by_d"], rnn["flops_by_d"], strict=True)]
    layer_over_rnn_n = [a / r for a, r in zip(sa["layer_flops_by_n"], rnn["flops_by_n"], strict=True)]
    layer_over_rnn_d = [a / r for a, r in zip(sa["layer_flops_by_d"], rnn["flops_by_d"], strict=True)]
    layer_formula = [8 * n * d0**2 + 4 * n**2 * d0 for n in ns] + [8 * n0 * d**2 + 4 * n0**2 * d for d in ds]
    layer_counted = sa["layer_flops_by_n"] + sa["layer_flops_by_d"]
    rnn_formula = [4 * n * d0**2 for n in ns] + [4 * n0 * d**2 for d in ds]
    rnn_counted = rnn["flops_by_n"] + rnn["flops_by_d"]
    return {
        "core_over_rnn_by_n": core_over_rnn_n,
        "core_over_rnn_by_d": core_over_rnn_d,
        "layer_over_rnn_by_n": layer_over_rnn_n,
        "layer_over_rnn_by_d": layer_over_rnn_d,
        "core_equals_rnn_at_n": crossing(ns, core_over_rnn_n),
        "core_equals_rnn_at_d": crossing(ds, [1 / r for r in core_over_rnn_d]),
        "layer_equals_rnn_at_n": crossing(ns, layer_over_rnn_n),
        "layer_over_rnn_min": min(layer_over_rnn_n + layer_over_rnn_d),
        "layer_formula_error": max(abs(c - f) / f for c, f in zip(layer_counted, layer_formula, strict=True)),
        "rnn_formula_error": max(abs(c - f) / f for c, f in zip(rnn_counted, rnn_formula, strict=True)),
    }


def compare(
    num_steps: Sequence[int] = (64, 128, 256, 512, 1024),
    num_hiddens: Sequence[int] = (16, 32, 64, 128),
    kernel_sizes: Sequence[int] = (3, 5, 7, 9),
    *,
    fixed_hiddens: int = 32,
    fixed_steps: int = 128,
    fixed_kernel: int = 3,
    repeats: int = 3,
    rounds: int = 3,
    path_hiddens: int = 4,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Measure the chapter's table over a sweep; every value is a plain number or list.

    Args:
        num_steps: the n sweep (d = ``fixed_hiddens``, k = ``fixed_kernel``).
        num_hiddens: the d sweep (n = ``fixed_steps``).
        kernel_sizes: the k sweep for the CNN (n = ``fixed_steps``, d = ``fixed_hiddens``;
            path lengths at the largest n).
        repeats: timed forward passes per point (the median is kept).
        rounds: how many times the whole timing sweep runs; exponents are fitted per round and
            reported as their median and spread.
        path_hiddens: feature size of the layers whose path lengths are measured.
        progress: called with a short description after each measurement.

    Returns:
        ``{"sweep": {...}, "cnn": {...}, "rnn": {...}, "self_attention": {...}}``; each layer
        holds ``flops_exponent_n``, ``flops_exponent_d``, ``sequential_ops`` and
        ``max_path_length`` at the largest n (with that ``n`` and ``k``), plus the series.
    """
    ns = _check_sweep("num_steps", num_steps, 2)
    ds = _check_sweep("num_hiddens", num_hiddens, 1)
    ks = _check_sweep("kernel_sizes", kernel_sizes, 2)
    d0 = require_positive_int("fixed_hiddens", fixed_hiddens)
    n0 = require_positive_int("fixed_steps", fixed_steps)
    k0 = require_positive_int("fixed_kernel", fixed_kernel)
    if k0 < 2:
        raise ValueError(f"fixed_kernel must be at least 2, got {k0}")
    rounds = require_positive_int("rounds", rounds)
    tick = progress or (lambda _description: None)
    results: dict[str, Any] = {
        "sweep": {
            "n": ns,
            "d": ds,
            "k": ks,
            "fixed_d": d0,
            "fixed_n": n0,
            "fixed_k": k0,
            "repeats": repeats,
            "rounds": rounds,
        },
    }
    for kind in KINDS:
        results[kind] = _measure_layer(kind, ns, ds, ks, d0, n0, k0, repeats, rounds, path_hiddens, tick)
    # What the chapter's figure predicts, in matrix products: one convolution per layer of the
    # smallest stack; the input projection and one recurrent product per later step; value
    # projection, weighted sum and output projection.
    results["cnn"]["expected_path_length_by_n"] = [math.ceil((n - 1) / (k0 - 1)) for n in ns]
    results["rnn"]["expected_path_length_by_n"] = list(ns)
    results["self_attention"]["expected_path_length_by_n"] = [3 for _ in ns]
    results["crossings"] = _compute_crossings(results, ns, ds, d0, n0)
    return results
