"""Each CPU route against a float64 formula written here, forward and every gradient, where routes and options meet.

The cases pin three defects of issue 30 at the routes they came through:

* heads whose last dimension is not contiguous (sliced with a step, transposed), which PyTorch's
  CPU flash kernel read as if it were (fused sinks, causal key rows, the flash blocks);
* rows that see no key only because of causality, with a band of T5 or Kerple (its ``-inf``
  held the causal mask, so the empty rows went unseen and the softmax ran over ``-inf``);
* a value head size other than the key head size with sinks or a softcap (the flash kernel
  takes one head size).

Every case asserts the route :func:`selfattn.core.dispatch.explain` names, so a test exercises
the route it is written for. Shape legend: b batch, h heads, hk kv heads, lq queries, lk keys,
d head size, dv value size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from selfattn import MultiHeadAttention
from selfattn.core import dispatch
from selfattn.core.call import AttentionCall
from selfattn.functional import attention, t5_relative_bucket
from selfattn.functional._attention import describe_attention
from selfattn.masks import Rule, Visibility, causal, key_padding, window
from selfattn.positional import (
    ALiBiPositionalBias,
    KerplePositionalBias,
    RotaryPositionalEncoding,
    ShawRelativePositionEncoding,
    T5RelativePositionBias,
    build,
)

BATCH, HEADS = 2, 2

# ---------------------------------------------------------------------------------------- references


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    value_term: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dense float64 attention from the formula: a row that sees no key gives zeros (and zero gradients).

    ``q (b, h, lq, d)``, ``k (b, hk, lk, d)``, ``v (b, hk, lk, dv)``: kv head ``j`` serves query
    heads ``j * h / hk ..``. ``visible`` bool and ``bias`` broadcast to ``(b, h, lq, lk)``;
    logits are ``q k^T * scale + bias``, capped by ``softcap * tanh(. / softcap)``, then masked;
    ``sinks (h,)`` are one more column of each softmax that adds no value; ``value_term``
    maps the weights to an addition to the output (Shaw's values).
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    visible = visible.expand(logits.shape)
    sees_a_key = visible.any(dim=-1, keepdim=True)  # (b, h, lq, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink_column], dim=-1)
    weights = torch.softmax(torch.where(sees_a_key, logits, 0.0), dim=-1)
    weights = torch.where(sees_a_key, weights[..., : visible.shape[-1]], 0.0)  # the sink column dropped
    out = weights @ v
    return out if value_term is None else out + value_term(weights)


def alibi_slopes_reference(heads: int) -> torch.Tensor:
    """``2^(-8 (i + 1) / h)`` for head ``i`` (a power-of-two head count)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], dtype=torch.float64)


