"""The "split keys" route (split-K decoding): exact against a float64 formula and the fused route; chosen by sizes and threads.

Shape legend: b batch, r query rows, lk keys, d head size.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import selfattn.masks as masks
from selfattn.core import dispatch
from selfattn.core.call import AttentionCall
from selfattn.core.routes.fused import FUSED
from selfattn.core.routes.split_keys import SPLIT_KEYS, SPLIT_MIN_KEYS, split_chunks, split_keys_attention
from selfattn.latent import LatentCache, MultiHeadLatentAttention
from selfattn.masks import Visibility
from selfattn.positional.rotary import RotaryPositionalEncoding

SCALE = 0.3


@pytest.fixture
def threads() -> Iterator[None]:
    """The test sets torch's thread count; it is put back after (the suite runs at 1)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _call(batch: int, rows: int, num_keys: int, *rules: masks.Rule, dtype=torch.float64, q_first=None) -> AttentionCall:
    """One head of ``rows`` queries over ``num_keys`` keys (values: other tensors), the queries after the keys."""
    gen = torch.Generator().manual_seed(rows * 1000 + num_keys)
    q, k, v = (torch.randn(batch, 1, n, 12, generator=gen, dtype=dtype) for n in (rows, num_keys, num_keys))
    visibility = Visibility(rows, num_keys, num_keys if q_first is None else q_first, 0).with_rules(*rules)
    return AttentionCall.of_heads(q, k, v, visibility, scale=SCALE)


def _formula(call: AttentionCall) -> torch.Tensor:
    """``softmax(q k^T * scale, hidden keys -inf) v`` in float64, a query that sees no key 0, ``(b, 1, r, d)``."""
    scores = call.q.double() @ call.k.double().transpose(-2, -1) * SCALE  # (b, 1, r, lk)
    seen = call.visibility.dense(torch.device("cpu"))
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of -inf only: no key, zeros
    return weights @ call.v.double()


def _padded_rows(batch: int, rows: int, num_keys: int) -> masks.Rule:
    """Row 1 hides its first 600 keys (left padding), row 0 keys 5 and 6; query row 2 of row 0 sees no key."""
    seen = torch.ones(batch, 1, rows, num_keys, dtype=torch.bool)
    seen[1, ..., :600] = False
    seen[0, ..., 5:7] = False
    seen[0, 0, 2] = False
    return masks.dense(seen)


CASES = {
    # name -> (batch, rows, keys, rules, first query)
    "odd length": (1, 16, 1031, (), None),
    "padding": (2, 16, 1031, ("padding",), None),
    # the window shows the last 300 keys: chunks of 343 (3) or 147 (7) cut inside it and hide some wholly
    "window": (1, 2, 1031, ("causal", "window"), 1029),
}


def _case(name: str, dtype=torch.float64) -> AttentionCall:
    batch, rows, keys, rule_names, q_first = CASES[name]
    made = {
        "padding": lambda: _padded_rows(batch, rows, keys),
        "causal": masks.causal,
        "window": lambda: masks.window(300),
    }
    return _call(batch, rows, keys, *(made[n]() for n in rule_names), dtype=dtype, q_first=q_first)


