"""Differential fuzz over sequences of calls: what a call leaves behind (a plan, a remembered route) never changes
the answer of a later call.

Three places keep state between calls so that the next call of the same kind skips its checks: the transformers
backend's step plans (:mod:`selfattn.integrations._hf_plan`), :func:`selfattn.functional.attention`'s plain calls
and :class:`~selfattn.MultiHeadAttention`'s decoding plans (:mod:`selfattn._decode_plan`). Each test here draws a
sequence of calls that changes one thing or a few between them (shapes, dtype, grad mode, autocast, options,
keywords, a mask, weights wanted, a NaN or an infinity in the query, the layer's weights in place, ``train()``, a
new cache) and asks, call by call, for the answer the same call gets with no state behind it: the same bits (NaN
where NaN), the same gradient, or the same error.

CI runs the derandomized ``ci`` profile (tests/conftest.py); ``--hypothesis-profile=deep`` draws many more.

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, d head size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfattn._decode_plan as decode_plan
import selfattn.functional._attention as functional_attention
from selfattn import KVCache, MultiHeadAttention
from selfattn.core import dispatch
from selfattn.functional import attention
from selfattn.positional import build

transformers = pytest.importorskip("transformers")

import selfattn.integrations.transformers as backend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: One sink tensor per number of heads, the same objects in every call (a layer's parameter is).
SINKS = {h: torch.linspace(-1.0, 1.0, h) for h in (2, 4)}


def _outcome(run: Callable[[], Any]) -> tuple[str, Any]:
    """``("error", (type, message))`` or ``("value", what run returned)``."""
    try:
        return "value", run()
    except (ValueError, RuntimeError) as error:
        return "error", (type(error), str(error))


def _mixed(heads: list[torch.Tensor], fields: dict[str, Any]) -> list[torch.Tensor]:
    """``heads`` with the one that ``fields["mixed_dtype"]`` names (0, 1, 2: q, k, v) in the other float dtype."""
    which = fields["mixed_dtype"]
    if which is not None:
        heads[which] = heads[which].to(torch.float64 if heads[which].dtype == torch.float32 else torch.float32)
    return heads


@contextlib.contextmanager
def _verifying(verify: bool) -> Iterator[None]:
    """Remembered choices asked again (as the rest of the suite runs) or trusted (as users run)."""
    previous, dispatch.VERIFY_REMEMBERED_CHOICES = dispatch.VERIFY_REMEMBERED_CHOICES, verify
    try:
        yield
    finally:
        dispatch.VERIFY_REMEMBERED_CHOICES = previous


VERIFY = pytest.mark.parametrize("verify", [True, False], ids=["routes asked again", "plans trusted"])


def _assert_same(got: tuple[str, Any], expected: tuple[str, Any], where: str) -> None:
    assert got[0] == expected[0], f"{where}: {got} against {expected}"
    if got[0] == "error":
        assert got[1] == expected[1], where
        return
    for a, b in zip(got[1], expected[1], strict=True):
        if a is None or b is None:
            assert a is None and b is None, where
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")


# ------------------------------------------------------------------------------- the transformers backend


class _Layer(torch.nn.Module):
    """What the attention functions read off a model's attention layer."""

    is_causal = True


#: What a backend call is made of, each drawn from its list: the first call draws all, each later call redraws
#: one or none (most later calls keep the kind of the one before, as a model's decoding steps do; the cache grows
#: by one).
BACKEND_FIELDS: dict[str, list[Any]] = {
    "queries": [1, 1, 1, 3],
    "prefill_keys": [3, 3, 5],  # keys of a call of 3 queries (5: a cache's, no plan serves it)
    "heads": [(4, 2), (4, 2), (2, 2), (4, 1)],
    "d": [8, 8, 5],
    "dtype": [torch.float32, torch.float32, torch.float64],
    "mixed_dtype": [None, None, None, 0, 1, 2],  # q, k or v alone in the other dtype: a call that is refused
    "scaling": [None, None, 0.3],
    "softcap": [None, None, 5.0],
    "sliding_window": [None, None, 2, 50],
    "is_causal": [None, None, False],
    "layer_causal": [True, True, False],  # the layer's own is_causal, read where the call gives None
    "sinks": [False, False, True],
    "output_attentions": [False, False, False, True],
    "extra": [{}, {"use_cache": True}, {"mystery": None}, {"mystery": torch.ones(3)}, {"bogus": 2}],
    "mask": [False, False, False, True],  # a bool mask, sometimes hiding every key of a row
    "grad": [False, True],
    "wants_grad": [False, True],
    "autocast": [False, False, False, True],  # CPU autocast to bfloat16 around the call
    "special": [None, None, None, float("nan"), float("inf"), float("-inf")],  # in one query entry
}


