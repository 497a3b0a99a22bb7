"""Differential fuzz over every route of :data:`selfattn.core.dispatch.ROUTES` against float64 formulas.

For each route a hypothesis strategy draws calls that the route takes (``explain`` must name it)
over random combinations of the options that route accepts: softcap, sinks, grouped-query heads,
score encodings (ALiBi, T5, Kerple, FIRE, Shaw), rotary, windows, chunks, prefix / spans /
documents rules joined with ``&`` and ``|``, valid lengths, key padding on the left and the
right, ``skip_padded_queries``, strided and transposed heads, ``dv != dk``, float64 / float32 /
bfloat16, tiny and odd sizes, block sizes that split the queries unevenly. Each case is run and
its output, weights (when asked for) and every gradient (inputs, projections, sinks, encoding
parameters) are compared with :mod:`fuzz_reference`, written from the formulas in float64.
Dropout is left out: its masks are drawn inside the routes and no reference can redraw them.

A route added to ``ROUTES`` without a strategy here fails :func:`test_every_route_is_fuzzed`.

CI runs the derandomized ``ci`` profile (tests/conftest.py); for thousands of cases::

    pytest tests/test_fuzz_routes.py --hypothesis-profile=deep

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, dk key size, dv value size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from fuzz_reference import Layer, Term, all_of, attend, document_positions, layer_forward, visible
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfattn.masks as masks
from selfattn import MultiHeadAttention
from selfattn.core import dispatch
from selfattn.core.routes._window import window_block
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from selfattn.functional._sparse import describe_sparse_attention
from selfattn.positional import (
    ALiBiPositionalBias,
    FIREPositionalBias,
    KerplePositionalBias,
    RotaryPositionalEncoding,
    ShawRelativePositionEncoding,
    T5RelativePositionBias,
)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest error allowed, relative to max(1, the reference's largest magnitude).
TOLERANCE = {"float64": 1e-8, "float32": 2e-4, "bfloat16": 6e-2}
# A gradient in bfloat16 sums rounded terms over every token, pair or path, and QK-norm of a few features amplifies
# them. Measured against float64, the formula itself computed in bfloat16 was up to 8.3% off in a parameter's
# gradient over 150 seeds of one drawn case (T5, QK-norm, softcap 0.7, sinks, a gate; selfattn up to 6.2%), and up
# to 21.6% in the shared input's gradient over 100 seeds of another (prefix, QK-norm of head size 2, a gate;
# selfattn up to 6.5%, median 0.19%). Outputs keep the tighter bound (there the formula reached 5.9%).
GRADIENT_TOLERANCE = TOLERANCE | {"bfloat16": 1e-1}


@dataclass
class Case:
    """One call: which API, sizes, dtype, a seed for the tensors, and the options (plain data, printed on failure)."""

    route: str
    api: str  # "functional" or "module"
    dtype: str
    batch: int
    lq: int
    lk: int
    heads: int
    kv_heads: int
    seed: int
    opts: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- shared draws

HEADS = st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (6, 3)])
DTYPE = st.sampled_from(["float64", "float32", "float32", "bfloat16"])
LAYOUT = st.sampled_from(["contiguous", "strided", "transposed"])
SEED = st.integers(0, 2**16)


@st.composite
def lengths_for(draw, batch: int, length: int, *, low: int = 0) -> list[int]:
    return draw(st.lists(st.integers(low, length), min_size=batch, max_size=batch))


@st.composite
def padding_for(draw, batch: int, length: int) -> list[tuple[int, int]]:
    """Per row (left, right) counts of padded keys: left-padded batches, right-padded ones, both."""
    side = draw(st.sampled_from(["left", "right", "both"]))
    rows = []
    for _ in range(batch):
        count = draw(st.integers(0, length))
        left = count if side == "left" else 0 if side == "right" else draw(st.integers(0, count))
        rows.append((left, count - left))
    return rows


@st.composite
def mask_tree(draw, depth: int = 2, *, leaves=("causal", "window", "chunks", "prefix", "spans", "documents")):
    """A rule tree of plain data (tensors are drawn later from the seed): leaves joined by "and" / "or"."""
    if depth == 0 or draw(st.booleans()):
        kind = draw(st.sampled_from(leaves))
        if kind in ("window", "chunks"):
            return (kind, draw(st.integers(1, 4)))
        if kind == "prefix":
            return (kind, draw(st.one_of(st.integers(0, 6), st.just("per row"))))
        return (kind,)
    op = draw(st.sampled_from(["and", "or"]))
    return (op, draw(mask_tree(depth - 1, leaves=leaves)), draw(mask_tree(depth - 1, leaves=leaves)))


TERMS = {
    "alibi": Term("alibi", causal=True),
    "alibi bidirectional": Term("alibi", causal=False),
    "t5": Term("t5", bidirectional=True, num_buckets=8, max_distance=12),
    "t5 causal": Term("t5", bidirectional=False, num_buckets=6, max_distance=9),
    "kerple": Term("kerple"),
    "fire": Term("fire"),
    "shaw": Term("shaw", max_distance=3),
    "shaw keys": Term("shaw", max_distance=2, values=False),
}


@st.composite
def layer_options(draw, *, rotary=True, modifiers=False, head_dims=(1, 2, 3, 4, 5, 8)) -> dict:
    """A module's own options: head size, biases, QK-norm, gate, scale, and maybe rotary, softcap, sinks."""
    head_dim = draw(st.sampled_from(head_dims))
    opts = {
        "head_dim": head_dim,
        "bias": draw(st.booleans()),
        # RMSNorm of one feature is its sign, whose gradient is all rounding in bfloat16: from two features on.
        "qk_norm": head_dim > 1 and draw(st.booleans()),
        "gated": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, None, 0.3, 1.0])),
        "shared_input": draw(st.booleans()),
        # values' head size of their own (a route sizing a buffer or a view by the keys' fails on it)
        "value_head_dim": draw(st.sampled_from([None, None, 1, 3])),
    }
    if rotary and opts["head_dim"] % 2 == 0 and draw(st.booleans()):
        opts["rotary"] = draw(st.sampled_from(["interleaved", "half"]))
    if modifiers:
        opts["softcap"] = draw(st.sampled_from([None, 0.7, 5.0]))
        opts["sinks"] = draw(st.booleans())
    return opts


def window_threshold(window: int) -> int:
    """The length from which the window routes take a call (band_only / banded's ``too short`` reason)."""
    return 2 * (window_block(window) + 2 * (window - 1))


