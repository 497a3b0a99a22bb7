"""``masks.selected`` and the "sparse selection" route against a dense float64 formula, forward and backward.

The reference folds the picks into a dense bool mask by scatter and attends over every key
(``test_route_exactness.reference_attention``); the route gathers the picks. Every case asserts
the route ``explain`` names. Shape legend: b batch, h heads, hk kv heads, lq queries, lk keys,
t picks per query, d head size, dv value size.
"""

from __future__ import annotations

import pytest
import torch
from test_route_exactness import reference_attention

import selfattn.masks as masks
from selfattn.core import dispatch
from selfattn.core.call import AttentionCall
from selfattn.functional import sparse_attention
from selfattn.functional._sparse import describe_sparse_attention
from selfattn.masks import Visibility


def _folded(picks: torch.Tensor, lk: int) -> torch.Tensor:
    """Bool ``(b, 1, lq, lk)``: key ``c`` was picked by the query (-1 names nothing)."""
    slots = picks.long().masked_fill(picks < 0, lk)
    return torch.zeros(*picks.shape[:-1], lk + 1, dtype=torch.bool).scatter(-1, slots, True)[..., :lk][:, None]


def _picks(b: int, lq: int, lk: int, t: int, seed: int) -> torch.Tensor:
    """Random picks with an unused slot, a key picked twice, and a row that picked only -1."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(-1, lk, (b, lq, t), generator=generator)
    picks[0, 0] = -1  # picks nothing: sees no key
    picks[-1, -1, :2] = picks[-1, -1, 2]  # one key three times (t >= 3)
    return picks


def _padding(b: int, lk: int) -> torch.Tensor:
    padding = torch.zeros(b, lk, dtype=torch.bool)
    padding[0, :3] = True  # left
    padding[-1, -2:] = True  # right
    return padding


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "sliced":
        return torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2]
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


CASES = {
    # (b, h, hk, lq, lk, d, dv, t, causal, padding, block_size)
    "odd sizes causal padding both sides": (2, 3, 3, 7, 23, 5, 3, 3, True, True, None),
    "gqa uneven blocks": (2, 4, 2, 9, 37, 6, 4, 5, True, True, 4),
    "mqa decoding one query": (3, 4, 1, 1, 41, 4, 7, 6, True, True, None),
    "no causal rule": (1, 2, 1, 5, 20, 3, 3, 4, False, False, 2),
}


@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_route_equals_the_dense_masked_formula(name: str, dtype: torch.dtype, layout: str) -> None:
    b, h, hk, lq, lk, d, dv, t, is_causal, padded, block = CASES[name]
    generator = torch.Generator().manual_seed(len(name))
    leaves = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in
              ((b, h, lq, d), (b, hk, lk, d), (b, hk, lk, dv))]  # fmt: skip
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    q, k, v = (_laid_out(leaf.to(dtype), layout) for leaf in leaves)
    picks = _picks(b, lq, lk, t, seed=lq)
    padding = _padding(b, lk) if padded else None
    rules = [masks.causal()] if is_causal else []
    rules += [masks.key_padding(padding)] if padding is not None else []
    visibility = Visibility.lower_right(lq, lk, *rules, masks.selected(picks))
    call = AttentionCall.of_heads(q, k, v, visibility, scale=0.7, block_size=block)
    assert dispatch.explain(call).route == "sparse selection"
    out = dispatch.run(call).out
    seen = _folded(picks, lk)
    if is_causal:
        seen = seen & (torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None])
    if padding is not None:
        seen = seen & ~padding[:, None, None, :]
    expected = reference_attention(*leaves, seen, scale=0.7)
    grad = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    got_grads = torch.autograd.grad(out, leaves, grad.to(dtype))
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    for got_grad, expected_grad in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got_grad, expected_grad, atol=tolerance, rtol=0)
    assert out.dtype == dtype and torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))  # picked only -1


@pytest.mark.parametrize("values", ["own", "the keys", "the keys' first features"])
def test_without_autograd_the_reused_storage_gives_the_formula(values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No autograd: the gathered rows go into storage reused block after block (once when the values are the keys).

    Blocks of 3 queries over 2 sequences and 2 kv heads, so each block's rows overwrite the last's.
    The absorbed latent call's shape (values ``k[..., :dv]``, the latent without its rotated key)
    gathers the rows once: one ``index_select`` per block, sequence and kv head, not two.
    """
    b, h, hk, lq, lk, d, t, block = 2, 4, 2, 10, 30, 6, 5, 3
    generator = torch.Generator().manual_seed(4)
    q, k = torch.randn(b, h, lq, d, generator=generator), torch.randn(b, hk, lk, d, generator=generator)
    v = {"own": torch.randn(b, hk, lk, 3, generator=generator), "the keys": k, "the keys' first features": k[..., :4]}
    v = v[values]
    picks = _picks(b, lq, lk, t, seed=2)
    call = AttentionCall.of_heads(
        q, k, v, Visibility.lower_right(lq, lk, masks.causal(), masks.selected(picks)), scale=0.6, block_size=block
    )
    assert dispatch.explain(call).route == "sparse selection"
    gathers = []
    index_select = torch.index_select

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        gathers.append(1)
        return index_select(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(torch, "index_select", counted)
    with torch.no_grad():
        out = dispatch.run(call).out
    blocks = -(-lq // block) * b * hk
    assert len(gathers) == (2 * blocks if values == "own" else blocks)
    seen = _folded(picks, lk) & (torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None])
    expected = reference_attention(q.double(), k.double(), v.double(), seen, scale=0.6)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


def test_the_backward_pass_keeps_no_gathered_rows() -> None:
    """What the route saves for backward is the size of its inputs and output, not of the gathered rows.

    Left to autograd, each block's gathered keys and values (``lq x t x (d + dv)`` per kv head,
    here 16x the keys) stayed alive until the backward pass; the route now gathers them again there.
    """
    b, h, hk, lq, lk, d, t = 1, 4, 1, 64, 64, 8, 16
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, lq, d, generator=generator, requires_grad=True)
    k, v = (torch.randn(b, hk, lk, d, generator=generator, requires_grad=True) for _ in range(2))
    picks = torch.stack([torch.randperm(lk, generator=generator)[:t] for _ in range(lq)])[None]
    call = AttentionCall.of_heads(q, k, v, Visibility.lower_right(lq, lk, masks.selected(picks)), block_size=8)
    assert dispatch.explain(call).route == "sparse selection"
    saved: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = dispatch.run(call).out
    inputs_and_output = sum(x.numel() * x.element_size() for x in (q, k, v, picks, out, out[..., 0]))
    gathered = lq * t * 2 * d * 4  # one pass's gathered key and value rows, float32
    assert sum(saved) <= inputs_and_output < gathered, (sum(saved), inputs_and_output, gathered)
    seen = _folded(picks, lk)
    expected = reference_attention(q.double(), k.double(), v.double(), seen, scale=d**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected_grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))
    for got, wanted in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, wanted, atol=2e-5, rtol=0)


