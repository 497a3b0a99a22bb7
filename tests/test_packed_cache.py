"""Packed sequences with a cache, and cumulative lengths: decoding a packed row == the full pass == each document alone."""

import pytest
import torch
from reference_mha import ENCODINGS, make_encoding

from selfattn import KVCache, MultiHeadAttention
from selfattn.attention import cumulative_lengths_to_document_ids, document_positions

D, H = 16, 4
# Row 0: documents of 3, 4 and 2 tokens; row 1: 5 and 4 (ids need not count from 0).
IDS = torch.tensor([[0] * 3 + [1] * 4 + [2] * 2, [7] * 5 + [3] * 4])
L = IDS.shape[1]


def _mha(name, **kwargs):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    return MultiHeadAttention(D, H, position=position, num_kv_heads=2, **kwargs).double().eval()


def _alone(mha, x, ids):
    """Each document of each row run on its own (causal), put back in place: (b, l, d)."""
    out = torch.empty_like(x)
    for row in range(x.shape[0]):
        for doc in ids[row].unique():
            where = (ids[row] == doc).nonzero().flatten()
            piece = x[row : row + 1, where]
            out[row, where] = mha(piece, piece, piece, causal=True)[0]
    return out


def _decode(mha, x, ids, cache, chunks):
    """Run x through the cache in chunks of the given sizes; the outputs concatenated."""
    outs, start = [], 0
    for size in chunks:
        part, part_ids = x[:, start : start + size], ids[:, start : start + size]
        outs.append(mha(part, part, part, causal=True, cache=cache, document_ids=part_ids))
        start += size
    assert start == x.shape[1]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("chunks", [[1] * L, [4, 1, 1, 3], [2, 5, 2]], ids=["tokens", "prefill 4", "pairs"])
