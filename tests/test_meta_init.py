"""device=/dtype= on every module, and meta-device construction + to_empty() + reset_parameters()."""

import pytest
import torch

from selfattn import MultiHeadAttention
from selfattn.positional import NAMES, build

D, H = 24, 4


def _state(module):
    """Every tensor a module holds (parameters and buffers, persistent or not)."""
    return {name: t.detach().clone() for name, t in [*module.named_parameters(), *module.named_buffers()]}


def _assert_meta_then_reset_repeats(make, seed=0):
    """``make(device=None)`` built normally equals it built on meta, materialized and reset with the same seed."""
    torch.manual_seed(seed)
    normal = make()
    meta = make("meta")
    assert all(t.is_meta for t in _state(meta).values())
    meta.to_empty(device="cpu")
    torch.manual_seed(seed)
    meta.reset_parameters()
    expected, got = _state(normal), _state(meta)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_meta_then_reset_equals_normal_construction(name):
    _assert_meta_then_reset_repeats(lambda device=None: build(name, num_hiddens=D, num_heads=H, device=device))


@pytest.mark.parametrize("name", NAMES)
def test_device_and_dtype_arguments(name):
    encoding = build(name, num_hiddens=D, num_heads=H, device="cpu", dtype=torch.float64)
    for key, t in _state(encoding).items():
        assert t.device.type == "cpu"
        if t.is_floating_point() and key in dict(encoding.named_parameters()):
            assert t.dtype == torch.float64, key


def test_multihead_attention_meta_init_with_default_context():
    torch.manual_seed(3)
    normal = MultiHeadAttention(D, H, bias=True, num_kv_heads=2, position=build("t5", num_hiddens=D, num_heads=H))
    with torch.device("meta"):
        meta = MultiHeadAttention(D, H, bias=True, num_kv_heads=2, position=build("t5", num_hiddens=D, num_heads=H))
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    for key, value in normal.state_dict().items():
        torch.testing.assert_close(meta.state_dict()[key], value, atol=0, rtol=0, msg=key)
    half = MultiHeadAttention(D, H, dtype=torch.float64, device="cpu")
    assert {p.dtype for p in half.parameters()} == {torch.float64}


def test_alibi_meta_context_tables_are_exact_after_reset():
    with torch.device("meta"):
        alibi = build("alibi", num_hiddens=D, num_heads=H)
        rotary = build("rotary", num_hiddens=D, num_heads=H)
    for module, table in ((alibi, "slopes"), (rotary, "inv_freq")):
        module.to_empty(device="cpu")
        module.reset_parameters()
        assert getattr(module, table).dtype == torch.float64
    assert alibi.slopes.tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    assert rotary.inv_freq.tolist() == [10000.0 ** (-2 * j / 6) for j in range(3)]


def test_meta_then_reset_repeats_a_layer_built_with_its_own_and_given_parts():
    """Parts given in parts= are built before the layer (as its position): reset_parameters drew them after the
    projections, so every weight differed (0.35) from a normal construction; the keywords' parts come after."""
    from selfattn.parts import OutputGate

    def layer(device=None):
        position = build("t5", num_hiddens=D, num_heads=H, device=device)
        given = {"gate": OutputGate(D, H, D // H, device=device)}
        return MultiHeadAttention(D, H, position=position, parts=given, qk_norm=True, device=device)

    _assert_meta_then_reset_repeats(layer, seed=5)