def test_other_rules_and_per_head_masks_hold_on_the_picked_pairs() -> None:
    """Documents, a window and a per-head dense mask, evaluated on the picks alone, equal the dense route."""
    b, h, lq, lk = 2, 2, 8, 40
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, 4, generator=generator, dtype=torch.float64) for n in (lq, lk, lk))
    picks = torch.randint(-1, lk, (1, lq, 9), generator=generator)  # one selection shared by the batch
    ids = (torch.arange(lk) // 7)[None].expand(b, -1)
    head_mask = torch.rand(b, h, lq, lk, generator=generator) > 0.3
    visibility = Visibility.lower_right(lq, lk, masks.documents(ids[:, -lq:], ids), masks.window(30))
    visibility = visibility & masks.dense(head_mask) & masks.selected(picks)
    call = AttentionCall.of_heads(q, k, v, visibility)
    assert dispatch.explain(call).route == "sparse selection"
    dense = visibility.dense(q.device)
    assert dense is not None and torch.equal(
        dense, visibility.without(masks.Selected).dense(q.device) & _folded(picks, lk)
    )
    torch.testing.assert_close(
        dispatch.run(call).out, reference_attention(q, k, v, dense, scale=0.5), atol=1e-12, rtol=0
    )


def test_renderings_of_the_rule_agree() -> None:
    """``block`` (a scatter), ``allows`` (any broadcast) and ``scalar`` (FlexAttention's form) give one mask."""
    picks = _picks(2, 6, 11, 4, seed=1)
    visibility = Visibility.lower_right(6, 11, masks.selected(picks))
    expected = _folded(picks, 11)
    assert torch.equal(visibility.dense(torch.device("cpu")), expected)
    assert torch.equal(visibility.block(2, 5, slice(3, 9), device=torch.device("cpu")), expected[:, :, 2:5, 3:9])
    rows, columns = torch.arange(6)[:, None], torch.arange(11)[None, :]
    assert torch.equal(visibility.at(rows, columns), expected)
    allowed = visibility.predicate()
    assert allowed is not None
    for s, r, c in ((0, 1, 3), (1, 5, 10), (1, 0, 0), (0, 4, 7)):
        scalar = allowed(torch.tensor(s), torch.tensor(0), torch.tensor(r), torch.tensor(c))
        assert bool(scalar) == bool(expected[s, 0, r, c])


def test_dense_selection_goes_to_the_dense_routes_with_the_reason() -> None:
    q = torch.randn(1, 2, 4, 3)
    k = torch.randn(1, 2, 8, 3)
    picks = torch.randint(0, 8, (1, 4, 3))  # 3 of 8 keys: over a quarter
    explanation = dispatch.explain(describe_sparse_attention(q, k, k, picks, causal=True), verbose=True)
    assert explanation.route != "sparse selection"
    assert dict(explanation.declined)["sparse selection"] == (
        "3 picks per query of 8 keys: more than 25% of them, a dense masked pass costs less"
    )
    weights = dispatch.explain(describe_sparse_attention(q, k, k, picks[..., :1], return_weights=True), verbose=True)
    assert dict(weights.declined)["sparse selection"] == "the weights were asked for"
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=_folded(picks, 8) & (torch.arange(8) <= torch.arange(4, 8)[:, None])
    )
    torch.testing.assert_close(sparse_attention(q, k, k, picks, causal=True), expected, atol=1e-6, rtol=0)


