"""Dropout masks drawn per block from a seed: the backward pass redraws exactly the forward's mask.

The keep test compares 16 random bits with a threshold: the drop probability is ``p`` rounded to
a multiple of ``2**-16`` (0.1 becomes 0.100006), and kept weights are divided by the exact keep
probability, so the output stays an unbiased estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from selfattn._validation import require_probability
from selfattn.functional._block_common import _Workspace

__all__ = ["dropout_keep_probability"]


def dropout_keep_probability(p: float) -> float:
    """The keep probability blockwise dropout really uses: ``1 - p`` with ``p`` on a ``2**-16`` grid."""
    return (65536 - _drop_units(require_probability("p", p))) / 65536


def _drop_units(p: float) -> int:
    return min(round(p * 65536), 65535)


# Random words per generator: a block's bits are drawn in chunks of this many int64, each from
# its own generator seeded by (block seed, chunk), so CPU threads can draw them side by side
# (one generator draws serially) and the mask depends on the seed alone, not the thread count.
RANDOM_CHUNK_WORDS = 1 << 18
_random_pool: ThreadPoolExecutor | None = None


def _random_lanes(
    shape: Sequence[int], seed: int, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """16 random bits per entry (int16, four per 64-bit draw), determined by ``seed``.

    ``out``: an int64 buffer of at least ``ceil(numel / 4)`` entries to draw into (no new allocation).
    """
    global _random_pool
    count = math.prod(shape)
    words = (count + 3) // 4
    bits = torch.empty(words, dtype=torch.int64, device=device) if out is None else out[:words]

    def draw(chunk: int) -> None:
        generator = torch.Generator(device=device)
        generator.manual_seed((seed + chunk * 0x632BE59BD9B4E019) % 2**63)
        part = bits[chunk * RANDOM_CHUNK_WORDS : (chunk + 1) * RANDOM_CHUNK_WORDS]
        part.random_(-(2**63), None, generator=generator)  # the full 64-bit range

    chunks = range((words + RANDOM_CHUNK_WORDS - 1) // RANDOM_CHUNK_WORDS)
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1 and len(chunks) > 1:
        if _random_pool is None or _random_pool._max_workers != threads:
            _random_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="selfattn-dropout")
        list(_random_pool.map(draw, chunks))
    else:
        for chunk in chunks:
            draw(chunk)
    return bits.view(torch.int16)[:count].view(*shape)


def _keep_mask(shape: Sequence[int], seed: int, p: float, device: torch.device) -> torch.Tensor:
    """Bool mask, True = keep, from 16 random bits per entry (four per 64-bit draw)."""
    return _random_lanes(shape, seed, device) >= _drop_units(p) - 32768


def _keep_factors(shape: Sequence[int], seed: int, p: float, dtype: torch.dtype, workspace: _Workspace) -> torch.Tensor:
    """``_keep_mask(...)`` as 1.0 / 0.0 in ``dtype``, drawn into the workspace's buffers.

    A float multiply is several times faster than ``masked_fill_`` with a bool mask on CPU, and
    one comparison written straight into ``dtype`` took a quarter of the time of a comparison
    into bool followed by a conversion (torch 2.13, one thread, a (128, 4096) tile; 0.8x on
    (16, 128, 4096) with two threads).
    """
    lanes = _random_lanes(
        shape, seed, workspace.device, out=workspace.get("bits", (math.prod(shape) + 3) // 4, torch.int64)
    )
    return torch.ge(lanes, _drop_units(p) - 32768, out=workspace.get("keep", shape, dtype))
