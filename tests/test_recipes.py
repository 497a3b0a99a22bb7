"""Today's attention options (scale, softcap, sinks, QK-norm, gated output) against float64 references.

Each option is checked on every route it can take (``explain`` says which): forward against the
loop reference of ``tests/reference_mha.py``, gradients against a float64 formula written
here in plain torch ops, the cache against the full pass, compiled against eager.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo as dynamo

from selfattn import KVCache, MultiHeadAttention
from selfattn.core import dispatch
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from tests.reference_mha import make_encoding, naive_mha, visibility
from tests.routes import WINDOW_ROUTES, without_routes

D, H = 16, 4

RECIPES = {
    "softcap": {"softcap": 0.8},
    "sinks": {"sinks": True},
    "softcap+sinks+scale": {"softcap": 1.5, "sinks": True, "scale": 0.7},
    "qk_norm+gate": {"qk_norm": True, "gated_output": True},
    "everything": {"softcap": 2.0, "sinks": True, "qk_norm": True, "gated_output": True, "scale": 0.4},
}


def _module(recipe, *, position=None, seed=0, dtype=torch.float64, **options):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(D, H, position=position, dtype=dtype, **RECIPES[recipe], **options).to(dtype).eval()
    with torch.no_grad():  # parameters away from their neutral start (zero sinks, unit norms)
        if mha.sinks is not None:
            mha.sinks.copy_(torch.randn(H, dtype=dtype) * 2)
        if mha.q_norm is not None:
            mha.q_norm.weight.uniform_(0.5, 1.5)
            mha.k_norm.weight.uniform_(0.5, 1.5)
    return mha


def _positions(b, n):
    return torch.arange(n).expand(b, n)


def _check(mha, x, visible, out, rtol=1e-10):
    b, n, _ = x.shape
    expected, _ = naive_mha(mha, x, x, x, visible, _positions(b, n), _positions(b, n))
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------- forward on every route


CASES = {
    # name: (encoding, forward options, routes left out, expected route)
    "causal": ("none", {"causal": True}, (), "blockwise"),
    "causal, explicit": ("none", {"causal": True}, ("blockwise", "fused sinks"), "explicit softcap/sinks"),
    "weights": ("none", {"causal": True, "return_weights": True}, (), "explicit"),
    "alibi band": ("alibi_causal", {"causal": True}, (), "blockwise band"),
    "t5 learnable": ("t5", {}, (), "blockwise band"),
    "shaw values": ("shaw", {"causal": True}, (), "blockwise"),
    "rotary": ("rotary", {"causal": True}, (), "blockwise"),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_equals_the_loop_reference_on_each_route(recipe, case):
    encoding, options, left_out, route = CASES[case]
    mha = _module(recipe, position=make_encoding(encoding, D, H))
    x = torch.randn(2, 11, D, dtype=torch.float64)
    modifies = "softcap" in RECIPES[recipe] or "sinks" in RECIPES[recipe]
    with without_routes(*left_out):
        chosen = mha.explain(x, x, x, **options).route
        result = mha(x, x, x, **options)
    if modifies:
        sinks_alone = (
            route == "blockwise"
            and not options.get("return_weights")
            and encoding in ("none", "rotary")
            and not left_out
        )
        if sinks_alone and "sinks" in RECIPES[recipe] and "softcap" not in RECIPES[recipe]:
            route = "fused sinks"  # one flash call with its log-sum-exp
        assert chosen == route
    out = result[0] if options.get("return_weights") else result
    _check(mha, x, visibility(2, 11, 11, causal=options.get("causal", False)), out)


@pytest.mark.parametrize("recipe", ["softcap+sinks+scale", "everything"])
def test_masks_gqa_windows_documents_and_valid_lens(recipe):
    mha = _module(recipe, num_kv_heads=2, window=4)
    x = torch.randn(3, 13, D, dtype=torch.float64)
    documents = torch.tensor([[0] * 5 + [1] * 8, [0] * 13, [0] * 2 + [1] * 11])
    valid_lens = torch.tensor([13, 9, 4])
    for left_out in ((), WINDOW_ROUTES):
        with without_routes(*left_out):
            out = mha(x, x, x, valid_lens, causal=True, document_ids=documents)
        visible = visibility(3, 13, 13, causal=True, valid_lens=valid_lens.tolist(), window=4)
        same_document = documents[:, :, None] == documents[:, None, :]
        _check(mha, x, visible & same_document.numpy(), out)


def test_a_query_that_sees_nothing_gets_zeros_before_w_o():
    mha = _module("softcap+sinks+scale", bias=False)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    out = mha(x, x, x, torch.tensor([6, 0]), causal=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def test_scale_reaches_the_ragged_and_window_routes():
    torch.manual_seed(1)
    mha = MultiHeadAttention(D, H, scale=0.3, window=3, dtype=torch.float64).eval()
    x = torch.randn(2, 60, D, dtype=torch.float64)
    valid_lens = torch.tensor([60, 30])
    assert mha.explain(x, x, x, causal=True).route == "band only"
    _check(mha, x, visibility(2, 60, 60, causal=True, window=3), mha(x, x, x, causal=True))
    assert mha.explain(x, x, x, valid_lens, causal=True).route == "banded"
    visible = visibility(2, 60, 60, causal=True, window=3, valid_lens=valid_lens.tolist())
    _check(mha, x, visible, mha(x, x, x, valid_lens, causal=True))
    plain = MultiHeadAttention(D, H, scale=0.3, dtype=torch.float64).eval()
    plain.load_state_dict(mha.state_dict())
    assert plain.explain(x, x, x, valid_lens, causal=True).route == "ragged"
    visible = visibility(2, 60, 60, causal=True, valid_lens=valid_lens.tolist())
    _check(plain, x, visible, plain(x, x, x, valid_lens, causal=True))


# ---------------------------------------------------------------- gradients


def _formula(mha, x, causal):
    """The module's output written out in float64 torch ops, differentiable in every parameter."""
    b, n, _ = x.shape
    h, dh = mha.num_heads, mha.head_dim

    def heads(linear, rows):
        return (x @ linear.weight.T).view(b, n, rows, dh).transpose(1, 2)

    q, k, v = heads(mha.W_q, h), heads(mha.W_k, mha.num_kv_heads), heads(mha.W_v, mha.num_kv_heads)
    if mha.q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + mha.q_norm.eps) * mha.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + mha.k_norm.eps) * mha.k_norm.weight
    group = h // mha.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(dh) if mha.scale is None else mha.scale
    logits = q @ k.transpose(-1, -2) * scale
    if mha.softcap is not None:
        logits = mha.softcap * torch.tanh(logits / mha.softcap)
    if causal:
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if mha.sinks is not None:
        sink = mha.sinks.view(1, h, 1, 1).expand(b, h, n, 1)
        weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    merged = (weights @ v).transpose(1, 2).reshape(b, n, h * dh)
    if mha.W_g is not None:
        merged = merged * torch.sigmoid(x @ mha.W_g.weight.T)
    return merged @ mha.W_o.weight.T


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "left_out", [(), ("blockwise",), ("blockwise", "fused sinks")], ids=["default", "no blockwise", "explicit"]
)
def test_gradients_of_inputs_and_every_parameter(recipe, left_out):
    mha = _module(recipe, bias=False, num_kv_heads=2)
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 9, D, dtype=torch.float64)
    params = [x, *mha.parameters()]
    with without_routes(*left_out):
        got = torch.autograd.grad(mha(x, x, x, causal=True), params, grad)
    expected = torch.autograd.grad(_formula(mha, x, True), params, grad)
    names = ["x", *(name for name, _ in mha.named_parameters())]
    for name, a, b in zip(names, got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_sinks_and_gate_learn():
    mha = _module("everything", bias=False)
    assert [name for name, _ in mha.named_parameters() if "sink" in name] == ["sinks"]
    x = torch.randn(2, 7, D, dtype=torch.float64)
    before = (mha.sinks.clone(), mha.W_g.weight.clone())
    optimizer = torch.optim.SGD(mha.parameters(), lr=0.5)
    mha(x, x, x, causal=True).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(before[0], mha.sinks) and not torch.equal(before[1], mha.W_g.weight)


def test_double_backward_through_the_fused_sinks_route():
    mha = _module("sinks", bias=False)
    x = torch.randn(1, 6, D, dtype=torch.float64, requires_grad=True)
    assert mha.explain(x, x, x, causal=True).route == "fused sinks"
    assert torch.autograd.gradgradcheck(lambda t: mha(t, t, t, causal=True), (x,))


def test_double_backward_through_the_blockwise_route():
    mha = _module("softcap+sinks+scale", bias=False)
    x = torch.randn(1, 6, D, dtype=torch.float64, requires_grad=True)
    assert mha.explain(x, x, x, causal=True).route == "blockwise"
    assert torch.autograd.gradgradcheck(lambda t: mha(t, t, t, causal=True), (x,))


# ---------------------------------------------------------------- the functional form


@pytest.mark.parametrize("left_out", [(), ("blockwise",)])
def test_functional_attention_softcap_and_sinks(left_out):
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(3, dtype=torch.float64)
    mask = torch.rand(10, 10) > 0.3
    with without_routes(*left_out, "fused sinks"):
        out = attention(q, k, v, mask=mask, softcap=0.5, sinks=sinks)
    logits = 0.5 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8) / 0.5)
    logits = torch.cat([logits.masked_fill(~mask, float("-inf")), sinks[:, None, None].expand(2, 3, 10, 1)], -1)
    torch.testing.assert_close(out, torch.softmax(logits, -1)[..., :-1] @ v, rtol=1e-12, atol=1e-12)