def test_many_queries_with_few_heads_per_key_go_dense_with_the_reason() -> None:
    """Gathers pay when a decoded token reads few keys, or when many query heads share each gathered row."""
    lk, picks = 300, torch.randint(0, 300, (1, 65, 8))
    k = torch.randn(1, 1, lk, 4)
    prefill = dispatch.explain(describe_sparse_attention(torch.randn(1, 4, 65, 4), k, k, picks), verbose=True)
    assert prefill.route != "sparse selection"
    assert dict(prefill.declined)["sparse selection"] == (
        "65 queries (more than 64) whose gathered keys serve 4 head(s) each (fewer than 8): "
        "gathering costs more than a dense masked pass"
    )
    grouped = dispatch.explain(describe_sparse_attention(torch.randn(1, 8, 65, 4), k, k, picks))
    assert grouped.route == "sparse selection"
    decoded = dispatch.explain(describe_sparse_attention(torch.randn(1, 4, 64, 4), k, k, picks[:, :64]))
    assert decoded.route == "sparse selection"


def test_a_causal_selection_the_sparse_route_declines_goes_in_blocks_that_skip_the_hidden_half() -> None:
    """Many queries, one head per kv head (DeepSeek-V3.2's expanded shape): causal blocks, not a masked pass over all pairs.

    The fused kernel takes a selection only as a dense mask over every (query, key) pair; blocks of
    queries reach the keys up to their last query, a little over half the pairs (the masked fused
    pass measured 2x the blocks' time at n=4096, top-k 512). Without the causal rule nothing is
    skipped and the fused pass stays. Either way the answer is the dense masked formula.
    """
    b, h, lq, t, block = 1, 2, 256, 8, 16
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, lq, d, generator=generator, dtype=torch.float64) for d in (4, 4, 3))
    picks = torch.randint(0, lq, (b, lq, t), generator=generator)
    causal = AttentionCall.of_heads(
        q, k, v, Visibility.lower_right(lq, lq, masks.causal(), masks.selected(picks)), block_size=block
    )
    explained = dispatch.explain(causal, verbose=True)
    assert explained.route == "blockwise", str(explained)  # was "fused": blocks computing 53% of the pairs declined
    assert "serve 1 head(s) each" in dict(explained.declined)["sparse selection"]
    everything = AttentionCall.of_heads(
        q, k, v, Visibility.lower_right(lq, lq, masks.selected(picks)), block_size=block
    )
    explained = dispatch.explain(everything, verbose=True)
    assert explained.route == "fused" and "100% of the pairs (more than 60%)" in dict(explained.declined)["blockwise"]
    seen = _folded(picks, lq) & (torch.arange(lq)[None, :] <= torch.arange(lq)[:, None])
    expected = reference_attention(q, k, v, seen, scale=4**-0.5)
    torch.testing.assert_close(dispatch.run(causal).out, expected, atol=1e-10, rtol=0)


