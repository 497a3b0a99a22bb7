"""Every edge behaves: NaN in gives NaN out, bad input is a clear error naming the argument,
a failed call leaves the cache as it was, reduced precision is accumulated in float32."""

from __future__ import annotations

import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import attention, attention_weights, causal_mask, sinusoidal_table, valid_lens_mask
from selfattn.functional._few_keys import few_keys
from selfattn.positional import build

NAN, NEG_INF = float("nan"), float("-inf")


def qkv(*, lq: int = 2, lk: int = 3, d: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 1, lq, d, generator=g),
        torch.randn(1, 1, lk, d, generator=g),
        torch.randn(1, 1, lk, d, generator=g),
    )


def both_paths(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    fused = attention(q, k, v, **kwargs)
    explicit, _ = attention(q, k, v, return_weights=True, **kwargs)
    assert isinstance(fused, torch.Tensor)
    return fused, explicit


# --- silent wrong answers ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_a_non_finite_query_gives_nan_on_both_paths(bad: float) -> None:
    q, k, v = qkv()
    q[..., 0, 0] = bad
    for out in both_paths(q, k, v):
        assert out[..., 0, :].isnan().all()
        assert out[..., 1, :].isfinite().all()


def test_a_nan_key_or_value_a_query_sees_gives_nan_on_both_paths() -> None:
    for which in ("k", "v"):
        q, k, v = qkv()
        (k if which == "k" else v)[..., 1, 0] = NAN
        for out in both_paths(q, k, v):
            assert out.isnan().any(dim=-1).all(), which


@pytest.mark.parametrize("num_keys", [3, 40])  # below and past the kernel's one vector of keys
def test_infinite_keys_and_values_on_both_paths(num_keys: int) -> None:
    """+inf score: NaN row; -inf score: that key weighs zero (the other keys' answer); infinite value: inf
    there; every visible score -inf from infinite keys: zeros fused from one vector of the CPU kernel's keys on
    (fewer: the formula written out), NaN explicit (attention's docstring)."""
    q, k, v = qkv(lq=1, lk=num_keys)
    q = q.abs() + 0.1  # every query element positive: a key's sign decides its score's
    for sign in (1.0, -1.0):
        keys = k.clone()
        keys[..., 1, :] = sign * float("inf")
        for out in both_paths(q, keys, v):
            if sign > 0:
                assert out.isnan().all()
            else:
                others = [j for j in range(num_keys) if j != 1]
                torch.testing.assert_close(out, attention(q, k[..., others, :], v[..., others, :]))
    values = v.clone()
    values[..., 1, 0] = float("inf")
    for out in both_paths(q, k, values):
        assert out[..., 0].isposinf().all() and out[..., 1:].isfinite().all()
    fused, explicit = both_paths(q, torch.full_like(k, NEG_INF), v)
    assert (fused.isnan() if few_keys(q, k) else fused.eq(0)).all() and explicit.isnan().all()
    assert few_keys(q, k) == (num_keys == 3)  # both sides of the vector drawn


def test_nan_behind_a_mask_reaches_the_row_as_attention_says() -> None:
    """A masked value weighs 0, and 0 * NaN is NaN on both paths; a masked key's NaN score reaches the fused
    kernel's row (it adds the mask to the scores) but not the explicit path's (it fills them). The causal rule
    hides a key's NaN on both (attention's docstring)."""
    q, k, v = qkv(lq=3, lk=40, d=8)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[:, :10] = False
    keys, values = k.clone(), v.clone()
    keys[..., 3, 2], values[..., 4, 2] = NAN, NAN
    fused, explicit = both_paths(q, keys, v, mask=mask)
    assert fused.isnan().all() and explicit.isfinite().all()
    torch.testing.assert_close(explicit, attention(q, k, v, mask=mask))
    for out in both_paths(q, k, values, mask=mask):
        assert out[..., 2].isnan().all() and out[..., [0, 1, 3, 4, 5, 6, 7]].isfinite().all()
    square_q, square_k, square_v = qkv(lq=40, lk=40, d=8)
    square_k[..., 30, 1] = NAN
    for out in both_paths(square_q, square_k, square_v, causal=True):
        assert out[..., 30:, :].isnan().all() and out[..., :30, :].isfinite().all()


def test_multi_head_attention_propagates_nan() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 3, 8)
    queries = x.clone()
    queries[0, 1, 0] = NAN
    for out in (mha(queries, x, x), mha(queries, x, x, return_weights=True)[0]):
        assert out[0, 1].isnan().all()
        assert out[0, [0, 2]].isfinite().all()


