"""Properties every encoding built by name must have inside MultiHeadAttention."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from selfattn import KVCache, MultiHeadAttention
from selfattn.functional import _block_autograd as blockwise
from selfattn.positional import NAMES, InputEncoding, QueryKeyEncoding, ScoreEncoding, build

NUM_HIDDENS, NUM_HEADS, LENGTH, BATCH = 16, 4, 6, 2
# rotary3d needs a head size of at least 6 (2 features per axis); tests/test_rotary_variants.py covers it.
NAMES = tuple(name for name in NAMES if name != "rotary3d")
GRIDS = {"sinusoidal2d": (2, 3), "sinusoidal3d": (3, 1, 2)}  # LENGTH tokens in raster order
# mrope runs here on text positions (all three axes equal); tests/test_mrope.py gives it (3, b, l) positions.
RELATIVE = {"none", "rotary", "alibi", "t5", "shaw", "xpos", "rotary2d", "rotary3d", "kerple", "mrope"}
PARAMETERS = {
    "learned": {"weight"},
    "t5": {"relative_attention_bias.weight"},
    "shaw": {"key_embeddings", "value_embeddings"},
    "kerple": {"raw_r1", "raw_r2"},
    "fire": {"mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "raw_c", "raw_threshold"},
}
BUFFERS = {
    "sinusoidal": {"P"},
    "rotary": {"inv_freq"},
    "xpos": {"inv_freq", "zeta"},
    "rotary2d": {"inv_freq"},
    "mrope": {"inv_freq"},
    "alibi": {"slopes"},
    "sinusoidal2d": {"axes.0.P", "axes.1.P"},
    "sinusoidal3d": {"axes.0.P", "axes.1.P", "axes.2.P"},
}


def make(name: str, dtype: torch.dtype = torch.float32, **options):
    """The encoding and an attention layer using it, both in ``dtype``, with fixed weights."""
    torch.manual_seed(0)
    encoding = build(name, num_hiddens=NUM_HIDDENS, num_heads=NUM_HEADS, **options)
    inside = None if isinstance(encoding, InputEncoding) else encoding
    mha = MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, position=inside)
    return encoding.to(dtype).eval(), mha.to(dtype).eval()


def encode(name: str, encoding, x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The input of tokens ``start ..`` with the encoding added (a no-op for attention-side encodings)."""
    if not isinstance(encoding, InputEncoding):
        return x
    if name not in GRIDS:
        return encoding(x, offset=start)
    # One grid cell per token, each at its own cell offset, so any chunk of tokens works.
    cells = []
    for t in range(start, start + x.shape[1]):
        cell = x[:, t - start].view(x.shape[0], *([1] * len(GRIDS[name])), -1)  # (b, 1, .., 1, d)
        coords = tuple(int(c) for c in torch.unravel_index(torch.tensor(t), GRIDS[name]))
        cells.append(encoding(cell, offset=coords).reshape(x.shape[0], 1, -1))
    return torch.cat(cells, dim=1)  # (b, l, d)


def full_pass(name, encoding, mha, x, valid_lens=None, *, offset=0, causal=True):
    if name in GRIDS and isinstance(encoding, InputEncoding):
        grid = x.view(x.shape[0], *GRIDS[name], -1)  # (b, *grid, d)
        encoded = encoding(grid, offset=offset).reshape(x.shape)  # (b, l, d)
    else:
        encoded = encode(name, encoding, x, offset)
    return mha(encoded, encoded, encoded, valid_lens, causal=causal, offset=offset)


