"""Arguments that used to be accepted silently: a non-bool ``causal``, an encoding sized for another layer."""

from __future__ import annotations

import pytest
import torch

import selfattn.nn
from selfattn import MultiHeadAttention
from selfattn.functional import attention, blockwise_attention, flex_score_attention
from selfattn.models import TransformerBlock
from selfattn.positional import ALiBiPositionalBias, T5RelativePositionBias, build

NOT_BOOLS = [
    ("yes", "str 'yes'"),
    (1, "int 1"),
    (None, "NoneType None"),
    (torch.tensor(True), "Tensor tensor\\(True\\)"),
]


@pytest.mark.parametrize(("value", "shown"), NOT_BOOLS)
def test_module_refuses_a_causal_that_is_not_a_bool(value, shown):
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match=f"causal must be True or False, got {shown}"):
        mha(x, x, x, causal=value)
    with pytest.raises(ValueError, match=f"causal must be True or False, got {shown}"):
        mha.explain(x, x, x, causal=value)
    with pytest.raises(ValueError, match=f"return_weights must be True or False, got {shown}"):
        mha(x, x, x, return_weights=value)


@pytest.mark.parametrize(("value", "shown"), NOT_BOOLS)
def test_functions_refuse_a_causal_that_is_not_a_bool(value, shown):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=f"causal must be True or False, got {shown}"):
        attention(q, q, q, causal=value)
    with pytest.raises(ValueError, match=f"return_weights must be True or False, got {shown}"):
        attention(q, q, q, return_weights=value)
    with pytest.raises(ValueError, match=f"causal must be True or False, got {shown}"):
        blockwise_attention(q, q, q, dropout_p=0.1, causal=value)
    positions = torch.arange(3)
    with pytest.raises(ValueError, match=f"causal must be True or False, got {shown}"):
        flex_score_attention(
            q, q, q, term=ALiBiPositionalBias(2), q_positions=positions, k_positions=positions, causal=value
        )


def test_models_and_encodings_refuse_a_causal_that_is_not_a_bool():
    block = TransformerBlock(8, 2, 16)
    with pytest.raises(ValueError, match="causal must be True or False, got str 'yes'"):
        block(torch.randn(1, 3, 8), causal="yes")
    with pytest.raises(ValueError, match="causal must be True or False, got str 'no'"):
        ALiBiPositionalBias(2, causal="no")  # bool("no") is True: the opposite of what was written


def test_a_bool_causal_still_works():
    mha = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    causal, weights = mha(x, x, x, causal=True, return_weights=True)
    assert (weights[0, :, 0, 1:] == 0).all() and (weights[0, :, 2] > 0).all()
    assert not torch.allclose(causal, mha(x, x, x, causal=False))


WRONG_SIZES = [
    ("t5", T5RelativePositionBias(4), "T5RelativePositionBias built for 4 heads, the layer has 8"),
    ("alibi", build("alibi", num_hiddens=16, num_heads=4), "ALiBiPositionalBias built for 4 heads, the layer has 8"),
    ("kerple", build("kerple", num_hiddens=16, num_heads=4), "KerplePositionalBias built for 4 heads, the layer has 8"),
    ("fire", build("fire", num_hiddens=16, num_heads=4), "FIREPositionalBias built for 4 heads, the layer has 8"),
    (
        "rotary",
        build("rotary", num_hiddens=32, num_heads=4),
        "RotaryPositionalEncoding built for head size 8, the layer's is 4",
    ),
    ("xpos", build("xpos", num_hiddens=32, num_heads=4), "XPosEncoding built for head size 8, the layer's is 4"),
    (
        "shaw",
        build("shaw", num_hiddens=32, num_heads=4),
        "ShawRelativePositionEncoding built for head size 8, the layer's is 4",
    ),
    (
        "mrope",
        build("mrope", num_hiddens=32, num_heads=2),
        "MultimodalRotaryPositionalEncoding built for head size 16, the layer's is 4",
    ),
    (
        "rotary2d",
        build("rotary2d", num_hiddens=32, num_heads=4),
        "RotaryPositionalEncoding2D built for head size 8, the layer's is 4",
    ),
]


@pytest.mark.parametrize(("name", "encoding", "message"), WRONG_SIZES, ids=[case[0] for case in WRONG_SIZES])
def test_an_encoding_for_another_layer_is_refused_at_construction(name, encoding, message):
    with pytest.raises(ValueError, match=f"position={message}"):
        MultiHeadAttention(32, 8, position=encoding)
    with pytest.raises(ValueError, match=f"position={message}"):
        TransformerBlock(32, 8, 64, position=encoding)
    with pytest.raises(ValueError, match=f"position={message}"):
        selfattn.nn.MultiheadAttention(32, 8, position=encoding, batch_first=True)


@pytest.mark.parametrize("name", ["t5", "alibi", "kerple", "fire", "rotary", "xpos", "shaw", "mrope", "rotary2d"])
def test_an_encoding_built_for_the_layer_is_accepted(name):
    encoding = build(name, num_hiddens=32, num_heads=8)
    mha = MultiHeadAttention(32, 8, position=encoding)
    x = torch.randn(1, 5, 32)
    assert mha(x, x, x).shape == (1, 5, 32)