# ---------------------------------------------------------------------------------------- route strategies


@st.composite
def ragged_cases(draw, route: str) -> Case:
    """Valid lengths (and causal) alone through the module: per-length groups, with or without padded rows."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 10))
    heads, kv = draw(HEADS)
    opts = draw(layer_options())
    opts |= {"skip": route == "ragged valid rows", "causal": draw(st.booleans())}
    lengths = lengths_for(batch, length)
    # Every row padded: skip_padded_queries leaves it to the masked routes (nothing for groups to run).
    opts["valid_lens"] = draw(lengths.filter(any) if opts["skip"] else lengths)
    opts["positions"] = draw(st.sampled_from(["default", "offset", "per row"]))
    return Case(route, "module", draw(DTYPE), batch, length, length, heads, kv, draw(SEED), opts)


@st.composite
def window_cases(draw, route: str) -> Case:
    """A sliding window long enough for bands; ``banded`` adds lengths, padding, documents or a score term."""
    window = draw(st.integers(1, 3))
    length = window_threshold(window) + draw(st.integers(1, 9))
    batch = draw(st.integers(1, 2))
    heads, kv = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    opts = draw(layer_options(head_dims=(2, 3, 4)))
    opts |= {"window": window, "causal": draw(st.booleans()), "positions": "default"}
    if route == "banded":
        extras = draw(st.sets(st.sampled_from(["valid", "padding", "documents", "term"]), min_size=1))
        if "valid" in extras:  # the longest is the length: keys past it would be dropped, and the call no square
            opts["valid_lens"] = [length, *draw(lengths_for(batch - 1, length))]
            opts["skip"] = draw(st.booleans())
        if "padding" in extras:
            opts["padding"] = draw(padding_for(batch, length))
        if "documents" in extras:
            opts["documents"] = True
        if "term" in extras:
            opts["term"] = draw(st.sampled_from(sorted(set(TERMS) - {"shaw"})))
            opts.pop("rotary", None)
    return Case(route, "module", draw(DTYPE), batch, length, length, heads, kv, draw(SEED), opts)


@st.composite
def chunk_cases(draw, route: str) -> Case:
    """Chunks (module ``chunk_size`` or a ``masks.chunks`` rule), causal inside them or not."""
    size = draw(st.integers(1, 6))
    length = draw(st.integers(size + 1, 15))
    batch = draw(st.integers(1, 3))
    heads, kv = draw(HEADS)
    opts = draw(layer_options()) | {"causal": draw(st.booleans()), "positions": "default"}
    if draw(st.booleans()):
        opts["chunk_size"] = size
    else:
        opts["tree"] = ("chunks", size)
    return Case(route, "module", draw(DTYPE), batch, length, length, heads, kv, draw(SEED), opts)


@st.composite
def prefix_cases(draw, route: str) -> Case:
    """``causal() | prefix(P)`` alone, P an int or one per sequence."""
    length, batch = draw(st.integers(1, 14)), draw(st.integers(1, 3))
    heads, kv = draw(HEADS)
    opts = draw(layer_options()) | {"positions": draw(st.sampled_from(["default", "offset"]))}
    prefix = draw(st.one_of(st.integers(0, length + 2), st.just("per row")))
    opts["tree"] = ("or", ("causal",), ("prefix", prefix))
    return Case(route, "module", draw(DTYPE), batch, length, length, heads, kv, draw(SEED), opts)


@st.composite
def key_row_cases(draw, route: str) -> Case:
    """ALiBi's causal form: causal alone (``causal key rows``) or one row of keys for every query (``blockwise key row``)."""
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 6))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    opts = draw(layer_options(rotary=False)) | {"term": "alibi"}
    # One token alone sees its one key: causal hides nothing there, and the call has no rule (so key row).
    lq = lk = draw(st.integers(2 if route == "causal key rows" else 1, 14))
    if route == "causal key rows":
        opts |= {"causal": True, "positions": draw(st.sampled_from(["default", "offset"]))}
    else:
        lk = draw(st.integers(1, 14))
        opts |= {"causal": False, "positions": "default", "block_size": draw(st.sampled_from([None, 1, 3]))}
        opts["shared_input"] &= lq == lk
        if draw(st.booleans()):
            opts["valid_lens"] = draw(lengths_for(batch, lk))
        if draw(st.booleans()):
            opts["padding"] = draw(padding_for(batch, lk))
    return Case(route, "module", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)


@st.composite
def functional_options(draw, *, dv_differs=True) -> dict:
    """What every functional call may vary: sizes of the heads, their memory layout, the scale."""
    dk = draw(st.integers(1, 8))
    return {
        "dk": dk,
        "dv": draw(st.integers(1, 8)) if dv_differs and draw(st.booleans()) else dk,
        "layouts": tuple(draw(LAYOUT) for _ in range(3)),
        "scale": draw(st.sampled_from([None, None, 0.5])),
    }


@st.composite
def fused_sinks_cases(draw, route: str) -> Case:
    """Sinks with no mask but causal on a square: functional (any layout, dv != dk) or the module."""
    batch = draw(st.integers(1, 3))
    heads, kv = draw(HEADS)
    causal = draw(st.booleans())
    lq = draw(st.integers(1, 20))  # on both sides of one vector of the CPU kernel's keys (16 float32 with AVX-512)
    lk = lq if causal else draw(st.integers(1, 20))
    if draw(st.booleans()):
        opts = draw(functional_options()) | {"causal": causal, "sinks": True}
        return Case(route, "functional", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)
    opts = draw(layer_options(modifiers=True)) | {"causal": causal, "positions": "default", "softcap": None}
    opts |= {"sinks": True, "shared_input": opts["shared_input"] and lq == lk}
    return Case(route, "module", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)


@st.composite
def sliced_cases(draw, route: str) -> Case:
    """A softcap (sinks with it or not) on at least 2**16 scores per (batch, head): one slice at a time."""
    heads, kv = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    lq, lk = 256 + draw(st.integers(0, 5)), 256 + draw(st.integers(0, 5))
    opts = draw(functional_options()) | {"softcap": draw(st.sampled_from([0.5, 3.0])), "sinks": draw(st.booleans())}
    opts["causal"] = draw(st.booleans())
    opts["mask"] = draw(st.sampled_from([None, "shared", "keys"]))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    return Case(route, "functional", dtype, 1, lq, lk, heads, kv, draw(SEED), opts)