def inputs(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(BATCH, LENGTH, NUM_HIDDENS).to(dtype)


@pytest.mark.parametrize("name", NAMES)
def test_relative_encodings_ignore_offsets_and_absolute_ones_do_not(name):
    encoding, mha = make(name)
    assert encoding.is_relative == (name in RELATIVE)
    x, valid_lens = inputs(), torch.tensor([4, 5])
    with torch.no_grad():
        at_zero = full_pass(name, encoding, mha, x, valid_lens)
        shifted = full_pass(name, encoding, mha, x, valid_lens, offset=37)
    if encoding.is_relative:
        torch.testing.assert_close(shifted, at_zero, rtol=0, atol=1e-5)
    else:
        assert float((shifted - at_zero).abs().max()) > 1e-3


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", NAMES)
def test_cache_gives_the_full_causal_pass(name, dtype, atol, per_query):
    encoding, mha = make(name, dtype)
    x = inputs(dtype)
    # The longest length is 5 of 6 keys, so the full pass also drops the last key (not the cache).
    valid_lens = torch.tensor([[1, 2, 2, 4, 5, 5], [0, 2, 3, 3, 5, 5]]) if per_query else torch.tensor([4, 5])
    for chunks in ([1] * LENGTH, [2, 1, 3]):
        cache, outputs, start = KVCache(LENGTH), [], 0
        with torch.no_grad():
            expected = full_pass(name, encoding, mha, x, valid_lens)
            for size in chunks:
                piece = encode(name, encoding, x[:, start : start + size], start)
                lens = valid_lens[:, start : start + size] if per_query else valid_lens
                outputs.append(mha(piece, piece, piece, lens, causal=True, cache=cache))
                start += size
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.02), (torch.float64, 0.0)])
@pytest.mark.parametrize("name", NAMES)
def test_dtypes_agree_with_float64(name, dtype, atol, causal):
    encoding, mha = make(name, dtype)
    reference_encoding, reference_mha = make(name, torch.float64)
    x, valid_lens = inputs(torch.float64), torch.tensor([3, 5])
    out = full_pass(name, encoding, mha, x.to(dtype), valid_lens, offset=300, causal=causal)
    assert out.dtype == dtype
    with torch.no_grad():
        reference = full_pass(name, reference_encoding, reference_mha, x, valid_lens, offset=300, causal=causal)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=max(atol, 1e-12))
    out.float().square().sum().backward()
    trained = list(encoding.parameters()) + list(mha.parameters())
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in trained)


@pytest.mark.parametrize("name", NAMES)
def test_tables_are_non_persistent_buffers_and_parameters_are_saved(name):
    encoding, _ = make(name)
    buffers = dict(encoding.named_buffers())
    assert set(buffers) == BUFFERS.get(name, set())
    assert set(encoding.state_dict()) == PARAMETERS.get(name, set()) == {n for n, _ in encoding.named_parameters()}
    # A fresh encoding loaded from the state_dict behaves the same.
    torch.manual_seed(123)
    fresh = build(name, num_hiddens=NUM_HIDDENS, num_heads=NUM_HEADS)
    fresh.load_state_dict(encoding.state_dict())
    fresh_mha = MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, position=None if isinstance(fresh, InputEncoding) else fresh)
    _, mha = make(name)
    fresh_mha.load_state_dict(mha.state_dict())
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            full_pass(name, fresh, fresh_mha, x), full_pass(name, encoding, mha, x), rtol=0, atol=0
        )


@pytest.mark.parametrize("name", NAMES)
def test_to_moves_tables_and_parameters(name):
    encoding, _ = make(name)
    dtypes_before = {n: b.dtype for n, b in encoding.named_buffers()}
    encoding.to(torch.bfloat16)
    for n, p in encoding.named_parameters():
        assert p.dtype == torch.bfloat16, n
    for n, b in encoding.named_buffers():
        # Frequencies and slopes keep float64; tables of values follow the dtype.
        assert b.dtype == (torch.float64 if dtypes_before[n] == torch.float64 else torch.bfloat16), n
    encoding.to("meta")
    assert all(t.device.type == "meta" for t in list(encoding.parameters()) + list(encoding.buffers()))


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_runs_on_the_gpu(name):
    encoding, mha = make(name)
    encoding, mha = encoding.cuda(), mha.cuda()
    x = inputs()
    with torch.no_grad():
        on_gpu = full_pass(name, encoding, mha, x.cuda(), torch.tensor([4, 6], device="cuda"), offset=5)
        on_cpu = full_pass(name, encoding.cpu(), mha.cpu(), x, torch.tensor([4, 6]), offset=5)
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "fire"])
def test_score_terms_through_flex_on_the_gpu_equal_the_cpu(name):  # pragma: no cover - GPU only
    # Head size 16: MultiHeadAttention hands alibi, t5 and kerple to FlexAttention's compiled kernel;
    # fire (compiles_in_flex = False) takes the blockwise path on CUDA.
    torch.manual_seed(0)
    encoding = build(name, num_hiddens=64, num_heads=4)
    mha = MultiHeadAttention(64, 4, position=encoding)
    x = torch.randn(2, 40, 64)
    results = []
    for device in ("cuda", "cpu"):
        mha.to(device).zero_grad()
        xd = x.to(device).requires_grad_(True)
        out = mha(xd, xd, xd, torch.tensor([33, 40], device=device), causal=True)
        out.square().sum().backward()
        results.append([out, xd.grad, *(p.grad for p in encoding.parameters())])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("name", "options", "fused"),
    [
        ("rotary", {}, True),
        ("alibi", {}, True),
        ("t5", {}, True),
        ("shaw", {"values": False}, True),
        ("shaw", {}, False),
        ("kerple", {}, True),
        ("fire", {}, True),
    ],
)
def test_score_terms_reach_the_fused_kernel(name, options, fused):
    encoding, mha = make(name, **options)
    torch.manual_seed(1)
    x = torch.randn(BATCH, 40, NUM_HIDDENS)  # past one vector of the CPU kernel's keys (fewer are written out)
    lengths = torch.tensor([24, 40])
    if not isinstance(encoding, ScoreEncoding):
        with (
            mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as spy,
            torch.no_grad(),
        ):
            mha(x, x, x, lengths, causal=True)
        assert spy.called == fused
        return
    # Score terms go blockwise, each block to the CPU flash kernel with its bias as a float mask.
    flash = blockwise._flash_forward
    with mock.patch.object(blockwise, "_flash_forward", wraps=flash) as spy, torch.no_grad():
        mha(x, x, x, lengths, causal=True)
    assert spy.called == fused
    if fused:
        assert spy.call_args.kwargs["attn_mask"].is_floating_point()