@st.composite
def backend_sequences(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Calls of ``attention_forward`` on one layer: each a dict of :data:`BACKEND_FIELDS`, keys ``lk`` and ``seed``."""
    fields = {name: draw(st.sampled_from(choices)) for name, choices in BACKEND_FIELDS.items()}
    fields |= {"lk": draw(st.integers(1, 16)), "seed": 0}
    calls = []
    for i in range(draw(st.integers(2, 8))):
        if i:
            changed = draw(st.sampled_from([None, *BACKEND_FIELDS]))  # one field at most: the rest keeps the kind
            if changed is not None:
                fields[changed] = draw(st.sampled_from(BACKEND_FIELDS[changed]))
            fields["lk"] = fields["lk"] + 1 if draw(st.integers(0, 3)) else draw(st.integers(1, 20))
        fields["seed"] = draw(st.integers(0, 2**16))
        calls.append(dict(fields))
    return calls


def _backend_call(fields: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, dict[str, Any]]:
    """``((q, k, v), mask, keywords)`` of one drawn call."""
    lq, (heads, kv_heads), d = fields["queries"], fields["heads"], fields["d"]
    lk = fields["lk"] if lq == 1 else fields["prefill_keys"]
    gen = torch.Generator().manual_seed(fields["seed"])
    sizes = ((heads, lq), (kv_heads, lk), (kv_heads, lk))
    q, k, v = _mixed(
        [torch.randn(2, n, length, d, generator=gen, dtype=fields["dtype"]) for n, length in sizes], fields
    )
    if fields["special"] is not None:
        q[1, heads - 1, -1, d // 2] = fields["special"]
    mask = torch.rand(2, 1, lq, lk, generator=gen) > 0.4 if fields["mask"] else None
    keywords = {
        name: fields[name] for name in ("scaling", "softcap", "sliding_window", "is_causal", "output_attentions")
    }
    return (q, k, v), mask, keywords | {"s_aux": SINKS[heads] if fields["sinks"] else None} | fields["extra"]


def _backend_outcome(module: torch.nn.Module, fields: dict[str, Any]) -> tuple[str, Any]:
    module.is_causal = fields["layer_causal"]
    heads, mask, keywords = _backend_call(fields)
    wants = fields["grad"] and fields["wants_grad"]
    q, k, v = (t.requires_grad_(wants) for t in heads)

    def run() -> tuple[torch.Tensor | None, ...]:
        with torch.set_grad_enabled(fields["grad"]), torch.autocast("cpu", torch.bfloat16, enabled=fields["autocast"]):
            out, weights = backend.attention_forward(module, q, k, v, mask, **keywords)
        grad = None
        if out.requires_grad:
            out.backward(torch.ones_like(out))
            grad = q.grad
        return out.detach(), None if weights is None else weights.detach(), grad

    return _outcome(run)


@VERIFY
@settings(max_examples=max(settings().max_examples, 120))  # a change that keeps the kind is a narrow draw
@given(calls=backend_sequences())
def test_a_backend_layers_earlier_calls_never_change_a_later_answer(calls, verify):
    """Each call of one layer (plans made and replayed) against the same call of a layer never called before."""
    layer = _Layer()
    with _verifying(verify):
        for i, fields in enumerate(calls):
            _assert_same(_backend_outcome(layer, fields), _backend_outcome(_Layer(), fields), f"call {i}: {fields}")


def _single_changes(fields: dict[str, list[Any]], base: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` for each field of ``base`` and each of its other values (once each: the lists repeat
    values to weigh the random draws)."""
    for name, choices in fields.items():
        seen = [base[name]]
        for value in choices:
            if not any(value is old or (type(value) is type(old) and value == old) for old in seen):
                seen.append(value)
                yield name, value


@st.composite
def plannable_calls(draw: st.DrawFn) -> dict[str, Any]:
    """A backend call that a plan serves (no mask, no weights wanted, finite heads, no refused keyword)."""
    plannable = {
        "mask": [False], "output_attentions": [False], "special": [None], "mixed_dtype": [None],
        "extra": BACKEND_FIELDS["extra"][:3],
    }  # fmt: skip
    fields = {name: draw(st.sampled_from(plannable.get(name, choices))) for name, choices in BACKEND_FIELDS.items()}
    return fields | {"lk": draw(st.integers(2, 16)), "seed": draw(st.integers(0, 2**16))}


@VERIFY
@given(base=plannable_calls())
def test_one_change_after_a_planned_call_gives_a_fresh_layers_answer(base, verify):
    """Every single change of a planned call, each field to each of its other values (the keys one more, as a
    decoding step's), on the layer that planned it, against the changed call on a layer never called before:
    a fact that a plan's kind misses shows up here without waiting for a random sequence to draw it."""
    with _verifying(verify):
        for name, value in _single_changes(BACKEND_FIELDS, base):
            layer = _Layer()
            _backend_outcome(layer, base)  # in full: the plan is made
            _backend_outcome(layer, base | {"lk": base["lk"] + 1})  # replayed
            changed = base | {name: value, "lk": base["lk"] + 2, "seed": base["seed"] + 1}
            _assert_same(_backend_outcome(layer, changed), _backend_outcome(_Layer(), changed), f"{name}={value}")


# ------------------------------------------------------------------------------- functional attention


#: What a plain call of :func:`attention` is made of (nothing but heads, ``causal`` and ``scale``: what it
#: remembers), each drawn from its list.
PLAIN_FIELDS: dict[str, list[Any]] = {
    "queries": [1, 1, 4],
    "extra_keys": [0, 0, 3, 16],  # keys beyond the queries
    "heads": [(4, 2), (2, 2), (4, 1), (1, 1)],
    "d": [8, 5],
    "dtype": [torch.float32, torch.float32, torch.float64],
    "mixed_dtype": [None, None, None, 0, 1, 2],  # q, k or v alone in the other dtype: a call that is refused
    "strided": [False, False, False, True],  # the query heads laid out (b, lq, h, d): the same shapes
    "causal": [False, True],
    "scale": [None, None, 0.3],
    "grad": [False, True],
    "wants_grad": [False, True],
    "special": [None, None, None, float("nan"), float("inf"), float("-inf")],  # in one query entry
}


def _plain_outcome(fields: dict[str, Any]) -> tuple[str, Any]:
    lq, (heads, kv_heads), d = fields["queries"], fields["heads"], fields["d"]
    gen = torch.Generator().manual_seed(fields["seed"])
    sizes = ((heads, lq), (kv_heads, lq + fields["extra_keys"]), (kv_heads, lq + fields["extra_keys"]))
    q, k, v = _mixed(
        [torch.randn(2, n, length, d, generator=gen, dtype=fields["dtype"]) for n, length in sizes], fields
    )
    if fields["special"] is not None:
        q[1, heads - 1, -1, d // 2] = fields["special"]
    if fields["strided"]:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    q.requires_grad_(fields["grad"] and fields["wants_grad"])

    def run() -> tuple[torch.Tensor | None, ...]:
        with torch.set_grad_enabled(fields["grad"]):
            out = attention(q, k, v, causal=fields["causal"], scale=fields["scale"])
        grad = None
        if out.requires_grad:
            out.backward(torch.ones_like(out))
            grad = q.grad
        return out.detach(), grad

    return _outcome(run)


def _fresh_plain_outcome(fields: dict[str, Any]) -> tuple[str, Any]:
    """The call with nothing remembered, and nothing kept after it: the full path."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional_attention, "_PLAIN_CALLS", {})
        patch.setattr(functional_attention, "_remember_plain_call", lambda *args: None)
        return _plain_outcome(fields)


@st.composite
def plain_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A plain call: a value of each of :data:`PLAIN_FIELDS`, and a seed."""
    fields = {name: draw(st.sampled_from(choices)) for name, choices in PLAIN_FIELDS.items()}
    return fields | {"seed": draw(st.integers(0, 2**16))}


@VERIFY
@given(calls=st.lists(plain_fields(), min_size=2, max_size=8))
def test_a_plain_calls_remembered_route_never_changes_a_later_answer(calls, verify):
    """Each plain call (remembered, then run from memory: the memory is the process's, so earlier tests' calls
    are in it too) against the same call with nothing remembered."""
    with _verifying(verify):
        for i, fields in enumerate(calls):
            _assert_same(_plain_outcome(fields), _fresh_plain_outcome(fields), f"call {i}: {fields}")


@VERIFY
@given(base=plain_fields())
def test_one_change_after_a_remembered_plain_call_gives_the_full_paths_answer(base, verify):
    """Every single change of a remembered plain call, each field to each of its other values, against the
    changed call with nothing remembered."""
    base = base | {"special": None, "mixed_dtype": None}  # a call that is remembered; the change may alter it
    with _verifying(verify):
        for name, value in _single_changes(PLAIN_FIELDS, base):
            _plain_outcome(base)  # in full: remembered
            _plain_outcome(base | {"seed": base["seed"] + 1})  # from memory
            changed = base | {name: value, "seed": base["seed"] + 2}
            _assert_same(_plain_outcome(changed), _fresh_plain_outcome(changed), f"{name}={value}")


# ------------------------------------------------------------------------------- a layer's decoding plans

D, H = 16, 4

LAYERS: dict[str, Callable[[], MultiHeadAttention]] = {
    "rotary gqa": lambda: MultiHeadAttention(
        D, H, num_kv_heads=2, position=build("rotary", num_hiddens=D, num_heads=H)
    ),
    "sinks softcap": lambda: MultiHeadAttention(D, H, num_kv_heads=2, sinks=True, softcap=5.0),
    "sinks": lambda: MultiHeadAttention(D, H, num_kv_heads=2, sinks=True),
    "alibi": lambda: MultiHeadAttention(D, H, position=build("alibi", num_hiddens=D, num_heads=H)),
    "qk_norm gate": lambda: MultiHeadAttention(D, H, qk_norm=True, gated_output=True),
}

#: What may happen before a decoding step: nothing (mostly), or one change of the layer or of the step.
EVENTS = [
    "step", "step", "step", "step", "weights in place", "train", "eval", "grad mode", "float64", "nan", "new cache",
]  # fmt: skip


def _decode(layer: MultiHeadAttention, tokens: torch.Tensor, events: list[str]) -> list[tuple[str, Any]]:
    """The prompt (tokens[:, :3]) in one call, then a step per event (a change first, where the event is one)."""
    cache = KVCache(max_len=tokens.shape[1] + 1)
    prompt = tokens[:, :3]
    outcomes = [_outcome(lambda: (layer(prompt, prompt, prompt, cache=cache, causal=True),))]
    grad, dtype = False, torch.float32
    for i, event in enumerate(events):
        step = tokens[:, 3 + i : 4 + i].to(dtype)
        if event == "weights in place":
            with torch.no_grad():
                for parameter in layer.parameters():
                    parameter.mul_(1.25).add_(0.01)
        elif event in ("train", "eval"):
            layer.train(event == "train")
        elif event == "grad mode":
            grad = not grad
        elif event == "float64":
            layer, dtype, cache = layer.double(), torch.float64, KVCache(max_len=tokens.shape[1] + 1)
            step = step.double()
        elif event == "new cache":  # a new sequence with no prompt: its first step has no earlier key
            cache = KVCache(max_len=tokens.shape[1] + 1)
        elif event == "nan":
            step = step.clone()
            step[0, 0, 1] = float("nan")
        with torch.set_grad_enabled(grad):
            run = functools.partial(layer, step, step, step, cache=cache, causal=True)
            outcomes.append(_outcome(lambda run=run: (run().detach(),)))
    return outcomes


@VERIFY
@pytest.mark.parametrize("name", list(LAYERS))
@given(events=st.lists(st.sampled_from(EVENTS), min_size=2, max_size=9), seed=st.integers(0, 2**16))
def test_a_layers_decoding_plan_never_changes_a_later_step(name, events, seed, verify):
    """A layer decoding with plans against a copy of it decoding every step in full, through the same events.
    The layers have no dropout, so ``train()`` changes the kind of the steps, not their answer."""
    torch.manual_seed(seed)
    layer = LAYERS[name]().eval()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))  # the sinks and norms away from their initial values
    full = copy.deepcopy(layer)
    tokens = torch.randn(2, 3 + len(events), D)
    with _verifying(verify):
        planned = _decode(layer, tokens, events)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_plan, "ENABLED", False)
        expected = _decode(full, tokens, events)
    for i, (got, want) in enumerate(zip(planned, expected, strict=True)):
        _assert_same(got, want, f"call {i} ({['prompt', *events][i]})")