@st.composite
def module_masks(draw, opts: dict, batch: int, lq: int, lk: int, *, tree=True, attn_mask=True, keep_keys=False) -> dict:
    """Causal, valid lengths (per sequence or per query), key padding, a bool attn_mask and a rule tree, each maybe.

    ``keep_keys``: one valid length is every key (else the keys past the longest are dropped, and
    a causal call with fewer keys than queries is another route's).
    """
    opts["causal"] = lq <= lk and draw(st.sampled_from([True, True, False]))
    if draw(st.booleans()):
        per_query = draw(st.booleans())
        opts["valid_lens"] = draw(lengths_for(batch * (lq if per_query else 1), lk))
        if keep_keys:
            opts["valid_lens"][0] = lk
        opts["valid_per_query"] = per_query
        opts["skip"] = lq == lk and not per_query and draw(st.booleans())
    if draw(st.sampled_from([True, True, False])):
        opts["padding"] = draw(padding_for(batch, lk))
    if attn_mask and draw(st.integers(0, 3)) == 0:
        opts["attn_mask"] = "bool"
    if tree and lq == lk and draw(st.booleans()):
        opts["tree"] = draw(mask_tree())
    return opts


@st.composite
def blockwise_cases(draw, route: str) -> Case:
    """Score terms, softcap and sinks one block of queries at a time (module), or softcap/sinks with masks (functional)."""
    batch, heads_kv = draw(st.integers(1, 3)), draw(HEADS)
    lq = draw(st.integers(1, 12))
    lk = lq if draw(st.booleans()) else draw(st.integers(1, 12))
    if route == "blockwise" and draw(st.integers(0, 3)) == 0:
        opts = draw(functional_options()) | {"softcap": draw(st.sampled_from([None, 0.8])), "sinks": True}
        opts |= {"causal": lq <= lk and draw(st.booleans()), "mask": draw(st.sampled_from(["full", "rows", "keys"]))}
        return Case(route, "functional", draw(DTYPE), batch, lq, lk, *heads_kv, draw(SEED), opts)
    clipped, band = route == "blockwise clipped", route == "blockwise band"
    opts = draw(layer_options(rotary=False, modifiers=not clipped))
    opts["shared_input"] &= lq == lk
    if clipped:
        opts["term"] = draw(st.sampled_from(["shaw", "shaw keys"]))
    elif band:
        opts["term"] = draw(st.sampled_from(["t5", "t5 causal", "kerple", "alibi bidirectional", "alibi"]))
    else:  # not ALiBi's causal form: with one row of keys for every query it goes by key rows
        opts["term"] = draw(st.sampled_from(sorted(set(TERMS) - {"alibi"})))
    opts["block_size"] = draw(st.sampled_from([None, 1, 2, 3, 5]))
    opts = draw(module_masks(opts, batch, lq, lk, keep_keys=band))
    if route == "blockwise" and opts["term"] != "fire":
        opts["positions"] = draw(st.sampled_from(["per row", "documents"])) if lq == lk else "per row"
    else:
        opts["positions"] = draw(st.sampled_from(["default", "offset"]))
    if opts["positions"] == "documents":
        opts["documents"] = True
    if opts["term"] == "alibi" and band and not (opts["softcap"] or opts["sinks"]):
        # ALiBi's causal form goes by key rows unless causal with a block size set (and more than one query: one
        # query sees every key whatever the causal rule, and goes by key rows)
        causal_band = 2 <= lq <= lk
        opts |= (
            {"causal": True, "block_size": opts["block_size"] or 4} if causal_band else {"term": "alibi bidirectional"}
        )
    return Case(route, "module", draw(DTYPE), batch, lq, lk, *heads_kv, draw(SEED), opts)


@st.composite
def explicit_cases(draw, route: str) -> Case:
    """The weights asked for, Shaw's value term, or softcap/sinks that blocks cannot take (a float bias, 3-D heads)."""
    batch, (heads, kv) = draw(st.integers(1, 3)), draw(HEADS)
    lq = draw(st.integers(1, 12))
    lk = lq if draw(st.booleans()) else draw(st.integers(1, 12))
    if route != "explicit value term" and draw(st.booleans()):
        opts = draw(functional_options()) | {"causal": lq <= lk and draw(st.booleans())}
        opts |= {"mask": draw(st.sampled_from([None, "full", "rows", "keys", "shared"]))}
        opts |= {"softcap": draw(st.sampled_from([None, 0.8, 4.0])), "sinks": draw(st.booleans())}
        if route == "explicit":
            opts["return_weights"] = True
        else:
            opts["sinks"] |= opts["softcap"] is None
            opts["three_d"] = draw(st.booleans())
            opts["mask"] = "shared" if opts["three_d"] and opts["mask"] else opts["mask"]  # (lq, lk) fits (h, lq, lk)
            opts["bias"] = not opts["three_d"] or draw(st.booleans())
            batch = 1 if opts["three_d"] else batch
        return Case(route, "functional", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)
    opts = draw(layer_options(modifiers=True))
    opts["shared_input"] &= lq == lk
    terms = {"explicit value term": ["shaw"], "explicit": sorted(set(TERMS) - {"shaw"})}.get(route, ["none"])
    opts["term"] = draw(st.sampled_from([*terms, "none"] if route == "explicit" else terms))
    opts = draw(module_masks(opts, batch, lq, lk))
    opts["positions"] = draw(st.sampled_from(["default", "offset", "per row"]))
    if route == "explicit value term":
        opts["return_weights"] = draw(st.booleans())
        opts["attn_mask"] = "float" if not opts["return_weights"] else opts.get("attn_mask")
    elif route == "explicit":
        opts["return_weights"] = True
    else:
        opts |= {"attn_mask": "float", "sinks": opts["sinks"] or not opts["softcap"]}
    if opts["term"] == "none":
        del opts["term"]
    else:
        opts.pop("rotary", None)
    return Case(route, "module", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)


