"""Per-layer recipes: a Gemma-like, a Llama-4-like and a Gemma-3-like stack in a few lines, decoding equal to the full pass."""

from __future__ import annotations

import pytest
import torch

from selfattn.models import LayerRecipe, TransformerLM, repeat_pattern


def _lm(layers, position="rotary", **options):
    torch.manual_seed(0)
    return TransformerLM(50, 32, 4, len(layers), position=position, layers=layers, **options).double().eval()


def _decoding_equals_full_pass(lm, length=12):
    tokens = torch.randint(0, 50, (2, length))
    full = lm(tokens)
    caches = lm.make_caches(length)
    steps = [lm(tokens[:, :5], caches=caches)] + [lm(tokens[:, t : t + 1], caches=caches) for t in range(5, length)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-10)


def test_gemma_like_alternating_windows_with_softcap():
    local, global_ = LayerRecipe(window=3, softcap=5.0, scale=0.3), LayerRecipe(softcap=5.0, scale=0.3)
    lm = _lm(repeat_pattern(4, local, global_))
    windows = [block.attention.window for block in lm.blocks]
    assert windows == [3, None, 3, None]
    assert all(block.attention.softcap == 5.0 and block.attention.scale == 0.3 for block in lm.blocks)
    _decoding_equals_full_pass(lm)


def test_llama4_like_chunked_layers_and_a_nope_layer_with_temperature():
    chunked = LayerRecipe(chunk_size=4, qk_norm=True)
    nope = LayerRecipe(position=False, temperature_tuning=(0.1, 4.0))
    lm = _lm(repeat_pattern(4, chunked, chunked, chunked, nope))
    assert [block.attention.position is None for block in lm.blocks] == [False, False, False, True]
    assert lm.blocks[0].attention.chunk_size == 4 and lm.blocks[3].attention.temperature_tuning == (0.1, 4.0)
    _decoding_equals_full_pass(lm)


def test_gemma3_like_local_layers_with_their_own_rotary_base_and_sinks():
    local = LayerRecipe(window=4, rotary_base=10_000.0, qk_norm=True, sinks=True)
    global_ = LayerRecipe(qk_norm=True, sinks=True, gated_output=True)
    lm = _lm(repeat_pattern(3, local, local, global_), position_options={"base": 1_000_000.0})
    positions = [block.attention.position for block in lm.blocks]
    assert positions[0] is positions[1] and positions[0].base == 10_000.0
    assert positions[2] is lm.position and lm.position.base == 1_000_000.0
    _decoding_equals_full_pass(lm)


def test_plain_layers_by_default():
    lm = TransformerLM(50, 32, 4, 2)
    assert lm.layers == [LayerRecipe(), LayerRecipe()]
    assert all(block.attention.position is lm.position for block in lm.blocks)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: TransformerLM(50, 32, 4, 2, layers=[LayerRecipe()]), r"one LayerRecipe per layer \(2\), got 1"),
        (
            lambda: TransformerLM(50, 32, 4, 1, layers=["sliding_attention"]),
            r"layers\[0\] must be a LayerRecipe, got str",
        ),
        (
            lambda: TransformerLM(50, 32, 4, 1, position="alibi", layers=[LayerRecipe(rotary_base=1e4)]),
            r"rotary_base=10000.0, but position='alibi' is not rotary",
        ),
        (lambda: LayerRecipe(window=0), "window must be a positive integer, got 0"),
        (lambda: LayerRecipe(softcap=-2.0), "softcap must be a positive finite number, got -2.0"),
        (
            lambda: LayerRecipe(position=False, rotary_base=1e4),
            r"rotary_base=10000.0 is given for a layer without position",
        ),
        (lambda: repeat_pattern(0, LayerRecipe()), "num_layers must be a positive integer, got 0"),
        (lambda: repeat_pattern(2), "pattern must hold at least one LayerRecipe"),
    ],
)
def test_bad_recipes_name_the_argument(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()
