"""A layer's decoding plan (selfattn._decode_plan): replayed steps equal the full path, and any change of kind drops it.

Each comparison runs the same layer twice from the same state: once with plans (the steps after the
first replay the plan) and once with ``_decode_plan.ENABLED`` off (every step in full), and asks for
equal bits. The drop tests check that the plan is gone after the change and that the next step equals
a layer built with the new setting from the start.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

import selfattn._decode_plan as decode_plan
import selfattn.core.dispatch as dispatch
from selfattn import KVCache, MultiHeadAttention
from selfattn.models import TransformerLM
from selfattn.positional import build

D, H = 32, 4


def _rotary() -> torch.nn.Module:
    return build("rotary", num_hiddens=D, num_heads=H)


LAYERS: dict[str, Callable[[], MultiHeadAttention]] = {
    "rotary gqa": lambda: MultiHeadAttention(D, H, num_kv_heads=2, position=_rotary()),
    "no encoding": lambda: MultiHeadAttention(D, H),
    "sinks": lambda: MultiHeadAttention(D, H, num_kv_heads=2, sinks=True, position=_rotary()),
    "softcap": lambda: MultiHeadAttention(D, H, num_kv_heads=2, softcap=5.0, position=_rotary()),
    "qk_norm and gate (parts)": lambda: MultiHeadAttention(D, H, qk_norm=True, gated_output=True, position=_rotary()),
    "values from keys": lambda: MultiHeadAttention(D, H, values_from_keys=True),
    "xpos": lambda: MultiHeadAttention(D, H, position=build("xpos", num_hiddens=D, num_heads=H)),
    "alibi gqa (a key-only score term)": lambda: MultiHeadAttention(
        D, H, num_kv_heads=2, position=build("alibi", num_hiddens=D, num_heads=H)
    ),
    # The window hides nothing while the cache is short, then hides the oldest keys: a step's kind changes.
    "window 6": lambda: MultiHeadAttention(D, H, num_kv_heads=2, window=6, position=_rotary()),
    "chunks of 6": lambda: MultiHeadAttention(D, H, chunk_size=6, position=_rotary()),
}

CACHES: dict[str, Callable[[], KVCache]] = {
    "preallocated": lambda: KVCache(max_len=32),
    "window + sink tokens": lambda: KVCache(window=6, sink_tokens=2),
}


def _steps(layer: MultiHeadAttention, cache: KVCache, tokens: torch.Tensor, **kwargs: object) -> list[torch.Tensor]:
    """The prompt (tokens[:, :5]) in one call, then one call per token."""
    outs = [layer(tokens[:, :5], tokens[:, :5], tokens[:, :5], cache=cache, causal=True)]
    for i in range(5, tokens.shape[1]):
        step = tokens[:, i : i + 1]
        outs.append(layer(step, step, step, cache=cache, causal=True, **kwargs))
    return outs


def _with_and_without_plans(
    monkeypatch: pytest.MonkeyPatch, make_layer: Callable[[], MultiHeadAttention], make_cache: Callable[[], KVCache],
    grad: bool = False, **kwargs: object,
) -> tuple[list[torch.Tensor], list[torch.Tensor], MultiHeadAttention]:  # fmt: skip
    torch.manual_seed(0)
    layer = make_layer().eval()
    with torch.no_grad():
        if layer.sinks is not None:
            layer.sinks.normal_()
    tokens = torch.randn(2, 12, D)
    full_layer = copy.deepcopy(layer)
    with torch.set_grad_enabled(grad):
        planned = _steps(layer, make_cache(), tokens, **kwargs)
        monkeypatch.setattr(decode_plan, "ENABLED", False)
        full = _steps(full_layer, make_cache(), tokens, **kwargs)
        monkeypatch.setattr(decode_plan, "ENABLED", True)
    return planned, full, layer


@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("name", list(LAYERS))
def test_replayed_steps_equal_the_full_path(monkeypatch, name, cache_name):
    if cache_name != "preallocated" and name in ("window 6", "chunks of 6"):
        pytest.skip("a layer with a window or chunks refuses a cache with sink tokens")
    planned, full, layer = _with_and_without_plans(monkeypatch, LAYERS[name], CACHES[cache_name])
    if name not in ("window 6", "chunks of 6"):  # those must run every step in full
        assert decode_plan.plan_of(layer) is not None, "the steps made no plan: the comparison would test nothing"
    for step, (a, b) in enumerate(zip(planned, full, strict=True)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a - b).abs().max().item()}"


@pytest.mark.parametrize("name", ["softcap", "sinks"])
def test_a_softcap_or_sinks_step_in_grad_mode_is_described_and_equals_the_full_path(monkeypatch, name):
    """In grad mode the decoding step's kind does not say whether the sinks or the heads want a gradient: no step
    form (the routes' own autograd paths run), and the gradient reaches the sinks as on the full path."""
    planned, full, layer = _with_and_without_plans(monkeypatch, LAYERS[name], CACHES["preallocated"], grad=True)
    plan = decode_plan.plan_of(layer)
    assert plan is not None and plan.step is None
    for a, b in zip(planned, full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    planned[-1].sum().backward()
    assert layer.W_q.weight.grad is not None and (layer.sinks is None or layer.sinks.grad is not None)


def test_replayed_steps_with_an_offset_and_under_grad_equal_the_full_path(monkeypatch):
    planned, full, layer = _with_and_without_plans(monkeypatch, LAYERS["rotary gqa"], CACHES["preallocated"], grad=True)
    assert decode_plan.plan_of(layer) is not None
    for a, b in zip(planned, full, strict=True):
        assert torch.equal(a.detach(), b.detach())
    planned[-1].sum().backward()  # the replayed step's graph reaches the weights
    assert layer.W_q.weight.grad is not None


def test_a_replayed_step_runs_no_full_path(monkeypatch):
    """After the first step of a kind, the next runs without describing the call (the plan is used at all)."""
    layer, cache = LAYERS["rotary gqa"]().eval(), KVCache(max_len=16)
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        layer(x[:, :4], x[:, :4], x[:, :4], cache=cache, causal=True)
        step = x[:, 4:5]
        layer(step, step, step, cache=cache, causal=True)  # in full: the plan is made

        def refuse(*args: object) -> None:
            raise AssertionError("the full path ran")

        monkeypatch.setattr(decode_plan, "describe", refuse)
        step = x[:, 5:6]
        layer(step, step, step, cache=cache, causal=True)
    assert cache.length == 6


def _decoded(layer: MultiHeadAttention, steps: int = 3) -> tuple[MultiHeadAttention, KVCache, torch.Tensor]:
    """``layer`` after a prompt and ``steps`` tokens (so it holds a plan), its cache, and a next token."""
    torch.manual_seed(1)
    cache, x = KVCache(max_len=32), torch.randn(1, 4 + steps + 1, D)
    with torch.no_grad():
        layer(x[:, :4], x[:, :4], x[:, :4], cache=cache, causal=True)
        for i in range(4, 4 + steps):
            step = x[:, i : i + 1]  # one tensor as queries, keys and values: self-attention, as decoders pass it
            layer(step, step, step, cache=cache, causal=True)
    assert decode_plan.plan_of(layer) is not None
    return layer, cache, x[:, -1:]


def test_a_mask_drops_the_plan():
    layer, cache, x = _decoded(LAYERS["rotary gqa"]().eval())
    with torch.no_grad():
        layer(x, x, x, cache=cache, causal=True, attn_mask=torch.ones(1, cache.length + 1, dtype=torch.bool))
    assert decode_plan.plan_of(layer) is None


def test_a_new_dtype_drops_the_plan_and_the_step_runs_in_it():
    layer, _, x = _decoded(LAYERS["rotary gqa"]().eval())
    layer.double()
    assert decode_plan.plan_of(layer) is None
    with torch.no_grad():
        out = layer(x.double(), x.double(), x.double(), cache=KVCache(max_len=4), causal=True)
    assert out.dtype == torch.float64


def test_training_drops_the_plan():
    layer, _, _ = _decoded(LAYERS["rotary gqa"]().eval())
    layer.train()
    assert decode_plan.plan_of(layer) is None


def _next_steps(layer: MultiHeadAttention, cache: KVCache, x: torch.Tensor) -> list[torch.Tensor]:
    """Two more steps: the first in full after a drop, the second replayed from the plan it makes (if any)."""
    with torch.no_grad():
        y = -x
        return [layer(x, x, x, cache=cache, causal=True), layer(y, y, y, cache=cache, causal=True)]


@pytest.mark.parametrize(
    ("setting", "value"),
    [("softcap", 5.0), ("scale", 0.1), ("position", None), ("position", "alibi"), ("window", 2), ("dropout", 0.5)],
    ids=["softcap", "scale", "no encoding", "new encoding", "window", "dropout (eval: unused)"],
)
def test_a_setting_changed_drops_the_plan_and_the_next_steps_follow_it(monkeypatch, setting, value):
    layer, cache, x = _decoded(LAYERS["rotary gqa"]().eval())
    twin, twin_cache = copy.deepcopy(layer), cache.copy()
    if value == "alibi":
        value = build("alibi", num_hiddens=D, num_heads=H)
    setattr(layer, setting, value)
    assert decode_plan.plan_of(layer) is None
    setattr(twin, setting, copy.deepcopy(value))
    planned = _next_steps(layer, cache, x)
    monkeypatch.setattr(decode_plan, "ENABLED", False)
    full = _next_steps(twin, twin_cache, x)
    for a, b in zip(planned, full, strict=True):
        assert torch.equal(a, b)


def test_a_part_setting_changed_is_followed_by_the_next_step(monkeypatch):
    """A part's own attribute is read by each replayed step (the plan calls the part): the next step follows it."""
    layer, cache, x = _decoded(LAYERS["qk_norm and gate (parts)"]().eval())
    twin, twin_cache = copy.deepcopy(layer), cache.copy()
    layer.q_norm.eps = twin.q_norm.eps = 0.5
    planned = _next_steps(layer, cache, x)
    monkeypatch.setattr(decode_plan, "ENABLED", False)
    full = _next_steps(twin, twin_cache, x)
    for a, b in zip(planned, full, strict=True):
        assert torch.equal(a, b)


def test_a_cache_holding_padding_is_not_replayed(monkeypatch):
    """A cache that stored padding is another kind (its visibility reads the padding): the step runs in full."""
    layer, _, _ = _decoded(LAYERS["rotary gqa"]().eval())
    twin = copy.deepcopy(layer)
    pair, padding = torch.randn(1, 3, D), torch.tensor([[True, False, False]])
    outs = []
    for model in (layer, twin):
        cache = KVCache(max_len=8)
        with torch.no_grad():
            model(pair, pair, pair, cache=cache, causal=True, key_padding_mask=padding)
            outs.append(_next_steps(model, cache, pair[:, 1:2]))
        monkeypatch.setattr(decode_plan, "ENABLED", False)
    assert decode_plan.plan_of(layer) is None
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_a_replaced_route_list_voids_the_plan(monkeypatch):
    layer, cache, x = _decoded(LAYERS["rotary gqa"]().eval())
    ran: list[str] = []

    def wrap(route: dispatch.Route) -> dispatch.Route:
        def run(call: object) -> dispatch.Output:
            ran.append(route.name)
            return route.run(call)  # type: ignore[arg-type]

        return dataclasses.replace(route, run=run)

    monkeypatch.setattr(dispatch, "ROUTES", tuple(wrap(route) for route in dispatch.ROUTES))
    with torch.no_grad():
        layer(x, x, x, cache=cache, causal=True)
    assert ran == ["fused"]


def test_transformer_lm_generates_the_same_tokens_with_plans(monkeypatch):
    torch.manual_seed(0)
    model = TransformerLM(50, D, H, 2, position="rotary", max_len=40).eval()
    prompt = torch.randint(0, 50, (2, 5))
    planned = model.generate(prompt, 12)
    monkeypatch.setattr(decode_plan, "ENABLED", False)
    full = model.generate(prompt, 12)
    assert torch.equal(planned, full)
    assert all(decode_plan.plan_of(block.attention) is None for block in model.blocks)  # ENABLED off: every step full


def test_a_copy_of_a_layer_carries_no_plan():
    """Plans live beside the layers: a copied (or pickled) layer starts without one and makes its own."""
    layer, cache, x = _decoded(LAYERS["rotary gqa"]().eval())
    twin, twin_cache = copy.deepcopy(layer), cache.copy()
    assert decode_plan.plan_of(twin) is None
    with torch.no_grad():
        assert torch.equal(layer(x, x, x, cache=cache, causal=True), twin(x, x, x, cache=twin_cache, causal=True))


def test_a_one_head_layer_keeps_no_plan_and_takes_split_keys_where_the_cache_grows_long_enough(monkeypatch):
    """One query head over one key head is the "split keys" route's kind of call, chosen by the keys' length and
    the threads: a plan made on a short cache would replay the fused kernel past the point where the
    dispatcher (and ``explain``) switch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the route splits only where threads sit idle
    layer, cache = MultiHeadAttention(8, 1).eval(), KVCache(max_len=1100)
    tokens = torch.randn(1, 1030, 8)
    with torch.no_grad():
        prompt = tokens[:, :500]
        layer(prompt, prompt, prompt, cache=cache, causal=True)
        routes = []
        for i in range(500, 530):  # the dispatcher splits from 512 keys (2 chunks of 256)
            step = tokens[:, i : i + 1]
            routes.append(layer.explain(step, step, step, cache=cache, causal=True).route)
            layer(step, step, step, cache=cache, causal=True)
            assert decode_plan.plan_of(layer) is None
    assert routes[0] == "fused" and routes[-1] == "split keys"


def test_a_compiled_step_reads_no_plan():
    """A graph neither keeps nor reads plans: reading the weak dictionary while tracing put guards on its entries,
    and a guard on an entry collected before the guards were built failed the compile (IndexError in the suite)."""
    x = torch.randn(1, 8, D)
    planned, cache = MultiHeadAttention(D, H).eval(), KVCache(max_len=16)
    with torch.no_grad():
        planned(x[:, :4], x[:, :4], x[:, :4], cache=cache, causal=True)
        for i in (4, 5):
            step = x[:, i : i + 1]
            planned(step, step, step, cache=cache, causal=True)
        assert decode_plan.plan_of(planned) is not None  # an entry the trace could see
        layer, other_cache = MultiHeadAttention(D, H).eval(), KVCache(max_len=16)
        layer(x[:, :4], x[:, :4], x[:, :4], cache=other_cache, causal=True)
        traced = torch._dynamo.explain(lambda q: layer(q, q, q, cache=other_cache, causal=True))(x[:, 4:5])
    assert not [guard for guard in traced.out_guards if "_PLANS" in str(guard)]
    assert decode_plan.plan_of(layer) is None


def _alibi() -> MultiHeadAttention:
    return LAYERS["alibi gqa (a key-only score term)"]().eval()


def test_an_alibi_layer_plans_its_key_row_route_in_inference_only():
    """ALiBi's causal term: the dispatcher's key-row route is remembered without grad; with grad every step runs
    in full (a term's parameters, and the queries', may want a gradient: the route's test reads grad mode)."""
    layer, _, _ = _decoded(_alibi())
    plan = decode_plan.plan_of(layer)
    assert plan is not None and plan.route.name == "blockwise key row" and plan.term is layer.position
    assert plan.step is None  # the key-row route has no step form: its call is described from the plan
    layer = _alibi()
    cache, x = KVCache(max_len=16), torch.randn(1, 7, D)
    layer(x[:, :4], x[:, :4], x[:, :4], cache=cache, causal=True)
    for i in (4, 5, 6):
        step = x[:, i : i + 1]
        layer(step, step, step, cache=cache, causal=True)
        assert decode_plan.plan_of(layer) is None


def test_an_alibi_plan_replays_no_step_onto_an_empty_cache():
    """A query alone (a cache rewound to nothing) is no decoding step: off the CPU the key-row route declines it."""
    layer, cache, x = _decoded(_alibi())
    cache.length = 0
    given = (x, x, x, None, True, False, None, cache, None, None, None, None, None, None, None)
    with torch.no_grad():
        assert decode_plan.replay(layer, given) is None
        cache.length = 1
        assert decode_plan.replay(layer, given) is not None


def test_a_term_that_loses_its_key_only_form_is_followed_by_the_next_step(monkeypatch):
    """An attribute of the term set after the plan was made (ALiBi made bidirectional) is not a setting of the
    layer, so the plan is not dropped: the replay asks the term each step and runs in full when it changed."""
    layer, cache, x = _decoded(_alibi())
    twin, twin_cache = copy.deepcopy(layer), cache.copy()
    layer.position.causal = twin.position.causal = False
    planned = _next_steps(layer, cache, x)
    monkeypatch.setattr(decode_plan, "ENABLED", False)
    full = _next_steps(twin, twin_cache, x)
    for a, b in zip(planned, full, strict=True):
        assert torch.equal(a, b)


def test_a_score_term_without_a_key_only_form_keeps_no_plan():
    layer = MultiHeadAttention(D, H, position=build("t5", num_hiddens=D, num_heads=H)).eval()
    cache, x = KVCache(max_len=16), torch.randn(1, 7, D)
    with torch.no_grad():
        layer(x[:, :4], x[:, :4], x[:, :4], cache=cache, causal=True)
        for i in (4, 5, 6):
            step = x[:, i : i + 1]
            layer(step, step, step, cache=cache, causal=True)
    assert decode_plan.plan_of(layer) is None


@pytest.mark.parametrize(
    ("name", "stepped"),
    [("rotary gqa", True), ("softcap", True), ("sinks", True), ("alibi gqa (a key-only score term)", False)],
)
def test_a_route_with_a_step_form_runs_it_without_describing_the_call(monkeypatch, name, stepped):
    """In inference the fused kernel's step form, and the decoding step of the routes that apply a softcap or sinks,
    run from the heads; a score term's call is described (its route reads the keys' positions)."""
    layer, cache, x = _decoded(LAYERS[name]().eval())
    plan = decode_plan.plan_of(layer)
    assert plan is not None and (plan.step is not None) is stepped
    monkeypatch.setattr(dispatch, "VERIFY_REMEMBERED_CHOICES", False)  # the suite's check describes every call
    described: list[object] = []
    monkeypatch.setattr(decode_plan, "AttentionCall", lambda **kw: described.append(kw) or dispatch.AttentionCall(**kw))
    with torch.no_grad():
        layer(x, x, x, cache=cache, causal=True)
    assert bool(described) is not stepped


def test_positions_a_replayed_step_leaves_unwritten_are_there_when_read(monkeypatch):
    """A step at its own index writes no position (KVCache.write_step defers it); reading the positions, copying
    the cache, a later step at another position and a full update all see every position right."""
    layer, cache, x = _decoded(LAYERS["rotary gqa"]().eval())  # 4 prompt tokens, 3 replayed steps
    assert cache._deferred_from is not None  # the steps' positions were deferred, not written
    assert torch.equal(cache.copy().positions, torch.arange(7))  # the copy reads them: written first
    assert cache._deferred_from is None and torch.equal(cache.positions, torch.arange(7))
    with torch.no_grad():
        layer(x, x, x, cache=cache, causal=True)  # deferred again
        layer(x, x, x, cache=cache, causal=True, offset=20)  # a position other than its index: written, after the rest
        assert torch.equal(cache.positions, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 20]))
        layer(x, x, x, cache=cache, causal=True)  # at index 9, position 9: deferred
        cache.update(x.new_zeros(1, 2, 1, D // H), x.new_zeros(1, 2, 1, D // H))  # a full update follows them
    assert torch.equal(cache.positions, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 20, 9, 10]))


def test_a_positioned_step_returns_what_a_full_update_returns():
    """KVCache.write_positioned_step (an ALiBi plan's write): the keys, values and positions update returns, with
    the positions deferred before it written first; (b, lk) positions where the sequences' positions differ."""
    gen = torch.Generator().manual_seed(3)
    kv = [torch.randn(2, 2, 1, 4, generator=gen) for _ in range(8)]
    for first_positions in (torch.arange(3), torch.tensor([[0, 1, 2], [5, 6, 7]])):
        stepped, updated = KVCache(max_len=8), KVCache(max_len=8)
        prompt = torch.randn(2, 2, 3, 4, generator=gen)
        for cache in (stepped, updated):
            cache.update(prompt, prompt, positions=first_positions)
        for i, first in enumerate((3, 4, 9, 10)):  # at its index (deferred by write_step), then elsewhere
            if i == 1:
                assert stepped.write_step(kv[i], kv[i], first) is not None
                stepped.commit()
                updated.update(kv[i], kv[i], positions=torch.tensor([first]))
                continue
            written = stepped.write_positioned_step(kv[i], kv[i], first)
            seen = updated.update(kv[i], kv[i], positions=torch.tensor([first]), commit=False)
            assert written is not None
            for a, b in zip(written, (seen.keys, seen.values, seen.positions), strict=True):
                assert torch.equal(a, b)
            stepped.commit()
            updated.commit()
        assert torch.equal(stepped.positions, updated.positions)
    assert KVCache(window=4).write_positioned_step(kv[0], kv[0], 0) is None  # a windowed cache: update's job
