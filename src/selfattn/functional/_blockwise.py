"""Blockwise attention: score terms, learnable biases, value terms and dropout in O(block) memory.

The fused kernel takes a plain float mask and nothing else: a bias that needs a gradient, a
term added to the values (Shaw) or dropout send ``scaled_dot_product_attention`` to a path
that holds every ``(b, h, lq, lk)`` score at once. :func:`blockwise_attention` instead walks
over blocks of queries. For each block it asks the score term for its bias at those query
positions and the keys they may see (a block is just a smaller call of the encoding), and

* with no gradient to give the bias, no value term and no dropout, hands the block and its
  bias (a float mask) to the CPU flash kernel, forward and backward;
* otherwise computes the block's scores, probabilities and output explicitly, and in the
  backward pass recomputes them, so nothing of size ``(h, lq, lk)`` outlives a block. The
  gradient of the score term (its parameters, and the queries for Shaw's key term) comes from
  autograd run on the block's bias alone, so any encoding with parameters gets its gradient
  without writing one.

The explicit path is written for few passes over the ``(b, h, block, lk)`` tensors: they live
in buffers reused by every block (a fresh tensor of tens of MiB per block is page-faulted in
each time), the scale goes on the queries, the probabilities come from PyTorch's fused
softmax (in place on CPU; the backward recomputes them the same way, so no log-sum-exp is
kept) and the score gradient from its fused softmax backward.

A term that is a function of the key alone up to a constant per query (ALiBi's causal form:
``-m (i - j) = m (j - a) - m (i - a)``, and softmax ignores ``m (i - a)``) needs no
``(lq, lk)`` bias at all when every query sees the same keys (no causal mask, 1-D
``valid_lens``, a mask with one row): one ``(1 or b, h, 1, lk)`` row, anchored at the last
visible key so that float32 keeps the precision of the term itself, is expanded into the
float mask of every block, and the default block is then all queries at once (one call of the
flash kernel, forward and backward; :func:`_key_only_bias`). Terms with parameters evaluate
cheaply per block where they can (FIRE's MLP of a scalar is read as a piecewise linear
function, see :class:`~selfattn.positional.FIREPositionalBias`).

Causal attention with such a term (the language-model case; ``lq == lk``, no other mask) goes
chunk by chunk (:class:`_CausalKeyRows`): the keys before a chunk of queries are seen by all of
them, so they take one flash call with a view of the key-only row as the mask, and the square
diagonal tile takes one with the kernel's own causal mask; the two are merged by their
log-sum-exps, and each backward call is given the merged output and log-sum-exp.

Dropout draws a fresh mask per block from a generator seeded by (call seed, block index), so
the backward pass redraws exactly the forward's mask. Dropout with no score term on CPU (and at
least ``SLICED_MIN_SCORES`` scores per slice) goes one ``(batch, head)`` slice at a time in
tiles of about 2 MiB (:class:`_SlicedDropoutAttention`, :func:`choose_slice_block`), seeded
per (call seed, slice, block index): each tile's softmax, keep mask and products then work in
cache, and the slices go to worker threads running one PyTorch thread each, so no small op
waits on an OpenMP team. The keep test compares 16 random bits
with a threshold: the drop probability is ``p`` rounded to a multiple of ``2**-16`` (0.1 becomes
0.100006), and kept weights are divided by the exact keep probability, so the output stays an
unbiased estimate. The mask is applied as 1.0 / 0.0 factors (a float multiply is several times
faster than ``masked_fill`` with a bool mask), and ``1 / keep`` goes on the ``(block, dv)``
side: the block's output in the forward, the output gradient in the backward.

Shaw's terms at consecutive positions (:class:`_Clipped`) gather nothing over the block: the
keys more than ``K`` away from every query of the block share the two end embeddings, which
two indicator columns appended to the keys and values carry through the block's matrix
products (scores, weight sums per distance, and their gradients); only a band of
``block + 2K`` keys is gathered by distance. Value terms must be linear in the weights.

Every query block sees all keys (up to the last one it may see when causal), so each row's
softmax is finished within its block and no online rescaling is needed; the block size
(:func:`choose_block_size`) keeps one block's ``(b, h, block, lk)`` scores near 32 MiB.

Shape legend:
    b: batch, h: heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from selfattn._validation import require_positive_int, require_probability

__all__ = ["ScoreTerm", "blockwise_attention", "choose_block_size", "dropout_keep_probability"]

# One block's (b, h, block, lk) scores in the compute dtype stay near this many bytes.
BLOCK_BYTES = 32 * 2**20
MIN_BLOCK, MAX_BLOCK = 16, 512

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class ScoreTerm(Protocol):
    """What blockwise attention needs from a score encoding (any :class:`~selfattn.positional.ScoreEncoding`).

    ``term(q, q_positions=..., k_positions=...)`` returns the bias for those positions,
    broadcastable to ``(b, h, lq, lk)``; positions are integer ``(..., lq)`` / ``(..., lk)``.
    """

    def __call__(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor: ...

    def value_term(
        self, weights: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor: ...

    def parameters(self) -> Any: ...


def choose_block_size(batch: int, heads: int, num_queries: int, num_keys: int, *, dtype: torch.dtype) -> int:
    """Queries per block: the largest power of two whose ``(b, h, block, lk)`` scores fit 32 MiB.

    The scores are counted in the compute dtype (float32 for half precision), then the block
    is clamped to ``[16, 512]`` and to ``lq``. So b=2, 8 heads, lk=4096 in float32 gives 128
    queries per block, and b=1, 8 heads, lk=32768 gives 32.
    """
    itemsize = torch.empty(0, dtype=_compute_dtype(dtype)).element_size()
    per_query = max(batch * heads * num_keys * itemsize, 1)
    rows = max(BLOCK_BYTES // per_query, 1)
    block = 1 << (rows.bit_length() - 1)  # largest power of two <= rows
    return max(1, min(num_queries, max(MIN_BLOCK, min(MAX_BLOCK, block))))


def dropout_keep_probability(p: float) -> float:
    """The keep probability blockwise dropout really uses: ``1 - p`` with ``p`` on a ``2**-16`` grid."""
    return (65536 - _drop_units(p)) / 65536


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


class _Workspace:
    """Buffers reused by every block of one pass.

    A fresh ``(b, h, block, lk)`` tensor per block is tens of MiB that the allocator maps and
    the kernel page-faults in each time; reusing one buffer per role skips that.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < count:
            buffer = torch.empty(count, dtype=dtype, device=self.device)
            self.buffers[name] = buffer
        return buffer[:count].view(shape)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


