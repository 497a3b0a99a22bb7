"""Every value a mask rule or option takes is checked: when built, and against the call it is placed on.

A rule's tensor that covers more or fewer sequences, queries or keys than the call, of the wrong
dtype or sign, is a ``ValueError`` naming the rule, the argument and the sizes, never an index
clamped into range (issue 30, item 4). Valid shapes, broadcasts included, still give the answer
of a float64 loop reference.
"""

import numpy as np
import pytest
import torch
from reference_mha import naive_mha

from selfattn import MultiHeadAttention, masks
from selfattn.functional import attention, blockwise_attention, valid_lens_mask
from selfattn.masks import Visibility
from selfattn.models import LayerRecipe

D, H, B, L = 8, 2, 2, 5
LONG = torch.long


def _mha(**options):
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, dtype=torch.float64, **options).eval()


def _x(b=B, n=L):
    return torch.randn(b, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------- refused when built


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: masks.valid_lengths(torch.tensor([1.5, 2.0])), r"masks.valid_lengths: lengths must be an integer"),
        (lambda: masks.valid_lengths(torch.tensor([2.0, 3.0])), r"masks.valid_lengths: .* got torch.float32 \(2,\)"),
        (
            lambda: masks.valid_lengths(torch.tensor([-1, 2])),
            r"masks.valid_lengths: lengths must be non-negative, got -1",
        ),
        (lambda: masks.valid_lengths(torch.tensor([True, False])), r"masks.valid_lengths: .* got torch.bool"),
        (
            lambda: masks.valid_lengths(torch.ones(2, 2, 2, dtype=LONG)),
            r"masks.valid_lengths: .* got torch.int64 \(2, 2, 2\)",
        ),
        (lambda: masks.valid_lengths([1, 2]), r"masks.valid_lengths: .* got list"),
        (
            lambda: masks.key_padding(torch.zeros(B, L)),
            r"masks.key_padding: padding must be a bool tensor .* torch.float32",
        ),
        (
            lambda: masks.key_padding(torch.zeros(L, dtype=torch.bool)),
            r"masks.key_padding: .* \(b, lk\), got torch.bool \(5,\)",
        ),
        (lambda: masks.documents(torch.zeros(B, L)), r"masks.documents: query_ids must be an integer tensor"),
        (lambda: masks.documents(torch.zeros(L, dtype=LONG)), r"masks.documents: query_ids .* got torch.int64 \(5,\)"),
        (lambda: masks.documents(torch.zeros(B, L, dtype=LONG), torch.zeros(B, L)), r"masks.documents: key_ids"),
        (lambda: masks.dense(torch.ones(L, L)), r"masks.dense: mask must be a bool tensor .* got torch.float32"),
        (
            lambda: masks.chunks(2, query_positions=torch.arange(L) * 1.0),
            r"masks.chunks: query_positions must be an integer",
        ),
        (
            lambda: masks.chunks(2, query_positions=torch.arange(L), key_positions=torch.zeros(2, 2, L, dtype=LONG)),
            r"masks.chunks: key_positions .* got torch.int64 \(2, 2, 5\)",
        ),
        (lambda: masks.prefix(torch.tensor([2, -1])), r"masks.prefix: lengths must be non-negative, got -1"),
        (lambda: masks.prefix(-1), r"masks.prefix: prefix lengths must be a non-negative int .* got -1"),
        (lambda: masks.window(0), r"masks.window: window size must be a positive integer, got 0"),
        (lambda: masks.window(-3), r"masks.window: window size must be a positive integer, got -3"),
        (lambda: masks.chunks(-1), r"masks.chunks: chunk size must be a positive integer, got -1"),
    ],
)
def test_rules_refuse_bad_values_when_built(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------- refused on the call


def _ids(*shape):
    return torch.zeros(*shape, dtype=LONG)


@pytest.mark.parametrize(
    ("rule", "match"),
    [
        (masks.documents(_ids(B, 3)), r"masks.documents: query_ids of shape \(2, 3\) has 3 queries .* the call has 5"),
        (
            masks.documents(_ids(B, L), _ids(B, 3)),
            r"masks.documents: key_ids of shape \(2, 3\) has 3 keys .* has 5 keys",
        ),
        (
            masks.documents(_ids(3, L)),
            r"masks.documents: query_ids of shape \(3, 5\) has 3 sequences .* has 2 sequences",
        ),
        (masks.valid_lengths(torch.tensor([1, 2, 3])), r"masks.valid_lengths: lengths of shape \(3,\) has 3 sequences"),
        (masks.valid_lengths(torch.ones(B, 4, dtype=LONG)), r"masks.valid_lengths: .* \(2, 4\) has 4 queries .* has 5"),
        (
            masks.key_padding(torch.zeros(B, 3, dtype=torch.bool)),
            r"masks.key_padding: .* \(2, 3\) has 3 keys .* 5 keys",
        ),
        (
            masks.key_padding(torch.zeros(1, L, dtype=torch.bool)),
            r"masks.key_padding: .* has 1 sequences .* 2 sequences",
        ),
        (masks.dense(torch.ones(7, 7, dtype=torch.bool)), r"masks.dense: mask of shape \(1, 1, 7, 7\) has 7 keys"),
        (masks.dense(torch.ones(L, 7, dtype=torch.bool)), r"masks.dense: .* has 7 keys .* has 5 keys \(or 1, shared"),
        (masks.dense(torch.ones(4, L, dtype=torch.bool)), r"masks.dense: .* has 4 queries .* has 5 queries"),
        (masks.dense(torch.ones(3, 1, L, L, dtype=torch.bool)), r"masks.dense: .* has 3 sequences .* 2 sequences"),
        (masks.dense(torch.ones(1, 3, L, L, dtype=torch.bool)), r"masks.dense: .* has 3 heads .* has 2 heads"),
        (  # a fifth dimension: it broadcast the call's heads and failed in W_o with a RuntimeError
            masks.dense(torch.ones(2, 1, 1, L, L, dtype=torch.bool)),
            r"masks.dense: mask of shape \(2, 1, 1, 5, 5\) has more dimensions than the call's \(b, h, lq, lk\)",
        ),
        (masks.dense(torch.ones(1, 3, 1, L, L, dtype=torch.bool)), r"masks.dense: .* has 3 sequences .* 2 sequences"),
        (masks.prefix(torch.tensor([1, 2, 3])), r"masks.prefix: lengths of shape \(3,\) has 3 sequences"),
        (masks.spans(_ids(3, L)), r"masks.spans: ids of shape \(3, 5\) has 3 sequences"),
        (
            masks.chunks(2, query_positions=torch.arange(4)),
            r"masks.chunks: query_positions of shape \(4,\) has 4 queries",
        ),
        (
            masks.chunks(2, query_positions=torch.arange(L), key_positions=torch.arange(6)),
            r"masks.chunks: key_positions of shape \(6,\) has 6 keys .* has 5 keys",
        ),
        (
            masks.chunks(2, query_positions=torch.arange(L), key_positions=torch.arange(L).expand(3, L)),
            r"masks.chunks: key_positions of shape \(3, 5\) has 3 sequences .* has 2 sequences",
        ),
        (
            masks.chunks(2, query_positions=torch.arange(L).expand(3, L)),
            r"masks.chunks: query_positions of shape \(3, 5\) has 3 sequences",
        ),
        # nested in | and &: still checked
        (masks.causal() | (masks.window(2) & masks.documents(_ids(B, 3))), r"masks.documents: query_ids .* 3 queries"),
    ],
)
def test_rules_refuse_a_call_they_do_not_fit(rule, match):
    x = _x()
    mha = _mha()
    with pytest.raises(ValueError, match=match):
        mha(x, x, x, mask=rule)
    with pytest.raises(ValueError, match=match):
        mha.explain(x, x, x, mask=rule)


def test_the_functional_calls_check_their_rules_too():
    q = torch.randn(B, H, L, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"masks.valid_lengths: lengths of shape \(3,\) has 3 sequences"):
        blockwise_attention(q, q, q, valid_lens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"masks.valid_lengths: lengths of shape \(2, 4\) has 4 queries"):
        blockwise_attention(q, q, q, valid_lens=torch.ones(B, 4, dtype=LONG))
    with pytest.raises(ValueError, match=r"valid_lens must not be negative, got \[2, -1\]"):
        blockwise_attention(q, q, q, valid_lens=torch.tensor([2, -1]))
    with pytest.raises(ValueError, match=r"valid_lens must hold whole numbers, got \[1.5, 2.0\]"):
        blockwise_attention(q, q, q, valid_lens=torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match=r"masks.dense: .* has 7 keys"):  # a rule placed on a call by hand
        Visibility.lower_right(L, L, masks.dense(torch.ones(L, 7, dtype=torch.bool))).check(B, H)


def test_chunk_positions_for_fewer_queries_than_keys_need_key_positions():
    mha, x = _mha(), _x()
    rule = masks.chunks(2, query_positions=torch.arange(3, 5))  # 2 queries, 5 keys: the keys' positions are missing
    with pytest.raises(ValueError, match=r"masks.chunks: key_positions \(by default query_positions\) of shape \(2,\)"):
        mha(x[:, 3:], x, x, mask=rule)
    keys = torch.arange(L)
    out = mha(x[:, 3:], x, x, mask=masks.chunks(2, query_positions=torch.arange(3, 5), key_positions=keys))
    visible = np.array([[[i // 2 == j // 2 for j in range(L)] for i in (3, 4)]] * B)
    expected, _ = naive_mha(mha, x[:, 3:], x, x, visible, torch.arange(3, 5).expand(B, 2), keys.expand(B, L))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_valid_lens_dropping_unseen_keys_cuts_the_callers_rule_after_checking_it_whole():
    """Keys past the longest valid length are dropped: a rule of the whole call is cut with them, a wrong one refused."""
    mha, x = _mha(), _x()
    valid_lens = torch.tensor([3, 2])  # keys 3 and 4 seen by nobody: the call keeps 3 keys
    padding = torch.tensor([[False, True, False, False, False], [False, False, False, True, False]])
    out = mha(x, x, x, valid_lens, mask=masks.key_padding(padding))
    visible = np.array(
        [[[j < n and not padding[b, j] for j in range(L)] for _ in range(L)] for b, n in enumerate([3, 2])]
    )
    positions = torch.arange(L).expand(B, L)
    expected, _ = naive_mha(mha, x, x, x, visible, positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"masks.key_padding: padding of shape \(2, 3\) has 3 keys .* has 5 keys"):
        mha(x, x, x, valid_lens, mask=masks.key_padding(padding[:, :3]))  # the kept keys' count is no excuse


# ---------------------------------------------------------------------- valid shapes: the right answer


def _loop_visibility(b, n, allowed):
    """Bool (b, n, n) from a per-(sequence, query, key) predicate, one entry at a time."""
    return np.array([[[bool(allowed(s, i, j)) for j in range(n)] for i in range(n)] for s in range(b)])


def test_valid_rules_of_every_kind_equal_the_loop_reference():
    b, n = 3, 7
    mha, x = _mha(), _x(b, n)
    gen = torch.Generator().manual_seed(3)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2], [0] * 7])
    per_query = torch.randint(1, n + 1, (b, n), generator=gen)
    padding = torch.rand(b, n, generator=gen) > 0.7
    dense = torch.rand(n, n, generator=gen) > 0.2  # (lq, lk): shared by every sequence and head
    spans = torch.tensor([[0, 1, 1, 0, 2, 2, 0]])  # one row: shared by every sequence
    prefix = torch.tensor([2])  # one row: shared
    rule = (
        masks.documents(docs)
        & masks.valid_lengths(per_query)
        & masks.key_padding(padding)
        & masks.dense(dense)
        & (masks.causal() | masks.spans(spans) | masks.prefix(prefix))
    )

    def allowed(s, i, j):
        causal_or = j <= i or (spans[0, i] == spans[0, j] != 0) or j < 2
        return docs[s, i] == docs[s, j] and j < per_query[s, i] and not padding[s, j] and dense[i, j] and causal_or

    out = mha(x, x, x, mask=rule)
    positions = torch.arange(n).expand(b, n)
    expected, _ = naive_mha(mha, x, x, x, _loop_visibility(b, n, allowed), positions, positions)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_position_chunks_and_a_per_head_dense_mask_equal_the_loop_reference():
    b, n = 2, 6
    mha, x = _mha(), _x(b, n)
    positions = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])  # row 0 left-padded
    per_head = torch.rand(b, H, n, n, generator=torch.Generator().manual_seed(4)) > 0.3
    rule = masks.causal() & masks.chunks(2, query_positions=positions) & masks.dense(per_head)
    out = mha(x, x, x, mask=rule)
    visible = np.array(
        [
            [[[j <= i and positions[s, i] // 2 == positions[s, j] // 2 and per_head[s, h, i, j] for j in range(n)]
              for i in range(n)] for h in range(H)]
            for s in range(b)
        ]
    )  # fmt: skip
    expected, _ = naive_mha(mha, x, x, x, visible, torch.arange(n).expand(b, n), torch.arange(n).expand(b, n))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_a_one_row_prefix_or_span_tensor_serves_every_sequence_in_the_scalar_predicate():
    """FlexAttention's ``mask_mod`` reads one (sequence, query, key) at a time: a shared row is read at row 0."""
    ids = [0, 0, 1, 1, 0]
    rule = masks.causal() | masks.prefix(torch.tensor([1])) | masks.spans(torch.tensor([ids]))
    allowed = Visibility.lower_right(5, 5, rule).predicate()
    assert allowed is not None
    for s in range(3):  # sequences past the one row
        for i in range(5):
            for j in range(5):
                got = allowed(torch.tensor(s), torch.tensor(0), torch.tensor(i), torch.tensor(j))
                assert bool(got) == (j <= i or j < 1 or ids[i] == ids[j] != 0), (s, i, j)


def test_functional_valid_lengths_accept_whole_floats_and_broadcast_masks():
    q = torch.randn(B, H, L, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([2.0, 4.0])
    assert valid_lens_mask(lengths, L).tolist() == valid_lens_mask(lengths.long(), L).tolist()
    visible = torch.arange(L) < lengths[:, None, None, None]  # (b, 1, 1, lk)
    reference = torch.softmax((q @ q.transpose(-1, -2) / 2).masked_fill(~visible, float("-inf")), -1) @ q
    torch.testing.assert_close(blockwise_attention(q, q, q, valid_lens=lengths), reference, rtol=1e-10, atol=1e-12)
    row = torch.tensor([True, False, True, True, True])  # (lk,): one row for every query
    reference = torch.softmax((q @ q.transpose(-1, -2) / 2).masked_fill(~row, float("-inf")), -1) @ q
    torch.testing.assert_close(attention(q, q, q, mask=row), reference, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- temperature tuning


def test_temperature_tuning_refuses_negative_positions():
    mha, x = _mha(temperature_tuning=(0.1, 4.0)), _x()
    with pytest.raises(ValueError, match=r"positions must be non-negative with temperature_tuning .* got .* -10"):
        mha(x, x, x, positions=torch.arange(-10, -5))
    with pytest.raises(ValueError, match=r"positions must be non-negative with temperature_tuning .* got .* -1"):
        mha(x, x, x, positions=torch.tensor([[0, 1, 2, 3, 4], [-1, 0, 1, 2, 3]]))
    assert torch.isfinite(mha(x, x, x, positions=torch.arange(3, 8))).all()  # position 0 and up: fine


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((1.0,), r"temperature_tuning must be \(attn_scale, floor_scale\), got \(1.0,\)"),
        (0.1, r"temperature_tuning must be \(attn_scale, floor_scale\), got 0.1"),
        ((0.1, -4.0), r"temperature_tuning\[1\] \(floor_scale\) must be a positive finite number, got -4.0"),
        ((float("nan"), 4.0), r"temperature_tuning\[0\] \(attn_scale\) must be a positive finite number, got nan"),
    ],
)
def test_layer_recipe_checks_temperature_tuning_as_the_layer_does(value, match):
    with pytest.raises(ValueError, match=match):
        LayerRecipe(temperature_tuning=value)
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(D, H, temperature_tuning=value)


def test_layer_recipe_keeps_temperature_tuning_as_a_tuple():
    recipe = LayerRecipe(position=False, temperature_tuning=[0.1, 4])
    assert recipe.temperature_tuning == (0.1, 4.0)
    assert hash(recipe) == hash(LayerRecipe(position=False, temperature_tuning=(0.1, 4.0)))


def test_a_dense_mask_with_leading_ones_equals_its_four_dimensions():
    x, mha = _x(), _mha()
    allowed = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(0)) > 0.3
    with torch.no_grad():
        expected = mha(x, x, x, mask=masks.dense(allowed))
        torch.testing.assert_close(mha(x, x, x, mask=masks.dense(allowed[None, None])), expected, atol=0, rtol=0)
