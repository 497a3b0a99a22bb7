"""What one decoding step of a rotary GQA layer costs in PyTorch ops and in submodule lookups.

A decoded token through :class:`~selfattn.MultiHeadAttention` is dominated by its fixed costs:
every ATen op is a few microseconds on CPU, and every read of a submodule or buffer
(``self.position``, ``inv_freq``) goes through ``nn.Module.__getattr__`` after a failed lookup
that formats an ``AttributeError``. These bounds pin what the step takes today (counted with a
``TorchDispatchMode`` and a patched ``__getattr__``), so a change that adds work per token fails here
rather than only in the benchmark (``benchmarks/decoding.py``), whose timings a loaded machine blurs.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import build

# The step: 4 projections (t, mm, _unsafe_view each), 3 head splits (view, transpose), two rotations
# (two slices of the angle tables, roll, 2 mul, add each), the cache's 3 writes (slice, copy_ or fill_ of
# the new position) and its 2 views, the kernel, its NaN-query guard (add: q + 0 * q, from one vector of keys on;
# it was sum, add_), the heads merged (transpose, view) for W_o: 42 counted on 2026-11-28. (51 before the decoding
# plan: an arange of the position, promote_types, and a view of the stored positions.)
MAX_OPS = 47
# The weights and biases of W_q, W_k, W_v, W_o (Linear.forward reads its own). The layer's decoding plan
# (selfattn._decode_plan) holds its projections and rotary, so neither is looked up (the full path read
# position 4 times, W_q 3 times and the others once), and the rotary reads inv_freq from its buffers (it went
# through __getattr__ once per rotation).
MAX_LOOKUPS = {"position": 0, "inv_freq": 0, "W_q": 0, "W_k": 0, "W_v": 0, "W_o": 0, "weight": 4, "bias": 4}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _decoding_layer() -> tuple[MultiHeadAttention, KVCache]:
    torch.manual_seed(0)
    encoding = build("rotary", num_hiddens=64, num_heads=4, interleaved=False)
    layer = MultiHeadAttention(64, 4, num_kv_heads=2, position=encoding).eval()
    cache = KVCache(64)
    # past one vector of the CPU kernel's keys (16 float32 with AVX-512, 32 elsewhere): the kernel's step
    prompt, token = torch.randn(1, 32, 64), torch.randn(1, 1, 64)
    with torch.no_grad():
        layer(prompt, prompt, prompt, cache=cache, causal=True)
        layer(token, token, token, cache=cache, causal=True)  # warm: the angle tables, the remembered route
    return layer, cache


def test_a_decoding_step_runs_few_ops():
    layer, cache = _decoding_layer()
    token = torch.randn(1, 1, 64)
    with torch.no_grad(), _CountOps() as counted:
        layer(token, token, token, cache=cache, causal=True)
    total = sum(counted.ops.values())
    assert counted.ops["aten._scaled_dot_product_flash_attention_for_cpu"] == 1, dict(counted.ops)
    assert total <= MAX_OPS, f"{total} ops per decoded token (at most {MAX_OPS}): {dict(counted.ops)}"


def test_a_decoding_step_looks_each_submodule_up_once_per_use(monkeypatch: pytest.MonkeyPatch):
    layer, cache = _decoding_layer()
    token = torch.randn(1, 1, 64)
    lookups: collections.Counter[str] = collections.Counter()
    original = nn.Module.__getattr__

    def counted(self: nn.Module, name: str) -> Any:
        lookups[name] += 1
        return original(self, name)

    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(nn.Module, "__getattr__", counted)
        layer(token, token, token, cache=cache, causal=True)
    over = {name: lookups[name] for name, most in MAX_LOOKUPS.items() if lookups[name] > most}
    assert lookups["weight"] >= 1, "the counter saw no lookup: it would pass any change"
    assert not over, f"looked up more often than {MAX_LOOKUPS}: {dict(lookups)}"