@dataclass
class _Plan:
    """Everything about one call that is not a tensor needing a gradient."""

    term: ScoreTerm | None
    q_positions: torch.Tensor | None
    k_positions: torch.Tensor | None
    mask: torch.Tensor | None
    valid_lens: torch.Tensor | None
    causal: bool
    scale: float
    block: int
    dropout_p: float
    seed: int
    bias_needs_grad: bool
    queries_in_term: bool
    value_term: bool
    num_queries: int
    num_keys: int
    on_cpu: bool
    band_base: int | None = None  # set when the term is read from one band (see band())
    clipped: _Clipped | None = None  # set for a Shaw term at consecutive positions (see _Clipped)
    key_bias: torch.Tensor | None = None  # set when one row of bias serves every query (see _key_only_bias)

    def key_mask(self, rows: int) -> torch.Tensor:
        """The float mask of a block of ``rows`` queries when the bias is the same for every query: a view."""
        assert self.key_bias is not None
        return self.key_bias.expand(*self.key_bias.shape[:-2], rows, self.key_bias.shape[-1])

    @property
    def last_start(self) -> int:
        return (self.num_queries - 1) // self.block * self.block

    def band(self, q: torch.Tensor) -> torch.Tensor:
        """The term for every block at once, ``(1 or b, h, block, last_start + lk)``.

        For a term of ``j - i`` alone (``is_relative``) at consecutive positions, block ``s``'s
        bias is the window ``[last_start - s, last_start - s + lk)`` of the columns of one band:
        row ``r``, column ``m`` holds the term for query position ``r`` and key position
        ``m + band_base``. The band is built once per pass instead of once per block.
        """
        assert self.term is not None and self.band_base is not None
        rows = torch.arange(self.block, device=q.device)  # (block,)
        columns = torch.arange(self.last_start + self.num_keys, device=q.device) + self.band_base  # (width,)
        band = _as_4d(self.term(q[:1, :, : self.block], q_positions=rows, k_positions=columns))
        return band.expand(*band.shape[:2], rows.shape[0], columns.shape[0])

    def hide_future(self, band: torch.Tensor) -> torch.Tensor:
        """``band`` with ``-inf`` on keys a causal query may not see (a function of ``j - i`` too)."""
        if not self.causal:
            return band
        rows = torch.arange(band.shape[-2], device=band.device)[:, None]  # (block, 1)
        columns = torch.arange(band.shape[-1], device=band.device)  # (width,)
        hidden = columns > rows + self.last_start + self.num_keys - self.num_queries  # (block, width)
        return band.masked_fill(hidden, float("-inf"))

    def window(self, band: torch.Tensor, start: int, end: int, keys: int) -> torch.Tensor:
        """Block ``start``'s ``(1 or b, h, end - start, keys)`` bias: a view of the band."""
        first = self.last_start - start
        return band[..., : end - start, first : first + keys]

    @property
    def flash_forward(self) -> bool:
        """Whether the forward hands blocks to the CPU flash kernel (it takes no value term, no dropout)."""
        return self.on_cpu and self.dropout_p == 0.0 and not self.value_term

    @property
    def flash_backward(self) -> bool:
        return self.flash_forward and not self.bias_needs_grad

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``(index, first query, end query, end key)`` of every block."""
        out = []
        for index, start in enumerate(range(0, self.num_queries, self.block)):
            end = min(start + self.block, self.num_queries)
            keys = self.num_keys
            if self.causal:  # the last query of the block sees keys j <= end - 1 + lk - lq
                keys = min(keys, max(end + self.num_keys - self.num_queries, 1))
            out.append((index, start, end, keys))
        return out

    def bias(self, q: torch.Tensor, start: int, end: int, keys: int) -> torch.Tensor | None:
        if self.term is None:
            return None
        assert self.q_positions is not None and self.k_positions is not None
        return self.term(q, q_positions=self.q_positions[..., start:end], k_positions=self.k_positions[..., :keys])

    def value(self, weights: torch.Tensor, start: int, end: int, keys: int) -> torch.Tensor:
        assert self.term is not None and self.q_positions is not None and self.k_positions is not None
        return self.term.value_term(
            weights, q_positions=self.q_positions[..., start:end], k_positions=self.k_positions[..., :keys]
        )

    def visible(self, start: int, end: int, keys: int, device: torch.device) -> torch.Tensor | None:
        """Bool, True = attend, broadcastable to ``(b, h, block, keys)``; None when all are visible.

        With a band the causal part is already in the band's ``-inf`` and is left out here.
        """
        visible = None
        columns = torch.arange(keys, device=device)  # (keys,)
        if self.causal and self.band_base is None:
            rows = torch.arange(start, end, device=device)[:, None]  # (block, 1)
            visible = columns <= rows + (self.num_keys - self.num_queries)  # (block, keys)
        if self.valid_lens is not None:
            if self.valid_lens.dim() == 1:
                by_length = (columns < self.valid_lens[:, None])[:, None, None, :]  # (b, 1, 1, keys)
            else:
                by_length = (columns < self.valid_lens[:, start:end, None])[:, None]  # (b, 1, block, keys)
            visible = by_length if visible is None else visible & by_length
        if self.mask is not None:
            rows_slice = slice(start, end) if self.mask.shape[-2] != 1 else slice(None)
            given = self.mask[..., rows_slice, :keys]
            visible = given if visible is None else visible & given
        return visible

    def keep(self, index: int, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return _keep_mask(shape, self.block_seed(index), self.dropout_p, device)

    def keep_factors(self, index: int, shape: Sequence[int], dtype: torch.dtype, workspace: _Workspace) -> torch.Tensor:
        """Block ``index``'s keep mask as 1.0 / 0.0 in a workspace buffer."""
        return _keep_factors(shape, self.block_seed(index), self.dropout_p, dtype, workspace)

    def block_seed(self, index: int) -> int:
        return (self.seed + index * 0x9E3779B1) % 2**63