def test_functional_bad_softcap_and_sinks():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"softcap must be a positive finite number.*0"):
        attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\).*\(3,\)"):
        attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks must be a floating"):
        attention(q, q, q, sinks=torch.zeros(2, dtype=torch.long))
    call = describe_attention(q, q, q, softcap=1.0)
    assert dispatch.explain(call).route == "blockwise"


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"softcap": -1.0}, r"softcap must be a positive finite number, got -1.0"),
        ({"softcap": float("nan")}, r"softcap must be a positive finite number, got nan"),
        ({"scale": 0}, r"scale must be a positive finite number, got 0"),
        ({"sinks": 1}, r"sinks must be True or False, got 1"),
        ({"qk_norm": "yes"}, r"qk_norm must be True or False, got 'yes'"),
        ({"gated_output": None}, r"gated_output must be True or False, got None"),
        ({"qk_norm": True, "qk_norm_eps": 0.0}, r"qk_norm_eps must be a positive finite number, got 0.0"),
    ],
)
def test_bad_options_name_the_argument(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(D, H, **options)


# ---------------------------------------------------------------- caches, compile, dtypes, meta


@pytest.mark.parametrize("recipe", ["softcap+sinks+scale", "everything"])
def test_cached_decoding_equals_the_full_pass(recipe):
    mha = _module(recipe, position=make_encoding("rotary", D, H), num_kv_heads=2)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    full = mha(x, x, x, causal=True)
    cache = KVCache(max_len=16)
    steps = [mha(x[:, :4], x[:, :4], x[:, :4], causal=True, cache=cache)]
    steps += [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def test_compiled_graph_without_breaks_equals_eager():
    mha = _module("everything", dtype=torch.float32)
    x = torch.randn(2, 12, D)
    dynamo.reset()
    explanation = dynamo.explain(mha)(x, x, x, causal=True)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(mha, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, x, x, causal=True), mha(x, x, x, causal=True), rtol=1e-5, atol=1e-6)
    dynamo.reset()


def test_bfloat16_close_to_float32():
    mha = _module("everything", dtype=torch.float32)
    x = torch.randn(2, 12, D)
    reference = mha(x, x, x, causal=True)
    out = mha.to(torch.bfloat16)(x.bfloat16(), x.bfloat16(), x.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


def test_meta_init_then_reset_equals_a_normal_construction():
    torch.manual_seed(3)
    normal = MultiHeadAttention(D, H, **RECIPES["everything"])
    meta = MultiHeadAttention(D, H, device="meta", **RECIPES["everything"]).to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    for (name, a), (_, b) in zip(normal.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert "softcap=2.0, sinks=True, qk_norm=True, gated_output=True" in repr(normal)


def test_gate_and_qk_norm_on_the_route_that_projects_valid_rows_only():
    mha = _module("qk_norm+gate", skip_padded_queries=True)
    x = torch.randn(3, 8, D, dtype=torch.float64)
    valid_lens = torch.tensor([8, 5, 5])
    assert mha.explain(x, x, x, valid_lens, causal=True).route == "ragged valid rows"
    out = mha(x, x, x, valid_lens, causal=True)
    expected, _ = naive_mha(
        mha, x, x, x, visibility(3, 8, 8, causal=True, valid_lens=[8, 5, 5]), _positions(3, 8), _positions(3, 8)
    )
    rows = torch.arange(8)[None, :] < valid_lens[:, None]  # (b, l): padded query rows are zeros
    torch.testing.assert_close(out, expected.masked_fill(~rows[..., None], 0.0), rtol=1e-10, atol=1e-12)


def test_chunk_size_and_temperature_tuning():
    torch.manual_seed(4)
    mha = MultiHeadAttention(D, H, chunk_size=3, temperature_tuning=(0.1, 2.0), dtype=torch.float64).eval()
    x = torch.randn(2, 10, D, dtype=torch.float64)
    positions = torch.tensor([list(range(10)), list(range(5, 15))])
    out = mha(x, x, x, causal=True, positions=positions)
    plain = MultiHeadAttention(D, H, dtype=torch.float64).eval()
    plain.load_state_dict(mha.state_dict())
    factor = 1 + 0.1 * torch.log(1 + torch.floor((positions.double() + 1) / 2.0))  # (b, l), Llama 4's formula
    index = torch.arange(10)
    causal = index[None, :] <= index[:, None]
    # The temperature scales the queries, so it equals scaling q's rows: fold it into the scores by rows.
    expected = []
    for row in range(2):
        q = plain.split_heads(plain.W_q(x[row : row + 1])) * factor[row][:, None]
        k, v = plain.split_heads(plain.W_k(x[row : row + 1])), plain.split_heads(plain.W_v(x[row : row + 1]))
        chunk = (positions[row][:, None] // 3 == positions[row][None, :] // 3) & causal  # chunks of positions
        weights = torch.softmax((q @ k.transpose(-1, -2) / 2).masked_fill(~chunk, float("-inf")), -1)
        expected.append(plain.W_o((weights @ v).transpose(1, 2).flatten(2)))
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-10, atol=1e-12)
    assert "chunk_size=3, temperature_tuning=(0.1, 2.0)" in repr(mha)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        MultiHeadAttention(D, H, chunk_size=0)
    with pytest.raises(ValueError, match=r"temperature_tuning must be \(attn_scale, floor_scale\), got 0.1"):
        MultiHeadAttention(D, H, temperature_tuning=0.1)


# ---------------------------------------------------------------- StreamingLLM's sink tokens


def test_cache_with_sink_tokens_equals_a_mask_of_sinks_and_window():
    torch.manual_seed(5)
    mha = MultiHeadAttention(D, H, position=make_encoding("rotary", D, H), dtype=torch.float64).eval()
    sinks, window, n = 2, 4, 14
    x = torch.randn(2, n, D, dtype=torch.float64)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (j <= i) & ((j < sinks) | (i - j < window))  # the first keys, and a window ending at the query
    expected = mha(x, x, x, attn_mask=seen)
    cache = KVCache(window=window, sink_tokens=sinks)
    steps = [mha(x[:, :3], x[:, :3], x[:, :3], causal=True, cache=cache)]
    for t in range(3, n):  # one token at a time: it sees the sinks, the kept window and itself
        steps.append(mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache))
    assert cache.stored == sinks + window - 1
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="sink_tokens=2 drops the keys between its sinks"):
        MultiHeadAttention(D, H, window=4, dtype=torch.float64)(
            x, x, x, causal=True, cache=KVCache(window=4, sink_tokens=2)
        )
    with pytest.raises(ValueError, match="sink_tokens=2 needs a window"):
        KVCache(16, sink_tokens=2)
    with pytest.raises(ValueError, match="sink_tokens must be a non-negative integer, got -1"):
        KVCache(window=4, sink_tokens=-1)


# ---------------------------------------------------------------- mask rules passed to forward


def _dense(rule_name, n, ids=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    return {
        "chunks": causal & (i // 50 == j // 50),
        "prefix": causal | (j < 40),
        "spans": causal | ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)),
        "window or prefix": causal & ((i - j < 30) | (j < 5)),
    }[rule_name]


@pytest.mark.parametrize("rule_name", ["chunks", "prefix", "spans", "window or prefix"])
@pytest.mark.parametrize("recipe", [None, "softcap+sinks+scale"])
def test_mask_rules_equal_the_same_dense_mask(rule_name, recipe):
    from selfattn import masks

    n = 300
    ids = torch.zeros(2, n, dtype=torch.long)
    ids[0, 100:130], ids[1, 10:20], ids[1, 200:260] = 1, 1, 2
    rule = {
        "chunks": masks.causal() & masks.chunks(50),
        "prefix": masks.causal() | masks.prefix(40),
        "spans": masks.causal() | masks.spans(ids),
        "window or prefix": masks.causal() & (masks.window(30) | masks.prefix(5)),
    }[rule_name]
    mha = _module(recipe) if recipe else MultiHeadAttention(D, H, dtype=torch.float64).eval()
    x = torch.randn(2, n, D, dtype=torch.float64, requires_grad=True)
    route = mha.explain(x, x, x, mask=rule).route
    if rule_name == "chunks":
        assert route == ("sliced" if recipe else "chunks")  # tiles skip other chunks, or one call of chunks
    out = mha(x, x, x, mask=rule)
    expected = mha(x, x, x, attn_mask=_dense(rule_name, n, ids))
    grad = torch.randn_like(out)
    params = [x, *mha.parameters()]
    got, wanted = torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_prefix_lm_decoding_with_a_cache_equals_the_full_pass():
    from selfattn import masks

    mha = _module("everything", position=make_encoding("rotary", D, H))
    x = torch.randn(2, 12, D, dtype=torch.float64)
    rule = masks.causal() | masks.prefix(torch.tensor([4, 6]))
    full = mha(x, x, x, mask=rule)
    cache = KVCache(max_len=12)
    steps = [mha(x[:, :6], x[:, :6], x[:, :6], mask=rule, cache=cache)]
    steps += [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], mask=rule, cache=cache) for t in range(6, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def test_bad_mask_rules_name_the_argument():
    from selfattn import masks

    x = torch.randn(1, 4, D)
    with pytest.raises(
        ValueError, match=r"mask must be a selfattn.masks rule .* got Tensor \(a tensor goes in attn_mask\)"
    ):
        MultiHeadAttention(D, H)(x, x, x, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk size must be a positive integer, got 0"):
        masks.chunks(0)
    with pytest.raises(ValueError, match=r"prefix lengths must be a non-negative int .* got -1"):
        masks.prefix(-1)
    with pytest.raises(
        ValueError, match=r"prefix lengths must be an int or an integer \(b,\) tensor, got torch.float32"
    ):
        masks.prefix(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="key_positions need query_positions"):
        masks.chunks(4, key_positions=torch.arange(4))
    with pytest.raises(ValueError, match=r"span ids must be an integer \(b, l\) tensor, got torch.int64 \(4,\)"):
        masks.spans(torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("encoding", ["alibi_causal", "t5", "shaw"])
def test_gradients_with_score_terms_agree_between_blockwise_and_explicit(encoding):
    mha = _module("softcap+sinks+scale", position=make_encoding(encoding, D, H), bias=False)
    x = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 9, D, dtype=torch.float64)
    params = [x, *mha.parameters()]
    blockwise_route = mha.explain(x, x, x, causal=True).route
    assert blockwise_route.startswith("blockwise")
    blockwise = torch.autograd.grad(mha(x, x, x, causal=True), params, grad)
    with without_routes("blockwise", "blockwise band"):
        expected_route = "explicit value term" if encoding == "shaw" else "explicit softcap/sinks"
        assert mha.explain(x, x, x, causal=True).route == expected_route
        explicit = torch.autograd.grad(mha(x, x, x, causal=True), params, grad)
    names = ["x", *(name for name, _ in mha.named_parameters())]
    for name, a, b in zip(names, blockwise, explicit, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{blockwise_route}: {name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [48, 53])
def test_chunks_as_a_batch_of_chunks_equal_the_dense_mask(causal, length):
    from selfattn import masks

    torch.manual_seed(6)
    mha = MultiHeadAttention(D, H, num_kv_heads=2, dtype=torch.float64).eval()
    x = torch.randn(2, length, D, dtype=torch.float64, requires_grad=True)
    rule = (masks.causal() & masks.chunks(8)) if causal else masks.chunks(8)
    assert mha.explain(x, x, x, mask=rule).route == "chunks"
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    dense = (i // 8 == j // 8) & ((j <= i) if causal else True)
    out, expected = mha(x, x, x, mask=rule), mha(x, x, x, attn_mask=dense)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    params = [x, *mha.parameters()]
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert MultiHeadAttention(D, H, chunk_size=8, dtype=torch.float64).explain(x, x, x, causal=True).route == "chunks"
