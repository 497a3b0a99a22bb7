"""The pure sliding window (no other mask): edge blocks dense, inner blocks sharing one band pattern.

Checked against the float64 loop reference with a band visibility, and against the same module
forced onto the dense band mask, for block sizes that do and do not divide the length.
"""

import pytest
import torch
from reference_mha import make_encoding, naive_mha, visibility
from routes import WINDOW_ROUTES, without_routes

from selfattn import KVCache, MultiHeadAttention
from selfattn.core.routes import _window
from selfattn.core.routes import band_only as band_only_route

D, H = 8, 2

_FORCED: dict[str, object] = {}  # this test's block size and spy, read by the patched route functions


@pytest.fixture(autouse=True)
def _forced_blocks_and_spy(monkeypatch):
    _FORCED.clear()
    default_block, band_only = _window.window_block, band_only_route._band_only

    def counted(*args, **kwargs):
        if "spy" in _FORCED:
            _FORCED["spy"].append(args[0].shape[-2])  # queries seen by the band-only path
        return band_only(*args, **kwargs)

    monkeypatch.setattr(_window, "window_block", lambda window: _FORCED.get("block") or default_block(window))
    monkeypatch.setattr(band_only_route, "_band_only", counted)


def _mha(window, *, block=None, name="none", num_kv_heads=None, spy=None):
    position = make_encoding(name, D, H)
    torch.manual_seed(1)
    mha = MultiHeadAttention(D, H, position=position, window=window, num_kv_heads=num_kv_heads).double().eval()
    if block is not None:
        _FORCED["block"] = block
    if spy is not None:
        _FORCED["spy"] = spy
    return mha


def _dense_twin(mha):
    twin = (
        MultiHeadAttention(D, H, position=mha.position, window=mha.window, num_kv_heads=mha.num_kv_heads)
        .double()
        .eval()
    )
    twin.load_state_dict(mha.state_dict())

    def dense(*args, **kwargs):
        with without_routes(*WINDOW_ROUTES):  # the same module on the dense band mask
            return twin(*args, **kwargs)

    dense.get_parameter = twin.get_parameter  # type: ignore[attr-defined]
    return dense


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(
    ("window", "block", "length"),
    [(3, 5, 60), (3, 5, 63), (3, 24, 72), (3, 24, 61), (4, 2, 40), (1, 16, 50)],
    ids=["divides", "tail", "default-divides", "default-tail", "block<window", "window1"],
)
@pytest.mark.parametrize("num_kv_heads", [None, 1], ids=["mha", "mqa"])
def test_band_only_equals_band_mask(causal, window, block, length, num_kv_heads):
    seen = []
    mha = _mha(window, block=block, num_kv_heads=num_kv_heads, spy=seen)
    x = torch.randn(2, length, D, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        out = mha(x, x, x, causal=causal)
    assert seen == [length]  # the band-only path ran, on the whole sequence
    positions = torch.arange(length).expand(2, length)
    expected, _ = naive_mha(
        mha, x, x, x, visibility(2, length, length, causal=causal, window=window), positions, positions
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_band_only_with_rotary_at_an_offset(causal):
    seen = []
    mha = _mha(3, block=7, name="rotary", spy=seen)
    length, offset = 50, 11
    x = torch.randn(1, length, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = mha(x, x, x, causal=causal, offset=offset)
    assert seen == [length]
    positions = (torch.arange(length) + offset)[None]
    expected, _ = naive_mha(mha, x, x, x, visibility(1, length, length, causal=causal, window=3), positions, positions)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_band_only_gradients_equal_the_dense_band_mask(causal):
    mha = _mha(4, block=6, num_kv_heads=1, spy=[])
    dense = _dense_twin(mha)
    x = torch.randn(2, 53, D, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out, expected = mha(x, x, x, causal=causal), dense(x2, x2, x2, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-12, rtol=1e-10)
    for name, param in mha.named_parameters():
        torch.testing.assert_close(param.grad, dense.get_parameter(name).grad, atol=1e-12, rtol=1e-10)


def test_band_only_prefill_then_decoding_with_a_window_cache():
    seen = []
    mha = _mha(4, block=5, name="rotary", spy=seen)
    x = torch.randn(2, 48, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cache = KVCache(window=4)
    with torch.no_grad():
        prefix = mha(x[:, :40], x[:, :40], x[:, :40], causal=True, cache=cache)
        steps = [
            mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache) for t in range(40, 48)
        ]
        full = _dense_twin(mha)(x, x, x, causal=True)
    assert seen == [40]  # the prefill went through the band-only path, the single steps did not
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, atol=1e-12, rtol=1e-10)


def test_band_only_keeps_a_nan_query_visible():
    mha = _mha(3, block=8, spy=[])
    x = torch.randn(1, 64, D, dtype=torch.float64)
    x[0, 30, 0] = float("nan")
    with torch.no_grad():
        out = mha(x, x, x, causal=True)
    assert out[0, 30:33].isnan().all()  # the NaN token and the queries whose window holds it
    assert out[0, :24].isfinite().all() and out[0, 40:].isfinite().all()  # blocks that never see it


@pytest.mark.parametrize(
    "kwargs",
    [{"valid_lens": torch.tensor([40, 33])}, {"key_padding_mask": torch.zeros(2, 40, dtype=torch.bool)}],
    ids=["valid_lens", "key_padding_mask"],
)
def test_other_masks_keep_the_general_window_path(kwargs):
    seen = []
    mha = _mha(3, block=5, spy=seen)
    x = torch.randn(2, 40, D, dtype=torch.float64)
    with torch.no_grad():
        mha(x, x, x, causal=True, **kwargs)
    assert seen == []


def test_band_only_second_order_gradients():
    seen = []
    mha = _mha(3, block=4, spy=seen)
    # 17: the shortest the route takes (> 2 * (block + 2 * (window - 1))): a leading edge block, three inner
    # blocks and a trailing query. gradgradcheck checks each of the 136 inputs (30 rows took twice as long).
    x = torch.randn(1, 17, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: mha(x, x, x, causal=True), (x,))
    assert seen and set(seen) == {
        17
    }  # the shared band mask went through the fused kernel's twice-differentiable wrapper


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "batched"])
def test_band_only_one_row_at_a_time_equals_the_batch(causal, per_row, monkeypatch):
    seen = []
    mha = _mha(4, block=6, num_kv_heads=1, spy=seen)
    monkeypatch.setattr(band_only_route, "PER_ROW_BAND_ELEMENTS", 0 if per_row else 1 << 60)
    x = torch.randn(3, 47, D, dtype=torch.float64, requires_grad=True)
    out = mha(x, x, x, causal=causal)
    assert len(seen) == (4 if per_row else 1)  # the batch, then each of its rows on its own
    x2 = x.detach().clone().requires_grad_(True)
    expected = _dense_twin(mha)(x2, x2, x2, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-12, rtol=1e-10)