def term_bias(term: object, q: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """The term's ``(1 or b, h, lq, lk)`` bias from its published formula and its parameters (differentiable)."""
    relative = (k_positions[None, :] - q_positions[:, None]).long()  # (lq, lk): j - i
    if isinstance(term, T5RelativePositionBias):
        buckets = t5_relative_bucket(relative, **term._bucket_options())
        return term.relative_attention_bias.weight[buckets].permute(2, 0, 1)[None]  # (1, h, lq, lk)
    if isinstance(term, KerplePositionalBias):
        r1, r2 = F.softplus(term.raw_r1)[:, None, None], F.softplus(term.raw_r2)[:, None, None]
        return (-r1 * torch.log1p(r2 * relative.abs().double()))[None]
    if isinstance(term, ALiBiPositionalBias):
        slopes = alibi_slopes_reference(term.num_heads)[:, None, None]
        distance = -relative if term.causal else relative.abs()
        return (-slopes * distance.double())[None]
    if isinstance(term, ShawRelativePositionEncoding):
        rows = relative.clamp(-term.max_distance, term.max_distance) + term.max_distance
        return torch.einsum("bhqd,qkd->bhqk", q.double(), term.key_embeddings[rows]) / math.sqrt(q.shape[-1])
    raise AssertionError(f"no reference for {type(term).__name__}")


def shaw_values(term: ShawRelativePositionEncoding, q_positions: torch.Tensor, k_positions: torch.Tensor):
    """Shaw's value term ``sum_j w_ij a^V_clip(j - i)`` as a function of the weights."""
    relative = (k_positions[None, :] - q_positions[:, None]).long()
    rows = relative.clamp(-term.max_distance, term.max_distance) + term.max_distance
    table = term.value_embeddings[rows]  # (lq, lk, dv)
    return lambda weights: torch.einsum("bhqk,qkd->bhqd", weights, table)


def visibility_reference(rules: list[str], lq: int, lk: int, padding: torch.Tensor | None) -> torch.Tensor:
    """Bool ``(b, 1, lq, lk)`` by plain comparison: query ``i`` is at position ``lk - lq + i``."""
    i = torch.arange(lk - lq, lk)[:, None]
    j = torch.arange(lk)[None, :]
    visible = torch.ones(BATCH, 1, lq, lk, dtype=torch.bool)
    if "causal" in rules:
        visible &= j <= i
    if "window2" in rules:
        visible &= (i - j).abs() < 2
    if padding is not None:
        visible &= ~padding[:, None, None, :]
    return visible


# ---------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """One call: sizes, visibility, options, and the route it must take."""

    route: str
    lq: int = 6
    lk: int = 6
    d: int = 4
    dv: int = 4
    kv_heads: int = HEADS
    rules: list[str] = field(default_factory=list)  # "causal", "window2"
    padding: str | None = (
        None  # "left": row 0 pads its first two keys; "right": its last two; "all": row 1 is all padding
    )
    term: Callable[[], torch.nn.Module] | None = None
    frozen_term: bool = False  # the term's parameters want no gradient (the flash blocks' backward)
    sinks: bool = False
    softcap: float | None = None
    bias: bool = False
    block_size: int | None = None


def _padding(kind: str | None, lk: int) -> torch.Tensor | None:
    if kind is None:
        return None
    padding = torch.zeros(BATCH, lk, dtype=torch.bool)
    if kind == "left":
        padding[0, :2] = True
    elif kind == "right":
        padding[0, -2:] = True
    elif kind == "all":
        padding[1] = True
    return padding


def t5() -> torch.nn.Module:
    return T5RelativePositionBias(HEADS, num_buckets=8, max_distance=16)


def kerple() -> torch.nn.Module:
    return KerplePositionalBias(HEADS)


CASES = {
    # fused sinks: one call of the flash kernel, forward and backward
    "fused sinks causal": Case("fused sinks", rules=["causal"], sinks=True),
    "fused sinks dv < d": Case("fused sinks", d=6, dv=4, rules=["causal"], sinks=True),
    "fused sinks dv > d": Case("fused sinks", d=4, dv=6, sinks=True),
    "fused sinks gqa": Case("fused sinks", kv_heads=1, d=6, dv=3, rules=["causal"], sinks=True),
    # the flash blocks with sinks (a mask other than causal)
    "blockwise sinks left padding dv < d": Case("blockwise", d=6, dv=4, padding="left", sinks=True, block_size=4),
    "blockwise sinks right padding dv > d": Case("blockwise", dv=6, rules=["causal"], padding="right", sinks=True),
    "blockwise sinks empty sequence": Case("blockwise", d=5, dv=3, padding="all", sinks=True),
    # the explicit blocks: softcap, sinks
    "blockwise softcap sinks dv < d": Case(
        "blockwise", d=6, dv=4, rules=["causal"], padding="left", sinks=True, softcap=2.0, block_size=4
    ),
    "sliced softcap sinks dv < d": Case("sliced", lq=256, lk=256, d=6, dv=4, rules=["causal"], sinks=True, softcap=3.0),
    "sliced softcap dv > d causal left padding": Case(
        "sliced", lq=256, lk=256, d=3, dv=5, rules=["causal"], padding="left", softcap=3.0
    ),
    "blockwise softcap window left padding": Case(
        "blockwise", rules=["causal", "window2"], padding="left", softcap=2.0, block_size=4
    ),
    # one band of a relative term: rows empty only under causality
    "band t5 causal left padding": Case("blockwise band", rules=["causal"], padding="left", term=t5),
    "band kerple causal left padding": Case("blockwise band", rules=["causal"], padding="left", term=kerple),
    "band t5 causal left padding uneven blocks": Case(
        "blockwise band", lq=7, lk=7, rules=["causal"], padding="left", term=t5, block_size=4
    ),
    "band t5 frozen causal left padding": Case(
        "blockwise band", rules=["causal"], padding="left", term=t5, frozen_term=True, block_size=4
    ),
    "band kerple window left padding": Case(
        "blockwise band", rules=["causal", "window2"], padding="left", term=kerple, block_size=2
    ),
    "band t5 sinks softcap dv < d": Case(
        "blockwise band", d=6, dv=4, rules=["causal"], padding="left", term=t5, sinks=True, softcap=2.0
    ),
    "band t5 sinks frozen right padding dv > d": Case(
        "blockwise band", dv=6, rules=["causal"], padding="right", term=t5, frozen_term=True, sinks=True
    ),
    # Shaw's clipped tables, ALiBi's key-only rows
    "clipped shaw causal left padding": Case(
        "blockwise clipped", rules=["causal"], padding="left", term=lambda: ShawRelativePositionEncoding(4, 2)
    ),
    "key row alibi empty sequence": Case(
        "blockwise key row", d=6, dv=4, padding="all", term=lambda: ALiBiPositionalBias(HEADS, causal=True)
    ),
    "causal key rows alibi dv < d": Case(
        "causal key rows", d=6, dv=4, rules=["causal"], term=lambda: ALiBiPositionalBias(HEADS, causal=True)
    ),
    # decoding: queries after every key see them all under causal (and a window that hides none): no mask
    "decoding causal one query": Case("fused", lq=1, lk=6, rules=["causal"]),
    "decoding causal two queries": Case("fused", lq=2, lk=6, rules=["causal"]),
    "decoding window hides none": Case("fused", lq=1, lk=2, rules=["causal", "window2"]),
    "decoding window hides some": Case("fused", lq=1, lk=6, rules=["causal", "window2"]),
    "decoding causal padding": Case("fused", lq=1, lk=6, rules=["causal"], padding="all"),
    "more queries than keys, causal: empty rows": Case("fused", lq=6, lk=2, rules=["causal"]),
    "decoding fused sinks": Case("fused sinks", lq=1, lk=6, rules=["causal"], sinks=True),
    "decoding fused sinks gqa dv < d": Case(
        "fused sinks", lq=1, lk=6, kv_heads=1, d=6, dv=4, rules=["causal"], sinks=True
    ),
    "decoding sinks window hides some": Case("blockwise", lq=1, lk=6, rules=["causal", "window2"], sinks=True),
    # a float bias: the explicit route applies the softcap and sinks
    "explicit bias sinks softcap dv < d": Case(
        "explicit softcap/sinks", d=6, dv=4, rules=["causal"], bias=True, sinks=True, softcap=2.0
    ),
}

LAYOUTS = ("contiguous", "sliced", "transposed")


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in another memory layout, differentiable back to ``t``: last-dimension stride 2 or ``l``."""
    if layout == "sliced":
        return torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2]
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def _rules(case: Case, padding: torch.Tensor | None) -> list[Rule]:
    rules: list[Rule] = []
    if "causal" in case.rules:
        rules.append(causal())
    if "window2" in case.rules:
        rules.append(window(2))
    if padding is not None:
        rules.append(key_padding(padding))
    return rules


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_route_matches_the_formula(name: str, layout: str) -> None:
    case = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    q = torch.randn(BATCH, HEADS, case.lq, case.d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, case.kv_heads, case.lk, case.d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, case.kv_heads, case.lk, case.dv, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=True) if case.sinks else None
    bias = torch.randn(1, HEADS, case.lq, case.lk, dtype=torch.float64) if case.bias else None
    term = None if case.term is None else case.term().double()
    if term is not None:
        with torch.no_grad():
            for parameter in term.parameters():
                parameter.copy_(torch.randn_like(parameter)).requires_grad_(not case.frozen_term)
    q_positions, k_positions = torch.arange(case.lk - case.lq, case.lk), torch.arange(case.lk)
    padding = _padding(case.padding, case.lk)
    positions = {} if term is None else {"term": term, "q_positions": q_positions, "k_positions": k_positions}
    call = AttentionCall.of_heads(
        _laid_out(q, layout), _laid_out(k, layout), _laid_out(v, layout),
        Visibility.lower_right(case.lq, case.lk, *_rules(case, padding)), bias=bias, sinks=sinks,
        softcap=case.softcap, block_size=case.block_size, **positions,
    )  # fmt: skip
    assert dispatch.explain(call).route == case.route
    out = dispatch.run(call).out

    term_bias_ = None if term is None else term_bias(term, q, q_positions, k_positions)
    biases = [b for b in (bias, term_bias_) if b is not None]
    expected = reference_attention(
        q, k, v, visibility_reference(case.rules, case.lq, case.lk, padding), scale=1 / math.sqrt(case.d),
        bias=sum(biases) if biases else None, softcap=case.softcap, sinks=sinks,
        value_term=shaw_values(term, q_positions, k_positions)
        if isinstance(term, ShawRelativePositionEncoding) else None,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)

    grad_out = torch.randn_like(expected)
    leaves = [q, k, v, *([] if sinks is None else [sinks])]
    leaves += [p for p in ([] if term is None else term.parameters()) if p.requires_grad]
    got = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    want = torch.autograd.grad(expected, leaves, grad_out, allow_unused=True)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        w = torch.zeros_like(leaves[index]) if w is None else w
        g = torch.zeros_like(leaves[index]) if g is None else g
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m, i=index: f"gradient {i}: {m}")


# ---------------------------------------------------------------------------------------- the calls


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)]


def test_sliced_heads_with_sinks_through_attention() -> None:
    """``attention(q[..., ::2], k[..., ::2], v, causal=True, sinks=s)``: the issue's call, 1.15 off before."""
    torch.manual_seed(0)
    q_wide = torch.randn(2, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    k_wide = torch.randn(2, 4, 6, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    q, k = q_wide[..., ::2], k_wide[..., ::2]
    assert dispatch.explain(describe_attention(q, k, v, causal=True, sinks=sinks)).route == "fused sinks"
    out = attention(q, k, v, causal=True, sinks=sinks)
    causal_visible = torch.ones(6, 6, dtype=torch.bool).tril()
    expected = reference_attention(q, k, v, causal_visible, scale=1 / math.sqrt(8), sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    grad_out, leaves = torch.randn_like(out), [q_wide, k_wide, v, sinks]
    for got, want in zip(_grads(out, leaves, grad_out), _grads(expected, leaves, grad_out), strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("softcap", [None, 4.0])
def test_value_head_size_other_than_key_head_size_with_sinks(softcap: float | None) -> None:
    """The issue's call: ``d = 24``, ``dv = 16`` with sinks raised ``Q/K/V should have the same head size``."""
    torch.manual_seed(1)
    q = torch.randn(2, 4, 6, 24, requires_grad=True)
    k = torch.randn(2, 4, 6, 24, requires_grad=True)
    v = torch.randn(2, 4, 6, 16, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    route = dispatch.explain(describe_attention(q, k, v, sinks=sinks, softcap=softcap)).route
    assert route == ("fused sinks" if softcap is None else "blockwise")
    out = attention(q, k, v, sinks=sinks, softcap=softcap)
    assert out.shape == (2, 4, 6, 16)
    everything = torch.ones(6, 6, dtype=torch.bool)
    expected = reference_attention(q, k, v, everything, scale=1 / math.sqrt(24), softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    grad_out, leaves = torch.randn_like(out), [q, k, v, sinks]
    for got, want in zip(_grads(out, leaves, grad_out), _grads(expected, leaves, grad_out.double()), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # float32 leaves, float32 gradients


def _module_grads(mha: torch.nn.Module, x: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of ``x`` and every parameter for a fixed output gradient."""
    out = mha(x, x, x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    leaves = [x, *(p for p in mha.parameters() if p.requires_grad)]
    generator = torch.Generator().manual_seed(7)
    return out, _grads(out, leaves, torch.randn(out.shape, generator=generator, dtype=out.dtype))


def _assert_equals_the_explicit_route(mha: MultiHeadAttention, x: torch.Tensor, **kwargs: object) -> None:
    """The module's output and every gradient equal those of the same call with weights (the dense explicit route)."""
    out, grads = _module_grads(mha, x, **kwargs)
    expected, expected_grads = _module_grads(mha, x, return_weights=True, **kwargs)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_head_size_two_half_split_rotary_with_sinks() -> None:
    """Half-split rotary of head size 2 joins two width-1 halves: a stride-2 layout the fused sinks route read wrong."""
    torch.manual_seed(2)
    mha = MultiHeadAttention(4, 2, position=RotaryPositionalEncoding(2, interleaved=False), sinks=True).double()
    with torch.no_grad():
        mha.sinks.normal_()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert mha.explain(x, x, x, causal=True).route == "fused sinks"
    assert mha.explain(x, x, x, causal=True, return_weights=True).route == "explicit"  # weights: dense, in plain ops
    _assert_equals_the_explicit_route(mha, x, causal=True)


@pytest.mark.parametrize("encoding", ["t5", "kerple"])
def test_left_padded_causal_band_gradients(encoding: str) -> None:
    """The issue's module: T5 or Kerple, causal, the first two keys of a row padded; gradients were NaN."""
    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 2, position=build(encoding, num_hiddens=8, num_heads=2)).double()
    with torch.no_grad():
        for parameter in mha.position.parameters():
            parameter.normal_()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, :2] = True
    assert mha.explain(x, x, x, causal=True, key_padding_mask=padding).route == "blockwise band"
    dense = mha.explain(x, x, x, causal=True, key_padding_mask=padding, return_weights=True)
    assert dense.route == "explicit"  # the reference: the whole score matrix in plain ops
    _assert_equals_the_explicit_route(mha, x, causal=True, key_padding_mask=padding)


@pytest.mark.parametrize("encoding", ["t5", "kerple"])
def test_left_padded_causal_band_with_dropout(encoding: str) -> None:
    """With dropout in training the queries that see no key gave NaN rows; they give the zero row (then ``W_o``)."""
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 2, position=build(encoding, num_hiddens=8, num_heads=2), dropout=0.1).double().train()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, :2] = True
    assert mha.explain(x, x, x, causal=True, key_padding_mask=padding).route == "blockwise band"
    out, grads = _module_grads(mha, x, causal=True, key_padding_mask=padding)
    zero_row = mha.W_o(torch.zeros(8, dtype=torch.float64))  # what an attention row of zeros becomes
    torch.testing.assert_close(out[0, :2], zero_row.expand(2, 8).detach(), atol=0, rtol=0)
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("options", ["mask", "causal lq < lk", "mask and sinks", "mask and weights"])
def test_heads_of_rank_two_and_three_take_masks_and_sinks(rank: int, options: str) -> None:
    """Heads ``(h, l, d)`` or ``(l, d)`` with a mask, a lower-right causal mask or sinks, against the formula.

    Before the fix the rules' 4-D mask was refused against 3-D scores (``mask of shape (1, 1, 3, 3)
    does not broadcast``), and the sink column of 2-D heads could not expand.
    """
    gen = torch.Generator().manual_seed(rank)
    lead = (2,) if rank == 3 else ()
    q = torch.randn(*lead, 3, 4, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(*lead, 5, 4, generator=gen, dtype=torch.float64),
        torch.randn(*lead, 5, 3, generator=gen, dtype=torch.float64),
    )
    visible = torch.rand(3, 5, generator=gen) > 0.4
    visible[:, 0] = True
    sinks = torch.randn(lead[0] if lead else 1, generator=gen, dtype=torch.float64)
    kwargs: dict = {"causal": True} if options.startswith("causal") else {"mask": visible}
    if "sinks" in options:
        kwargs["sinks"] = sinks
    if "weights" in options:
        kwargs["return_weights"] = True
    result = attention(q, k, v, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    if options.startswith("causal"):
        visible = torch.ones(3, 5, dtype=torch.bool).tril(2)  # query i sees keys j <= i + lk - lq
    scores = (q @ k.transpose(-1, -2) / 2).masked_fill(~visible, float("-inf"))  # scale 1/sqrt(4)
    if "sinks" in options:
        column = sinks.reshape(-1, 1, 1) if rank == 3 else sinks.reshape(1, 1)
        weights = torch.softmax(torch.cat((scores, column.expand(*scores.shape[:-1], 1)), dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(out, weights @ v, rtol=1e-12, atol=1e-12)
    if isinstance(result, tuple):
        torch.testing.assert_close(result[1], weights, rtol=1e-12, atol=1e-12)


def test_bfloat16_sinks_on_the_fused_sinks_route_backpropagate() -> None:
    """The kernel's log-sum-exp of bf16 heads is float32, and its backward wants it back so (it raised before)."""
    q = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    sinks = torch.zeros(3, requires_grad=True)
    assert dispatch.explain(describe_attention(q, q, q, causal=True, sinks=sinks)).route == "fused sinks"
    attention(q, q, q, causal=True, sinks=sinks).float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16 and bool(q.grad.isfinite().all())
    assert sinks.grad is not None and bool(sinks.grad.isfinite().all())