@st.composite
def fused_cases(draw, route: str) -> Case:
    """PyTorch's kernel: plain, masked, biased or causal (functional); masks and a float attn_mask (module)."""
    batch, (heads, kv) = draw(st.integers(1, 3)), draw(HEADS)
    lq = draw(st.integers(1, 12))
    # up to 40 keys: a decoding step's kernel call changes form at one vector of keys (8, 16 or 32)
    lk = lq if draw(st.booleans()) else draw(st.one_of(st.integers(1, 12), st.integers(13, 40)))
    if draw(st.booleans()):
        opts = draw(functional_options()) | {"causal": lq <= lk and draw(st.booleans())}
        opts |= {"mask": draw(st.sampled_from([None, "full", "rows", "keys", "shared"])), "bias": draw(st.booleans())}
        return Case(route, "functional", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)
    opts = draw(layer_options())
    opts["shared_input"] &= lq == lk
    opts = draw(module_masks(opts, batch, lq, lk))
    opts["positions"] = draw(st.sampled_from(["default", "offset", "per row"]))
    if draw(st.booleans()):  # a score term goes to the kernel as a float mask with a float attn_mask
        opts["term"] = draw(st.sampled_from(sorted(set(TERMS) - {"shaw"})))
        opts["attn_mask"] = "float"
        opts.pop("rotary", None)
    else:  # key padding keeps the ragged, chunks and prefix routes out
        opts["padding"] = opts.get("padding") or draw(padding_for(batch, lk))
    return Case(route, "module", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)


@st.composite
def split_key_cases(draw, route: str) -> Case:
    """One head of a few queries over 512 to 1,100 keys, without grad mode at 2 or 4 threads (absorbed MLA decoding)."""
    threads = draw(st.sampled_from([2, 4]))
    batch, lq, lk = draw(st.integers(1, threads - 1)), draw(st.integers(1, 8)), draw(st.integers(512, 1100))
    opts = draw(functional_options(dv_differs=False)) | {"causal": draw(st.booleans()), "threads": threads}
    opts["mask"] = draw(st.sampled_from([None, "full", "rows", "keys", "shared"]))
    return Case(route, "functional", draw(DTYPE), batch, lq, lk, 1, 1, draw(SEED), opts)


@st.composite
def flex_cases(draw, route: str) -> Case:
    """A score term with an elementwise form on CUDA, heads of at least 16 (FlexAttention)."""
    batch, (heads, kv) = draw(st.integers(1, 2)), draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    length = draw(st.integers(1, 20))
    opts = draw(layer_options(rotary=False, head_dims=(16, 32))) | {"positions": "default", "device": "cuda"}
    opts["term"] = draw(st.sampled_from(["alibi", "alibi bidirectional", "t5", "t5 causal", "kerple", "shaw keys"]))
    opts = draw(module_masks(opts, batch, length, length, attn_mask=False))
    opts["dtype"] = draw(st.sampled_from(["float32", "bfloat16"]))
    return Case(route, "module", opts["dtype"], batch, length, length, heads, kv, draw(SEED), opts)


@st.composite
def sparse_cases(draw, route: str) -> Case:
    """Picked keys (``masks.selected``) with causal and a bool mask, picks repeated or unused, at most a quarter of the keys."""
    batch, (heads, kv) = draw(st.integers(1, 3)), draw(HEADS)
    picks = draw(st.integers(1, 4))
    lq, lk = draw(st.integers(1, 9)), draw(st.integers(4 * picks, 4 * picks + 9))
    opts = draw(functional_options()) | {"causal": lq <= lk and draw(st.booleans()), "picks": picks}
    opts |= {
        "mask": draw(st.sampled_from([None, "full", "rows", "keys"])),
        "block_size": draw(st.sampled_from([None, 1, 2, 3])),
    }
    opts["shared_picks"] = batch > 1 and draw(st.booleans())  # one (1, lq, t) selection for every sequence
    return Case(route, "functional", draw(DTYPE), batch, lq, lk, heads, kv, draw(SEED), opts)


#: A module case's route when whichever route the dispatcher picks may take it (the answer is checked, not the route).
ANY_ROUTE = "any"


