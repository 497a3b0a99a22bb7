"""Defects found where options meet (two rules of one kind, a value head size of its own, a NaN the CPU kernel
passes over, a static cache's prefill asked for its weights, a half-precision term's learned rates): each test
here failed before its fix.

The differential fuzz (tests/test_fuzz_routes.py) draws these cases too; these pin one instance of each, with
the reference written here (dense masks, float64).
"""

from __future__ import annotations

import math

import pytest
import torch

import selfattn.masks as masks
from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import attention, blockwise_attention, sparse_attention
from selfattn.functional._few_keys import KERNEL_SPREADS_NAN_FROM_KEYS
from selfattn.positional import RotaryPositionalEncoding, build

NAN = float("nan")


def _layer(**options) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(8, 2, **options).double().eval()


def _grid(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(length)[:, None], torch.arange(length)[None, :]  # query i, key j


# ------------------------------------------------------------------------------------- two rules of one kind


@pytest.mark.parametrize("as_option", [False, True])
def test_chunks_of_two_sizes_both_apply(as_option: bool) -> None:
    i, j = _grid(20)
    layer = _layer(chunk_size=5) if as_option else _layer()
    rule = masks.chunks(2) if as_option else masks.chunks(5) & masks.chunks(2)
    x = torch.randn(1, 20, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = _layer()(x, x, x, attn_mask=(i // 5 == j // 5) & (i // 2 == j // 2))
        torch.testing.assert_close(layer(x, x, x, mask=rule), expected)
        assert layer.explain(x, x, x, mask=rule).route != "chunks"
        assert layer.explain(x, x, x, mask=rule & masks.chunks(2 if as_option else 5)).route != "chunks"
    if as_option:  # the same size twice is one rule: the chunks route keeps it
        assert layer.explain(x, x, x, mask=masks.chunks(5)).route == "chunks"


def test_valid_lengths_twice_both_apply() -> None:
    layer, length = _layer(), 6
    x = torch.randn(2, length, 8, dtype=torch.float64)
    first, second = torch.tensor([3, 6]), torch.tensor([6, 2])
    seen = torch.arange(length)[None, None, :] < torch.minimum(first, second)[:, None, None]  # (b, 1, lk)
    with torch.no_grad():
        expected = layer(x, x, x, attn_mask=seen.expand(2, length, length))
        for call in (
            dict(valid_lens=first, mask=masks.valid_lengths(second)),
            dict(mask=masks.valid_lengths(first) & masks.valid_lengths(second)),
        ):
            torch.testing.assert_close(layer(x, x, x, **call), expected)
            assert layer.explain(x, x, x, **call).route not in ("ragged", "ragged valid rows")


def test_two_selections_of_keys_both_apply_on_the_sparse_route() -> None:
    layer, length, picks = _layer(), 40, 4
    x = torch.randn(1, length, 8, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.rand(1, length, length, generator=generator).argsort(-1)[..., :picks] for _ in range(2))
    dense_first, dense_second = (
        torch.zeros(1, length, length, dtype=torch.bool).scatter_(-1, t, True) for t in (first, second)
    )
    rule = masks.selected(first) & masks.selected(second)
    with torch.no_grad():
        assert layer.explain(x, x, x, mask=rule).route == "sparse selection"
        torch.testing.assert_close(
            layer(x, x, x, mask=rule), layer(x, x, x, mask=masks.dense(dense_first & dense_second))
        )


def test_two_windows_give_the_narrower_band() -> None:
    i, j = _grid(200)
    layer = _layer(window=8)
    x = torch.randn(1, 200, 8, dtype=torch.float64)
    with torch.no_grad():
        assert layer.explain(x, x, x, causal=True, mask=masks.window(3)).route == "band only"
        expected = _layer()(x, x, x, attn_mask=(j <= i) & (i - j < 3))
        torch.testing.assert_close(layer(x, x, x, causal=True, mask=masks.window(3)), expected)


# --------------------------------------------------------------------------- a value head size of its own


@pytest.mark.parametrize(
    ("options", "length", "call", "route"),
    [
        ({}, 5, dict(valid_lens=torch.tensor([3, 5])), "ragged"),
        ({"window": 4}, 200, dict(causal=True), "band only"),
    ],
)
def test_value_heads_of_their_own_size(options: dict, length: int, call: dict, route: str) -> None:
    layer = _layer(value_head_dim=3, **options)
    x = torch.randn(2, length, 8, dtype=torch.float64)
    with torch.no_grad():
        assert layer.explain(x, x, x, **call).route == route
        rows = [layer(x[r : r + 1], x[r : r + 1], x[r : r + 1], **_row(call, r)) for r in range(2)]
        torch.testing.assert_close(layer(x, x, x, **call), torch.cat(rows))


def _row(call: dict, row: int) -> dict:
    return {name: value[row : row + 1] if isinstance(value, torch.Tensor) else value for name, value in call.items()}


def test_shaws_value_term_refuses_another_value_head_size() -> None:
    shaw = build("shaw", num_hiddens=8, num_heads=2, max_distance=3)
    with pytest.raises(ValueError, match=r"adds a term of head size 4 to the values, but value_head_dim=3"):
        MultiHeadAttention(8, 2, value_head_dim=3, position=shaw)
    keys_only = build("shaw", num_hiddens=8, num_heads=2, max_distance=3, values=False)
    MultiHeadAttention(8, 2, value_head_dim=3, position=keys_only)  # no value term: any value size


# ------------------------------------------------------------------------- NaN the CPU kernel passes over


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [2, 9, 17, 40])
def test_the_first_query_of_a_causal_square_sees_its_keys_nan(dtype: torch.dtype, length: int) -> None:
    """Its one key holds NaN: below one vector of keys the kernel gave that row zeros."""
    q, k, v = (torch.randn(1, 2, length, 4).to(dtype) for _ in range(3))
    k[..., 0, 0] = NAN
    out = attention(q, k, v, causal=True)
    assert out[..., 0, :].isnan().all()


@pytest.mark.parametrize("num_keys", [1, 3, 15])
def test_a_decoding_step_whose_every_key_holds_nan_is_nan(num_keys: int) -> None:
    q, k, v = torch.randn(1, 4, 1, 8), torch.full((1, 2, num_keys, 8), NAN), torch.randn(1, 2, num_keys, 8)
    with torch.no_grad():
        assert attention(q, k, v).isnan().all()


@pytest.mark.parametrize("sinks", [False, True])
def test_one_nan_key_reaches_the_row_with_sinks_and_blockwise(sinks: bool) -> None:
    q, k, v = torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2)
    k[..., 0, 0] = NAN
    assert attention(q, k, v, sinks=torch.randn(1) if sinks else None).isnan().all()
    assert blockwise_attention(q, k, v).isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_keys", [16, 17, 64])
def test_an_infinite_key_gives_half_precision_rows_nan(dtype: torch.dtype, num_keys: int) -> None:
    """Every query positive where the key is +inf: a +inf score, whose softmax is NaN (the kernel gave zeros)."""
    torch.manual_seed(0)
    q, k, v = torch.rand(1, 1, 3, 8) + 0.1, torch.randn(1, 1, num_keys, 8), torch.randn(1, 1, num_keys, 8)
    k[..., 5, 3] = math.inf
    assert attention(q.to(dtype), k.to(dtype), v.to(dtype)).isnan().all()
    assert attention(q, k, v).isnan().all()  # float32: the kernel's own NaN
    assert KERNEL_SPREADS_NAN_FROM_KEYS[torch.float32] <= num_keys  # the kernel's path, not the written-out one


# ------------------------------------------------------------------------------------------------- caches


def test_dynamic_rotary_rerotates_sink_tokens_from_the_prompts_length() -> None:
    """A window of 1 keeps only the sink tokens of a 12-token prompt: they were rotated at length 12, not at their
    own last position + 1 (3)."""
    torch.manual_seed(0)
    scaling = {"rope_type": "dynamic", "factor": 8.0, "original_max_position_embeddings": 2}
    layer = MultiHeadAttention(8, 2, position=RotaryPositionalEncoding(4, scaling=scaling)).double().eval()
    x, prompt, sinks = torch.randn(1, 13, 8, dtype=torch.float64), 12, 2
    cache = KVCache(window=1, sink_tokens=sinks)
    seen = torch.eye(13, dtype=torch.bool)
    seen[prompt, :sinks] = True  # the step sees the sinks and itself
    with torch.no_grad():
        layer(x[:, :prompt], x[:, :prompt], x[:, :prompt], causal=True, cache=cache)
        step = layer(x[:, prompt:], x[:, prompt:], x[:, prompt:], causal=True, cache=cache)
        torch.testing.assert_close(step, layer(x, x, x, attn_mask=seen)[:, prompt:], atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------------------------------ layouts


def test_padded_heads_of_a_permuted_layout_reach_the_kernel_with_adjacent_features() -> None:
    """Values of their own head size pad q and k with zero columns for the CPU flash kernel (sinks in grad mode go
    there); keys whose features are not adjacent (stride 2 here, heads innermost: a layer's rotated keys) kept their
    layout through the padding, and the kernel read them as adjacent (0.0085 off)."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, 2, dtype=torch.float64)
    k = torch.randn(1, 20, 2, 2, dtype=torch.float64).permute(0, 3, 1, 2)  # (b, h, lk, d) with strides (80, 1, 4, 2)
    v, sinks = torch.randn(1, 2, 20, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    assert k.stride(-1) == 2
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(2)  # (b, h, 1, lk)
    with_sink = torch.cat((scores, sinks.view(1, 2, 1, 1)), dim=-1).softmax(dim=-1)[..., :-1]
    expected = with_sink @ v
    out = attention(q.requires_grad_(), k, v, sinks=sinks)  # grad mode: the flash kernel's route, not a decoding step
    torch.testing.assert_close(out, expected)


def test_a_row_that_sees_no_key_is_zeros_whether_the_weights_are_asked_for_or_not() -> None:
    """A value its mask hides holds NaN: the explicit route (weights asked for) gave that row 0 * NaN = NaN where
    the fused route gives zeros; a row that sees one key keeps the NaN the docstring allows (0 * NaN) on both."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    v[..., 2, 0] = NAN
    mask = torch.tensor([[True, True, False], [False, False, False]])
    fused = attention(q, k, v, mask=mask)
    explicit, weights = attention(q, k, v, mask=mask, return_weights=True)
    assert fused[..., 1, :].eq(0).all() and explicit[..., 1, :].eq(0).all() and weights[..., 1, :].eq(0).all()
    assert fused[..., 0, 0].isnan().all() and explicit[..., 0, 0].isnan().all()


# ---------------------------------------------------------------------------- learned rates in half precision


@pytest.mark.parametrize("name", ["fire", "kerple"])
def test_a_half_precision_terms_rates_are_computed_as_its_bias_is(name: str) -> None:
    """FIRE's ``c`` and ``L``, Kerple's ``r1`` and ``r2`` are softplus of stored parameters: in bfloat16 they were
    rounded to bfloat16 (0.4%) before the float32 bias was computed from them, which moved FIRE's MLP input across
    its ReLU's kinks (a parameter's gradient 51% off float64 in the fuzz, deep profile). The bias in bfloat16 is now
    the float32 bias of the same parameters, rounded once."""
    torch.manual_seed(3)
    term = build(name, num_hiddens=32, num_heads=4)
    with torch.no_grad():
        for parameter in term.parameters():
            parameter.add_(0.37)  # rates whose softplus bfloat16 rounds
    half = term.to(torch.bfloat16)
    single = build(name, num_hiddens=32, num_heads=4).float()
    single.load_state_dict({key: value.float() for key, value in half.state_dict().items()})
    positions = torch.arange(11)
    q = torch.zeros(1, 4, 11, 8)
    expected = single(q, q_positions=positions, k_positions=positions).to(torch.bfloat16)
    actual = half(q.bfloat16(), q_positions=positions, k_positions=positions)
    assert torch.equal(actual, expected)
    heads, i, j = torch.arange(4)[:, None, None], positions[:, None], positions[None, :]  # the key-row routes' pairs
    assert torch.equal(half.pair_bias(heads, i, j), single.pair_bias(heads, i, j))  # in float32, not rounded after


# -------------------------------------------------------------------- sinks and a query whose scores are all -inf


@pytest.mark.parametrize("num_keys", [1, 5, 20])
@pytest.mark.parametrize("how", ["grad mode", "no grad", "weights", "mask"])
def test_sinks_take_the_row_of_an_infinite_query_whose_every_score_is_minus_inf(num_keys: int, how: str) -> None:
    """The formula with a sink: every key's weight exp(-inf) = 0, the sink's 1, the row zeros. The fused sinks
    route in grad mode (its NaN guard) and the blocks with one key (theirs) gave NaN where the other paths of the
    same call gave zeros."""
    gen = torch.Generator().manual_seed(num_keys)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, num_keys, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    k[0, 1, :, 2] = k[0, 1, :, 2].abs() + 0.1
    q[0, 1, 2, 2] = -math.inf  # query 2 of head 1: every score -inf
    sinks = torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_(how == "grad mode")
    options = {"sinks": sinks, "return_weights": how == "weights"}
    if how == "mask":
        options["mask"] = torch.ones(2, 1, 3, num_keys, dtype=torch.bool)
    with torch.set_grad_enabled(how == "grad mode"):
        out = attention(q.requires_grad_(how == "grad mode"), k, v, **options)
    out = out[0] if how == "weights" else out
    assert torch.equal(out[0, 1, 2], torch.zeros(4, dtype=torch.float64))
    assert out.isfinite().all()


# ------------------------------------------------------------------- scores of 1e4: rows that stay normalised


def _shared_large_feature(length: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs whose every token holds 200 in the first feature of each 16: scores near 1e4 that differ by about 1,
    and values whose first feature is 200 at every key (any convex sum of them is 200)."""
    x = torch.randn(1, length, width, generator=gen) * 0.25
    x[..., ::16] = 200.0
    return x


def test_the_causal_key_rows_merge_keeps_a_row_normalised_at_large_scores() -> None:
    """Past the first chunk of 256 queries the route merges two kernel calls by their log-sum-exps, whose float32
    rounding at 1e4 (5e-4) scaled the row: 200.1 for 200, and gradients 22% off float64 (now as the fused route)."""
    gen = torch.Generator().manual_seed(0)
    layer = MultiHeadAttention(64, 4, position=build("alibi", num_hiddens=64, num_heads=4)).eval()
    with torch.no_grad():
        for projection in (layer.W_q, layer.W_k, layer.W_v, layer.W_o):
            projection.weight.copy_(torch.eye(64))  # the heads are the input's features
    x = _shared_large_feature(300, 64, gen)
    assert layer.explain(x, x, x, causal=True).route == "causal key rows"
    out = layer(x, x, x, causal=True)
    assert (out[0, :, ::16] - 200.0).abs().max() <= 1e-3


def test_few_keys_keep_a_row_normalised_at_large_scores() -> None:
    """Below one vector of keys the written-out kernel took exp(scores - lse): rows summing to 1 - 5e-4, an
    output 0.094 off, and (fused sinks, 12 keys) a query's gradient 100 times its size off float64."""
    gen = torch.Generator().manual_seed(0)
    x = _shared_large_feature(12, 32, gen).view(1, 12, 2, 16).transpose(1, 2)  # (1, 2, 12, 16)
    q = x.clone().requires_grad_(True)
    out = attention(q, x, x, sinks=torch.zeros(2), scale=0.25)
    assert (out[..., 0] - 200.0).abs().max() <= 1e-3
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    q64 = x.double().requires_grad_(True)
    attention(q64, x.double(), x.double(), sinks=torch.zeros(2, dtype=torch.float64), scale=0.25).backward(
        grad.double()
    )
    assert (q.grad.double() - q64.grad).abs().max() <= 0.1 * q64.grad.abs().max()


@pytest.mark.parametrize("masked", [False, True])
def test_a_sink_near_a_large_log_sum_exp_keeps_its_share_in_the_gradients(masked: bool) -> None:
    """A sink logit 2 below rows' log-sum-exps of 1e4 (float32): logaddexp(lse, s) rounded the sink's 4.5e-4 share
    away, so the kernel's backward saw rows without a sink: the query's gradient, whose size is that share times
    the values' 200 and the keys' 200, came out 0.07 for 17 (the fused sinks route; the blocks with a mask too)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 300, 16, generator=gen) * 0.25
    x[..., 0] = 200.0
    sinks = torch.full((2,), 200.0 * 200.0 / 4 - 2)
    grad = torch.randn(1, 2, 300, 16, generator=gen)
    mask = None
    if masked:
        mask = torch.ones(1, 1, 300, 300, dtype=torch.bool)
        mask[..., 5] = False
    q = x.clone().requires_grad_(True)
    attention(q, x, x, sinks=sinks, scale=0.25, mask=mask).backward(grad)
    q64, x64 = x.double().requires_grad_(True), x.double()
    scores = q64 @ x64.transpose(-2, -1) * 0.25  # (1, 2, 300, 300)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    with_sink = torch.cat((scores, sinks.double().view(1, 2, 1, 1).expand(1, 2, 300, 1)), dim=-1)
    (torch.softmax(with_sink, dim=-1)[..., :-1] @ x64).backward(grad.double())  # the formula in float64
    assert (q.grad.double() - q64.grad).abs().max() <= 0.01 * q64.grad.abs().max()


def test_the_sparse_selection_keeps_a_row_normalised_at_large_scores() -> None:
    """Its weights were exp(scores - lse) from a float32 lse at 5e3 (rounded by 5e-4): rows summing to 1 - 5e-4,
    an output 0.049 off 200, the query's gradient 148% off float64 (the dense masked routes: 0.13%)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen, dtype=torch.float64) for n in (64, 1024, 1024))
    for x in (q, k, v):
        x[..., 0] = 200.0  # scores near 5e3; every value's first feature is 200
    picks = torch.stack([torch.randperm(1024, generator=gen)[:64] for _ in range(64)])[None]  # (1, lq, t)
    grad = torch.randn(1, 2, 64, 64, generator=gen, dtype=torch.float64)
    q32 = q.float().requires_grad_(True)
    out = sparse_attention(q32, k.float(), v.float(), picks)
    out.backward(grad.float())
    assert (out[..., 0] - 200.0).abs().max() <= 1e-3
    seen = torch.zeros(1, 1, 64, 1024, dtype=torch.bool).scatter_(-1, picks[:, None], True)
    q64 = q.clone().requires_grad_(True)
    scores = (q64 @ k.transpose(-2, -1) / 8.0).masked_fill(~seen, -math.inf)
    (torch.softmax(scores, dim=-1) @ v).backward(grad)  # the formula in float64
    assert (q32.grad.double() - q64.grad).abs().max() <= 0.01 * q64.grad.abs().max()
