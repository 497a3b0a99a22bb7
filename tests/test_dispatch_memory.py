"""The dispatcher remembers the route of each kind of call; the route that runs is the one ``explain`` names.

Every row of tests/test_dispatch.py runs twice through the module (the second time from the
dispatcher's memory where the call's kind is remembered) and must run the route ``explain``
reports; decoding steps, which are what the memory is for, do the same with every option of
the decoding benchmark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from test_dispatch import ROWS, WINDOW_ROWS, D, H, _mha, _x

from selfattn import KVCache, MultiHeadAttention
from selfattn.core import dispatch
from selfattn.core.call import AttentionCall
from selfattn.core.route import Step
from selfattn.functional import attention
from selfattn.functional._attention import describe_attention
from selfattn.positional import build


class _Recorder:
    """The routes, each noting its name when it runs and counting the calls of its test."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.asked = 0

    def wrap(self, route: dispatch.Route) -> dispatch.Route:
        def run(call: AttentionCall) -> dispatch.Output:
            self.ran.append(route.name)
            return route.run(call)

        def declines(call: AttentionCall) -> str | None:
            self.asked += 1
            return route.declines(call)

        def step_for(call: AttentionCall, causal: bool) -> Step | None:
            assert route.step_for is not None
            step = route.step_for(call, causal)
            if step is None:
                return None

            def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                self.ran.append(route.name)
                return step(q, k, v)

            return recorded

        made = None if route.step_for is None else step_for
        return dataclasses.replace(route, run=run, declines=declines, step_for=made)


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    recording = _Recorder()
    with mock.patch.object(dispatch, "ROUTES", tuple(recording.wrap(route) for route in dispatch.ROUTES)):
        yield recording


def _runs_as_explained(recording: _Recorder, mha: MultiHeadAttention, x: torch.Tensor, **kwargs: object) -> str:
    expected = mha.explain(x, x, x, **kwargs).route
    for _ in range(2):  # the second call finds its kind remembered
        recording.ran.clear()
        mha(x, x, x, **kwargs)
        assert recording.ran == [expected]
    return expected


@pytest.mark.parametrize(("factory", "kwargs", "expected"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_every_module_row_runs_the_route_explain_names(recorder, factory, kwargs, expected):
    assert _runs_as_explained(recorder, factory(), _x(12), **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "length", "expected"), [row[1:] for row in WINDOW_ROWS], ids=[row[0] for row in WINDOW_ROWS]
)
def test_every_window_row_runs_the_route_explain_names(recorder, kwargs, length, expected):
    assert _runs_as_explained(recorder, _mha(window=3), _x(length), **kwargs) == expected


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"return_weights": True},
        {"dropout_p": 0.1},
        {"softcap": 5.0},
        {"sinks": torch.zeros(H)},
        {"causal": True, "softcap": 5.0, "sinks": torch.zeros(H)},
    ],
    ids=["plain", "causal", "weights", "dropout", "softcap", "sinks", "causal softcap sinks"],
)
@pytest.mark.parametrize("num_queries", [1, 12])
def test_functional_calls_run_the_route_explain_names(recorder, options, num_queries):
    q, k = torch.randn(2, H, num_queries, 8), torch.randn(2, H, 12, 8)
    expected = dispatch.explain(describe_attention(q, k, k, **options)).route
    for _ in range(2):
        recorder.ran.clear()
        attention(q, k, k, **options)
        assert recorder.ran == [expected]


DECODING_LAYERS = {
    "plain": lambda: MultiHeadAttention(D, 4, num_kv_heads=2, position=build("rotary", num_hiddens=D, num_heads=4)),
    "sinks": lambda: MultiHeadAttention(D, 4, num_kv_heads=2, sinks=True),
    "softcap": lambda: MultiHeadAttention(D, 4, num_kv_heads=2, softcap=5.0),
    "alibi": lambda: MultiHeadAttention(D, 4, num_kv_heads=2, position=build("alibi", num_hiddens=D, num_heads=4)),
    "t5": lambda: MultiHeadAttention(D, 4, position=build("t5", num_hiddens=D, num_heads=4)),
}


@pytest.mark.parametrize("name", list(DECODING_LAYERS))
def test_decoding_steps_run_the_route_explain_names(recorder, name):
    mha = DECODING_LAYERS[name]().eval()
    cache = KVCache(max_len=16)
    with torch.no_grad():
        mha(_x(8, batch=1), _x(8, batch=1), _x(8, batch=1), cache=cache, causal=True)
        for _ in range(3):
            step = _x(1, batch=1)
            expected = mha.explain(step, step, step, cache=cache, causal=True).route
            recorder.ran.clear()
            mha(step, step, step, cache=cache, causal=True)
            assert recorder.ran == [expected]


