"""The dispatcher's choices, row by row: conditions -> the route ``explain`` names, and why others declined.

Each row was decided by the code before the redesign at one of seven places; the table pins that
the one dispatcher makes the same choice. The CUDA rows build the call's description with a CUDA
device (the selection reads only what the call knows), so CI checks them without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from selfattn import KVCache, MultiHeadAttention, _validation
from selfattn.core import dispatch
from selfattn.core.call import AttentionCall
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from selfattn.masks import Visibility, causal
from selfattn.positional import ALiBiPositionalBias, FIREPositionalBias, ShawRelativePositionEncoding, build

D, H = 16, 2


def _mha(position=None, **options):
    return MultiHeadAttention(D, H, position=position, **options).eval()


def _x(length=12, batch=2):
    return torch.randn(batch, length, D)


def _route(mha, length=12, *args, train=False, **kwargs):
    x = _x(length)
    mha.train(train)
    return mha.explain(x, x, x, *args, **kwargs)


T5 = lambda: build("t5", num_hiddens=D, num_heads=H)  # noqa: E731
ALIBI_CAUSAL = lambda: ALiBiPositionalBias(H, causal=True)  # noqa: E731

ROWS = [
    # (id, module factory, call kwargs, expected route)
    ("plain", lambda: _mha(), {}, "fused"),
    ("causal", lambda: _mha(), {"causal": True}, "fused"),
    ("weights", lambda: _mha(), {"return_weights": True}, "explicit"),
    ("rotary causal", lambda: _mha(build("rotary", num_hiddens=D, num_heads=H)), {"causal": True}, "fused"),
    (
        "shaw values weights",
        lambda: _mha(ShawRelativePositionEncoding(D // H, max_distance=3)),
        {"return_weights": True},
        "explicit value term",
    ),
    ("shaw values", lambda: _mha(ShawRelativePositionEncoding(D // H, max_distance=3)), {}, "blockwise clipped"),
    (
        "shaw keys only",
        lambda: _mha(ShawRelativePositionEncoding(D // H, max_distance=3, values=False)),
        {"causal": True},
        "blockwise clipped",
    ),
    (
        "shaw per-sequence positions",
        lambda: _mha(ShawRelativePositionEncoding(D // H, max_distance=3, values=False)),
        {"positions": torch.arange(12).expand(2, 12)},
        "blockwise",
    ),
    ("t5", lambda: _mha(T5()), {"causal": True}, "blockwise band"),
    ("t5 per-sequence positions", lambda: _mha(T5()), {"positions": torch.arange(12).expand(2, 12)}, "blockwise"),
    ("fire (absolute)", lambda: _mha(FIREPositionalBias(H)), {"causal": True}, "blockwise"),
    ("alibi causal form, causal", lambda: _mha(ALIBI_CAUSAL()), {"causal": True}, "causal key rows"),
    ("alibi causal form, bidirectional", lambda: _mha(ALIBI_CAUSAL()), {}, "blockwise key row"),
    (
        "alibi causal form, valid_lens",
        lambda: _mha(ALIBI_CAUSAL()),
        {"valid_lens": torch.tensor([12, 5])},
        "blockwise key row",
    ),
    (
        "alibi causal form, causal + valid_lens",
        lambda: _mha(ALIBI_CAUSAL()),
        {"valid_lens": torch.tensor([12, 5]), "causal": True},
        "blockwise band",
    ),
    (
        "alibi causal form, block size set",
        lambda: _mha(ALIBI_CAUSAL(), block_size=4),
        {"causal": True},
        "blockwise band",
    ),
    ("alibi bidirectional form", lambda: _mha(ALiBiPositionalBias(H, causal=False)), {}, "blockwise band"),
    (
        "alibi bidirectional form, causal",
        lambda: _mha(ALiBiPositionalBias(H, causal=False)),
        {"causal": True},
        "blockwise band",
    ),
    ("alibi float attn_mask", lambda: _mha(ALiBiPositionalBias(H)), {"attn_mask": torch.zeros(12, 12)}, "fused"),
    ("t5 weights", lambda: _mha(T5()), {"return_weights": True}, "explicit"),
    ("ragged valid_lens", lambda: _mha(), {"valid_lens": torch.tensor([12, 5])}, "ragged"),
    ("ragged causal", lambda: _mha(), {"valid_lens": torch.tensor([12, 5]), "causal": True}, "ragged"),
    (
        "skip padded queries",
        lambda: _mha(skip_padded_queries=True),
        {"valid_lens": torch.tensor([12, 5])},
        "ragged valid rows",
    ),
    ("per-query valid_lens", lambda: _mha(), {"valid_lens": torch.full((2, 12), 7)}, "fused"),
    (
        "valid_lens + key padding",
        lambda: _mha(),
        {"valid_lens": torch.tensor([12, 5]), "key_padding_mask": torch.zeros(2, 12, dtype=torch.bool)},
        "fused",
    ),
    (
        "valid_lens + rotary",
        lambda: _mha(build("rotary", num_hiddens=D, num_heads=H)),
        {"valid_lens": torch.tensor([12, 5])},
        "ragged",
    ),
    ("documents", lambda: _mha(), {"document_ids": torch.zeros(2, 12, dtype=torch.long)}, "fused"),
]

WINDOW_ROWS = [
    ("long window", {}, 100, "band only"),
    ("long window causal", {"causal": True}, 100, "band only"),
    ("long window + valid_lens", {"valid_lens": torch.tensor([100, 60])}, 100, "banded"),
    ("long window + documents", {"document_ids": torch.zeros(2, 100, dtype=torch.long), "causal": True}, 100, "banded"),
    ("long window + per-query valid_lens", {"valid_lens": torch.full((2, 100), 50)}, 100, "fused"),
    ("long window + bool attn_mask", {"attn_mask": torch.ones(100, 100, dtype=torch.bool)}, 100, "fused"),
    # from 2**16 pairs on, blocks that skip the keys outside the window pay for their loop
    ("longer window + bool attn_mask", {"attn_mask": torch.ones(300, 300, dtype=torch.bool)}, 300, "blockwise"),
    ("long window + weights", {"return_weights": True}, 100, "explicit"),
    ("short window", {"causal": True}, 12, "fused"),
]


@pytest.mark.parametrize(("factory", "kwargs", "expected"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_module_routes(factory, kwargs, expected):
    explanation = _route(factory(), 12, **kwargs)
    assert explanation.route == expected, str(explanation)
    names = [name for name, _ in explanation.declined]
    route_names = [route.name for route in dispatch.ROUTES]
    assert names == route_names[: len(names)]  # every route before the chosen one said why not
    assert all(reason for _, reason in explanation.declined)


@pytest.mark.parametrize(
    ("kwargs", "length", "expected"), [row[1:] for row in WINDOW_ROWS], ids=[row[0] for row in WINDOW_ROWS]
)
def test_window_routes(kwargs, length, expected):
    explanation = _route(_mha(window=3), length, **kwargs)
    assert explanation.route == expected, str(explanation)


def test_training_routes():
    x = torch.randn(2, 300, D)
    dropout = _mha(dropout=0.1).train()
    assert dropout.explain(x, x, x).route == "sliced"
    small = torch.randn(2, 12, D)
    assert dropout.explain(small, small, small).route == "blockwise"
    explanation = _mha(ALIBI_CAUSAL(), dropout=0.1).train().explain(small, small, small, causal=True)
    assert explanation.route == "blockwise band"
    assert ("causal key rows", "there is dropout") in explanation.declined  # the one condition that applied
    t5 = _mha(T5()).train()
    assert t5.explain(small, small, small).route == "blockwise band"  # a learnable table: explicit blocks


def test_compiled_graphs_keep_dense_routes(monkeypatch):
    monkeypatch.setattr(_validation, "is_compiling", lambda: True)
    x = _x()
    explanation = _mha(T5()).explain(x, x, x, causal=True)
    assert explanation.route == "fused"
    assert dict(explanation.declined)["blockwise band"].startswith("compiling")
    assert _mha(dropout=0.1).train().explain(x, x, x).route == "fused"
    q = torch.randn(2, H, 12, 8)
    call = describe_attention(q, q, q, dropout_p=0.1)
    assert dispatch.explain(call).route == "fused"  # functional.attention decides the same way


def test_functional_attention_routes():
    q = torch.randn(2, H, 300, 8)
    assert dispatch.explain(describe_attention(q, q, q)).route == "fused"
    assert dispatch.explain(describe_attention(q, q, q, return_weights=True)).route == "explicit"
    assert dispatch.explain(describe_attention(q, q, q, dropout_p=0.1)).route == "sliced"
    bias = torch.zeros(300, 300)
    assert dispatch.explain(describe_attention(q, q, q, dropout_p=0.1, bias=bias)).route == "fused"
    three_d = torch.randn(H, 12, 8)
    assert dispatch.explain(describe_attention(three_d, three_d, three_d, dropout_p=0.1)).route == "fused"
    assert attention(three_d, three_d, three_d).shape == (H, 12, 8)


def test_decoding_routes():
    mha = _mha(T5())
    cache = KVCache(max_len=20)
    x = _x(8)
    mha(x, x, x, causal=True, cache=cache)
    step = _x(1)
    explanation = mha.explain(step, step, step, causal=True, cache=cache)
    assert explanation.route == "blockwise band"
    assert cache.length == 8  # explain leaves the cache as it was
    plain = _mha()
    cache = KVCache(max_len=20)
    plain(x, x, x, causal=True, cache=cache)
    assert plain.explain(step, step, step, causal=True, cache=cache).route == "fused"


def _cuda_call(term, head_dim=16, **options):
    """A call described as on CUDA (selection reads the description only; nothing runs)."""
    q = torch.randn(1, H, 12, head_dim)
    positions = torch.arange(12)
    return AttentionCall(
        shape=(1, H, H, 12, 12, head_dim, head_dim), visibility=Visibility.lower_right(12, 12, causal()),
        device=torch.device("cuda"), dtype=torch.float32, q=q, k=q, v=q, q_positions=positions,
        k_positions=positions, term=term, **options,
    )  # fmt: skip


class ForwardOnly(torch.nn.Module):
    """Stands for a user's term: the base class's capabilities with only forward defined."""


@pytest.mark.parametrize(
    ("term", "head_dim", "options", "expected", "reason"),
    [
        (ALiBiPositionalBias(H), 16, {}, "flex", None),
        (build("t5", num_hiddens=32, num_heads=H), 16, {}, "flex", None),
        (FIREPositionalBias(H), 16, {}, "blockwise", "compiles_in_flex"),
        (ALiBiPositionalBias(H), 8, {}, "blockwise band", "head size below 16"),
        (ALiBiPositionalBias(H), 15, {}, "blockwise band", "head size below 16"),
        (ALiBiPositionalBias(H), 16, {"dropout_p": 0.1}, "blockwise band", "dropout"),
        (ShawRelativePositionEncoding(16, max_distance=2), 16, {}, "blockwise clipped", "value term"),
    ],
    ids=["alibi", "t5", "fire", "heads of 8", "heads of 15", "dropout", "shaw values"],
)
def test_cuda_selection(term, head_dim, options, expected, reason):
    explanation = dispatch.explain(_cuda_call(term, head_dim, **options))
    assert explanation.route == expected, str(explanation)
    if reason is not None:
        assert reason in dict(explanation.declined)["flex"]


def test_flex_only_on_cuda():
    call = _cuda_call(ALiBiPositionalBias(H))
    call.device = torch.device("cpu")
    assert dict(dispatch.explain(call).declined)["flex"] == "not on CUDA"


@pytest.mark.parametrize("wants_grad", [False, True], ids=["inference", "query wants a gradient"])
def test_a_decoding_step_of_a_key_only_term_takes_the_key_row_on_cuda(wants_grad):
    """One query after 12 cached keys, ALiBi's causal term, described as on CUDA: the step's row of bias,
    not FlexAttention's compiled call; a query that wants a gradient keeps FlexAttention's autograd."""
    q = torch.randn(1, H, 1, 16, requires_grad=wants_grad)
    k, positions = torch.randn(1, H, 12, 16), torch.arange(12)
    call = AttentionCall(
        shape=(1, H, H, 1, 12, 16, 16), visibility=Visibility(1, 12, 11), device=torch.device("cuda"),
        dtype=torch.float32, q=q, k=k, v=k, q_positions=positions[-1:], k_positions=positions,
        term=ALiBiPositionalBias(H, causal=True),
    )  # fmt: skip
    explanation = dispatch.explain(call)
    if wants_grad:
        assert explanation.route == "flex", str(explanation)
        assert dict(explanation.declined)["blockwise key row"].endswith("and not a decoding step")
    else:
        assert explanation.route == "blockwise key row", str(explanation)


def test_a_forward_only_term_is_not_sent_to_flex():
    from test_score_term_contract import AbsoluteTerm

    explanation = dispatch.explain(_cuda_call(AbsoluteTerm()))
    assert explanation.route == "blockwise"
    assert "elementwise form" in dict(explanation.declined)["flex"]


def test_the_route_is_a_profiler_range_while_profiling():
    """The range is skipped when no profiler listens (it costs a dispatcher call), and named when one does."""
    q = torch.randn(1, H, 4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, q, q)
    assert "selfattn::fused" in {event.key for event in prof.key_averages()}
