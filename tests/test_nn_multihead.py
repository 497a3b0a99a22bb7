"""selfattn.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same state_dict."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfattn
import selfattn.nn as snn

F64 = torch.float64
ATOL = 1e-10


def _pair(seed: int, **options: object) -> tuple[torch.nn.MultiheadAttention, snn.MultiheadAttention]:
    """A torch module with random weights (biases included) and ours with its state_dict."""
    torch.manual_seed(seed)
    reference = torch.nn.MultiheadAttention(**options, dtype=F64)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    ours = snn.MultiheadAttention(**options, dtype=F64)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, object]:
    heads = draw(st.integers(1, 3))
    embed_dim = heads * draw(st.integers(1, 3))
    case: dict[str, object] = {
        "options": dict(
            embed_dim=embed_dim,
            num_heads=heads,
            dropout=draw(st.sampled_from([0.0, 0.3])),  # dropout acts in training only
            bias=draw(st.booleans()),
            add_bias_kv=draw(st.booleans()),
            add_zero_attn=draw(st.booleans()),
            kdim=draw(st.sampled_from([None, embed_dim, 2])),
            vdim=draw(st.sampled_from([None, 3])),
            batch_first=draw(st.booleans()),
        ),
        "batch": draw(st.sampled_from([None, 1, 3])),  # None: unbatched
        "num_queries": draw(st.integers(1, 4)),
        "num_keys": draw(st.integers(1, 4)),
        "self_attention": draw(st.booleans()),
        "attn_mask": draw(st.sampled_from([None, "bool", "float", "bool3d", "float3d", "causal_bool", "causal_float"])),
        "key_padding_mask": draw(st.sampled_from([None, "bool", "float"])),
        "need_weights": draw(st.booleans()),
        "average_attn_weights": draw(st.booleans()),
        "training": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }
    return case


def _inputs(case: dict[str, object]) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    options = case["options"]
    assert isinstance(options, dict)
    heads, embed_dim = options["num_heads"], options["embed_dim"]
    batch, l, s = case["batch"], case["num_queries"], case["num_keys"]
    assert isinstance(l, int) and isinstance(s, int)
    kdim, vdim = options["kdim"] or embed_dim, options["vdim"] or embed_dim
    causal = str(case["attn_mask"]).startswith("causal")
    if (case["self_attention"] and kdim == vdim == embed_dim) or causal:
        s = l  # a causal mask is square
    gen = torch.Generator().manual_seed(int(case["seed"]))  # type: ignore[call-overload]

    def seq(length: int, size: int) -> torch.Tensor:
        shape = (length, size) if batch is None else (length, batch, size)
        x = torch.randn(shape, generator=gen, dtype=F64)
        return x.transpose(0, 1) if batch is not None and options["batch_first"] else x

    query = seq(l, embed_dim)
    if case["self_attention"] and kdim == vdim == embed_dim and s == l:
        key = value = query  # the fast paths want one tensor
    else:
        key, value = seq(s, kdim), seq(s, vdim)
    kwargs: dict[str, object] = {
        "need_weights": case["need_weights"],
        "average_attn_weights": case["average_attn_weights"],
    }
    # Key 0 stays visible: a query with no visible key is NaN in torch (zeros here; tested apart).
    kind = case["attn_mask"]
    lead = () if kind is None or "3d" not in str(kind) else (heads if batch is None else batch * heads,)
    if kind in ("bool", "bool3d"):
        mask = torch.rand((*lead, l, s), generator=gen) < 0.4
        mask[..., 0] = False
        kwargs["attn_mask"] = mask
    elif kind in ("float", "float3d"):
        kwargs["attn_mask"] = torch.randn((*lead, l, s), generator=gen, dtype=F64)
    elif causal:
        mask = torch.ones(l, s, dtype=torch.bool).triu(1)  # True = not allowed
        kwargs["attn_mask"] = (
            mask if kind == "causal_bool" else torch.zeros(l, s, dtype=F64).masked_fill(mask, -torch.inf)
        )
        kwargs["is_causal"] = True
    padding_shape = (s,) if batch is None else (batch, s)
    if case["key_padding_mask"] == "bool":
        padding = torch.rand(padding_shape, generator=gen) < 0.4
        padding[..., 0] = False
        kwargs["key_padding_mask"] = padding
    elif case["key_padding_mask"] == "float":
        kwargs["key_padding_mask"] = torch.randn(padding_shape, generator=gen, dtype=F64)
    return (query, key, value), kwargs


@settings(max_examples=200)
@given(_cases())
def test_matches_torch(case: dict[str, object]) -> None:
    options = case["options"]
    assert isinstance(options, dict)
    reference, ours = _pair(0, **options)
    training = bool(case["training"])
    reference.train(training)
    ours.train(training)
    if training:
        reference.dropout = ours.dropout = 0.0  # random masks differ; dropout is checked in eval
    args, kwargs = _inputs(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "mismatched key_padding_mask and attn_mask is deprecated"
        expected, expected_weights = reference(*args, **kwargs)
    out, weights = ours(*args, **kwargs)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    if expected_weights is None:
        assert weights is None
    else:
        assert weights is not None
        torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)


def test_matches_torch_with_gradients() -> None:
    reference, ours = _pair(1, embed_dim=6, num_heads=2, add_bias_kv=True, batch_first=True)
    x = torch.randn(2, 5, 6, dtype=F64, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    reference(x, x, x, attn_mask=mask, need_weights=False)[0].square().sum().backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    expected_x, x.grad = x.grad, None
    ours(x, x, x, attn_mask=mask, need_weights=False)[0].square().sum().backward()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], atol=ATOL, rtol=0)
    torch.testing.assert_close(x.grad, expected_x, atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [dict(), dict(kdim=3, vdim=5, bias=False), dict(add_bias_kv=True)])
def test_same_parameters_and_initialization(options: dict[str, object]) -> None:
    torch.manual_seed(3)
    reference = torch.nn.MultiheadAttention(6, 2, **options)
    torch.manual_seed(3)
    ours = snn.MultiheadAttention(6, 2, **options)
    expected, got = reference.state_dict(), ours.state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0)
    for attribute in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "batch_first", "_qkv_same_embed_dim"):
        assert getattr(ours, attribute) == getattr(reference, attribute)


def _layers(kind: str, batch_first: bool, norm_first: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(5)
    layer_type = torch.nn.TransformerEncoderLayer if kind == "encoder" else torch.nn.TransformerDecoderLayer
    options = dict(dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=F64)
    reference = layer_type(8, 2, 16, **options)
    ours = layer_type(8, 2, 16, **options)
    ours.self_attn = snn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=F64)
    if kind == "decoder":
        ours.multihead_attn = snn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=F64)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")  # torch's own layers
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_inside_transformer_layers(kind: str, batch_first: bool, norm_first: bool, training: bool) -> None:
    reference, ours = _layers(kind, batch_first, norm_first)
    reference.train(training)
    ours.train(training)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 8, generator=gen, dtype=F64)  # (b, l, e)
    memory = torch.randn(3, 4, 8, generator=gen, dtype=F64)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    with torch.set_grad_enabled(training):  # eval without grad: torch's fast path reads in_proj_weight
        if kind == "encoder":
            calls = [dict(), dict(src_key_padding_mask=padding), dict(src_mask=causal, is_causal=True)]
            for kwargs in calls:
                torch.testing.assert_close(ours(x, **kwargs), reference(x, **kwargs), atol=ATOL, rtol=0)
        else:
            memory_padding = torch.zeros(3, 4, dtype=torch.bool)
            memory_padding[0, 2:] = True
            kwargs = dict(tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=padding)
            kwargs |= dict(memory_key_padding_mask=memory_padding)
            expected = reference(x, memory, **kwargs)
            torch.testing.assert_close(ours(x, memory, **kwargs), expected, atol=ATOL, rtol=0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's fast path
def test_inside_transformer_encoder_stack() -> None:
    reference_layer, our_layer = _layers("encoder", True, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor advice
        reference = torch.nn.TransformerEncoder(reference_layer, 2).eval()
        ours = torch.nn.TransformerEncoder(our_layer, 2).eval()
    x = torch.randn(2, 6, 8, dtype=F64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 4:] = True
    with torch.no_grad():
        expected = reference(x, src_key_padding_mask=padding)
        got = ours(x, src_key_padding_mask=padding)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, equal_nan=True)


def test_fully_masked_query_gives_zeros_not_nan() -> None:
    reference, ours = _pair(2, embed_dim=4, num_heads=2, batch_first=True)
    x = torch.randn(1, 3, 4, dtype=F64)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1] = True  # query 1 may see no key
    expected = reference(x, x, x, attn_mask=mask)[0]
    out, weights = ours(x, x, x, attn_mask=mask)
    assert expected[0, 1].isnan().all()
    torch.testing.assert_close(out[0, 1], ours.out_proj.bias, atol=ATOL, rtol=0)  # zero before out_proj
    assert weights is not None and (weights[0, 1] == 0).all()
    torch.testing.assert_close(out[0, [0, 2]], expected[0, [0, 2]], atol=ATOL, rtol=0)


def test_is_causal_trusts_the_hint_like_torch() -> None:
    """Without key padding and weights, torch replaces attn_mask by the causal mask: so does this module."""
    reference, ours = _pair(4, embed_dim=4, num_heads=2, batch_first=True)
    x = torch.randn(2, 4, 4, dtype=F64)
    not_causal = torch.zeros(4, 4, dtype=torch.bool)
    expected = reference(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0]
    got = ours(x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False)[0]
    causal = ours(x, x, x, causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, causal, atol=ATOL, rtol=0)


def _copy_into_core(ours: snn.MultiheadAttention, core: selfattn.MultiHeadAttention) -> None:
    weights = ours.in_proj_weight.split(ours._split)
    biases = ours.in_proj_bias.split(ours._split)
    with torch.no_grad():
        for linear, weight, bias in zip((core.W_q, core.W_k, core.W_v), weights, biases, strict=True):
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        core.W_o.weight.copy_(ours.out_proj.weight)
        core.W_o.bias.copy_(ours.out_proj.bias)


@pytest.mark.parametrize("position", ["rotary", "alibi"])
def test_selfattn_options_run_the_core(position: str) -> None:
    torch.manual_seed(6)
    ours = snn.MultiheadAttention(8, 4, batch_first=True, dtype=F64, position=position, num_kv_heads=2, window=3)
    assert ours.in_proj_weight.shape == (8 + 2 * 4, 8) and not ours._qkv_same_embed_dim
    core = selfattn.MultiHeadAttention(8, 4, bias=True, position=ours.position, num_kv_heads=2, window=3, dtype=F64)
    _copy_into_core(ours, core)
    x = torch.randn(2, 6, 8, dtype=F64)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    out, weights = ours(x, x, x, causal=True, key_padding_mask=padding, average_attn_weights=False)
    expected, expected_weights = core(x, x, x, causal=True, key_padding_mask=padding, return_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)

    # decoding with a cache, one token at a time, in torch's (l, b, e) layout
    ours.batch_first = False
    cache = selfattn.KVCache(max_len=6)
    steps = [ours(t, t, t, causal=True, cache=cache, need_weights=False)[0] for t in x.transpose(0, 1).split(1)]
    torch.testing.assert_close(torch.cat(steps).transpose(0, 1), core(x, x, x, causal=True), atol=ATOL, rtol=0)


def test_selfattn_options_keep_torch_masks() -> None:
    torch.manual_seed(8)
    ours = snn.MultiheadAttention(4, 2, dtype=F64, position="rotary")
    core = selfattn.MultiHeadAttention(4, 2, bias=True, position=ours.position, dtype=F64)
    _copy_into_core(ours, core)
    x = torch.randn(5, 4, dtype=F64)  # unbatched (l, e)
    blocked = torch.rand(2, 5, 5) < 0.3  # (h, l, s), True = not allowed
    blocked[..., 0] = False
    out, _ = ours(x, x, x, attn_mask=blocked, positions=torch.arange(3, 8))
    expected = core(x[None], x[None], x[None], attn_mask=~blocked[None], positions=torch.arange(3, 8))
    torch.testing.assert_close(out, expected[0], atol=ATOL, rtol=0)


def test_state_dict_of_torch_loads_with_rotary() -> None:
    reference = torch.nn.MultiheadAttention(8, 2)
    ours = snn.MultiheadAttention(8, 2, position="rotary")
    ours.load_state_dict(reference.state_dict())  # strict: the same names and shapes


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(embed_dim=0, num_heads=1), "embed_dim must be a positive integer, got 0"),
        (dict(embed_dim=6, num_heads=4), "embed_dim=6 is not divisible by num_heads=4"),
        (dict(embed_dim=4, num_heads=2, dropout=1.5), "dropout must be a probability"),
        (dict(embed_dim=4, num_heads=2, kdim=0), "kdim must be a positive integer"),
        (dict(embed_dim=4, num_heads=2, batch_first=1), "batch_first must be True or False, got 1"),
        (dict(embed_dim=4, num_heads=2, add_zero_attn=True, position="rotary"), "add_bias_kv and add_zero_attn do not"),
        (dict(embed_dim=4, num_heads=2, num_kv_heads=3), "num_kv_heads"),
        (dict(embed_dim=4, num_heads=2, position="nope"), "name must be one of"),
    ],
)
def test_constructor_errors(options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        snn.MultiheadAttention(**options)


def test_forward_errors() -> None:
    mha = snn.MultiheadAttention(4, 2, batch_first=True)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"query must have shape \(l, 4\) or"):
        mha(x[..., :3], x, x)
    with pytest.raises(ValueError, match="all be batched"):
        mha(x, x[0], x[0])
    with pytest.raises(ValueError, match="must share the batch size"):
        mha(x, x[:1], x[:1])
    with pytest.raises(ValueError, match="key and value must have the same length"):
        mha(x, x, x[:, :2])
    with pytest.raises(
        ValueError, match=r"attn_mask must have shape \(3, 3\) or \(4, 3, 3\), got torch.bool \(2, 3, 3\)"
    ):
        mha(x, x, x, attn_mask=torch.zeros(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must be bool .* or floating point, got torch.int64"):
        mha(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 3\), got torch.bool \(3,\)"):
        mha(x, x, x, key_padding_mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool .* got torch.int64"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="is_causal=True is a hint that attn_mask is the causal mask"):
        mha(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(3,\)"):
        mha(x[0], x[0], x[0], key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    extra = snn.MultiheadAttention(4, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="do not combine with add_bias_kv or add_zero_attn"):
        extra(x, x, x, causal=True)
    rotary = snn.MultiheadAttention(4, 2, position="rotary", batch_first=True)
    with pytest.raises(ValueError, match="with a cache, key_padding_mask must be bool"):
        rotary(x, x, x, cache=selfattn.KVCache(max_len=4), key_padding_mask=torch.zeros(2, 3))


def test_dropout_in_training_only() -> None:
    _, ours = _pair(9, embed_dim=8, num_heads=2, batch_first=True)
    x = torch.randn(2, 6, 8, dtype=F64)
    evaluated = ours.eval()(x, x, x)[0]
    ours.dropout = 0.5  # read at every call, as torch's attribute
    torch.testing.assert_close(ours(x, x, x)[0], evaluated, atol=0, rtol=0)
    out, weights = ours.train()(x, x, x, average_attn_weights=False)
    assert not torch.allclose(out, evaluated)
    assert weights is not None
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 6, dtype=F64))  # the weights before dropout


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_batch_of_none_gives_torch_s_empty_outputs(need_weights: bool, batch_first: bool) -> None:
    """It raised RuntimeError (view's -1 had no elements to infer from)."""
    theirs, ours = _pair(0, embed_dim=8, num_heads=2, batch_first=batch_first)
    shape = (0, 3, 8) if batch_first else (3, 0, 8)
    x = torch.randn(*shape, dtype=torch.float64)
    expected, expected_weights = theirs(x, x, x, need_weights=need_weights)
    got, weights = ours(x, x, x, need_weights=need_weights)
    assert got.shape == expected.shape == shape
    assert (weights is None) == (expected_weights is None) and (weights is None or weights.shape == (0, 3, 3))


def test_need_weights_is_named_when_it_is_not_a_flag() -> None:
    """The error named return_weights, an argument of selfattn.functional.attention the caller never passed."""
    _, ours = _pair(0, embed_dim=8, num_heads=2, batch_first=True)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="need_weights must be True or False, got str 'no'"):
        ours(x, x, x, need_weights="no")  # type: ignore[arg-type]