def test_a_decoding_step_asks_no_route_once_its_kind_is_known(recorder, monkeypatch):
    """The plain decoding step's kind is remembered: later steps run the fused kernel without asking the routes."""
    monkeypatch.setattr(dispatch, "VERIFY_REMEMBERED_CHOICES", False)  # the suite's check would ask them all again
    mha = DECODING_LAYERS["plain"]().eval()
    cache = KVCache(max_len=16)
    with torch.no_grad():
        mha(_x(8, batch=1), _x(8, batch=1), _x(8, batch=1), cache=cache, causal=True)
        step = _x(1, batch=1)
        mha(step, step, step, cache=cache, causal=True)  # the kind of the step, chosen in full once
        recorder.asked = 0
        mha(step, step, step, cache=cache, causal=True)
    assert recorder.ran[-1] == "fused"
    assert recorder.asked == 0


def test_a_wrong_memory_is_caught_while_tests_verify(monkeypatch):
    """With VERIFY_REMEMBERED_CHOICES (the suite sets it) a remembered route that the full choice contradicts raises."""
    monkeypatch.setattr(dispatch, "VERIFY_REMEMBERED_CHOICES", True)
    q = torch.randn(1, H, 1, 8)
    call = describe_attention(q, q, q)
    kind = dispatch._kind(call)
    assert kind is not None
    routes = dispatch.ROUTES
    monkeypatch.setitem(dispatch._CHOSEN, id(routes), (routes, {kind: dispatch.EXPLICIT}))
    with pytest.raises(AssertionError, match="remembered route 'explicit' for a call that takes 'fused'"):
        dispatch.run(describe_attention(q, q, q))


def test_calls_with_rules_or_terms_are_not_remembered():
    """Only calls whose route the kind's facts decide are remembered: a window, valid lengths or a term are read each time."""
    q = torch.randn(1, H, 12, 8)
    assert dispatch._kind(describe_attention(q, q, q, causal=True)) is not None  # causal on a square
    assert dispatch._kind(describe_attention(q, q, q, mask=torch.ones(12, 12, dtype=torch.bool))) is None
    assert dispatch._kind(describe_attention(q[..., :3, :], q, q, causal=True)) is None  # hides keys, not square


def test_a_plain_functional_call_is_described_once_per_signature(monkeypatch):
    """attention(q, k, v) with nothing else, or causal on a square: the second call of a signature runs the remembered
    route's step form without describing itself, equal to the first; a new signature (threads, grad mode, shapes)
    is described, and so is each causal call with more keys than queries."""
    import selfattn.functional._attention as functional_attention

    monkeypatch.setattr(functional_attention, "_PLAIN_CALLS", {})
    q, k = torch.randn(2, H, 1, 8), torch.randn(2, H, 600, 8)
    described = []
    real = functional_attention.describe_attention
    monkeypatch.setattr(
        functional_attention, "describe_attention", lambda *a, **kw: described.append(kw) or real(*a, **kw)
    )
    monkeypatch.setattr(dispatch, "VERIFY_REMEMBERED_CHOICES", False)
    with torch.no_grad():
        first = attention(q, k, k, causal=True)
        second = attention(q, k, k, causal=True)
        assert len(described) == 1 and torch.equal(first, second)
        attention(q, k, k, causal=True, scale=0.5)  # another scale: another signature
        assert len(described) == 2
        monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # the split-keys route's choice reads the threads
        attention(q, k, k, causal=True)
        assert len(described) == 3
    attention(q, k, k, causal=True)  # grad mode on: another signature
    assert len(described) == 4
    square = torch.randn(2, H, 5, 8)
    first = attention(square, square, square, causal=True)
    second = attention(square, square, square, causal=True)  # the causal rule on a square: the kernel's own
    assert len(described) == 5 and torch.equal(first, second)
    fewer = square[:, :, 2:]
    attention(fewer, square, square, causal=True)
    attention(fewer, square, square, causal=True)  # lower-right on 3 x 5: a rule the kernel cannot state, described
    assert len(described) == 7


def test_a_remembered_causal_square_keeps_its_answer_and_gradients():
    """The causal square's step form, from the second call on: the float64 formula's output and gradients."""
    q, k, v = (torch.randn(2, H, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    hidden = torch.ones(6, 6, dtype=torch.bool).triu(1)
    for _ in range(2):
        out = attention(q, k, v, causal=True)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        weights = torch.softmax((q @ k.transpose(-1, -2) / 8**0.5).masked_fill(hidden, float("-inf")), dim=-1)
        wanted = weights @ v
        torch.testing.assert_close(out, wanted, atol=1e-12, rtol=1e-12)
        for grad, want in zip(grads, torch.autograd.grad((wanted * wanted).sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(grad, want, atol=1e-12, rtol=1e-12)


def test_a_plain_functional_call_keeps_its_gradients_and_errors():
    q = torch.randn(2, H, 1, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, H, 9, 8, dtype=torch.float64, requires_grad=True)
    for _ in range(2):  # the second call from the memory
        out = attention(q, k, k)
        (grad_q, grad_k) = torch.autograd.grad(out.sum(), (q, k))
        weights = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)
        want_q, want_k = torch.autograd.grad((weights @ k).sum(), (q, k))
        torch.testing.assert_close(out, weights @ k, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grad_q, want_q, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(grad_k, want_k, atol=1e-12, rtol=1e-12)
    for bad in (-1.0, float("nan")):
        for _ in range(2):  # never remembered: raised each time
            with pytest.raises(ValueError, match="scale"):
                attention(q, k, k, scale=bad)