@st.composite
def twice_cases(draw) -> Case:
    """Two rules of one kind at once, the layer's option and a mask rule or two mask rules: chunks of two sizes, two
    sets of valid lengths, two windows, two selections of keys. A route that reads one rule of a kind (its chunk
    size, its lengths, its picks) must apply the other too, or leave the call to a route that does."""
    kind = draw(st.sampled_from(["chunks", "valid", "window", "selected"]))
    batch, (heads, kv) = draw(st.integers(1, 3)), draw(HEADS)
    opts = draw(layer_options()) | {"causal": draw(st.booleans()), "positions": "default"}
    as_option = draw(st.booleans())  # the first rule given as the layer's option (or valid_lens), not a mask rule
    if kind == "window":  # long enough for the band routes
        first, second = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        length = window_threshold(max(first, second)) + draw(st.integers(1, 9))
    elif kind == "selected":  # the first picks at most a quarter of the keys: the sparse route's calls
        first, length = draw(st.integers(1, 2)), draw(st.integers(8, 16))
        second, as_option = draw(st.integers(1, length // 2)), False
    else:
        first, second, length = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(7, 15))
    if kind == "valid" and as_option:
        opts["valid_lens"] = draw(lengths_for(batch, length))
    elif as_option:
        opts["chunk_size" if kind == "chunks" else "window"] = first
    leaf = {"chunks": lambda n: ("chunks", n), "window": lambda n: ("window", n), "valid": lambda n: ("valid",),
            "selected": lambda n: ("selected", n)}[kind]  # fmt: skip
    opts["tree"] = leaf(second) if as_option else ("and", leaf(first), leaf(second))
    return Case(ANY_ROUTE, "module", draw(DTYPE), batch, length, length, heads, kv, draw(SEED), opts)


#: Cases per hypothesis example, for the routes that take the most combinations of options.
CASES_PER_EXAMPLE = {"blockwise": 3, "blockwise band": 3, "blockwise clipped": 2, "explicit": 2, "fused": 2}

#: Each route's strategy: a route added to ROUTES without one fails test_every_route_is_fuzzed.
STRATEGIES = {
    "sparse selection": sparse_cases,
    "ragged valid rows": ragged_cases,
    "ragged": ragged_cases,
    "band only": window_cases,
    "banded": window_cases,
    "chunks": chunk_cases,
    "prefix": prefix_cases,
    "flex": flex_cases,
    "causal key rows": key_row_cases,
    "blockwise key row": key_row_cases,
    "fused sinks": fused_sinks_cases,
    "sliced": sliced_cases,
    "blockwise clipped": blockwise_cases,
    "blockwise band": blockwise_cases,
    "blockwise": blockwise_cases,
    "explicit value term": explicit_cases,
    "explicit": explicit_cases,
    "explicit softcap/sinks": explicit_cases,
    "split keys": split_key_cases,
    "fused": fused_cases,
}


# ---------------------------------------------------------------------------------------- running a case


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _leaf(values: torch.Tensor, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return values.to(device, dtype).requires_grad_(True)


def _heads(gen: torch.Generator, shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> torch.Tensor:
    """Heads in one of three memory layouts; ``.grad`` is kept on the view itself."""
    *lead, length, size = shape
    if layout == "strided":  # every other feature of a wider tensor: the last dimension has stride 2
        x = _leaf(_randn(gen, *lead, length, 2 * size), dtype)[..., ::2]
    elif layout == "transposed":  # (b, l, h, d) split into heads: heads and positions swap strides
        x = _leaf(_randn(gen, *lead[:-1], length, lead[-1], size), dtype).transpose(-3, -2)
    else:
        x = _leaf(_randn(gen, *shape), dtype)
    if not x.is_leaf:
        x.retain_grad()
    return x


def _bool_mask(gen: torch.Generator, kind: str, batch: int, heads: int, lq: int, lk: int) -> torch.Tensor:
    shape = {"full": (batch, heads, lq, lk), "rows": (batch, 1, lq, lk), "keys": (batch, 1, 1, lk), "shared": (lq, lk)}
    return torch.rand(shape[kind], generator=gen) < 0.75


def _as64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64).requires_grad_(t.requires_grad)


def _backward(outputs: dict, gen_seed: int) -> None:
    """Sum each output times a fixed random tensor, and backpropagate (the same tensors for library and reference)."""
    gen = torch.Generator().manual_seed(gen_seed)
    total = sum((out.double().cpu() * _randn(gen, *out.shape)).sum() for out in outputs.values() if out is not None)
    total.backward()


@contextlib.contextmanager
def _decoding(threads: int | None) -> Iterator[None]:
    """Without grad mode at ``threads`` torch threads (the split-keys route's conditions), or as it is for None."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(before)


def run_functional(case: Case, poison: tuple[float, bool | None] | None = None) -> tuple[dict, dict]:
    """``attention`` and the reference on the same heads: ``(actual, expected)`` dicts of outputs and gradients.

    ``poison``: ``(value, oppose)`` puts ``value`` (NaN or an infinity) in one element of the last query of the
    last head (``oppose``: every key that head reads has the opposite sign there, so an infinity makes every score
    of that row -inf), or with ``oppose`` None NaN in one element of the last key of the last key/value head, or
    with ``oppose`` "key" ``value`` in the first key there and every query of its sign there (an infinity: a +inf
    score for each query that sees the key); and runs the call without gradients (the decoding steps' paths); no gradient is
    compared.
    """
    o, gen, dtype = case.opts, torch.Generator().manual_seed(case.seed), DTYPES[case.dtype]
    lead = () if o.get("three_d") else (case.batch,)
    q_shape, kv_shape = (*lead, case.heads, case.lq, o["dk"]), (*lead, case.kv_heads, case.lk)
    q, k = _heads(gen, q_shape, o["layouts"][0], dtype), _heads(gen, (*kv_shape, o["dk"]), o["layouts"][1], dtype)
    v = _heads(gen, (*kv_shape, o["dv"]), o["layouts"][2], dtype)
    if poison is not None:
        with torch.no_grad():
            value, oppose = poison
            if oppose == "key":  # the first key: PyTorch's CPU kernel reads it in a whole vector of keys
                k[..., -1, 0, 0] = value
                q[..., 0] = q[..., 0].abs().add(0.1).mul(1.0 if value > 0 else -1.0)
            elif oppose is None:
                k[..., -1, -1, 0] = value
            else:
                q[..., -1, -1, 0] = value
            if oppose is True:
                keys = k[..., -1, :, 0]  # the last key/value head: the last query head's
                keys.copy_(keys.abs() * (1.0 if value < 0 else -1.0))
    kwargs = {"causal": o.get("causal", False), "scale": o.get("scale"), "softcap": o.get("softcap")}
    kwargs["return_weights"] = o.get("return_weights", False)
    if o.get("mask"):
        kwargs["mask"] = _bool_mask(gen, o["mask"], case.batch, case.heads, case.lq, case.lk)
    if o.get("bias"):
        kwargs["bias"] = _leaf(0.5 * _randn(gen, *lead, case.heads, case.lq, case.lk), dtype)
    if o.get("sinks"):
        kwargs["sinks"] = _leaf(_randn(gen, case.heads), dtype)
    picks = None
    if o.get("picks"):
        picks = torch.randint(-1, case.lk, (1 if o["shared_picks"] else case.batch, case.lq, o["picks"]), generator=gen)
        call = describe_sparse_attention(q, k, v, picks, **kwargs)
        call.block_size = o["block_size"]
    else:
        call = describe_attention(q, k, v, **kwargs)
    with _decoding(o.get("threads")), torch.no_grad() if poison is not None else contextlib.nullcontext():
        route = dispatch.explain(call).route
        assert route == case.route, f"the case took {route!r}"
        result = attention(q, k, v, **kwargs) if picks is None else dispatch.run(call)
    if picks is not None:
        result = result.out
    out, weights = result if kwargs["return_weights"] else (result, None)
    tensors = {"q": q, "k": k, "v": v, "bias": kwargs.get("bias"), "sinks": kwargs.get("sinks")}
    tensors = {name: t for name, t in tensors.items() if t is not None}
    as64 = {name: _as64(t) for name, t in tensors.items()}
    batched = {name: t[None] if o.get("three_d") and name in "qkv" else t for name, t in as64.items()}
    causal = ("causal",) if kwargs["causal"] else None
    rule = all_of(
        causal, ("dense", kwargs["mask"]) if "mask" in kwargs else None, None if picks is None else ("selected", picks)
    )
    seen = None if rule is None else visible(rule, case.batch, case.lq, case.lk, case.lk - case.lq)
    scale = o.get("scale") or 1 / math.sqrt(o["dk"])
    ref_out, ref_weights = attend(
        batched["q"], batched["k"], batched["v"], seen, scale=scale, bias=batched.get("bias"),
        softcap=o.get("softcap"), sinks=batched.get("sinks"),
    )  # fmt: skip
    if o.get("three_d"):
        ref_out, ref_weights = ref_out[0], ref_weights[0]
    actual, expected = (
        {"out": out, "weights": weights},
        {"out": ref_out, "weights": ref_weights if weights is not None else None},
    )
    if o.get("threads") or poison is not None:
        return actual, expected  # computed without grad mode: no gradient to compare
    _backward(actual, case.seed + 1)
    _backward(expected, case.seed + 1)
    actual |= {f"grad {name}": t.grad for name, t in tensors.items()}
    expected |= {f"grad {name}": t.grad for name, t in as64.items()}
    return actual, expected


def make_encoding(case: Case):
    """The module's ``position``: a score encoding of ``TERMS``, rotary, or None."""
    o, heads = case.opts, case.heads
    term = TERMS.get(o.get("term", ""))
    if term is None:
        rotary = o.get("rotary")
        return None if rotary is None else RotaryPositionalEncoding(o["head_dim"], interleaved=rotary == "interleaved")
    if term.kind == "alibi":
        return ALiBiPositionalBias(heads, causal=term.causal)
    if term.kind == "t5":
        return T5RelativePositionBias(heads, term.num_buckets, term.max_distance, term.bidirectional)
    if term.kind == "kerple":
        return KerplePositionalBias(heads)
    if term.kind == "fire":
        # Off the integers: at L = i, max(i, L) has a kink, and which side rounding lands on (float32 or 64)
        # decides whether the threshold gets that query's gradient.
        return FIREPositionalBias(heads, hidden_size=6, threshold=3.5)
    return ShawRelativePositionEncoding(o["head_dim"], term.max_distance, values=term.values)


def build_module(case: Case) -> tuple[MultiHeadAttention, Layer]:
    """The module of a case (seeded weights; sinks, norms and Kerple's rates moved off their start) and its reference settings."""
    o, dtype = case.opts, DTYPES[case.dtype]
    torch.manual_seed(case.seed)
    hidden = case.heads * o["head_dim"]
    shared = o["shared_input"]
    term = TERMS.get(o.get("term", ""))
    value_term = term is not None and term.kind == "shaw" and term.values  # of the keys' head size: refused otherwise
    mha = MultiHeadAttention(
        hidden, case.heads, bias=o["bias"], num_kv_heads=case.kv_heads, position=make_encoding(case),
        value_head_dim=None if value_term else o.get("value_head_dim"),
        window=o.get("window"), chunk_size=o.get("chunk_size"), block_size=o.get("block_size"),
        skip_padded_queries=o.get("skip", False), scale=o["scale"], softcap=o.get("softcap"),
        sinks=bool(o.get("sinks")), qk_norm=o["qk_norm"], gated_output=o["gated"],
        key_size=None if shared else hidden + 1, value_size=None if shared else hidden + 2,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if name in ("sinks", "q_norm.weight", "k_norm.weight") or name.startswith("position.raw_r"):
                p.add_(0.5 * torch.randn_like(p))
    mha = mha.to(o.get("device", "cpu"), dtype).eval()
    layer = Layer(
        case.heads, case.kv_heads, o["head_dim"], o["scale"], o.get("softcap"), o["qk_norm"], o["gated"],
        o.get("rotary") if term is None else None, term,
    )  # fmt: skip
    return mha, layer


def module_positions(case: Case, gen: torch.Generator, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Puts the case's positions into ``kwargs``; the ``(b, lq)`` and ``(b, lk)`` positions the encodings see."""
    o, batch, lq, lk = case.opts, case.batch, case.lq, case.lk
    kind = o.get("positions", "default")
    if kind == "per row":  # each row shifted (left padding, a continued sequence); not one consecutive run
        q_pos = torch.arange(lq) + torch.randint(-3, 4, (batch, 1), generator=gen)
        k_pos = torch.arange(lk) + torch.randint(-3, 4, (batch, 1), generator=gen)
        kwargs["positions"] = q_pos
        if lq != lk or not o["shared_input"]:
            kwargs["key_positions"] = k_pos
        else:
            k_pos = q_pos
        return q_pos, k_pos
    if "document_ids" in kwargs:  # positions restart at each document
        q_pos = document_positions(kwargs["document_ids"])
        return q_pos, q_pos
    first = 0
    if kind == "offset":
        first = kwargs["offset"] = 3
    q_pos, k_pos = first + torch.arange(lq), first + lq - lk + torch.arange(lk)
    return q_pos.expand(batch, lq), k_pos.expand(batch, lk)


def materialize(tree: tuple, gen: torch.Generator, batch: int, length: int) -> tuple:
    """A drawn rule tree with its tensors drawn from ``gen``: the reference's plain-data form."""
    kind = tree[0]
    if kind in ("and", "or"):
        return (kind, materialize(tree[1], gen, batch, length), materialize(tree[2], gen, batch, length))
    if kind == "prefix" and tree[1] == "per row":
        return ("prefix", torch.randint(0, length + 2, (batch,), generator=gen))
    if kind == "spans":
        return ("spans", torch.randint(0, 3, (batch, length), generator=gen))
    if kind == "documents":
        return ("documents", torch.cumsum(torch.rand(batch, length, generator=gen) < 0.3, dim=1))
    if kind == "valid":
        return ("valid", torch.randint(0, length + 1, (batch,), generator=gen))
    if kind == "selected":  # tree[1] picks per query, -1 unused
        return ("selected", torch.randint(-1, length, (batch, length, tree[1]), generator=gen))
    return tree


def as_rule(tree: tuple) -> masks.Rule:
    """selfattn's rule for a materialized tree, joined with its own ``&`` and ``|``."""
    kind = tree[0]
    if kind == "and":
        return as_rule(tree[1]) & as_rule(tree[2])
    if kind == "or":
        return as_rule(tree[1]) | as_rule(tree[2])
    makers = {
        "causal": lambda: masks.causal(), "window": lambda: masks.window(tree[1]),
        "chunks": lambda: masks.chunks(tree[1]), "prefix": lambda: masks.prefix(tree[1]),
        "spans": lambda: masks.spans(tree[1]), "documents": lambda: masks.documents(tree[1]),
        "valid": lambda: masks.valid_lengths(tree[1]), "selected": lambda: masks.selected(tree[1]),
    }  # fmt: skip
    return makers[kind]()


def module_call(case: Case, gen: torch.Generator) -> tuple[dict, tuple | None, torch.Tensor | None]:
    """The call's keyword arguments, the reference's visibility rule and the finite part of a float attn_mask."""
    o, batch, lq, lk = case.opts, case.batch, case.lq, case.lk
    kwargs: dict = {"causal": o.get("causal", False), "return_weights": o.get("return_weights", False)}
    rules: list = [("causal",) if kwargs["causal"] else None]
    if o.get("window"):
        rules.append(("window", o["window"]))
    if "valid_lens" in o:
        lens = torch.tensor(o["valid_lens"]).view(batch, -1 if o.get("valid_per_query") else 1)
        kwargs["valid_lens"] = lens if o.get("valid_per_query") else lens[:, 0]
        rules.append(("valid", kwargs["valid_lens"]))
    if "padding" in o:
        index = torch.arange(lk)
        kwargs["key_padding_mask"] = torch.stack(
            [(index < left) | (index >= lk - right) for left, right in o["padding"]]
        )  # fmt: skip
        rules.append(("padding", kwargs["key_padding_mask"]))
    if o.get("documents"):
        kwargs["document_ids"] = torch.cumsum(torch.rand(batch, lq, generator=gen) < 0.3, dim=1)
        rules.append(("documents", kwargs["document_ids"]))
    float_bias = None
    if o.get("attn_mask"):
        shape = [(lq, lk), (batch, lq, lk), (batch, case.heads, lq, lk)][int(torch.randint(0, 3, (), generator=gen))]
        keep = torch.rand(shape, generator=gen) < 0.8
        if o["attn_mask"] == "bool":
            kwargs["attn_mask"] = keep
        else:
            finite = 0.5 * _randn(gen, *shape)
            kwargs["attn_mask"] = finite.masked_fill(~keep, -math.inf).to(DTYPES[case.dtype])
            float_bias = kwargs["attn_mask"].double().masked_fill(~keep, 0.0)
            float_bias = float_bias if float_bias.dim() == 4 else float_bias.unsqueeze(-3)
        rules.append(("dense", keep if keep.dim() == 4 else keep.unsqueeze(-3)))
    if "tree" in o:
        tree = materialize(o["tree"], gen, batch, lq)
        kwargs["mask"] = as_rule(tree)
        rules.append(tree)
    return kwargs, rules, float_bias


def run_module(case: Case, poison: float | None = None) -> tuple[dict, dict]:
    """``MultiHeadAttention`` and the reference with its weights: ``(actual, expected)`` outputs and gradients.

    ``poison``: that value (NaN or an infinity) in the first feature of the last query token of the last
    sequence (with shared input, that token's key and value too), the call run without gradients; no gradient is
    compared."""
    o, gen, dtype = case.opts, torch.Generator().manual_seed(case.seed), DTYPES[case.dtype]
    device = o.get("device", "cpu")
    mha, layer = build_module(case)
    kwargs, rules, float_bias = module_call(case, gen)
    q_pos, k_pos = module_positions(case, gen, kwargs)
    if o.get("chunk_size"):
        rules.append(("position chunks", o["chunk_size"]))
    width = case.heads * o["head_dim"]
    if o["shared_input"]:
        queries = keys = values = _leaf(_randn(gen, case.batch, case.lq, width), dtype, device)
        inputs = {"x": queries}
    else:
        queries = _leaf(_randn(gen, case.batch, case.lq, width), dtype, device)
        keys = _leaf(_randn(gen, case.batch, case.lk, width + 1), dtype, device)
        values = _leaf(_randn(gen, case.batch, case.lk, width + 2), dtype, device)
        inputs = {"queries": queries, "keys": keys, "values": values}
    if poison is not None:
        with torch.no_grad():
            queries[-1, -1, 0] = poison
    kwargs = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    with torch.no_grad() if poison is not None else contextlib.nullcontext():
        route = mha.explain(queries, keys, values, **kwargs).route
        # in inference a decoding step may take another route than the case's (the key-row steps): not asserted
        assert route == case.route or poison is not None or case.route == ANY_ROUTE, f"the case took {route!r}"
        result = mha(queries, keys, values, **kwargs)
    out, weights = result if kwargs["return_weights"] else (result, None)

    params = {name.removeprefix("position."): _as64(p) for name, p in mha.named_parameters()}
    as64 = {name: _as64(t) for name, t in inputs.items()}
    rows = None
    if o.get("skip") and "valid_lens" in kwargs:  # padded query rows: zero, and never read
        rows = torch.arange(case.lq)[None, :] < kwargs["valid_lens"].cpu()[:, None]  # (b, lq)
    read = {name: t if rows is None else torch.where(rows[..., None], t, 0.0) for name, t in as64.items()}
    ref_q, ref_k, ref_v = (read["x"],) * 3 if "x" in read else (read["queries"], read["keys"], read["values"])
    seen = (
        visible(all_of(*rules), case.batch, case.lq, case.lk, case.lk - case.lq, q_pos, k_pos) if any(rules) else None
    )
    ref_out, ref_weights = layer_forward(
        layer, params, ref_q, ref_k, ref_v, q_pos=q_pos, k_pos=k_pos, seen=seen, float_bias=float_bias
    )
    if rows is not None:
        ref_out = torch.where(rows[..., None], ref_out, 0.0)
        ref_weights = torch.where(rows[:, None, :, None], ref_weights, 0.0)
    actual = {"out": out, "weights": weights}
    expected = {"out": ref_out, "weights": ref_weights if weights is not None else None}
    if poison is not None:
        return actual, expected
    _backward(actual, case.seed + 1)
    _backward(expected, case.seed + 1)
    actual |= {f"grad {name}": t.grad for name, t in inputs.items()}
    actual |= {f"grad {name}": p.grad for name, p in mha.named_parameters()}
    expected |= {f"grad {name}": t.grad for name, t in as64.items()}
    expected |= {f"grad {name}": p.grad for name, p in zip(dict(mha.named_parameters()), params.values(), strict=True)}
    return actual, expected


def assert_close(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None, dtype: str) -> None:
    """``actual`` within the dtype's tolerance of ``expected``, relative to max(1, its largest magnitude) (a
    gradient: :data:`GRADIENT_TOLERANCE`)."""
    if expected is None or (actual is None and not expected.any()):
        return  # nothing to compare, or a gradient the library never formed where the reference's is zero
    assert actual is not None, f"{name}: no value where the reference has one"
    actual = actual.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    size = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    tolerance = (GRADIENT_TOLERANCE if name.startswith("grad ") else TOLERANCE)[dtype]
    assert error <= tolerance * size, f"{name}: off by {error:.3g} (largest |expected| {size:.3g})"


def check(case: Case) -> None:
    actual, expected = run_functional(case) if case.api == "functional" else run_module(case)
    for name, value in expected.items():
        assert_close(name, actual.get(name), value, case.dtype)


def test_every_route_is_fuzzed():
    assert set(STRATEGIES) == {route.name for route in dispatch.ROUTES}


_SLOW_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@pytest.mark.parametrize("route", [name for name in STRATEGIES if name != "flex"])
@settings(suppress_health_check=_SLOW_HEALTH)
@given(data=st.data())
def test_route_matches_float64(route, data):
    for _ in range(CASES_PER_EXAMPLE.get(route, 1)):
        case = data.draw(STRATEGIES[route](route), label="case")
        check(case)


@settings(suppress_health_check=_SLOW_HEALTH)
@given(data=st.data())
def test_rules_of_one_kind_twice_match_float64(data):
    check(data.draw(twice_cases(), label="case"))


@pytest.mark.gpu  # FlexAttention's route is CUDA only
@settings(suppress_health_check=_SLOW_HEALTH, max_examples=min(settings.default.max_examples, 8))
@given(data=st.data())
def test_flex_route_matches_float64(data):
    """Fewer examples: each compiles FlexAttention for its shapes (25 had not finished after about two minutes on an H200, 2026-11-27)."""
    check(data.draw(STRATEGIES["flex"]("flex"), label="case"))


def assert_nan_where_the_formula_has_nan(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None,
                                         dtype: str, query: bool, hidden: bool = True) -> None:  # fmt: skip
    """Rows (the last dimension) where ``expected`` holds NaN are NaN in ``actual``; the other rows are finite and
    within the dtype's tolerance where they are not NaN; with a poisoned query (``query``) and keys a rule hides
    (``hidden``) its own row may be NaN where the formula is not: an infinite query's score of a hidden key may be
    +inf, and the kernels add the mask's -inf to it. With no key hidden that row is the formula's too (finite with
    a softcap, zeros with sinks where every score is -inf)."""
    if expected is None:
        return
    assert actual is not None, f"{name}: no value where the reference has one"
    actual = actual.detach().to("cpu", torch.float64)
    nan_expected, nan_actual = expected.isnan().any(-1), actual.isnan()
    assert nan_actual.all(-1)[nan_expected].all(), f"{name}: a number where the formula gives NaN"
    if query:  # a query's NaN reaches no other query's row (a masked key's NaN may: PyTorch's kernels add the mask)
        poisoned = torch.zeros_like(nan_expected)
        poisoned[..., -1, -1] = hidden  # the last query of the last head
        assert not nan_actual.any(-1)[~nan_expected & ~poisoned].any(), f"{name}: NaN in a row the poison cannot reach"
    finite = ~nan_expected & ~nan_actual.any(-1)
    assert_close(name, actual[finite], expected[finite], dtype)


#: The routes whose strategies draw functional calls (the others' cases are layers, whose projections spread a
#: poisoned token everywhere).
FUNCTIONAL_ROUTES = ["sparse selection", "fused sinks", "sliced", "blockwise", "explicit", "explicit softcap/sinks",
                     "split keys", "fused"]  # fmt: skip


@pytest.mark.parametrize("route", FUNCTIONAL_ROUTES)
@settings(suppress_health_check=_SLOW_HEALTH)
@given(
    data=st.data(),
    value=st.sampled_from([math.nan, math.inf, -math.inf]),
    oppose=st.sampled_from([False, True, None, "key"]),
)
def test_route_gives_nan_where_the_formula_does(route, data, value, oppose):
    """A query holding NaN or an infinity, often against keys that all oppose it (every score of its row -inf,
    which PyTorch's kernel reads as a row that sees no key), or a key holding NaN (``oppose`` None; a single key
    the kernel gives its value whatever its score), or an infinite key that gives every query a +inf score
    (``oppose`` "key"; PyTorch's CPU kernel in bfloat16 gives such a row zeros): the float64 formula's NaN rows are
    NaN, the rest as in the formula; without gradients, as decoding runs. (A key holding -inf can make every score
    a row sees -inf; the library gives that row zeros, as a row that sees no key, where the formula's 0/0 is NaN:
    not drawn.)"""
    case = data.draw(STRATEGIES[route](route).filter(lambda c: c.api == "functional"), label="case")
    if oppose is None:
        value = math.nan
    actual, expected = run_functional(case, poison=(value, oppose))
    hidden = bool(case.opts.get("mask") or case.opts.get("causal") or case.opts.get("picks"))
    for name, reference in expected.items():
        query = oppose not in (None, "key")
        assert_nan_where_the_formula_has_nan(name, actual.get(name), reference, case.dtype, query, hidden)


#: The routes whose strategies draw layer calls.
MODULE_ROUTES = [name for name in STRATEGIES if name not in FUNCTIONAL_ROUTES and name != "flex"]


@pytest.mark.parametrize("route", MODULE_ROUTES)
@settings(suppress_health_check=_SLOW_HEALTH)
@given(data=st.data(), value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_layer_route_gives_nan_where_the_formula_does(route, data, value):
    """A token whose input holds NaN or an infinity (its query, and with shared input its key and value): every
    output feature the float64 layer makes NaN is NaN; without gradients, as decoding runs."""
    case = data.draw(STRATEGIES[route](route).filter(lambda c: c.api == "module"), label="case")
    if case.opts.get("softcap") and case.opts.get("term"):
        # Shaw's bias of an infinite query can be -inf, which hides its key before the softcap (as any -inf bias
        # does), where the formula caps the sum, NaN or finite by the signs: a convention, not tested here.
        value = math.nan
    actual, expected = run_module(case, poison=value)
    for name, reference in expected.items():
        if reference is None:
            continue
        got = actual[name].detach().to("cpu", torch.float64).isnan()
        if name == "out":  # each feature where the formula has NaN (the others may be infinite)
            assert got[reference.isnan()].all(), f"{name}: a number where the formula gives NaN"
        else:  # a row of weights keeps 0 for the keys it does not see
            assert got.any(-1)[reference.isnan().any(-1)].all(), f"{name}: a number where the formula gives NaN"


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_an_infinite_query_through_shaws_term_on_the_banded_route_gives_nan(value):
    """Shaw's bias is the query times the offsets' vectors: an infinite query makes it -inf at some keys, which
    the kernel call reads as hidden keys; with a window of 1 (one key: the token itself) and a head size of 1 its
    row can see none, where the formula's softmax is NaN. Seeds where that happens among 24."""
    found = 0
    for seed in range(24):
        case = Case("banded", "module", "float64", 1, 33, 33, 1, 1, seed, {
            "head_dim": 1, "bias": False, "qk_norm": False, "gated": False, "scale": None, "shared_input": False,
            "softcap": None, "sinks": False, "window": 1, "causal": False, "positions": "default", "term": "shaw keys",
        })  # fmt: skip
        actual, expected = run_module(case, poison=value)
        nan = expected["out"].isnan()
        assert actual["out"].isnan()[nan].all()
        found += bool(nan.any())
    assert found  # the case the test is about occurred
