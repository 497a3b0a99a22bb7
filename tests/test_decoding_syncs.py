"""No host read on the decoding path: a decoded token never asks a tensor for a Python value.

A read (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``) waits for the device and breaks CUDA
graphs; on CPU the stand-in counts such calls through patched ``torch.Tensor`` methods during
one decoding step, after a warm-up step, and wants none. With CUDA, PyTorch's own sync
debug mode raises at any synchronising call.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.core import dispatch
from selfattn.functional import attention
from selfattn.positional import build

D, H, KV = 32, 4, 2
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def counting_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Count each read of a tensor's value (where it came from) while the block runs."""
    reads: collections.Counter[str] = collections.Counter()
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(self: torch.Tensor, *args: object, _name: str = name, _original: Callable = original) -> object:
                caller = traceback.extract_stack(limit=3)[0]
                reads[f"{_name} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}"] += 1
                return _original(self, *args)

            patch.setattr(torch.Tensor, name, counted)
        yield reads


def test_the_counter_sees_a_read(monkeypatch):
    """The stand-in itself: a read of each kind is counted (else the tests below could not fail)."""
    t = torch.ones(2)
    with counting_reads(monkeypatch) as reads:
        bool(t[0]), int(t[0]), float(t[0]), t.tolist(), t[0].item(), [0, 1][t.long()[0]]
    assert {key.split(" ")[0] for key in reads} == set(READS)


def _layer(position: str | None = "rotary", **options: object) -> MultiHeadAttention:
    torch.manual_seed(0)
    encoding = None if position is None else build(position, num_hiddens=D, num_heads=H)
    return MultiHeadAttention(D, H, num_kv_heads=KV, position=encoding, **options).eval()


LAYERS = {
    "rotary": (lambda: _layer(), lambda: KVCache(64)),
    "sinks": (lambda: _layer(sinks=True), lambda: KVCache(64)),
    "softcap": (lambda: _layer(softcap=30.0), lambda: KVCache(64)),
    "window": (lambda: _layer(window=4), lambda: KVCache(window=4)),
    "sink tokens": (lambda: _layer(), lambda: KVCache(window=4, sink_tokens=2)),
    "alibi": (lambda: _layer("alibi"), lambda: KVCache(64)),
    "t5": (lambda: _layer("t5"), lambda: KVCache(64)),
    "kerple": (lambda: _layer("kerple"), lambda: KVCache(64)),
    "fire": (lambda: _layer("fire"), lambda: KVCache(64)),
}


def _decode(name: str, planned: bool = False) -> Callable[[], torch.Tensor]:
    """A layer and its cache after a prompt and one warm-up token: the step decodes one more token.

    ``planned``: the warm-up runs without grad, as the step does, so the step replays the layer's
    decoding plan; else the warm-up is of another kind and the step runs in full.
    """
    make_layer, make_cache = LAYERS[name]
    layer, cache = make_layer(), make_cache()
    prompt, token = torch.randn(2, 9, D), torch.randn(2, 1, D)
    with torch.set_grad_enabled(not planned):
        layer(prompt, prompt, prompt, cache=cache, causal=True)
        layer(token, token, token, cache=cache, causal=True)
    return lambda: layer(token, token, token, cache=cache, causal=True)