def test_a_nan_query_in_a_fully_masked_row_is_still_zero() -> None:
    q, k, v = qkv()
    q[..., 0, 0] = NAN
    mask = torch.tensor([[False, False, False], [True, True, True]])
    for out in both_paths(q, k, v, mask=mask):
        assert out[..., 0, :].eq(0).all()


def test_an_all_minus_inf_bias_row_is_a_fully_masked_row_on_both_paths() -> None:
    q, k, v = qkv()
    q.requires_grad_(True)
    bias = torch.zeros(1, 1, 2, 3)
    bias[..., 0, :] = NEG_INF
    bias[..., 1, 2] = NEG_INF
    fused, explicit = both_paths(q, k, v, bias=bias)
    expected, _ = attention(q, k[..., :2, :], v[..., :2, :], return_weights=True)
    for out in (fused, explicit):
        assert out[..., 0, :].eq(0).all()
        torch.testing.assert_close(out[..., 1, :], expected[..., 1, :])
    _, weights = attention(q, k, v, bias=bias, return_weights=True)
    assert weights[..., 0, :].eq(0).all()
    (fused.sum() + explicit.sum()).backward()
    assert q.grad is not None and q.grad.isfinite().all()


@pytest.mark.parametrize("scale", [NAN, float("inf"), 0.0, -1.0])
def test_scale_must_be_positive_and_finite(scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        attention(*qkv(), scale=scale)
    with pytest.raises(ValueError, match="scale"):
        attention(*qkv(), scale=scale, return_weights=True)


@pytest.mark.parametrize("scale", ["a", None.__class__, True])
def test_scale_of_the_wrong_type_names_scale(scale: object) -> None:
    with pytest.raises(TypeError, match="scale"):
        attention(*qkv(), scale=scale)  # type: ignore[arg-type]


def test_scale_still_takes_numbers() -> None:
    q, k, v = qkv()
    torch.testing.assert_close(attention(q, k, v, scale=0.5), attention(q * 0.5 * 2.0, k, v))


@pytest.mark.parametrize(
    "lengths, match",
    [
        (torch.tensor([1.5]), "whole numbers"),
        (torch.tensor([float("nan")]), "whole numbers"),
        (torch.tensor([-1]), "negative"),
        (torch.tensor([True]), "integer"),
        (torch.tensor(2), r"shape \(b,\)"),
        ([1, 2], "torch.Tensor"),
    ],
)
def test_valid_lens_mask_refuses_what_is_not_a_length(lengths: object, match: str) -> None:
    with pytest.raises(ValueError, match=f"valid_lens.*{match}|{match}.*valid_lens|valid_lens must be a {match}"):
        valid_lens_mask(lengths, 3)  # type: ignore[arg-type]


def test_valid_lens_mask_takes_whole_floats_and_checks_num_keys() -> None:
    assert valid_lens_mask(torch.tensor([2.0]), 3).tolist() == [[[[True, True, False]]]]
    with pytest.raises(ValueError, match="num_keys"):
        valid_lens_mask(torch.tensor([1]), -3)


# --- obscure errors from deep inside torch ----------------------------------------------------


def test_mismatched_batch_or_head_dims_name_q_k_v() -> None:
    q, k, v = qkv()
    for args in ((q.expand(2, 1, 2, 4), k, v), (q, k.expand(1, 2, 3, 4), v), (q, k, v.expand(2, 1, 3, 4))):
        with pytest.raises(ValueError, match="q, k and v must have the same leading"):
            attention(*args)
        with pytest.raises(ValueError, match="q, k and v must have the same leading"):
            attention(*args, return_weights=True)


@pytest.mark.parametrize("name", ["mask", "bias"])
@pytest.mark.parametrize("shape", [(3, 3), (2, 1, 2, 3), (1, 1, 1, 2, 3), (2,)])
def test_a_mask_or_bias_that_does_not_broadcast_names_itself(name: str, shape: tuple[int, ...]) -> None:
    term = torch.ones(shape, dtype=torch.bool) if name == "mask" else torch.zeros(shape)
    for return_weights in (False, True):
        with pytest.raises(ValueError, match=rf"{name} of shape .* does not broadcast"):
            attention(*qkv(), return_weights=return_weights, **{name: term})  # type: ignore[call-overload]


def test_broadcastable_masks_and_biases_still_work() -> None:
    q, k, v = qkv()
    for term in (
        torch.ones(3, dtype=torch.bool),
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(1, 1, 2, 1, dtype=torch.bool),
    ):
        torch.testing.assert_close(attention(q, k, v, mask=term), attention(q, k, v))


def test_mixed_dtypes_and_devices_name_q_k_v() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"one dtype.*float64"):
        attention(q, k.double(), v)
    with pytest.raises(ValueError, match="one dtype"):
        attention(q, k, v.half(), return_weights=True)
    with pytest.raises(ValueError, match=r"one device.*meta"):
        attention(q, k, v.to("meta"))
    with pytest.raises(ValueError, match="mask must be on the device of q"):
        attention(q, k, v, mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))