def test_cache_equals_full_pass_equals_documents_alone(name, chunks):
    mha = _mha(name)
    x = torch.randn(2, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = mha(x, x, x, causal=True, document_ids=IDS)
        cached = _decode(mha, x, IDS, KVCache(max_len=L), chunks)
        alone = _alone(mha, x, IDS)
    torch.testing.assert_close(full, alone, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(cached, full, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["rotary", "alibi", "t5"])
def test_windowed_cache_with_documents(name):
    mha = _mha(name, window=3)
    x = torch.randn(2, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = mha(x, x, x, causal=True, document_ids=IDS)
        cache = KVCache(window=3)
        cached = _decode(mha, x, IDS, cache, [1] * L)
        alone = _alone(mha, x, IDS)
    assert cache.stored == 2  # O(window) however long the packed row
    torch.testing.assert_close(cached, full, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(full, alone, atol=1e-12, rtol=1e-10)


def test_window_of_one_still_restarts_positions():
    mha = _mha("rotary", window=1)
    x = torch.randn(2, L, D, dtype=torch.float64)
    cache = KVCache(window=1)  # keeps no key at all, yet knows each row's last document and position
    with torch.no_grad():
        full = mha(x, x, x, causal=True, document_ids=IDS)
        cached = _decode(mha, x, IDS, cache, [1] * L)
    torch.testing.assert_close(cached, full, atol=1e-12, rtol=1e-10)
    last_ids, last_positions = cache.last_documents
    assert last_ids.tolist() == [2, 3] and last_positions.tolist() == [1, 3]


def test_cache_stores_document_ids_and_positions():
    mha = _mha("none")
    x = torch.randn(2, L, D, dtype=torch.float64)
    cache = KVCache(max_len=L)
    with torch.no_grad():
        mha(x[:, :4], x[:, :4], x[:, :4], causal=True, cache=cache, document_ids=IDS[:, :4])
        mha(x[:, 4:], x[:, 4:], x[:, 4:], causal=True, cache=cache, document_ids=IDS[:, 4:])
    assert cache.has_documents
    assert (
        cache.positions.tolist()
        == document_positions(IDS).tolist()
        == [
            [0, 1, 2, 0, 1, 2, 3, 0, 1],
            [0, 1, 2, 3, 4, 0, 1, 2, 3],
        ]
    )
    cache.reset()
    assert not cache.has_documents and cache.last_documents is None


def test_document_positions_continue_from_the_previous_token():
    ids = torch.tensor([[5, 5, 6], [1, 2, 2], [4, 4, 4]])
    previous = (torch.tensor([5, 1, 9]), torch.tensor([10, 0, 3]))
    assert document_positions(ids, previous=previous).tolist() == [[11, 12, 0], [1, 0, 1], [0, 1, 2]]


def test_packed_cache_errors():
    mha = _mha("none")
    x = torch.randn(2, 3, D, dtype=torch.float64)
    ids = torch.zeros(2, 3, dtype=torch.long)
    cache = KVCache(max_len=12)
    with torch.no_grad():
        mha(x, x, x, causal=True, cache=cache, document_ids=ids)
        with pytest.raises(ValueError, match="the cache holds a packed sequence: give document_ids"):
            mha(x, x, x, causal=True, cache=cache)
        with pytest.raises(ValueError, match="cumulative_lengths describe whole packed sequences"):
            mha(x, x, x, causal=True, cache=cache, cumulative_lengths=torch.tensor([0, 3]))
        assert cache.length == 3  # the failed calls left it as it was
        plain = KVCache(max_len=12)
        mha(x, x, x, causal=True, cache=plain)
        with pytest.raises(ValueError, match="the cache holds keys without document ids"):
            mha(x, x, x, causal=True, cache=plain, document_ids=ids)
        k = torch.randn(2, 2, 3, 4, dtype=torch.float64)
        with pytest.raises(ValueError, match="holds document ids: give documents"):
            cache.update(k, k)
        with pytest.raises(ValueError, match="holds keys without document ids: give none"):
            plain.update(k, k, documents=ids)
        with pytest.raises(ValueError, match=r"documents must have shape \(2, 3\)"):
            cache.update(k, k, documents=ids[:, :2])


# ------------------------------------------------------------------ cumulative lengths


@pytest.mark.parametrize("name", ["none", "rotary", "alibi"])
def test_cumulative_lengths_equal_document_ids(name):
    mha = _mha(name)
    x = torch.randn(2, L, D, dtype=torch.float64)
    ids = torch.tensor([[0] * 3 + [1] * 4 + [2] * 2, [0] * 5 + [1] * 4])
    with torch.no_grad():
        by_ids = mha(x, x, x, causal=True, document_ids=ids)
        per_row = mha(x, x, x, causal=True, cumulative_lengths=[torch.tensor([0, 3, 7, 9]), [0, 5, 9]])
        shared = mha(x, x, x, causal=True, cumulative_lengths=torch.tensor([0, 3, 7, 9]))
        shared_ids = mha(x, x, x, causal=True, document_ids=ids[:1].expand(2, L))
        cache = KVCache(max_len=L + 1)  # a prefill from cumulative lengths, then a token of document 2
        prefill = mha(x, x, x, causal=True, cache=cache, cumulative_lengths=torch.tensor([0, 3, 7, 9]))
        nxt = torch.randn(2, 1, D, dtype=torch.float64)
        step = mha(nxt, nxt, nxt, causal=True, cache=cache, document_ids=torch.tensor([[2], [2]]))
        whole = torch.cat([x, nxt], 1)
        expected = mha(
            whole, whole, whole, causal=True, document_ids=torch.cat([ids[:1].expand(2, L), ids[:, :1] + 2], 1)
        )
    torch.testing.assert_close(per_row, by_ids, atol=0, rtol=0)
    torch.testing.assert_close(shared, shared_ids, atol=0, rtol=0)
    torch.testing.assert_close(prefill, shared, atol=0, rtol=0)
    torch.testing.assert_close(step, expected[:, -1:], atol=1e-12, rtol=1e-10)


def test_cumulative_lengths_to_document_ids():
    assert cumulative_lengths_to_document_ids(torch.tensor([0, 2, 5]), 2, 5).tolist() == [[0, 0, 1, 1, 1]] * 2
    assert cumulative_lengths_to_document_ids([[0, 5], [0, 1, 3, 5]], 2, 5).tolist() == [
        [0, 0, 0, 0, 0],
        [0, 1, 1, 2, 2],
    ]
    assert cumulative_lengths_to_document_ids(torch.tensor([[0, 4, 5], [0, 1, 5]]), 2, 5).tolist() == [
        [0, 0, 0, 0, 1],
        [0, 1, 1, 1, 1],
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.tensor([1, 3, 5]), r"cumulative_lengths must start at 0, got \[1, 3, 5\]"),
        (torch.tensor([0, 3, 3, 5]), r"cumulative_lengths must be strictly increasing .*got \[0, 3, 3, 5\]"),
        (torch.tensor([0, 4, 2, 5]), r"must be strictly increasing"),
        (torch.tensor([0, 3, 4]), r"cumulative_lengths must end at the packed length 5, got \[0, 3, 4\]"),
        (torch.tensor([0, 3, 6]), r"must end at the packed length 5, got \[0, 3, 6\]"),
        (torch.tensor([0.0, 5.0]), r"cumulative_lengths must hold integers, got dtype torch.float32"),
        (torch.tensor([5]), r"cumulative_lengths must be 1-D with at least 2 entries .*got shape \(1,\)"),
        ([[0, 5], [0, 2, 2, 5]], r"cumulative_lengths\[1\] must be strictly increasing .*got \[0, 2, 2, 5\]"),
        (
            [[0, 5]] * 3,
            r"cumulative_lengths must be a 1-D integer tensor \(k \+ 1,\) shared by every row, or 2 of them",
        ),
        ("0,5", r"cumulative_lengths must be a 1-D integer tensor"),
    ],
)
def test_cumulative_lengths_errors(value, message):
    mha = _mha("none")
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        mha(x, x, x, cumulative_lengths=value)


def test_cumulative_lengths_with_document_ids_or_cross_attention():
    mha = _mha("none")
    x, kv = torch.randn(2, 5, D, dtype=torch.float64), torch.randn(2, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="give document_ids or cumulative_lengths, not both"):
        mha(x, x, x, document_ids=torch.zeros(2, 5, dtype=torch.long), cumulative_lengths=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cumulative_lengths describe whole packed sequences: self-attention"):
        mha(x, kv, kv, cumulative_lengths=torch.tensor([0, 5]))


def test_compiles_without_graph_breaks():
    import torch._dynamo as dynamo

    mha = MultiHeadAttention(D, H, num_kv_heads=2, position=make_encoding("rotary", D, H)).eval()
    x = torch.randn(2, 5, D)
    cache = KVCache(max_len=8)
    with torch.no_grad():
        mha(x, x, x, causal=True, cache=cache, document_ids=IDS[:, :5])
        for call, kwargs in (
            ((x[:, :1],) * 3, {"cache": cache, "document_ids": IDS[:, 5:6]}),  # one packed decoding step
            ((x,) * 3, {"cumulative_lengths": torch.tensor([0, 2, 5])}),
        ):
            dynamo.reset()
            explanation = dynamo.explain(mha)(*call, causal=True, **kwargs)
            dynamo.reset()
            assert explanation.graph_break_count == 0, [str(r.reason)[:200] for r in explanation.break_reasons]