@pytest.mark.parametrize("planned", [False, True], ids=["in full", "replayed"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_decoded_token_reads_no_tensor(monkeypatch, name, planned):
    step = _decode(name, planned)
    with torch.no_grad(), counting_reads(monkeypatch) as reads:
        step()
    assert not reads, dict(reads)


@pytest.mark.parametrize("planned", [False, True], ids=["in full", "replayed"])
def test_a_decoded_alibi_token_reads_no_tensor_where_no_key_row_route_runs(monkeypatch, planned):
    """Where the key-row routes decline (a step whose heads want a gradient; off the CPU, a call with no more keys
    than queries), the blockwise routes are asked: as here."""
    cpu_only = {"blockwise key row", "causal key rows"}
    monkeypatch.setattr(dispatch, "ROUTES", tuple(route for route in dispatch.ROUTES if route.name not in cpu_only))
    step = _decode("alibi", planned)
    with torch.no_grad(), counting_reads(monkeypatch) as reads:
        step()
    assert not reads, dict(reads)


@pytest.mark.parametrize("causal", [False, True])
def test_functional_attention_on_a_decoding_shape_reads_no_tensor(monkeypatch, causal):
    q, k = torch.randn(2, H, 1, 8), torch.randn(2, KV, 20, 8)
    attention(q, k, k, causal=causal)
    with counting_reads(monkeypatch) as reads:
        attention(q, k, k, causal=causal)
    assert not reads, dict(reads)


def _on_cuda_after_a_token(name: str) -> tuple[MultiHeadAttention, KVCache, torch.Tensor]:
    """The layer on CUDA and its cache after a prompt and one token (no grad), and the next token."""
    make_layer, make_cache = LAYERS[name]
    layer, cache = make_layer().cuda(), make_cache()
    prompt, token = torch.randn(2, 9, D, device="cuda"), torch.randn(2, 1, D, device="cuda")
    with torch.no_grad():
        layer(prompt, prompt, prompt, cache=cache, causal=True)
        layer(token, token, token, cache=cache, causal=True)
    return layer, cache, token


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_decoded_token_does_not_synchronise_cuda(name):
    layer, cache, token = _on_cuda_after_a_token(name)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(token, token, token, cache=cache, causal=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [name for name in LAYERS if name not in ("window", "sink tokens")])
def test_a_decoded_token_is_captured_in_a_cuda_graph(name):
    """A step captured in a CUDA graph and replayed gives what the step run eagerly gives from the same cache.

    Capture fails at any synchronising call, and a step that read a tensor's value on the host would
    replay the value seen at capture. The cache is preallocated, so the step writes into its storage.
    """
    layer, cache, token = _on_cuda_after_a_token(name)
    with torch.no_grad():
        eager_cache = cache.copy()
        expected = layer(token, token, token, cache=eager_cache, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up on a side stream, as graph capture asks, from a copy
            layer(token, token, token, cache=cache.copy(), causal=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(token, token, token, cache=cache, causal=True)
        graph.replay()
    torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-6)
    assert cache.length == eager_cache.length


def test_transformer_lm_reads_no_tensor_per_generated_token(monkeypatch):
    """The prompt's checks read it once; each generated token (an argmax, a valid id) adds no read."""
    from selfattn.models import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(50, D, H, 2, position="rotary", max_len=32).eval()
    prompt = torch.randint(0, 50, (1, 5))
    counts = []
    for new_tokens in (2, 6):
        model.generate(prompt, new_tokens)  # warm-up
        with counting_reads(monkeypatch) as reads:
            model.generate(prompt, new_tokens)
        counts.append(sum(reads.values()))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("name", ["t5", "kerple"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared positions", "positions per sequence"])
def test_a_one_query_bias_equals_its_row_of_a_many_query_bias(name, dtype, per_sequence):
    """T5 and Kerple form one query's bias pair by pair (no range read); it equals that query's row bit for bit."""
    torch.manual_seed(0)
    term = build(name, num_hiddens=D, num_heads=H).to(dtype)
    q = torch.randn(2, H, 7, D // H, dtype=dtype)
    q_positions, k_positions = torch.arange(20, 27), torch.tensor([0, 3, 4, 9, 15, 20, 21, 22, 25, 26, 40])
    if per_sequence:
        q_positions, k_positions = torch.stack((q_positions, q_positions + 5)), torch.stack((k_positions, k_positions))
    many = term(q, q_positions=q_positions, k_positions=k_positions)  # (1 or b, h, 7, lk)
    for row in range(7):
        one = term(q[..., row : row + 1, :], q_positions=q_positions[..., row : row + 1], k_positions=k_positions)
        assert torch.equal(one, many[..., row : row + 1, :]), row
