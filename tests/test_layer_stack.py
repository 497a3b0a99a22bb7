"""A layer stack that shares: per-layer head counts and sizes, and layers reading an earlier layer's keys (issue 32).

Gemma 4 gives its global layers other key/value heads and head sizes, and Gemma 3n's and Gemma 4's
last layers read the keys and values an earlier layer of their type attended to. The references
here are written from the formulas in float64 torch (differentiable, so gradients compare too):
interleaved rotary pair by pair, RMSNorm, the causal and window masks from index comparisons, key
heads repeated by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.models import LayerRecipe, SharedKVCache, SharedKVView, TransformerBlock, TransformerLM
from selfattn.parts import HeadNorm
from selfattn.positional import ALiBiPositionalBias, RotaryPositionalEncoding

VOCAB, D, HEADS = 23, 16, 4

# Gemma-like: a global layer of 1 kv head of size 8 (h * dh = 32, not d), a local one, then three
# layers reading them: a local, a global of fewer query heads, and a second reader of the local.
SHARING = [
    LayerRecipe(num_kv_heads=1, head_dim=8, qk_norm=True),
    LayerRecipe(window=3, num_kv_heads=2, qk_norm=True),
    LayerRecipe(window=3, num_kv_heads=2, qk_norm=True, shares_kv_with=1),
    LayerRecipe(num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True, shares_kv_with=0),
    LayerRecipe(window=2, num_kv_heads=2, shares_kv_with=1),
]


def _lm(layers, position="rotary", seed=0):
    torch.manual_seed(seed)
    lm = TransformerLM(VOCAB, D, HEADS, len(layers), position=position, layers=layers).double().eval()
    with torch.no_grad():  # norms and biases away from their defaults, so each one shows
        for module in lm.modules():
            if isinstance(module, (HeadNorm, torch.nn.LayerNorm)):
                module.weight.uniform_(0.5, 1.5)
            if isinstance(module, torch.nn.LayerNorm):
                module.bias.uniform_(-0.2, 0.2)
    return lm


# ---------------------------------------------------------------------- the float64 reference


def _rotate(x, positions, base):
    """Interleaved rotary of ``x`` (b, h, l, dh): pair (2j, 2j + 1) turns by ``p * base ** (-2j / dh)``."""
    dh = x.shape[-1]
    angle = positions.double()[:, None] * base ** (-2 * torch.arange(dh // 2, dtype=torch.float64) / dh)
    cos, sin = angle.cos(), angle.sin()  # (l, dh / 2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _rms(x, norm):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _layer_norm(x, norm):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias


def _heads(x, heads):
    b, length, _ = x.shape
    return x.view(b, length, heads, -1).transpose(1, 2)  # (b, heads, l, size)


def _reference_keys(mha, x, positions):
    """The keys (rotated, normalized) and values a layer projects: what a sharing layer reads."""
    k = _heads(x @ mha.W_k.weight.T, mha.num_kv_heads)
    if mha.k_norm is not None:
        k = _rms(k, mha.k_norm)
    if isinstance(mha.position, RotaryPositionalEncoding):
        k = _rotate(k, positions, mha.position.base)
    return k, _heads(x @ mha.W_v.weight.T, mha.num_kv_heads)


def _reference_attention(mha, x, keys, values, positions):
    q = _heads(x @ mha.W_q.weight.T, mha.num_heads)
    if mha.q_norm is not None:
        q = _rms(q, mha.q_norm)
    if isinstance(mha.position, RotaryPositionalEncoding):
        q = _rotate(q, positions, mha.position.base)
    group = mha.num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, h, l, l)
    index = torch.arange(len(positions))  # masks count tokens; the rotation reads their positions
    i, j = index[:, None], index[None, :]
    visible = j <= i
    if mha.window is not None:
        visible &= i - j < mha.window
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ values).transpose(1, 2).flatten(2) @ mha.W_o.weight.T


def _reference_lm(lm, tokens, share_weights_instead=False, positions=None):
    """The model from the formulas: each non-sharing layer's keys computed once and handed to its readers.

    ``share_weights_instead``: a sharing layer projects its own input with its source's weights (the
    mistake a stack that shared projections rather than keys would make), to show the test tells them apart.
    """
    positions = torch.arange(tokens.shape[1]) if positions is None else positions
    x = lm.embedding.weight[tokens] * math.sqrt(D)
    kept = {}
    for index, (block, recipe) in enumerate(zip(lm.blocks, lm.layers, strict=True)):
        mha, normed = block.attention, _layer_norm(x, block.norm_1)
        if recipe.shares_kv_with is None:
            kept[index] = _reference_keys(mha, normed, positions)
        keys, values = kept[index if recipe.shares_kv_with is None else recipe.shares_kv_with]
        if share_weights_instead and recipe.shares_kv_with is not None:
            keys, values = _reference_keys(lm.blocks[recipe.shares_kv_with].attention, normed, positions)
        x = x + _reference_attention(mha, normed, keys, values, positions)
        hidden = _layer_norm(x, block.norm_2) @ block.mlp[0].weight.T
        x = x + (0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))) @ block.mlp[2].weight.T
    return _layer_norm(x, lm.norm) @ lm.embedding.weight.T


# ---------------------------------------------------------------------- per-layer sizes


def test_per_layer_sizes_equal_layers_built_by_hand():
    layers = [LayerRecipe(), LayerRecipe(num_heads=2, num_kv_heads=1, head_dim=12), LayerRecipe(num_kv_heads=2)]
    lm = _lm(layers)
    shapes = [(a.num_heads, a.num_kv_heads, a.head_dim) for a in (b.attention for b in lm.blocks)]
    assert shapes == [(4, 4, 4), (2, 1, 12), (4, 2, 4)]
    assert lm.blocks[1].attention.position.head_dim == 12 and lm.blocks[0].attention.position is lm.position
    by_hand = [
        MultiHeadAttention(D, HEADS, position=RotaryPositionalEncoding(4)),
        MultiHeadAttention(
            24, 2, num_kv_heads=1, query_size=D, key_size=D, value_size=D, output_size=D,
            position=RotaryPositionalEncoding(12),
        ),
        MultiHeadAttention(D, HEADS, num_kv_heads=2, position=RotaryPositionalEncoding(4)),
    ]  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 7))
    x = lm.embedding(tokens) * math.sqrt(D)
    for block, mha in zip(lm.blocks, by_hand, strict=True):
        mha.double().load_state_dict(block.attention.state_dict())  # strict: the same weights, of the same shapes
        normed = block.norm_1(x)
        attended = mha(normed, normed, normed, causal=True)
        torch.testing.assert_close(block.attention(normed, normed, normed, causal=True), attended)
        x = x + attended
        x = x + block.mlp(block.norm_2(x))
    torch.testing.assert_close(lm(tokens), lm.norm(x) @ lm.embedding.weight.T, rtol=0, atol=1e-12)


def test_a_score_encoding_is_built_anew_for_a_layer_of_other_heads():
    two_heads = LayerRecipe(num_heads=2, num_kv_heads=2, head_dim=8)
    lm = _lm([LayerRecipe(), two_heads, two_heads], "alibi")
    own = lm.blocks[1].attention.position
    assert isinstance(own, ALiBiPositionalBias) and own.num_heads == 2 and lm.position.num_heads == HEADS
    assert lm.blocks[2].attention.position is own  # one per distinct shape
    tokens = torch.randint(0, VOCAB, (2, 6))
    caches = lm.make_caches(6)
    steps = [lm(tokens[:, :3], caches=caches)] + [lm(tokens[:, t : t + 1], caches=caches) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), lm(tokens), rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------- sharing keys and values


def test_sharing_layers_project_no_keys_and_read_their_sources():
    lm = _lm(SHARING)
    for index in (2, 3, 4):
        mha = lm.blocks[index].attention
        assert mha.shared_kv and mha.W_k is None and mha.W_v is None and mha.k_norm is None
        assert not any(name.startswith(("W_k", "W_v", "k_norm")) for name, _ in mha.named_parameters())
    assert lm.blocks[3].attention.q_norm is not None  # its own queries are still normalized
    # Its queries turn with the rotary that turned the keys it reads (one per head size, whatever the heads).
    assert lm.blocks[3].attention.position is lm.blocks[0].attention.position is not lm.position
    assert "shared_kv" in lm.blocks[2].attention.describe_parts()[0]


def test_sharing_stack_full_pass_and_gradients_equal_the_float64_reference():
    lm = _lm(SHARING)
    tokens = torch.randint(0, VOCAB, (2, 9))
    logits, expected = lm(tokens), _reference_lm(lm, tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    params = [p for p in lm.parameters() if p.requires_grad]
    got = torch.autograd.grad((logits * torch.linspace(-1, 1, VOCAB, dtype=torch.float64)).sum(), params)
    want = torch.autograd.grad((expected * torch.linspace(-1, 1, VOCAB, dtype=torch.float64)).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-9)
    source_key_grad = dict(zip((n for n, p in lm.named_parameters() if p.requires_grad), got, strict=True))
    assert source_key_grad["blocks.0.attention.W_k.weight"].abs().sum() > 0


def test_sharing_stack_at_given_positions_and_with_padding():
    lm = _lm(SHARING)
    tokens = torch.randint(0, VOCAB, (2, 8))
    positions = torch.tensor([0, 2, 3, 7, 8, 11, 12, 20])  # randomized positions: rotations there, masks by index
    expected = _reference_lm(lm, tokens, positions=positions)
    torch.testing.assert_close(lm(tokens, positions=positions), expected, rtol=0, atol=1e-10)
    padded = lm(tokens, torch.tensor([8, 5]))  # right padding: each valid row as its sequence alone
    torch.testing.assert_close(padded[1, :5], lm(tokens[1:, :5])[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(padded[0], lm(tokens[:1])[0], rtol=0, atol=1e-10)


def test_sharing_keys_is_not_sharing_projections():
    """The reference tells apart reading the source's keys and projecting one's own input with its weights."""
    lm = _lm(SHARING)
    tokens = torch.randint(0, VOCAB, (2, 9))
    assert (lm(tokens) - _reference_lm(lm, tokens, share_weights_instead=True)).abs().max() > 1e-3


def test_sharing_stack_decoding_equals_the_full_pass():
    lm = _lm(SHARING)
    tokens = torch.randint(0, VOCAB, (2, 10))
    caches = lm.make_caches(10)
    steps = [lm(tokens[:, :4], caches=caches)] + [lm(tokens[:, t : t + 1], caches=caches) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), lm(tokens), rtol=0, atol=1e-10)
    assert [c.length for c in caches] == [10] * len(SHARING)
    generated = lm.generate(tokens[:, :4], 5)
    greedy = lm(generated[:, :-1])[:, 3:].argmax(-1)
    assert torch.equal(generated[:, 4:], greedy)


def test_the_caches_hold_the_shared_keys_once():
    lm = _lm(SHARING)
    batch, max_len = 2, 10
    caches = lm.make_caches(max_len)
    assert [type(c) for c in caches] == [SharedKVCache, SharedKVCache, SharedKVView, SharedKVView, SharedKVView]
    assert caches[2].source is caches[1] and caches[3].source is caches[0] and caches[4].source is caches[1]
    lm(torch.randint(0, VOCAB, (batch, 6)), caches=caches)
    # Keys and values (float64) and int64 positions, for the two layers that project them.
    owned = [(1, 8), (2, 4)]  # (kv heads, head size) of layers 0 and 1
    expected = sum(2 * batch * kv * max_len * dh * 8 + batch * max_len * 8 for kv, dh in owned)
    assert sum(c.nbytes for c in caches) == sum(caches[i].nbytes for i in (0, 1)) == expected
    assert all(caches[i].nbytes == 0 for i in (2, 3, 4))
    unshared = _lm([LayerRecipe(**{**r.__dict__, "shares_kv_with": None}) for r in SHARING]).make_caches(max_len)
    unshared_model = _lm([LayerRecipe(**{**r.__dict__, "shares_kv_with": None}) for r in SHARING])
    unshared_model(torch.randint(0, VOCAB, (batch, 6)), caches=unshared)
    assert sum(c.nbytes for c in unshared) > expected  # without sharing, every layer stores its own


def test_a_shared_layer_on_its_own_reads_the_source_cache():
    torch.manual_seed(0)
    source = MultiHeadAttention(D, HEADS, num_kv_heads=2).double()
    sharer = MultiHeadAttention(D, HEADS, num_kv_heads=2, shared_kv=True).double()
    x, y = torch.randn(2, 5, D, dtype=torch.float64), torch.randn(2, 5, D, dtype=torch.float64)
    cache = SharedKVCache(5)
    view = SharedKVView(cache)
    source(x, x, x, causal=True, cache=cache)
    assert "shared_kv" in str(sharer.explain(y, y, y, causal=True, cache=view))  # a dry run: nothing moves
    assert view.length == 0
    out = sharer(y, y, y, causal=True, cache=view)
    keys, values = _heads(x @ source.W_k.weight.T, 2), _heads(x @ source.W_v.weight.T, 2)
    torch.testing.assert_close(out, _reference_attention(sharer, y, keys, values, torch.arange(5)), rtol=0, atol=1e-12)
    assert view.length == 5 and view.nbytes == 0


def test_a_windowed_source_cache_serves_its_readers_every_key_they_see():
    """A windowed cache keeps w - 1 keys after each call; its readers see the w of that call, as the source did."""
    torch.manual_seed(0)
    source = MultiHeadAttention(D, HEADS, num_kv_heads=2, window=3).double()
    sharer = MultiHeadAttention(D, HEADS, num_kv_heads=2, window=3, shared_kv=True).double()
    x = torch.randn(1, 7, D, dtype=torch.float64)
    full_cache = SharedKVCache(7)
    source(x, x, x, causal=True, cache=full_cache)
    full = sharer(x, x, x, causal=True, cache=SharedKVView(full_cache))
    cache = SharedKVCache(window=3)
    view = SharedKVView(cache)
    steps = []
    for t in range(7):
        token = x[:, t : t + 1]
        source(token, token, token, causal=True, cache=cache)
        steps.append(sharer(token, token, token, causal=True, cache=view))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    assert view.nbytes == 0 and cache.stored == 2


# ---------------------------------------------------------------------- errors


def _stack(*layers):
    return lambda: TransformerLM(VOCAB, D, HEADS, len(layers), layers=list(layers))


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: LayerRecipe(num_heads=0), "num_heads must be a positive integer, got 0"),
        (lambda: LayerRecipe(num_kv_heads=2.0), r"num_kv_heads must be a positive integer, got 2\.0"),
        (lambda: LayerRecipe(head_dim=-4), "head_dim must be a positive integer, got -4"),
        (lambda: LayerRecipe(shares_kv_with=-1), "shares_kv_with must be a non-negative integer, got -1"),
        (lambda: LayerRecipe(shares_kv_with=True), "shares_kv_with must be a non-negative integer, got True"),
        (
            _stack(LayerRecipe(num_heads=6)),
            r"layers\[0\]\.num_heads=6 is not divisible by num_kv_heads \(the model's num_heads\)=4",
        ),
        (_stack(LayerRecipe(num_kv_heads=3)), r"layers\[0\]\.num_heads=4 is not divisible by num_kv_heads=3"),
        (
            lambda: TransformerLM(VOCAB, 18, 4, 1, layers=[LayerRecipe(head_dim=4)]),
            "num_hiddens=18 is not divisible by num_heads=4",
        ),
        (
            lambda: TransformerLM(VOCAB, D, HEADS, 1, position="sinusoidal", layers=[LayerRecipe(rotary_base=1e4)]),
            r"rotary_base=10000\.0, but position='sinusoidal' is not rotary",
        ),
        (
            _stack(LayerRecipe(shares_kv_with=0)),
            r"layers\[0\]\.shares_kv_with=0: .* an earlier layer, and layer 0 has none",
        ),
        (
            _stack(LayerRecipe(), LayerRecipe(shares_kv_with=3), LayerRecipe(), LayerRecipe()),
            r"layers\[1\]\.shares_kv_with=3: .* an earlier layer, one of 0\.\.0",
        ),
        (
            _stack(LayerRecipe(), LayerRecipe(shares_kv_with=0), LayerRecipe(shares_kv_with=1)),
            r"layers\[2\]\.shares_kv_with=1: layer 1 reads layer 0's keys and values itself; name layer 0",
        ),
        (
            _stack(LayerRecipe(), LayerRecipe(num_kv_heads=2, shares_kv_with=0)),
            r"layers\[1\]\.shares_kv_with=0: layer 0 has 4 key/value heads of size 4, this layer 2 of size 4",
        ),
        (
            _stack(LayerRecipe(), LayerRecipe(head_dim=8, shares_kv_with=0)),
            r"layers\[1\]\.shares_kv_with=0: layer 0 has 4 key/value heads of size 4, this layer 4 of size 8",
        ),
        (
            _stack(LayerRecipe(), LayerRecipe(position=False, shares_kv_with=0)),
            r"layers\[1\]\.shares_kv_with=0: layer 0 has position=True, rotary_base=None; this layer position=False",
        ),
        (
            _stack(LayerRecipe(rotary_base=100.0), LayerRecipe(shares_kv_with=0)),
            r"layers\[1\]\.shares_kv_with=0: layer 0 has position=True, rotary_base=100\.0; .*rotary_base=None",
        ),
    ],
)
def test_bad_stacks_name_the_field_and_value(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_a_sharing_model_refuses_caches_that_do_not_share():
    lm = _lm(SHARING)
    tokens = torch.randint(0, VOCAB, (1, 3))
    with pytest.raises(ValueError, match=r"caches\[2\] must be a SharedKVView of caches\[1\] .*got KVCache"):
        lm(tokens, caches=[KVCache(8) for _ in SHARING])
    caches, others = lm.make_caches(8), lm.make_caches(8)
    with pytest.raises(ValueError, match=r"caches\[3\] must be a SharedKVView of caches\[0\]"):
        lm(tokens, caches=[*caches[:3], others[3], caches[4]])


def test_a_shared_layer_refuses_what_it_cannot_read():
    torch.manual_seed(0)
    source = MultiHeadAttention(D, HEADS, num_kv_heads=2)
    sharer = MultiHeadAttention(D, HEADS, num_kv_heads=2, shared_kv=True)
    x = torch.randn(1, 3, D)
    with pytest.raises(ValueError, match=r"cache must be a SharedKVView .*got none"):
        sharer(x, x, x)
    with pytest.raises(ValueError, match=r"cache must be a SharedKVView .*got KVCache"):
        sharer(x, x, x, cache=KVCache(4))
    cache = SharedKVCache(8)
    view = SharedKVView(cache)
    with pytest.raises(ValueError, match="brings 3 tokens after 0, but the source layer's latest call brought 0"):
        sharer(x, x, x, cache=view)  # the source has not run
    source(x, x, x, cache=cache)
    with pytest.raises(ValueError, match=r"brings 1 tokens after 0, .* brought 3 and its cache holds 3"):
        sharer(x[:, :1], x[:, :1], x[:, :1], cache=view)
    wide = MultiHeadAttention(D, HEADS, shared_kv=True)
    with pytest.raises(ValueError, match=r"keys have 2 heads of size 4 .* the sharing layer has num_kv_heads=4"):
        wide(x, x, x, cache=view)
    with pytest.raises(ValueError, match="this SharedKVView is read-only"):
        source(x, x, x, cache=view)
    with pytest.raises(ValueError, match="source must be a SharedKVCache, got KVCache"):
        SharedKVView(KVCache(4))
    with pytest.raises(ValueError, match="shared_kv=True: this layer reads another layer's keys"):
        sharer.project_keys(x, torch.arange(3))


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"shared_kv": 1}, "shared_kv must be True or False, got 1"),
        ({"shared_kv": True, "values_from_keys": True}, "values_from_keys=True needs W_k, and a layer with shared_kv"),
        (
            {"shared_kv": True, "parts": {"v_norm": HeadNorm(4, slot="values")}},
            r"parts\['v_norm'\] acts at 'values', but a layer with shared_kv=True projects no keys or values",
        ),
    ],
)
def test_bad_shared_layer_options(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(D, HEADS, **options)


def test_a_block_with_a_sharing_recipe_needs_the_view():
    block = TransformerBlock(D, HEADS, 32, recipe=LayerRecipe(shares_kv_with=0))
    assert block.attention.shared_kv
    with pytest.raises(ValueError, match="cache must be a SharedKVView"):
        block(torch.randn(1, 2, D), causal=True)
