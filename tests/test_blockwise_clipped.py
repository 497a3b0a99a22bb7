"""Blockwise Shaw at consecutive positions (far keys through indicator columns) and the dropout buffers.

References: a naive float64 loop of Shaw's formulas, and the generic blockwise route (the term
called per block, gathers and autograd), which the clipped route must equal with the same
dropout mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.functional import blockwise_attention
from selfattn.functional._block_clipped import _Clipped
from selfattn.functional._block_common import _Workspace
from selfattn.functional._dropout_masks import RANDOM_CHUNK_WORDS, _keep_factors, _keep_mask, _random_lanes
from selfattn.positional import ScoreEncoding, ShawRelativePositionEncoding

HEADS, HEAD_DIM = 2, 4


def shaw(max_distance: int, **options) -> ShawRelativePositionEncoding:
    torch.manual_seed(5)
    return ShawRelativePositionEncoding(HEAD_DIM, max_distance, dtype=torch.float64, **options)


def qkv(b: int, lq: int, lk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, HEADS, n, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True) for n in (lq, lk, lk)
    ]


def naive_shaw(term, q, k, v, q_positions, k_positions, causal):
    """Shaw et al. (2018) written out pair by pair: e_ij = q_i.(k_j + aK) / sqrt(d), z_i = sum_j a_ij (v_j + aV)."""
    b, h, lq, d = q.shape
    lk = k.shape[-2]
    reach = term.max_distance
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                scores, rows = [], []
                for j in range(lk):
                    if causal and j > i + lk - lq:
                        continue
                    row = max(-reach, min(reach, int(k_positions[j]) - int(q_positions[i]))) + reach
                    key = k[bi, hi, j] + (term.key_embeddings[row] if term.key_embeddings is not None else 0)
                    scores.append(q[bi, hi, i] @ key / math.sqrt(d))
                    rows.append((j, row))
                weights = torch.softmax(torch.stack(scores), dim=0)
                for w, (j, row) in zip(weights, rows, strict=True):
                    value = v[bi, hi, j] + (term.value_embeddings[row] if term.value_embeddings is not None else 0)
                    out[bi, hi, i] += w * value
    return out


@pytest.mark.parametrize(
    ("max_distance", "options", "lq", "lk", "block", "causal"),
    [
        (2, {}, 9, 9, 4, False),
        (2, {}, 9, 9, 4, True),
        (0, {}, 7, 7, 3, False),
        (20, {}, 7, 7, 2, True),
        (3, {"keys": False}, 5, 11, 2, True),  # queries are the last 5 of 11 keys, as with a cache
        (3, {"values": False}, 5, 11, 3, False),
        (1, {}, 11, 11, 1, False),
    ],
)
def test_clipped_route_matches_the_naive_loop(max_distance, options, lq, lk, block, causal):
    term = shaw(max_distance, **options)
    q, k, v = qkv(2, lq, lk)
    k_positions = torch.arange(40, 40 + lk)
    q_positions = k_positions[lk - lq :]
    with torch.no_grad():
        out = blockwise_attention(
            q, k, v, term=term, q_positions=q_positions, k_positions=k_positions, causal=causal, block_size=block
        )
        ref = naive_shaw(term, q, k, v, q_positions, k_positions, causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


class Generic(ScoreEncoding):
    """The same Shaw term without ``clipped_embeddings``: blockwise takes its generic route."""

    uses_weights = True

    def __init__(self, inner: ShawRelativePositionEncoding):
        super().__init__()
        self.inner = inner

    def forward(self, q, *, q_positions, k_positions):
        return self.inner(q, q_positions=q_positions, k_positions=k_positions)

    def value_term(self, weights, *, q_positions, k_positions):
        return self.inner.value_term(weights, q_positions=q_positions, k_positions=k_positions)


@pytest.mark.parametrize(("dropout_p", "causal", "block"), [(0.0, False, 3), (0.3, False, 4), (0.3, True, 5)])
def test_clipped_route_equals_the_generic_route_with_gradients(dropout_p, causal, block):
    term = shaw(2)
    q, k, v = qkv(2, 12, 12, seed=1)
    positions = torch.arange(3, 15)
    results = []
    for route in (term, Generic(term)):
        torch.manual_seed(9)  # the same dropout seed for both routes
        out = blockwise_attention(
            q, k, v, term=route, q_positions=positions, k_positions=positions, causal=causal,
            dropout_p=dropout_p, block_size=block,
        )  # fmt: skip
        grad = torch.randn_like(out, generator=torch.Generator().manual_seed(4))
        grads = torch.autograd.grad(out, [q, k, v, term.key_embeddings, term.value_embeddings], grad)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)


def test_clipped_route_gradcheck_with_valid_lens():
    term = shaw(2)
    q, k, v = qkv(2, 7, 7, seed=2)
    positions = torch.arange(7)
    valid_lens = torch.tensor([7, 3])

    def run(q, k, v, key_table, value_table):
        return blockwise_attention(
            q, k, v, term=term, q_positions=positions, k_positions=positions, valid_lens=valid_lens, block_size=3
        )

    assert torch.autograd.gradcheck(run, (q, k, v, term.key_embeddings, term.value_embeddings))


@pytest.mark.parametrize("offset", [-9, -3, 0, 2, 7])
@pytest.mark.parametrize("max_distance", [0, 1, 3])
def test_far_keys_are_beyond_the_clipping_distance_for_every_query_of_the_block(offset, max_distance):
    clipped = _Clipped(max_distance, None, None, 1.0, offset=offset, key_param=None, value_param=None)
    keys = 12
    for start, end in [(0, 4), (4, 8), (8, 10), (5, 6)]:
        first, last, index = clipped.split(start, end, keys, torch.device("cpu"))
        distance = torch.arange(keys)[None, :] - torch.arange(start, end)[:, None] + offset  # (block, keys)
        assert bool((distance[:, :first] <= -max_distance).all())
        assert bool((distance[:, last:] >= max_distance).all())
        expected = distance[:, first:last].clamp(-max_distance, max_distance) + max_distance
        assert torch.equal(index, expected)
        assert last - first <= end - start + 2 * max_distance - 1 or last == first


def test_keep_factors_are_the_keep_mask():
    workspace = _Workspace(torch.device("cpu"))
    for shape in [(2, 3, 5, 7), (1, 1, 1, 3), (3, 2, 4, 4)]:
        factors = _keep_factors(shape, 1234, 0.3, torch.float32, workspace)
        mask = _keep_mask(shape, 1234, 0.3, torch.device("cpu"))
        assert torch.equal(factors, mask.float())


def test_random_bits_do_not_depend_on_the_thread_count():
    """Chunks drawn side by side on two threads give the bits one thread draws in turn."""
    shape = (1, 1, 1024, 1100)  # more than one chunk of RANDOM_CHUNK_WORDS 64-bit words
    assert math.prod(shape) > 4 * RANDOM_CHUNK_WORDS
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _random_lanes(shape, 77, torch.device("cpu")).clone()
        torch.set_num_threads(2)
        parallel = _random_lanes(shape, 77, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)
    assert not torch.equal(serial[..., :512, :], serial[..., 512:, :])  # the chunks are not copies