def test_head_size_zero_is_a_value_error() -> None:
    q, k, v = qkv(d=0)
    for return_weights in (False, True):
        with pytest.raises(ValueError, match="head size of at least 1"):
            attention(q, k, v, return_weights=return_weights)


def test_multi_head_attention_says_which_dtype_it_expects() -> None:
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match=r"queries must be torch\.float32 .* got torch\.float64"):
        mha(x.double(), x, x)
    with pytest.raises(ValueError, match=r"values must be torch\.float32"):
        mha(x, x, x.half())


def test_multi_head_attention_takes_mixed_dtypes_under_autocast() -> None:
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(x, x, x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16


def test_multi_head_attention_argument_types() -> None:
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with pytest.raises(TypeError, match="valid_lens"):
        mha(x, x, x, "ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        mha(x, x, x, cache="abc")  # type: ignore[arg-type]
    for offset in (2**63, 2**53, -1):
        with pytest.raises(ValueError, match="offset"):
            mha(x, x, x, offset=offset)
    assert mha(x, x, x, offset=2**53 - 2).shape == (1, 3, 8)  # positions 2**53 - 2 .. 2**53 are exact


def test_causal_mask_refuses_negative_sizes() -> None:
    with pytest.raises(ValueError, match="num_queries"):
        causal_mask(-1, 3)
    with pytest.raises(ValueError, match="num_keys"):
        causal_mask(1, -3)
    assert causal_mask(0, 2).shape == (0, 2)


def test_sinusoidal_table_refuses_inexact_offsets_and_string_dtypes() -> None:
    with pytest.raises(ValueError, match=r"offset .*2\*\*53"):
        sinusoidal_table(2, 4, offset=2**60)
    with pytest.raises(ValueError, match="offset"):
        sinusoidal_table(2, 4, offset=2**53)  # the second row would sit at 2**53 + 1
    assert sinusoidal_table(2, 4, offset=2**53 - 1).shape == (2, 4)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        sinusoidal_table(2, 4, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        sinusoidal_table(2, 4, dtype=torch.int64)


# --- the cache --------------------------------------------------------------------------------


def test_cache_append_checks_values_against_keys() -> None:
    keys = torch.randn(1, 2, 3, 4)
    cache = KVCache(4)
    with pytest.raises(ValueError, match=r"values of shape .* do not match keys"):
        cache.append(keys, torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match=r"values of shape .* do not match keys"):
        cache.append(keys, torch.randn(2, 2, 3, 4))
    with pytest.raises(ValueError, match="share dtype and device"):
        cache.append(keys, torch.randn(1, 2, 3, 4).double())
    with pytest.raises(TypeError, match=r"values must be a torch\.Tensor"):
        cache.append(keys, "abc")  # type: ignore[arg-type]
    assert cache.length == 0


def test_cache_refuses_keys_of_another_dtype_or_device() -> None:
    cache = KVCache(4)
    cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match=r"dtype torch\.float64 .* cache holding torch\.float32"):
        cache.append(torch.randn(1, 2, 1, 4).double(), torch.randn(1, 2, 1, 4).double())
    with pytest.raises(ValueError, match="on meta"):
        cache.append(torch.randn(1, 2, 1, 4, device="meta"), torch.randn(1, 2, 1, 4, device="meta"))
    with pytest.raises(ValueError, match="values of shape"):
        cache.append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 5))
    assert cache.length == 1