def test_kinds_and_derived_sizes():
    kinds = {name: build(name, num_hiddens=24, num_heads=3).acts_on for name in NAMES}
    assert kinds == {
        "none": "input",
        "sinusoidal": "input",
        "learned": "input",
        "rotary": "query_key",
        "alibi": "scores",
        "t5": "scores",
        "shaw": "scores",
        "sinusoidal2d": "input",
        "sinusoidal3d": "input",
        "xpos": "query_key",
        "rotary2d": "query_key",
        "kerple": "scores",
        "fire": "scores",
        "mrope": "query_key",
    }
    assert isinstance(build("rotary", num_hiddens=24, num_heads=3), QueryKeyEncoding)
    assert build("rotary", num_hiddens=24, num_heads=3).head_dim == 8
    assert build("shaw", num_hiddens=24, num_heads=3, max_distance=5).key_embeddings.shape == (11, 8)
    assert build("alibi", num_hiddens=24, num_heads=3, causal=False).slopes.shape == (3,)
    assert build("t5", num_hiddens=24, num_heads=3).relative_attention_bias.weight.shape == (32, 3)
    assert build("learned", num_hiddens=24, num_heads=3).weight.shape == (1000, 24)
    assert build("learned", num_hiddens=24, num_heads=3, max_len=7).weight.shape == (7, 24)
    assert build("sinusoidal3d", num_hiddens=24, num_heads=3).num_axes == 3
    x = torch.randn(2, 5, 24)
    assert torch.equal(build("none", num_hiddens=24, num_heads=3)(x, offset=4), x)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        (
            "rope",
            {},
            "name must be one of none, sinusoidal, .*; got 'rope'",
        ),
        ("alibi", {"num_hiddens": 10, "num_heads": 4}, "num_hiddens=10 is not divisible by num_heads=4"),
        ("alibi", {"num_hiddens": 0}, "num_hiddens must be a positive integer, got 0"),
        ("alibi", {"num_heads": -2}, "num_heads must be a positive integer, got -2"),
        ("rotary", {"head_dim": 4}, "option head_dim=4 is not accepted by 'rotary'"),
        ("shaw", {"max_dist": 4}, "option max_dist=4 is not accepted by 'shaw'; it takes max_distance, keys, values"),
        ("none", {"dropout": 0.1}, "option dropout=0.1 is not accepted by 'none'; it takes no options"),
        ("shaw", {"max_distance": -3}, "max_distance must be a non-negative integer, got -3"),
    ],
)
def test_build_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(name, **{"num_hiddens": 16, "num_heads": 4, **kwargs})


def test_input_encodings_are_refused_inside_attention():
    with pytest.raises(ValueError, match="add input encodings to the input instead"):
        MultiHeadAttention(16, 4, position=build("learned", num_hiddens=16, num_heads=4))


def test_no_encoding_means_permutation_equivariance():
    # Sanity check that the family test can tell encodings apart: without one, order does not matter.
    encoding, mha = make("none")
    x = inputs()
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        out = full_pass("none", encoding, mha, x, causal=False)
        permuted = full_pass("none", encoding, mha, x[:, order], causal=False)
    torch.testing.assert_close(permuted, out[:, order], rtol=0, atol=1e-6)
    assert math.isfinite(float(out.abs().sum()))