def _settle_empty_rows(visible: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Let rows that see no key see every key (kept finite), and return them to be zeroed after."""
    if visible is None:
        return None, None
    empty = ~visible.any(dim=-1, keepdim=True)  # (..., block, 1)
    if not bool(empty.any()):
        return visible, None
    return visible | empty, empty


def _float_mask(bias: torch.Tensor | None, visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The 4-D float mask the flash kernel takes: the bias, -inf where a key is hidden."""
    if bias is None and visible is None:
        return None
    if bias is None:
        assert visible is not None
        zeros = torch.zeros((), dtype=dtype, device=visible.device)
        return _as_4d(zeros.masked_fill(~visible, float("-inf")))
    bias = bias.to(dtype)
    return _as_4d(bias if visible is None else bias.masked_fill(~visible, float("-inf")))


def _lead_shape(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    """The broadcast ``(b, h)`` of two 4-D tensors whose leading sizes agree or are 1."""
    return tuple(max(a, b) for a, b in zip(q.shape[:-2], k.shape[:-2], strict=True))


def _block_probs(
    qc: torch.Tensor,
    kc: torch.Tensor,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
    scale: float,
    workspace: _Workspace,
) -> torch.Tensor:
    """Softmax of one block's scores, ``(b, h, block, keys)``, computed in the workspace's score buffer.

    The scale goes on the queries (a ``(block, d)`` product instead of a ``(block, keys)`` one)
    and the softmax is PyTorch's fused kernel, in place on CPU: one pass where
    logsumexp-then-exp takes several.
    """
    shape = (*_lead_shape(qc, kc), qc.shape[-2], kc.shape[-2])
    scores = torch.matmul(qc * scale, kc.transpose(-2, -1), out=workspace.get("scores", shape, qc.dtype))
    if bias is not None:
        scores.add_(bias.to(scores.dtype))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    if scores.device.type == "cpu":
        probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        return probs
    return torch.softmax(scores, dim=-1)


def _add_matmul(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target += a @ b`` for ``(b, h, ., .)`` tensors, in place through ``baddbmm_`` when the shapes allow.

    The gradients of the keys and values gather one ``(b, h, lk, d)`` product per block; adding
    it in the matrix product saves a temporary and a pass over it.
    """
    lead = target.shape[:-2]
    if a.shape[:-2] == lead and b.shape[:-2] == lead and target.dim() == 4:
        try:
            flat = target.view(-1, *target.shape[-2:])  # (b * h, rows, columns), a view of target
        except RuntimeError:
            flat = None
        if flat is not None:
            flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
            return
    target += torch.matmul(a, b)


def _softmax_backward(grad_weights: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``probs * (grad_weights - sum(grad_weights * probs))`` row by row, fused (in place on CPU)."""
    if grad_weights.device.type == "cpu":
        grad: torch.Tensor = torch.ops.aten._softmax_backward_data.out(
            grad_weights, probs, -1, probs.dtype, grad_input=grad_weights
        )
        return grad
    out: torch.Tensor = torch.ops.aten._softmax_backward_data(grad_weights, probs, -1, probs.dtype)
    return out


@dataclass
class _Clipped:
    """A Shaw term (``clipped_embeddings()``) at consecutive positions, computed without gathers over the block.

    Query ``r`` of a block and key ``c`` are ``off + c - r`` apart (``off``: first key position
    minus the block's first query position); their embedding is row ``clip(off + c - r, -K, K) + K``.
    All of a block's queries are at least ``K`` after the keys ``[0, first)`` and at least ``K``
    before the keys ``[last, keys)``, so those keys use the two end rows of the tables. Two
    indicator columns appended to the keys (and values) carry the end rows through the block's
    matrix products: ``[q * scale, c_0, c_2K] . [k_j, 1[j < first], 1[j >= last]]`` adds the key
    term of the far keys to the scores, ``P @ [v, 1[..], 1[..]]`` sums the weights of the far
    keys, and the same columns reduce the score gradient in the backward pass. Only the middle
    keys ``[first, last)`` (at most ``block + 2K - 1`` of them) are gathered by distance.
    """

    max_distance: int
    key_table: torch.Tensor | None  # (2K+1, d)
    value_table: torch.Tensor | None  # (2K+1, dv)
    key_scale: float
    offset: int
    key_param: int | None  # index of key_table among the Function's parameters (None: no gradient)
    value_param: int | None

    def split(self, start: int, end: int, keys: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """``(first, last, index)``: far keys ``[0, first)`` and ``[last, keys)``; ``(block, last - first)`` rows."""
        off, reach, rows = self.offset - start, self.max_distance, end - start
        first = min(max(1 - reach - off, 0), keys)
        last = min(max(reach + rows - 1 - off, first), keys)
        distance = torch.arange(first, last, device=device) - torch.arange(rows, device=device)[:, None] + off
        return first, last, distance.clamp(-reach, reach) + reach  # (block, last - first)


def _with_indicators(x: torch.Tensor, first: int, last: int, buffer: torch.Tensor) -> torch.Tensor:
    """``[x, 1[j < first], 1[j >= last]]`` along the features: ``(..., keys, f)`` -> ``(..., keys, f + 2)``."""
    features = x.shape[-1]
    buffer[..., :features] = x
    buffer[..., features:] = 0
    buffer[..., :first, features] = 1
    buffer[..., last:, features + 1] = 1
    return buffer


def _ends(by_distance: torch.Tensor) -> torch.Tensor:
    """The first and last of ``(..., 2K+1)``: ``(..., 2)``."""
    return by_distance[..., [0, -1]]


def _clipped_probs(
    clipped: _Clipped,
    qc: torch.Tensor,
    kc: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    split: tuple[int, int, torch.Tensor],
    workspace: _Workspace,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax of a block's scores with the clipped key term, and the keys with indicators (None without keys table)."""
    if clipped.key_table is None:
        return _block_probs(qc, kc, None, visible, scale, workspace), None
    first, last, index = split
    lead = _lead_shape(qc, kc)
    by_distance = torch.matmul(qc, clipped.key_table.to(qc.dtype).t()).mul_(clipped.key_scale)  # (b, h, block, 2K+1)
    q_wide = torch.cat([qc * scale, _ends(by_distance)], dim=-1)  # (b, h, block, d + 2)
    k_wide = _with_indicators(
        kc, first, last, workspace.get("k_wide", (*lead, kc.shape[-2], kc.shape[-1] + 2), qc.dtype)
    )
    shape = (*lead, qc.shape[-2], kc.shape[-2])
    scores = torch.matmul(q_wide, k_wide.transpose(-2, -1), out=workspace.get("scores", shape, qc.dtype))
    if last > first:
        scores[..., first:last] += torch.gather(by_distance, -1, index.expand(*by_distance.shape[:-1], -1))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    if scores.device.type == "cpu":
        probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        return probs, k_wide
    return torch.softmax(scores, dim=-1), k_wide


def _per_distance(
    wide: torch.Tensor, weights: torch.Tensor, split: tuple[int, int, torch.Tensor], size: int
) -> torch.Tensor:
    """Sum of ``weights`` per clipped distance, ``(b, h, block, 2K+1)``, from the indicator columns of ``wide``."""
    first, last, index = split
    sums = wide.new_zeros(*wide.shape[:-1], size)
    sums[..., 0] = wide[..., -2]
    sums[..., -1] += wide[..., -1]
    if last > first:
        middle = weights[..., first:last]
        sums.scatter_add_(-1, index.expand(*middle.shape[:-1], -1), middle)
    return sums


def _differentiable_forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The forward of :class:`_BlockwiseAttention` block by block in differentiable ops (for double backward)."""
    compute = _compute_dtype(q.dtype)
    inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
    pieces = []
    for index, start, end, keys in plan.blocks():
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., :keys, :].to(compute), v[..., :keys, :].to(compute)
        visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
        bias = plan.bias(qc, start, end, keys)
        scores = torch.matmul(qc, kc.transpose(-2, -1)) * plan.scale  # (b, h, block, keys)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if plan.dropout_p > 0:
            weights = weights * plan.keep(index, weights.shape, q.device) * inverse_keep
        block_out = torch.matmul(weights, vc)  # (b, h, block, dv)
        if plan.value_term:
            block_out = block_out + plan.value(weights, start, end, keys)
        if empty is not None:
            block_out = block_out.masked_fill(empty, 0.0)
        pieces.append(block_out)
    return torch.cat(pieces, dim=-2).to(q.dtype)  # (b, h, lq, dv)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        compute = _compute_dtype(q.dtype)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # (b, h, lq, dv)
        out_compute = out if compute == q.dtype else out.to(compute)
        lse = torch.empty(out.shape[:-1], dtype=compute, device=q.device)  # (b, h, lq)
        inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
        band = None if plan.band_base is None else plan.hide_future(plan.band(q[:1, :, : plan.block].to(compute)))
        workspace = _Workspace(q.device)
        value_sums: torch.Tensor | None = None
        for index, start, end, keys in plan.blocks():
            qb, kb, vb = q[..., start:end, :], k[..., :keys, :], v[..., :keys, :]
            visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
            if plan.flash_forward and plan.key_bias is not None:
                mask: torch.Tensor | None = plan.key_mask(end - start)
            elif plan.flash_forward:
                bias = (
                    plan.bias(qb.to(compute), start, end, keys) if band is None else plan.window(band, start, end, keys)
                )
                mask = _float_mask(bias, visible, compute)
            if plan.flash_forward:
                block_out, block_lse = _flash_forward(qb, kb, vb, attn_mask=mask, scale=plan.scale)
                block_lse = block_lse.to(compute)
                # The CPU kernel gives a zero row for a query holding NaN or inf; the formula says NaN.
                query_sums = qb.sum(dim=-1, keepdim=True, dtype=compute)  # (b, h, block, 1)
                block_out = block_out + query_sums.mul(0).to(block_out.dtype)
            else:  # the explicit backward recomputes the probabilities with the fused softmax: no lse
                qc, kc, vc = qb.to(compute), kb.to(compute), vb.to(compute)
                clipped = plan.clipped
                if clipped is not None:
                    split = clipped.split(start, end, keys, q.device)
                    weights, _ = _clipped_probs(clipped, qc, kc, visible, plan.scale, split, workspace)
                else:
                    bias = plan.bias(qc, start, end, keys) if band is None else plan.window(band, start, end, keys)
                    weights = _block_probs(qc, kc, bias, visible, plan.scale, workspace)  # (b, h, block, keys)
                if plan.dropout_p > 0:  # dropped weights stay unscaled: 1 / keep goes on the block's output
                    weights = weights.mul_(plan.keep_factors(index, weights.shape, weights.dtype, workspace))
                if clipped is not None and clipped.value_table is not None:
                    first, last, _ = split
                    v_wide = _with_indicators(
                        vc, first, last, workspace.get("v_wide", (*vc.shape[:-1], vc.shape[-1] + 2), compute)
                    )
                    wide = torch.matmul(weights, v_wide)  # (b, h, block, dv + 2)
                    table = clipped.value_table.to(compute)
                    sums = _per_distance(wide, weights, split, table.shape[0])  # (b, h, block, 2K+1)
                    if value_sums is None:  # kept for the backward pass: (b, h, lq, 2K+1)
                        value_sums = sums.new_empty(*sums.shape[:-2], plan.num_queries, sums.shape[-1])
                    value_sums[..., start:end, :] = sums
                    block_out = wide[..., :-2] + torch.matmul(sums, table)
                else:
                    block_out = torch.matmul(weights, vc)  # (b, h, block, dv)
                    if plan.value_term:  # linear in the weights
                        block_out = block_out + plan.value(weights, start, end, keys)
                if plan.dropout_p > 0:
                    block_out = block_out.mul_(inverse_keep)
                block_lse = None
            if empty is not None:
                block_out = block_out.masked_fill(empty, 0.0)
            out[..., start:end, :] = block_out
            if out_compute is not out:
                out_compute[..., start:end, :] = block_out
            if block_lse is not None:
                lse[..., start:end] = block_lse
        ctx.plan = plan
        ctx.value_sums = value_sums
        ctx.num_params = len(params)
        ctx.save_for_backward(q, k, v, out_compute, lse, *params)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            q, k, v, _, _, *params = ctx.saved_tensors
            inputs = [q, k, v, *params]
            wanted = [t.requires_grad for t in inputs]
            out = _differentiable_forward(ctx.plan, q, k, v)
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, *(next(grads) if w else None for w in wanted))
        with torch.no_grad():
            return _BlockwiseAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        q, k, v, out, lse, *params = ctx.saved_tensors
        compute = _compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute, device=k.device)
        dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)

        def accumulate(grads: Sequence[torch.Tensor | None]) -> None:
            for i, g in enumerate(grads):
                if g is not None:
                    previous = param_grads[i]
                    param_grads[i] = g if previous is None else previous + g

        def add_param_grad(i: int, g: torch.Tensor) -> None:
            accumulate([None] * i + [g.to(params[i].dtype)])

        workspace = _Workspace(q.device)
        band = band_values = band_grad = None
        if plan.band_base is not None:
            with torch.set_grad_enabled(plan.bias_needs_grad):
                band = plan.band(q[:1, :, : plan.block].to(compute))
            band_values = plan.hide_future(band.detach())
            if band.requires_grad:  # the score gradient of every block lands in one band-sized tensor
                band_grad = torch.zeros(band.shape, dtype=band.dtype, device=band.device)

        for index, start, end, keys in plan.blocks():
            qb, kb, vb = q[..., start:end, :], k[..., :keys, :], v[..., :keys, :]
            visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
            gb = grad_out[..., start:end, :]
            if empty is not None:
                gb = gb.masked_fill(empty, 0.0)  # the output of an empty row is a constant zero
            if plan.flash_backward and plan.key_bias is not None:
                mask: torch.Tensor | None = plan.key_mask(end - start)
            elif plan.flash_backward:
                if band_values is None:
                    bias = plan.bias(qb.to(compute), start, end, keys)
                else:
                    bias = plan.window(band_values, start, end, keys)
                mask = _float_mask(bias, visible, compute)
            if plan.flash_backward:
                ob = out[..., start:end, :].to(q.dtype)
                gq, gk, gv = _flash_backward(
                    gb.contiguous(), qb, kb, vb, ob, lse[..., start:end], 0.0, False, attn_mask=mask, scale=plan.scale
                )
                dq[..., start:end, :] = gq
                dk[..., :keys, :] += gk
                dv[..., :keys, :] += gv
                continue

            qc, kc, vc, gc = qb.to(compute), kb.to(compute), vb.to(compute), gb.to(compute)
            q_leaf = qc.detach().requires_grad_(plan.queries_in_term)
            clipped, split, k_wide = plan.clipped, None, None
            bias = None
            if clipped is not None:
                split = clipped.split(start, end, keys, q.device)
                probs, k_wide = _clipped_probs(clipped, qc, kc, visible, plan.scale, split, workspace)
            else:
                if band_values is None:
                    with torch.set_grad_enabled(plan.bias_needs_grad):
                        bias = plan.bias(q_leaf, start, end, keys)
                else:
                    bias = plan.window(band_values, start, end, keys)
                probs = _block_probs(qc, kc, None if bias is None else bias.detach(), visible, plan.scale, workspace)
            keep = plan.keep_factors(index, probs.shape, compute, workspace) if plan.dropout_p > 0 else None
            g_scaled = gc if keep is None else gc * inverse_keep  # dropout's 1 / keep, on the small side
            # Without a value term the dropped weights serve only the values' gradient: they are
            # made in place from probs after its last use (no buffer, one stream fewer).
            drop_late = keep is not None and not plan.value_term and (clipped is None or clipped.value_table is None)
            dropped = probs
            if keep is not None and not drop_late:
                # the forward's weights, unscaled: probs with the same entries dropped
                dropped = torch.mul(probs, keep, out=workspace.get("dropped", probs.shape, compute))
            if not drop_late:
                _add_matmul(dv[..., :keys, :], dropped.transpose(-2, -1), g_scaled)
            grad_buffer = workspace.get("grad", probs.shape, compute)
            if clipped is not None and clipped.value_table is not None:
                assert split is not None
                first, last, distance_index = split
                table = clipped.value_table.to(compute)
                g_by_distance = torch.matmul(g_scaled, table.t())  # (b, h, block, 2K+1)
                g_wide = torch.cat([g_scaled, _ends(g_by_distance)], dim=-1)  # (b, h, block, dv + 2)
                v_wide = _with_indicators(
                    vc, first, last, workspace.get("v_wide", (*vc.shape[:-1], vc.shape[-1] + 2), compute)
                )
                grad_weights = torch.matmul(g_wide, v_wide.transpose(-2, -1), out=grad_buffer)
                if last > first:
                    grad_weights[..., first:last] += torch.gather(
                        g_by_distance, -1, distance_index.expand(*g_by_distance.shape[:-1], -1)
                    )
                if clipped.value_param is not None:
                    sums = ctx.value_sums[..., start:end, :]  # (b, h, block, 2K+1), saved by the forward
                    add_param_grad(
                        clipped.value_param,
                        sums.reshape(-1, sums.shape[-1]).t() @ g_scaled.reshape(-1, g_scaled.shape[-1]),
                    )
            else:
                grad_weights = torch.matmul(g_scaled, vc.transpose(-2, -1), out=grad_buffer)
                if plan.value_term:  # linear in the weights, so g * (1 / keep) gives its gradients with dropout
                    with torch.enable_grad():
                        weights_leaf = dropped.detach().requires_grad_(True)
                        value = plan.value(weights_leaf, start, end, keys)
                        grads = torch.autograd.grad(value, [weights_leaf, *params], g_scaled, allow_unused=True)
                    if grads[0] is not None:
                        grad_weights += grads[0]
                    accumulate(grads[1:])
            if keep is not None:
                grad_weights = grad_weights.mul_(keep)
            grad_scores = _softmax_backward(grad_weights, probs)  # (b, h, block, keys)
            if drop_late:
                assert keep is not None
                _add_matmul(dv[..., :keys, :], probs.mul_(keep).transpose(-2, -1), g_scaled)
            if clipped is not None and clipped.key_table is not None and k_wide is not None:
                assert split is not None
                dq_wide = torch.matmul(grad_scores, k_wide)  # (b, h, block, d + 2)
                table = clipped.key_table.to(compute)
                sums = _per_distance(dq_wide, grad_scores, split, table.shape[0])  # (b, h, block, 2K+1)
                dq[..., start:end, :] = dq_wide[..., :-2] * plan.scale + torch.matmul(sums, table) * clipped.key_scale
                if clipped.key_param is not None:
                    add_param_grad(
                        clipped.key_param,
                        (
                            sums.reshape(-1, sums.shape[-1]).t()
                            @ qc.expand(*sums.shape[:-1], -1).reshape(-1, qc.shape[-1])
                        )
                        * clipped.key_scale,
                    )
            else:
                dq[..., start:end, :] = torch.matmul(grad_scores, kc) * plan.scale
            _add_matmul(dk[..., :keys, :], grad_scores.transpose(-2, -1), qc * plan.scale)
            if band_grad is not None:
                window = plan.window(band_grad, start, end, keys)
                window += grad_scores.sum_to_size(window.shape)
            elif bias is not None and bias.requires_grad:
                inputs = ([q_leaf] if plan.queries_in_term else []) + list(params)
                grads = torch.autograd.grad(
                    bias, inputs, grad_scores.sum_to_size(bias.shape).to(bias.dtype), allow_unused=True
                )
                if plan.queries_in_term:
                    if grads[0] is not None:
                        dq[..., start:end, :] += grads[0]
                    grads = grads[1:]
                accumulate(grads)
        if band is not None and band_grad is not None:
            accumulate(torch.autograd.grad(band, params, band_grad, allow_unused=True))
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *param_grads)


# Dropout alone on CPU (no score term): one (batch, head) slice at a time, so that a tile of
# scores stays in the 32 MiB L3 cache between its matrix products and its elementwise passes,
# and the slices go to worker threads that each run PyTorch ops on one thread (see _slice_pool).
SLICE_TILE_BYTES = 2 * 2**20
# Below this many scores per slice (lq * lk) a tile is too small to pay for its own Python
# loop and ops: the batched explicit path takes the call instead.
SLICED_MIN_SCORES = 2**16
_slice_pool: ThreadPoolExecutor | None = None


def choose_slice_block(num_queries: int, num_keys: int, *, dtype: torch.dtype) -> int:
    """Queries per tile of the per-slice dropout route: the largest power of two whose ``(block, lk)`` scores fit 2 MiB.

    Clamped to ``[16, 512]`` and to ``lq``; lk=4096 in float32 gives 128, lk=16384 gives 32.
    """
    itemsize = torch.empty(0, dtype=_compute_dtype(dtype)).element_size()
    rows = max(SLICE_TILE_BYTES // max(num_keys * itemsize, 1), 1)
    block = 1 << (rows.bit_length() - 1)  # largest power of two <= rows
    return max(1, min(num_queries, max(MIN_BLOCK, min(MAX_BLOCK, block))))


def _one_thread_each(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` workers whose PyTorch ops each run on one thread (no OpenMP team per op).

    ``torch.set_num_threads`` is per thread for OpenMP but also sets the process default that
    new threads start from; every worker sets and reads its count at once behind a barrier
    (so none starts from a restored default), then the caller's count is put back.
    """
    global _slice_pool
    if _slice_pool is not None and _slice_pool._max_workers == threads:
        return _slice_pool
    previous = torch.get_num_threads()
    barrier = threading.Barrier(threads)

    def settle() -> None:
        torch.set_num_threads(1)
        torch.get_num_threads()  # fixes this thread's count now, while the default is 1
        barrier.wait()

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="selfattn-slices")
    try:
        for future in [pool.submit(settle) for _ in range(threads)]:
            future.result()
    finally:
        torch.set_num_threads(previous)
    _slice_pool = pool
    return pool


def _run_slices(count: int, work: Callable[[int], None]) -> None:
    """``work(s)`` for every slice, on the one-thread workers when there are enough slices to share."""
    threads = torch.get_num_threads()

    def without_grad(s: int) -> None:  # grad mode is per thread: the workers start with it on
        with torch.no_grad():
            work(s)

    if threads > 1 and count >= threads:
        list(_one_thread_each(threads).map(without_grad, range(count)))
    else:
        for s in range(count):
            without_grad(s)


def _pick(t: torch.Tensor | None, batch: int, head: int) -> torch.Tensor | None:
    """Slice ``(batch, head)`` of a tensor broadcastable to ``(b, h, ...)``: ``(...)``."""
    if t is None:
        return None
    t = _as_4d(t)
    return t[batch if t.shape[0] > 1 else 0, head if t.shape[1] > 1 else 0]


def _slice_keep(
    plan: _Plan, slice_index: int, block_index: int, shape: Sequence[int], dtype: torch.dtype, workspace: _Workspace
) -> torch.Tensor:
    """Keep factors (1.0 / 0.0) of one tile, seeded by (call seed, slice, block): the same in both passes."""
    return _keep_factors(shape, _slice_seed(plan, slice_index, block_index), plan.dropout_p, dtype, workspace)


def _slice_seed(plan: _Plan, slice_index: int, block_index: int) -> int:
    return (plan.block_seed(block_index) + slice_index * 0xBF58476D1CE4E5B9) % 2**63


def _slice_tile_probs(
    qs: torch.Tensor, ks: torch.Tensor, visible: torch.Tensor | None, workspace: _Workspace
) -> torch.Tensor:
    """Softmax of one tile's scores, ``(block, keys)``, in place in the workspace (``qs`` already scaled)."""
    scores = torch.matmul(qs, ks.t(), out=workspace.get("scores", (qs.shape[0], ks.shape[0]), qs.dtype))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    return probs


def _slice_tiles(plan: _Plan, device: torch.device) -> tuple[float, list[tuple[int, int, int, int]], list[Any]]:
    """What both passes of the per-slice route share: ``1 / keep``, the blocks, and each block's visibility and empty rows."""
    blocks = plan.blocks()
    visibles = [_settle_empty_rows(plan.visible(start, end, keys, device)) for _, start, end, keys in blocks]
    return 1.0 / dropout_keep_probability(plan.dropout_p), blocks, visibles


class _SlicedDropoutAttention(torch.autograd.Function):
    """Attention with dropout and no score term on CPU, tile by tile of one ``(batch, head)`` slice.

    Tile ``(slice s, block i)`` has ``(block, keys)`` scores (2 MiB, :func:`choose_slice_block`),
    so its softmax, keep mask and products read what the previous step left in cache instead of
    streaming ``(b, h, block, lk)`` tensors from memory. Slices are independent (their key and
    value gradients too), so worker threads take whole slices. The keep mask of a tile is
    seeded by (call seed, slice, block index): the backward pass redraws it, and it does not
    depend on how many threads run.
    """

    @staticmethod
    def forward(ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        compute = _compute_dtype(q.dtype)
        batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
        out = q.new_empty(batch, heads, q.shape[-2], v.shape[-1])  # (b, h, lq, dv)
        inverse_keep, blocks, visibles = _slice_tiles(plan, q.device)

        def work(s: int) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (_pick(t, b, h) for t in (q, k, v))
            assert qs is not None and ks is not None and vs is not None
            workspace = _Workspace(q.device)
            for (index, start, end, keys), (visible, empty) in zip(blocks, visibles, strict=True):
                probs = _slice_tile_probs(
                    qs[start:end].to(compute) * plan.scale, ks[:keys].to(compute), _pick(visible, b, h), workspace
                )
                probs.mul_(_slice_keep(plan, s, index, probs.shape, compute, workspace))
                tile = torch.matmul(probs, vs[:keys].to(compute)).mul_(inverse_keep)  # (block, dv)
                empty_rows = _pick(empty, b, h)
                if empty_rows is not None:
                    tile = tile.masked_fill_(empty_rows, 0.0)
                out[b, h, start:end] = tile

        _run_slices(batch * heads, work)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            inputs = [q, k, v]
            wanted = [t.requires_grad for t in inputs]
            out = _sliced_dropout_reference(plan, q, k, v)
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, *(next(grads) if w else None for w in wanted))
        with torch.no_grad():
            return _SlicedDropoutAttention._backward(plan, q, k, v, grad_out)

    @staticmethod
    def _backward(
        plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        compute = _compute_dtype(q.dtype)
        batch, heads = grad_out.shape[:2]
        # Per-slice gradients, (b, h, ., .); a broadcast input sums its own afterwards.
        dq = torch.empty(batch, heads, *q.shape[-2:], dtype=compute, device=q.device)
        dk = torch.zeros(batch, heads, *k.shape[-2:], dtype=compute, device=k.device)
        dv = torch.zeros(batch, heads, *v.shape[-2:], dtype=compute, device=v.device)
        inverse_keep, blocks, visibles = _slice_tiles(plan, q.device)

        def work(s: int) -> None:
            b, h = divmod(s, heads)
            qs, ks, vs = (_pick(t, b, h) for t in (q, k, v))
            assert qs is not None and ks is not None and vs is not None
            gs, dqs, dks, dvs = grad_out[b, h], dq[b, h], dk[b, h], dv[b, h]
            workspace = _Workspace(q.device)
            for (index, start, end, keys), (visible, empty) in zip(blocks, visibles, strict=True):
                kc, vc = ks[:keys].to(compute), vs[:keys].to(compute)
                q_scaled = qs[start:end].to(compute) * plan.scale  # (block, d)
                probs = _slice_tile_probs(q_scaled, kc, _pick(visible, b, h), workspace)
                keep = _slice_keep(plan, s, index, probs.shape, compute, workspace)
                g_scaled = gs[start:end].to(compute) * inverse_keep  # dropout's 1 / keep, on the small side
                empty_rows = _pick(empty, b, h)
                if empty_rows is not None:
                    g_scaled.masked_fill_(empty_rows, 0.0)  # the output of an empty row is a constant zero
                grad = torch.matmul(g_scaled, vc.t(), out=workspace.get("grad", probs.shape, compute)).mul_(keep)
                grad = _softmax_backward(grad, probs)  # (block, keys)
                dvs[:keys].addmm_(probs.mul_(keep).t(), g_scaled)  # probs is not needed after this
                torch.matmul(grad, kc, out=dqs[start:end]).mul_(plan.scale)
                dks[:keys].addmm_(grad.t(), q_scaled)

        _run_slices(batch * heads, work)
        return (
            None,
            dq.sum_to_size(q.shape).to(q.dtype),
            dk.sum_to_size(k.shape).to(k.dtype),
            dv.sum_to_size(v.shape).to(v.dtype),
        )


def _sliced_keep_mask(plan: _Plan, index: int, batch: int, heads: int, rows: int, keys: int) -> torch.Tensor:
    """Block ``index``'s keep mask of the per-slice route, ``(b, h, rows, keys)`` bool, as the tiles draw it."""
    tiles = [
        _keep_mask((rows, keys), _slice_seed(plan, s, index), plan.dropout_p, torch.device("cpu"))
        for s in range(batch * heads)
    ]
    return torch.stack(tiles).view(batch, heads, rows, keys)


def _sliced_dropout_reference(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What :class:`_SlicedDropoutAttention` computes, in differentiable ops with the same masks (double backward)."""
    compute = _compute_dtype(q.dtype)
    inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
    batch, heads = (max(t.shape[i] for t in (q, k, v)) for i in (0, 1))
    pieces = []
    for index, start, end, keys in plan.blocks():
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., :keys, :].to(compute), v[..., :keys, :].to(compute)
        visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
        scores = torch.matmul(qc * plan.scale, kc.transpose(-2, -1))  # (b, h, block, keys)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        keep = _sliced_keep_mask(plan, index, batch, heads, end - start, keys)
        weights = torch.softmax(scores, dim=-1) * keep * inverse_keep
        block_out = torch.matmul(weights, vc)  # (b, h, block, dv)
        if empty is not None:
            block_out = block_out.masked_fill(empty, 0.0)
        pieces.append(block_out)
    return torch.cat(pieces, dim=-2).to(q.dtype)  # (b, h, lq, dv)


def _consecutive(positions: torch.Tensor) -> int | None:
    """The first position if ``positions`` is ``(l,)`` and counts up by one, else None."""
    if positions.dim() != 1 or positions.numel() == 0:
        return None
    first = int(positions[0])
    expected = torch.arange(first, first + positions.shape[0], device=positions.device)
    return first if torch.equal(positions.long(), expected) else None


def _term_reads_queries(
    term: ScoreTerm, q: torch.Tensor, q_positions: torch.Tensor | None, k_positions: torch.Tensor | None
) -> bool:
    """Whether the term's bias depends on the queries (Shaw's key term does), probed on one pair."""
    assert q_positions is not None and k_positions is not None
    with torch.enable_grad():
        probe = q[..., :1, :].detach().to(_compute_dtype(q.dtype)).requires_grad_(True)
        bias = term(probe, q_positions=q_positions[..., :1], k_positions=k_positions[..., :1])
        if not bias.requires_grad:
            return False
        (grad,) = torch.autograd.grad(bias.sum(), probe, allow_unused=True)
    return grad is not None


def _key_only_bias(
    term: ScoreTerm,
    k_positions: torch.Tensor,
    mask: torch.Tensor | None,
    valid_lens: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """One ``(1 or b, h, 1, lk)`` row of float mask serving every query, or None if the term has none.

    A term that is a function of the key alone up to a constant per query (ALiBi's causal form,
    ``m (j - a)``; see its ``key_only_term``) needs no ``(lq, lk)`` bias, only this row, so one
    expanded view is the mask of any block. The anchor ``a`` is the last visible key of each
    sequence: the keys a query weighs most then get a bias near zero, where float32 is as
    exact as on the term itself. Hidden keys hold ``-inf``; a sequence that sees no key sees
    them all here (its rows are zeroed afterwards). Only for visibility that is the same for
    every query: no causal mask, 1-D ``valid_lens``, a mask with one row.
    """
    key_only_term = getattr(term, "key_only_term", None)
    if key_only_term is None or k_positions.shape[-1] == 0 or (valid_lens is not None and valid_lens.dim() != 1):
        return None
    if mask is not None and (mask.dim() >= 2 and mask.shape[-2] != 1):
        return None
    num_keys = k_positions.shape[-1]
    positions = k_positions.long().reshape(-1, 1, 1, num_keys)  # (1 or b, 1, 1, lk)
    visible = torch.ones(1, 1, 1, num_keys, dtype=torch.bool, device=positions.device)
    if valid_lens is not None:
        columns = torch.arange(num_keys, device=positions.device)
        visible = visible & (columns < valid_lens[:, None].to(positions.device))[:, None, None, :]  # (b, 1, 1, lk)
    if mask is not None:
        visible = visible & _as_4d(mask)
    anyone = visible.any(dim=-1, keepdim=True)  # (.., 1): sequences with a visible key
    anchor = torch.where(visible, positions, positions.min()).amax(dim=-1, keepdim=True)
    anchor = torch.where(anyone, anchor, 0)
    row = key_only_term(positions - anchor, dtype)  # (1 or b, h, 1, lk)
    if row is None:
        return None
    assert isinstance(row, torch.Tensor)
    return _as_4d(row).masked_fill(~(visible | ~anyone), float("-inf"))


# Queries per chunk of the causal key-row route: the bias of the keys a query weighs most is at
# most (slope x chunk) from zero, so float32 keeps it to about 1e-5 of a unit at slope 0.5.
CAUSAL_CHUNK = 256


def _causal_key_rows(
    term: ScoreTerm, k_positions: torch.Tensor, num_keys: int, dtype: torch.dtype
) -> list[torch.Tensor] | None:
    """Per chunk of :data:`CAUSAL_CHUNK` queries, the key-only row ``(1 or b, h, 1, end)`` anchored at its last key.

    None if the term has no key-only form.
    """
    key_only_term = getattr(term, "key_only_term", None)
    if key_only_term is None:
        return None
    positions = k_positions.long().reshape(-1, 1, 1, num_keys)  # (1 or b, 1, 1, lk)
    rows = []
    for start in range(0, num_keys, CAUSAL_CHUNK):
        end = min(start + CAUSAL_CHUNK, num_keys)
        anchor = positions[..., end - 1 : end]  # (1 or b, 1, 1, 1)
        row = key_only_term(positions[..., :end] - anchor, dtype)
        if row is None:
            return None
        rows.append(_as_4d(row))
    return rows


def _chunk_masks(row: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal ``(.., end - start, end - start)`` and earlier-keys ``(.., end - start, start)`` masks: views."""
    lead = row.shape[:-2]
    return row[..., start:end].expand(*lead, end - start, end - start), row[..., :start].expand(
        *lead, end - start, start
    )


class _CausalKeyRows(torch.autograd.Function):
    """Causal attention with a key-only term (ALiBi's causal form) through the flash kernel, chunk by chunk.

    A causal mask is not one row, so the single-row route of :func:`_key_only_bias` cannot take
    it; but within a chunk of queries the keys before the chunk are seen by every query of it.
    Each chunk makes two calls of the flash kernel with views of one row as the mask: the keys
    before the chunk (no causal mask) and the square diagonal tile (the kernel's own causal
    mask, which is exact for a square), merged by their log-sum-exps. The backward pass gives
    each call the merged output and log-sum-exp, so each recomputes its share of the merged
    probabilities. The row is anchored at the chunk's last key so that the keys its queries
    weigh most have a bias near zero (see :data:`CAUSAL_CHUNK`).
    """

    @staticmethod
    def forward(
        ctx: Any, rows: list[torch.Tensor], scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        compute = _compute_dtype(q.dtype)
        length = q.shape[-2]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # (b, h, l, dv)
        lse = torch.empty(out.shape[:-1], dtype=compute, device=q.device)  # (b, h, l)
        for row, start in zip(rows, range(0, length, CAUSAL_CHUNK), strict=True):
            end = min(start + CAUSAL_CHUNK, length)
            qb = q[..., start:end, :]
            diagonal, earlier = _chunk_masks(row, start, end)
            block_out, block_lse = _flash_forward(
                qb, k[..., start:end, :], v[..., start:end, :], is_causal=True, attn_mask=diagonal, scale=scale
            )
            block_lse = block_lse.to(compute)
            if start > 0:
                early_out, early_lse = _flash_forward(
                    qb, k[..., :start, :], v[..., :start, :], attn_mask=earlier, scale=scale
                )
                merged = torch.logaddexp(block_lse, early_lse.to(compute))  # (b, h, chunk)
                block_out = (
                    block_out.to(compute) * (block_lse - merged).exp()[..., None]
                    + early_out.to(compute) * (early_lse.to(compute) - merged).exp()[..., None]
                )
                block_lse = merged
            # The CPU kernel gives a zero row for a query holding NaN or inf; the formula says NaN.
            query_sums = qb.sum(dim=-1, keepdim=True, dtype=compute)  # (b, h, chunk, 1)
            out[..., start:end, :] = block_out + query_sums.mul(0).to(block_out.dtype)
            lse[..., start:end] = block_lse
        ctx.rows, ctx.scale = rows, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        rows, scale = ctx.rows, ctx.scale
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            inputs = [q, k, v]
            wanted = [t.requires_grad for t in inputs]
            recomputed = _causal_key_rows_reference(rows, scale, q, k, v)
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(recomputed, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, None, *(next(grads) if w else None for w in wanted))
        compute = _compute_dtype(q.dtype)
        length = q.shape[-2]
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute, device=k.device)
        dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        with torch.no_grad():
            for row, start in zip(rows, range(0, length, CAUSAL_CHUNK), strict=True):
                end = min(start + CAUSAL_CHUNK, length)
                qb, gb = q[..., start:end, :], grad_out[..., start:end, :].contiguous()
                ob, lb = out[..., start:end, :], lse[..., start:end]
                diagonal, earlier = _chunk_masks(row, start, end)
                kd, vd = k[..., start:end, :], v[..., start:end, :]
                gq, gk, gv = _flash_backward(gb, qb, kd, vd, ob, lb, 0.0, True, attn_mask=diagonal, scale=scale)
                dq[..., start:end, :] = gq
                dk[..., start:end, :] += gk
                dv[..., start:end, :] += gv
                if start > 0:
                    ke, ve = k[..., :start, :], v[..., :start, :]
                    gq, gk, gv = _flash_backward(gb, qb, ke, ve, ob, lb, 0.0, False, attn_mask=earlier, scale=scale)
                    dq[..., start:end, :] += gq
                    dk[..., :start, :] += gk
                    dv[..., :start, :] += gv
        return None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _causal_key_rows_reference(
    rows: list[torch.Tensor], scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """What :class:`_CausalKeyRows` computes, chunk by chunk in differentiable ops (for double backward)."""
    compute = _compute_dtype(q.dtype)
    length = q.shape[-2]
    pieces = []
    for row, start in zip(rows, range(0, length, CAUSAL_CHUNK), strict=True):
        end = min(start + CAUSAL_CHUNK, length)
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., :end, :].to(compute), v[..., :end, :].to(compute)
        scores = torch.matmul(qc, kc.transpose(-2, -1)) * scale + row.to(compute)  # (b, h, chunk, end)
        hidden = torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device)[:, None]
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        pieces.append(torch.matmul(weights, vc))  # (b, h, chunk, dv)
    return torch.cat(pieces, dim=-2).to(q.dtype)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    term: ScoreTerm | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    valid_lens: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Attention with a score term, value term and/or dropout, one block of queries at a time.

    Equal to dense attention with the term's full bias (``term(q, q_positions=...,
    k_positions=...)``) added to the scaled scores, plus its value term for value encodings,
    while holding only one block of ``(b, h, block, lk)`` scores at a time, in the forward and
    the backward pass. A query that sees no key gets an output row of zeros.

    Args:
        q: ``(b, h, lq, d)`` queries.
        k: ``(b, h, lk, d)`` keys.
        v: ``(b, h, lk, dv)`` values.
        term: a score encoding (ALiBi, T5, Shaw, Kerple, FIRE, ...), or None for dropout alone.
        q_positions: integer ``(lq,)`` or ``(b, lq)`` positions of the queries (default: the
            last ``lq`` of ``0 .. lk - 1``).
        k_positions: integer ``(lk,)`` or ``(b, lk)`` positions of the keys (default ``0 .. lk - 1``).
        mask: bool, True = attend, broadcastable to ``(b, h, lq, lk)``.
        valid_lens: ``(b,)`` or ``(b, lq)``: key ``j`` is visible iff ``j < valid_len``.
        causal: query ``i`` attends keys ``j <= i + lk - lq``.
        dropout_p: dropout on the attention weights (drawn per block, redrawn identically in
            the backward pass; see :func:`dropout_keep_probability`).
        scale: score scale, default ``1 / sqrt(d)``.
        block_size: queries per block; default :func:`choose_block_size`, or all queries when
            the term is one key-only row of bias for every query (ALiBi's causal form without
            a causal mask; see the module's notes), or :func:`choose_slice_block` for dropout
            with no term on CPU (one ``(batch, head)`` slice at a time).

    Returns:
        ``(b, h, lq, dv)``.
    """
    dropout_p = require_probability("dropout_p", dropout_p)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must have shape (batch, heads, length, features), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q, k, v do not fit together: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}"
        )
    batch, heads, num_queries, head_dim = q.shape
    num_keys = k.shape[-2]
    if mask is not None and mask.dim() < 2:
        mask = mask.reshape(1, -1)  # (1, lk)
    block_size_given = block_size
    if block_size is None:
        block_size = choose_block_size(batch, heads, num_queries, num_keys, dtype=q.dtype)
    block_size = require_positive_int("block_size", block_size)
    if term is not None:
        if k_positions is None:
            k_positions = torch.arange(num_keys, device=q.device)
        if q_positions is None:
            q_positions = torch.arange(num_keys - num_queries, num_keys, device=q.device)
        if q_positions.shape[-1] != num_queries or k_positions.shape[-1] != num_keys:
            raise ValueError(
                f"q_positions and k_positions must end in {num_queries} and {num_keys}, "
                f"got {tuple(q_positions.shape)} and {tuple(k_positions.shape)}"
            )
    grad = torch.is_grad_enabled()
    params = [p for p in term.parameters() if p.requires_grad] if (term is not None and grad) else []
    reads_queries = term is not None and _term_reads_queries(term, q, q_positions, k_positions)
    key_bias = None
    uses_weights = bool(term is not None and getattr(term, "uses_weights", False))
    if (
        term is not None
        and not (causal or reads_queries or params or uses_weights or dropout_p > 0)
        and q.device.type == "cpu"
    ):
        assert k_positions is not None
        key_bias = _key_only_bias(term, k_positions, mask, valid_lens, _compute_dtype(q.dtype))
        if key_bias is not None and block_size_given is None:
            block_size = num_queries  # the mask is one row: a block costs O(lk) however many queries it has
    if (
        term is not None
        and causal
        and num_queries == num_keys
        and mask is None
        and valid_lens is None
        and block_size_given is None
        and not (reads_queries or params or uses_weights or dropout_p > 0)
        and q.device.type == "cpu"
        and getattr(term, "key_only_term", None) is not None
    ):
        assert q_positions is not None and k_positions is not None
        rows = _causal_key_rows(term, k_positions, num_keys, _compute_dtype(q.dtype))
        if rows is not None:
            causal_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
            with torch.profiler.record_function("selfattn::blockwise_attention"):
                split_out: torch.Tensor = _CausalKeyRows.apply(rows, causal_scale, q, k, v)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
            return split_out
    sliced = (  # see _SlicedDropoutAttention
        term is None and dropout_p > 0 and q.device.type == "cpu" and num_queries * num_keys >= SLICED_MIN_SCORES
    )
    if sliced and block_size_given is None:
        block_size = choose_slice_block(num_queries, num_keys, dtype=q.dtype)
    block_size = max(1, min(block_size, num_queries))
    queries_in_term = bool(grad and q.requires_grad and reads_queries)
    clipped = None
    clipped_embeddings = getattr(term, "clipped_embeddings", None)
    if clipped_embeddings is not None:
        assert q_positions is not None and k_positions is not None
        first_query, first_key = _consecutive(q_positions), _consecutive(k_positions)
        if first_query is not None and first_key is not None:
            reach, key_table, value_table, key_scale = clipped_embeddings()
            clipped = _Clipped(
                max_distance=reach,
                key_table=key_table,
                value_table=value_table,
                key_scale=key_scale,
                offset=first_key - first_query,
                key_param=next((i for i, p in enumerate(params) if p is key_table), None),
                value_param=next((i for i, p in enumerate(params) if p is value_table), None),
            )
    band_base = None
    if (
        clipped is None  # its own route; the band would also carry the causal mask
        and key_bias is None  # one row serves every block
        and term is not None
        and getattr(term, "is_relative", False)
        and not reads_queries
        and not (causal and num_queries > num_keys)
    ):
        assert q_positions is not None and k_positions is not None
        first_query, first_key = _consecutive(q_positions), _consecutive(k_positions)
        if first_query is not None and first_key is not None:
            last_start = (num_queries - 1) // block_size * block_size
            band_base = first_key - first_query - last_start
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    plan = _Plan(
        term=term,
        q_positions=q_positions,
        k_positions=k_positions,
        mask=mask,
        valid_lens=None if valid_lens is None else valid_lens.to(q.device),
        causal=bool(causal),
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        block=block_size,
        dropout_p=dropout_p,
        seed=seed,
        bias_needs_grad=bool(params) or queries_in_term,
        queries_in_term=queries_in_term,
        value_term=bool(term is not None and getattr(term, "uses_weights", False)),
        num_queries=num_queries,
        num_keys=num_keys,
        on_cpu=q.device.type == "cpu",
        band_base=band_base,
        clipped=clipped,
        key_bias=key_bias,
    )
    with torch.profiler.record_function("selfattn::blockwise_attention"):
        if sliced:
            sliced_out: torch.Tensor = _SlicedDropoutAttention.apply(plan, q, k, v)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
            return sliced_out
        out: torch.Tensor = _BlockwiseAttention.apply(plan, q, k, v, *params)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return out