def test_a_failed_call_leaves_the_cache_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 4, 8)
    with torch.no_grad():
        full = mha(x, x, x, causal=True)
        cache = KVCache(8)
        first = mha(x[:, :2], x[:, :2], x[:, :2], causal=True, cache=cache)
        with pytest.raises(ValueError, match="float32"):
            mha(x[:, 2:3].double(), x[:, 2:3].double(), x[:, 2:3].double(), causal=True, cache=cache)
        assert cache.length == 2
        # A failure after the keys were written (here: in the output projection) changes nothing either.

        def broken(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("out of memory")

        monkeypatch.setattr(mha.W_o, "forward", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            mha(x[:, 2:3] + 100, x[:, 2:3] + 100, x[:, 2:3] + 100, causal=True, cache=cache)
        assert cache.length == 2
        monkeypatch.undo()
        rest = [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in (2, 3)]
    assert isinstance(first, torch.Tensor) and isinstance(full, torch.Tensor)
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full)


def test_a_failed_first_call_does_not_fix_the_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    mha = MultiHeadAttention(8, 2).eval()
    cache = KVCache(4)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("boom")

    monkeypatch.setattr(mha.W_o, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        mha(torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8), cache=cache)
    monkeypatch.undo()
    x = torch.randn(1, 1, 8)
    assert mha(x, x, x, cache=cache).shape == (1, 1, 8)
    assert cache.length == 1


def test_reset_forgets_the_batch_size_shapes_and_dtype() -> None:
    cache = KVCache(4)
    cache.append(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    cache.reset()
    assert cache.length == 0
    keys, values = cache.append(torch.randn(1, 3, 1, 8).double(), torch.randn(1, 3, 1, 5).double())
    assert keys.shape == (1, 3, 1, 8) and values.shape == (1, 3, 1, 5) and keys.dtype == torch.float64


# --- reduced precision on the explicit path ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_explicit_path_is_as_accurate_as_the_fused_path_in_reduced_precision(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, 2, 64, 32, generator=g).mul(3).to(dtype) for _ in range(2))  # q, k ~ N(0, 9)
    v = torch.randn(4, 2, 64, 32, generator=g).to(dtype)
    reference = attention(q.double(), k.double(), v.double())
    fused, explicit = both_paths(q, k, v)
    fused_error = (fused.double() - reference).abs().max()
    explicit_error = (explicit.double() - reference).abs().max()
    assert explicit.dtype == dtype and attention_weights(q, k).dtype == dtype
    assert explicit_error <= 1.5 * fused_error  # it was 13x before scores were accumulated in float32


def test_explicit_path_stays_finite_in_float16_with_large_inputs() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 1, 8, 16, generator=g).clamp(-3, 3).mul(1e4).half() for _ in range(2))
    v = torch.randn(1, 1, 8, 16, generator=g).half()
    fused, explicit = both_paths(q, k, v)
    assert fused.isfinite().all() and explicit.isfinite().all()
    torch.testing.assert_close(explicit, fused, atol=2e-3, rtol=2e-3)