def test_bad_selections_are_refused_naming_them() -> None:
    q = torch.randn(2, 2, 4, 3)
    k = torch.randn(2, 2, 16, 3)
    good = torch.zeros(2, 4, 2, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"masks.selected: indices must be an integer tensor of shape \(b, lq, t\), got torch.float32"
    ):
        masks.selected(good.float())
    with pytest.raises(
        ValueError,
        match=r"masks.selected: indices must be an integer tensor of shape \(b, lq, t\), got torch.int64 \(4, 2\)",
    ):
        masks.selected(good[0])
    with pytest.raises(
        ValueError, match=r"masks.selected: indices of shape \(2, 4, 2\) must lie in \[-1, 16\) \(the call has 16 keys"
    ):
        sparse_attention(q, k, k, good + 16)
    with pytest.raises(ValueError, match=r"got values in \[-2, -2\]"):
        sparse_attention(q, k, k, good - 2)
    with pytest.raises(
        ValueError,
        match=r"masks.selected: indices of shape \(2, 3, 2\) has 3 queries in dimension 1, the call has 4 queries",
    ):
        sparse_attention(q, k, k, good[:, :3])
    with pytest.raises(
        ValueError, match=r"masks.selected: indices of shape \(3, 4, 2\) has 3 sequences in dimension 0, the call has 2"
    ):
        sparse_attention(q, k, k, torch.zeros(3, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sparse_attention: q must be \(b, h, lq, d\), got shape \(2, 4, 3\)"):
        sparse_attention(q[0], k[0], k[0], good)
    with pytest.raises(
        ValueError, match=r"masks.selected: indices of shape \(2, 4, 0\) have no slot per query \(t = 0"
    ):
        sparse_attention(q, k, k, good[..., :0])  # a top-k of 0 (the route's reshape failed on it)


def test_a_module_call_with_the_rule_takes_the_sparse_route_and_equals_the_dense_rule() -> None:
    """``MultiHeadAttention(..., mask=masks.selected(picks))``: gradients of every weight equal the same picks as a dense rule."""
    from selfattn import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, num_kv_heads=1).double()
    x = torch.randn(2, 17, 12, dtype=torch.float64)
    picks = _picks(2, 17, 17, 4, seed=2)
    padding = _padding(2, 17)
    rule = masks.selected(picks)
    assert mha.explain(x, x, x, causal=True, key_padding_mask=padding, mask=rule).route == "sparse selection"
    results = []
    for mask in (rule, masks.dense(_folded(picks, 17))):
        mha.zero_grad()
        out = mha(x, x, x, causal=True, key_padding_mask=padding, mask=mask)
        out.square().sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in mha.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
