"""torch.compile(dynamic=True, fullgraph=True) and torch.export with a dynamic length, against eager.

Each case runs at four or more lengths through one compiled module and counts the graphs
compiled (at most 2 after the first); ``fullgraph=True`` turns any graph break into an error.
The backend is dynamo's ``eager`` behind a counter (dynamo traces with symbolic sizes: where
dynamic shapes fail or break the graph), and ``aot_eager`` for one broad case; inductor's code
generation costs seconds per graph on CPU, too slow here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.export import Dim, export

import selfattn
import selfattn.nn as snn
from selfattn.positional import build

LENGTHS = (3, 5, 8, 11)
E, H = 16, 4
ATOL = 1e-5

Inputs = tuple[tuple[torch.Tensor, ...], dict[str, Any]]


def _core(**options: Any) -> selfattn.MultiHeadAttention:
    torch.manual_seed(0)
    position = options.pop("position", None)
    if position is not None:
        options["position"] = build(position, num_hiddens=E, num_heads=H)
    return selfattn.MultiHeadAttention(E, H, bias=True, **options).eval()


def _x(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, E, generator=torch.Generator().manual_seed(length))


def _self(length: int, **kwargs: Any) -> Inputs:
    x = _x(length)
    return (x, x, x), kwargs


def _padding(length: int) -> torch.Tensor:
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, length // 2 :] = True
    return padding


def _compiled_runs(
    module: Callable[..., Any], make_inputs: Callable[[int], Inputs], backend: str = "eager"
) -> list[torch.fx.GraphModule]:
    """Run ``module`` eager and compiled at every length; return the graphs compiled."""
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=True, fullgraph=True, backend=counting_backend)
    for length in LENGTHS:
        args, kwargs = make_inputs(length)
        with torch.no_grad():
            expected = module(*args, **kwargs)
            got = compiled(*args, **kwargs)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    return graphs


CORE_CASES: list[Any] = [
    pytest.param({}, lambda l: _self(l), id="plain"),
    pytest.param({}, lambda l: _self(l, attn_mask=torch.rand(l, l) > 0.3), id="bool_attn_mask"),
    pytest.param({}, lambda l: _self(l, valid_lens=torch.tensor([l, l - 2])), id="valid_lens"),
    pytest.param({"position": "alibi"}, lambda l: _self(l, causal=True), id="alibi_causal"),
    pytest.param({"window": 3}, lambda l: _self(l, causal=True), id="window_causal"),
    pytest.param({}, lambda l: _self(l, causal=True), id="causal"),
    pytest.param({"num_kv_heads": 2}, lambda l: _self(l, causal=True), id="gqa_causal"),
    pytest.param({"position": "rotary"}, lambda l: _self(l, causal=True), id="rotary_causal"),
]


@pytest.mark.parametrize(("options", "make_inputs"), CORE_CASES)
def test_compile_core(options: dict[str, Any], make_inputs: Callable[[int], Inputs]) -> None:
    graphs = _compiled_runs(_core(**options), make_inputs)
    assert 1 <= len(graphs) <= 3, f"{len(graphs)} compilations over {len(LENGTHS)} lengths"


def test_compile_through_aot_autograd() -> None:
    """Rotary, grouped-query heads and key padding, traced through AOTAutograd too (what inductor compiles)."""
    module = _core(position="rotary", num_kv_heads=2)
    graphs = _compiled_runs(module, lambda l: _self(l, key_padding_mask=_padding(l)), "aot_eager")
    assert 1 <= len(graphs) <= 3


def _decode_step(causal: bool) -> Callable[[torch.nn.Module], Callable[[int], Inputs]]:
    """One new token after a cache prefilled with ``length`` tokens (a fresh cache per call)."""

    def make(module: torch.nn.Module) -> Callable[[int], Inputs]:
        def inputs(length: int) -> Inputs:
            cache = selfattn.KVCache(max_len=16)
            x = _x(length)
            with torch.no_grad():
                module(x, x, x, causal=causal, cache=cache)
            token = _x(1)
            return (token, token, token), {"causal": causal, "cache": cache}

        return inputs

    return make


@pytest.mark.parametrize("causal", [False, pytest.param(True)], ids=["cache", "cache_causal"])
def test_compile_cache_decoding(causal: bool) -> None:
    module = _core(position="rotary")
    make = _decode_step(causal)(module)
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(module, dynamic=True, fullgraph=True, backend=counting_backend)
    for length in LENGTHS:
        (args, kwargs), (args2, kwargs2) = make(length), make(length)  # two caches in the same state
        with torch.no_grad():
            torch.testing.assert_close(compiled(*args2, **kwargs2), module(*args, **kwargs), atol=ATOL, rtol=0)
        assert kwargs2["cache"].length == length + 1
    assert 1 <= len(graphs) <= 3


NN_CASES: list[Any] = [
    pytest.param(
        {},
        lambda l: _self(
            l,
            attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(l),
            is_causal=True,
            need_weights=False,
        ),
        id="is_causal_hint",
    ),
    pytest.param(
        {"add_bias_kv": True, "add_zero_attn": True},
        lambda l: _self(l, key_padding_mask=_padding(l)),
        id="bias_kv_zero_attn_key_padding_mask",
    ),
    pytest.param({"position": "rotary"}, lambda l: _self(l, need_weights=False), id="rotary"),
    pytest.param({}, lambda l: _self(l, causal=True), id="causal_need_weights"),  # weights: the explicit path
    pytest.param({}, lambda l: _self(l, causal=True, need_weights=False), id="causal"),
]


@pytest.mark.parametrize(("options", "make_inputs"), NN_CASES)
def test_compile_nn_multihead(options: dict[str, Any], make_inputs: Callable[[int], Inputs]) -> None:
    torch.manual_seed(0)
    module = snn.MultiheadAttention(E, H, batch_first=True, **options).eval()
    graphs = _compiled_runs(module, make_inputs)
    assert 1 <= len(graphs) <= 3


EXPORT_CASES: list[Any] = [
    pytest.param({}, {}, id="plain"),
    pytest.param({"position": "alibi"}, {"causal": True}, id="alibi_causal"),
    pytest.param({"window": 3}, {"causal": True}, id="window_causal"),
    pytest.param({}, {"causal": True}, id="causal"),
    pytest.param({"position": "rotary", "num_kv_heads": 2}, {"causal": True}, id="rotary_gqa_causal"),
]


@pytest.mark.parametrize(("options", "kwargs"), EXPORT_CASES)
def test_export_dynamic_length(options: dict[str, Any], kwargs: dict[str, Any]) -> None:
    module = _core(**options)
    length = Dim("length", min=2, max=8192)  # past 2048: no guard on the length squared
    x = _x(5)
    dynamic = {"queries": {1: length}, "keys": {1: length}, "values": {1: length}} | dict.fromkeys(kwargs)
    program = export(module, (x, x, x), kwargs, dynamic_shapes=dynamic)
    for n in (3, 7, 12, 20):
        x = _x(n)
        with torch.no_grad():
            torch.testing.assert_close(
                program.module()(x, x, x, **kwargs), module(x, x, x, **kwargs), atol=ATOL, rtol=0
            )