def test_shaw_in_float16_gives_no_nan() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, position=build("shaw", num_hiddens=16, num_heads=2)).half().eval()
    x = (torch.randn(1, 8, 16) * 300).half()
    out = mha(x, x, x)
    assert isinstance(out, torch.Tensor) and out.isfinite().all()


# ----------------------------------------------------------- edges found by hunting (each failed before its fix)


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"scale": 1.0}])
def test_no_queries_give_an_empty_output_on_the_plain_call(options: dict) -> None:
    q, k = torch.randn(2, 4, 0, 8), torch.randn(2, 2, 5, 8)
    for _ in range(2):  # the second call replays the remembered plain call
        assert attention(q, k, k, **options).shape == (2, 4, 0, 8)


@pytest.mark.parametrize("name", ["rotary", "xpos"])
def test_rotary_refuses_positions_whose_rows_would_meet_the_heads(name: str) -> None:
    """(b, l) positions broadcast against (b, h, l, d) paired sequence s's positions with head s (1.84 off)."""
    encoding = build(name, num_hiddens=16, num_heads=2)
    x = torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"positions of shape \(2, 3\) for x of shape \(2, 2, 3, 8\)"):
        encoding(x, torch.tensor([[0, 1, 2], [5, 6, 7]]))
    with pytest.raises(ValueError, match=r"must broadcast to x.shape\[:-1\] = \(3, 1, 3\)"):
        encoding(torch.randn(3, 1, 3, 8), torch.zeros(3, 3, dtype=torch.long)[:, None, None, :].expand(3, 3, 1, 3))
    per_sequence = encoding(x, torch.tensor([[0, 1, 2], [5, 6, 7]])[:, None])  # (b, 1, l): as each row alone
    assert torch.allclose(per_sequence[1], encoding(x[1:], torch.tensor([5, 6, 7]))[0])


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_input_encodings_refuse_positions_of_another_batch(name: str) -> None:
    encoding = build(name, num_hiddens=16, num_heads=1)
    with pytest.raises(ValueError, match=r"positions of shape \(5, 3\) need x of shape \(batch, 3, d\) with batch 5"):
        encoding(torch.zeros(1, 3, 16), positions=torch.zeros(5, 3, dtype=torch.long))
    assert encoding(torch.zeros(2, 3, 16), positions=torch.zeros(1, 3, dtype=torch.long)).shape == (2, 3, 16)


def test_sinusoidal_takes_no_rows_and_far_positions_without_a_table_to_them() -> None:
    encoding = build("sinusoidal", num_hiddens=16, num_heads=1)
    assert encoding(torch.zeros(2, 0, 16)).shape == (2, 0, 16)
    far = encoding(torch.zeros(1, 2, 16), positions=torch.tensor([2**40, 7]))  # was an 8.8 TB table
    assert torch.equal(far[0, 0], sinusoidal_table(1, 16, offset=2**40)[0])
    assert torch.equal(far[0, 1], sinusoidal_table(8, 16)[7])
    assert encoding.P.shape[1] == 1000  # the table kept its size
    with pytest.raises(ValueError, match="positions must be at most 2"):
        encoding(torch.zeros(1, 1, 16), positions=torch.tensor([2**53 + 5]))


def test_a_layer_without_rotary_has_no_query_key_encoding() -> None:
    """hasattr raised AssertionError (torch.jit.trace reads every attribute)."""
    assert not hasattr(MultiHeadAttention(8, 2), "query_key_encoding")
    assert hasattr(MultiHeadAttention(8, 2, position=build("rotary", num_hiddens=8, num_heads=2)), "query_key_encoding")