@pytest.mark.parametrize("chunks", [2, 3, 4, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_formula_and_the_fused_route(case: str, chunks: int) -> None:
    """Any number of chunks (with a tail of lk mod chunks keys) gives the softmax over all keys (float64: 1e-13)."""
    call = _case(case)
    with torch.no_grad():
        split = split_keys_attention(call, chunks)
        fused = FUSED.run(call).out
    expected = _formula(call)
    assert split.shape == fused.shape == expected.shape
    torch.testing.assert_close(split, expected, atol=1e-13, rtol=0)
    torch.testing.assert_close(split, fused, atol=1e-13, rtol=0)
    if case == "padding":
        assert torch.equal(split[0, 0, 2], torch.zeros(12, dtype=torch.float64))  # sees no key: zeros


def test_float32_and_a_nan_query() -> None:
    """float32 to rounding; a query holding NaN gives NaN (the kernel would give zeros), the other rows stay finite."""
    call = _case("padding", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(split_keys_attention(call, 3), FUSED.run(call).out, atol=1e-6, rtol=0)
        call.q[0, 0, 4, 7] = float("nan")
        out = split_keys_attention(call, 3)
    assert bool(out[0, 0, 4].isnan().all())
    assert bool(out[0, 0, :4].isfinite().all() and out[1].isfinite().all())


def test_chunks_follow_the_sizes_and_threads(threads: None) -> None:
    """Chunks only where the fused kernel's work items leave threads idle; never at one thread or in grad mode."""
    one_row = _call(1, 16, 1031)
    with torch.no_grad():
        torch.set_num_threads(1)
        assert split_chunks(one_row) == 0
        assert "1 work item(s) already keep 1 thread(s) busy" in str(SPLIT_KEYS.declines(one_row))
        torch.set_num_threads(2)
        assert split_chunks(one_row) == 4  # two per thread
        assert split_chunks(_call(1, 16, 2 * SPLIT_MIN_KEYS - 1)) == 0  # too few keys for 2 chunks
        assert split_chunks(_call(1, 16, 3 * SPLIT_MIN_KEYS)) == 3  # no chunk under SPLIT_MIN_KEYS keys
        assert split_chunks(_call(1, 64, 4096)) == 0  # 2 blocks of 32 rows: 2 items for 2 threads
        assert split_chunks(_call(2, 16, 4096)) == 0
        torch.set_num_threads(4)
        assert split_chunks(_call(2, 16, 4096)) == 4
    torch.set_num_threads(2)
    assert split_chunks(one_row) == 0 and "grad mode" in str(SPLIT_KEYS.declines(one_row))


def test_the_dispatcher_remembers_the_choice_per_thread_count(threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding call of one kind is chosen again when the thread count changes what pays (it failed before the
    choice memory counted the chunks: the fused route remembered at 1 thread served 2)."""
    monkeypatch.setattr(dispatch, "VERIFY_REMEMBERED_CHOICES", False)
    routes = tuple(dispatch.ROUTES)  # a list of its own: the memory starts empty
    call = _call(1, 16, 1031)
    with torch.no_grad():
        torch.set_num_threads(1)
        assert dispatch._route_for(call, routes) is FUSED
        torch.set_num_threads(2)
        assert dispatch._route_for(call, routes) is SPLIT_KEYS
        assert dispatch.explain(call).route == "split keys"


def _layer() -> MultiHeadLatentAttention:
    torch.manual_seed(2)
    layer = MultiHeadLatentAttention(
        hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        q_lora_rank=12, position=RotaryPositionalEncoding(4, 10000.0, True), dtype=torch.float64,
    )  # fmt: skip
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64) * param.shape[-1] ** -0.5)
    return layer


def test_absorbed_decoding_takes_it_and_equals_the_fused_route(threads: None) -> None:
    """MLA decoding after 600 cached tokens of a left-padded batch of 2 at 4 threads: the heads' stacked queries
    go to "split keys" and equal the same steps at 1 thread (the fused route) to float64 rounding."""
    layer = _layer()
    x = torch.randn(2, 603, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    padding = torch.zeros(2, 603, dtype=torch.bool)
    padding[1, :37] = True
    outputs, routes = [], []
    with torch.no_grad():
        for count in (1, 4):
            torch.set_num_threads(count)
            cache = LatentCache(max_len=604)
            layer(x[:, :600], key_padding_mask=padding[:, :600], cache=cache)
            steps = []
            for t in range(600, 603):
                step = dict(key_padding_mask=padding[:, t : t + 1], cache=cache)
                routes.append(layer.explain(x[:, t : t + 1], **step).route)
                steps.append(layer(x[:, t : t + 1], **step))
            outputs.append(torch.cat(steps, dim=1))
    assert routes == ["fused"] * 3 + ["split keys"] * 3
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-13, rtol=0)
    torch.set_num_threads(4)
    assert layer.explain(x[:, :1], key_padding_mask=padding[:, :1], cache=cache).route == "fused"  # grad mode
