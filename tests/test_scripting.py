"""torch.jit.script of selfattn's modules stops with one clear error naming torch.compile and torch.export.

TorchScript cannot type these modules' forwards; before, scripting them failed deep inside the
TorchScript frontend (a bare AssertionError, "Unknown type annotation: 'torch.Tensor'"). The
alternatives the message names are tested in tests/test_dynamic_shapes.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import selfattn
import selfattn.nn as snn
from selfattn.models import LayerRecipe, TransformerBlock, TransformerLM, repeat_pattern
from selfattn.positional import build

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

MODULES: dict[str, Callable[[], nn.Module]] = {
    "MultiHeadAttention": lambda: selfattn.MultiHeadAttention(
        8, 2, position=build("rotary", num_hiddens=8, num_heads=2)
    ),
    "MultiheadAttention": lambda: snn.MultiheadAttention(8, 2),
    "RotaryPositionalEncoding": lambda: build("rotary", num_hiddens=8, num_heads=2),
    "ALiBiPositionalBias": lambda: build("alibi", num_hiddens=8, num_heads=2),
    "TransformerBlock": lambda: TransformerBlock(8, 2, 16),
    "TransformerLM": lambda: TransformerLM(
        11, 8, 2, 2, layers=repeat_pattern(2, LayerRecipe(window=4), LayerRecipe(position=False))
    ),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_scripting_says_it_is_not_supported_and_what_to_use(name: str) -> None:
    module = MODULES[name]()
    assert type(module).__name__ == name
    with pytest.raises(NotImplementedError, match=rf"selfattn's {name}: .*torch\.compile.*torch\.export"):
        torch.jit.script(module)


def test_a_model_holding_a_selfattn_module_gets_the_same_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), selfattn.MultiHeadAttention(8, 2))
    with pytest.raises(NotImplementedError, match="does not support selfattn's MultiHeadAttention"):
        torch.jit.script(model)