@pytest.mark.parametrize("name", ["rotary", "xpos", "alibi", "t5", "shaw", "kerple", "fire"])
def test_an_empty_chunk_through_a_fresh_layer_and_cache_changes_nothing(name: str) -> None:
    """T5 read the range of no positions, a rotary table never grown had no columns (RuntimeErrors)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, position=build(name, num_hiddens=16, num_heads=2)).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    assert layer(x[:, :0], x[:, :0], x[:, :0], causal=True).shape == (2, 0, 16)
    cache = KVCache(max_len=8)
    steps = [layer(x[:, :0], x[:, :0], x[:, :0], causal=True, cache=cache)]
    steps.append(layer(x[:, :3], x[:, :3], x[:, :3], causal=True, cache=cache))
    steps.append(layer(x[:, 3:3], x[:, 3:3], x[:, 3:3], causal=True, cache=cache))
    steps.append(layer(x[:, 3:], x[:, 3:], x[:, 3:], causal=True, cache=cache))
    full = layer(x, x, x, causal=True)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-12)


def test_a_layers_explain_takes_verbose_as_the_functional_one() -> None:
    """docs/routes.md offers explain(..., verbose=True): the layer's raised TypeError."""
    layer, x = MultiHeadAttention(8, 2), torch.randn(1, 5, 8)
    assert "declined before it:" in str(layer.explain(x, x, x, causal=True, verbose=True))
    assert "declined before it:" not in str(layer.explain(x, x, x, causal=True))


def test_one_cache_given_to_a_second_layer_is_refused_until_reset() -> None:
    """Layer b read layer a's cached keys as its own, silently; its plan's steps too once a had decoded."""
    torch.manual_seed(0)
    a, b = MultiHeadAttention(8, 2).eval(), MultiHeadAttention(8, 2).eval()
    x, cache = torch.randn(2, 4, 8), KVCache(max_len=8)
    with torch.no_grad():
        for t in range(3):  # a prompt token, then steps (the decoding plan's)
            a(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache)
        with pytest.raises(ValueError, match=r"cache holds another layer's keys \(3 positions seen\)"):
            b(x[:, 3:], x[:, 3:], x[:, 3:], causal=True, cache=cache)
        with pytest.raises(ValueError, match=r"cache holds another layer's keys \(3 positions seen\)"):
            b.explain(x[:, 3:], x[:, 3:], x[:, 3:], causal=True, cache=cache)  # explain refuses what the call does
        assert a.explain(x[:, 3:], x[:, 3:], x[:, 3:], causal=True, cache=cache).route  # the writer's own: explained
        assert cache.length == 3  # refused before anything was written
        cache.reset()
        assert b(x, x, x, causal=True, cache=cache).shape == (2, 4, 8)  # an empty cache: b's now
        twin = cache.copy()  # a copy is no layer's until one writes to it
        assert a(x[:, :1], x[:, :1], x[:, :1], causal=True, cache=twin).shape == (2, 1, 8)


def test_a_cache_mid_decoding_pickles_and_deep_copies_with_its_model() -> None:
    """KVCache kept a weak reference to its writer: pickling raised TypeError, and a deep copy of (model, caches)
    still named the original layer, so the copy's next step was refused. A copy is no layer's until one writes."""
    import copy
    import pickle

    from selfattn.models import TransformerLM

    torch.manual_seed(0)
    lm = TransformerLM(20, 16, 2, 2, position="rotary").eval()
    tokens = torch.randint(0, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        caches = lm.make_caches(16)
        lm(tokens[:, :4], caches=caches)
        twins = [copy.deepcopy((lm, caches)), pickle.loads(pickle.dumps((lm, caches)))]
        expected = [lm(tokens[:, t : t + 1], caches=caches) for t in range(4, 7)]
        for twin_lm, twin_caches in twins:
            steps = [twin_lm(tokens[:, t : t + 1], caches=twin_caches) for t in range(4, 7)]
            for got, want in zip(steps, expected, strict=True):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
        with pytest.raises(ValueError, match="cache holds another layer's keys"):
            lm(tokens[:, :1], caches=twins[0][1])  # the copy is its writer's now: the original model is refused
