"""What every blockwise route shares: block sizes, the workspace, and one block's softmax and its gradient.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from selfattn import _validation
from selfattn.functional._few_keys import few_keys, few_keys_forward

__all__ = ["BLOCK_BYTES", "MAX_BLOCK", "MIN_BLOCK", "ScoreTerm", "choose_block_size"]

# One block's (b, h, block, lk) scores in the compute dtype stay near this many bytes.
BLOCK_BYTES = 32 * 2**20
MIN_BLOCK, MAX_BLOCK = 16, 512

# PyTorch's CPU flash kernel, bound raw (it returns the log-sum-exp the blocks merge by). It reads
# q, k, v, the output and its gradient by their batch, head and row strides but assumes each row's
# entries adjacent (stride 1 in the last dimension), and it takes one head size for q, k and v: call
# it only through _flash_forward and _flash_backward, which hand it such tensors.
_raw_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_raw_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _kernel_layout(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as the flash kernel reads it: last dimension ``width`` (zero columns appended) and stride 1 there.

    Copies only when needed: a head sliced with a step, a transposed head, or a head size
    smaller than the widest of q, k and v.
    """
    if t.shape[-1] < width:
        t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # keeps a permuted layout: stride(-1) may not be 1
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return t.contiguous()
    return t


def _flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's ``(out (b, h, lq, dv), lse (b, h, lq))`` for any strides and any ``dv``.

    A value head size other than ``d`` is served by zero columns: appended to q and k they add
    nothing to a score, appended to v they give output columns of zeros, cut off here. Fewer keys than one
    vector of the kernel's, the formula written out (:mod:`._few_keys`: the kernel passes over a NaN score there).
    """
    if not dropout_p and few_keys(q, k):
        return few_keys_forward(q, k, v, attn_mask, is_causal=is_causal, scale=scale)
    width = max(q.shape[-1], v.shape[-1])
    out, lse = _raw_flash_forward(
        _kernel_layout(q, width), _kernel_layout(k, width), _kernel_layout(v, width), dropout_p, is_causal,
        attn_mask=attn_mask, scale=scale,
    )  # fmt: skip
    return out[..., : v.shape[-1]], lse


def _flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's gradients ``(dq, dk, dv)`` of :func:`_flash_forward`, for any strides and any ``dv``.

    The zero columns of the forward go in again (those of the output and its gradient add
    nothing to a row's ``sum(dO * O)``) and the gradients of them are cut off.
    """
    width = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = _raw_flash_backward(
        _kernel_layout(grad_out, width), _kernel_layout(q, width), _kernel_layout(k, width),
        _kernel_layout(v, width), _kernel_layout(out, width), lse, dropout_p, is_causal,
        attn_mask=attn_mask, scale=scale,
    )  # fmt: skip
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


class ScoreTerm(Protocol):
    """What blockwise attention needs from a score encoding (any :class:`~selfattn.positional.ScoreEncoding`).

    ``term(q, q_positions=..., k_positions=...)`` returns the bias for those positions,
    broadcastable to ``(b, h, lq, lk)``; positions are integer ``(..., lq)`` / ``(..., lk)``.
    The other methods are the declared capabilities of the base class (with safe defaults).
    """

    @property
    def is_relative(self) -> bool: ...

    @property
    def uses_weights(self) -> bool: ...

    def __call__(self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor: ...

    def value_term(
        self, weights: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor: ...

    def key_only_term(self, key_offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None: ...

    def has_key_only_form(self) -> bool: ...

    def clipped_embeddings(self) -> tuple[int, torch.Tensor | None, torch.Tensor | None, float] | None: ...

    def parameters(self) -> Any: ...

    def named_parameters(self) -> Any: ...


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


def _keys_share(lse: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """The keys' share ``sigmoid(lse - s)`` of each row ``(b, h, lq)`` beside ``(h,)`` sink logits, the difference
    taken before the exponential: a sink a few units below a log-sum-exp of 1e4 keeps its share, which
    ``exp(lse - logaddexp(lse, s))`` rounds away in float32. NaN where ``lse`` is +inf (a +inf score: the formula's
    NaN, which the half-precision kernels' zeros drop)."""
    return torch.sigmoid(lse - sink_logits[:, None]) + (lse - lse)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _settle_empty_rows(visible: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Let rows that see no key see every key (kept finite), and return them to be zeroed after."""
    if visible is None:
        return None, None
    empty = ~visible.any(dim=-1, keepdim=True)  # (..., block, 1)
    if not _validation.is_compiling() and not bool(empty.any()):  # a graph settles every block (no host read)
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


def _block_scores(
    qc: torch.Tensor, kc: torch.Tensor, bias: torch.Tensor | None, scale: float, workspace: _Workspace
) -> torch.Tensor:
    """One block's scaled scores plus its bias, ``(b, h, block, keys)``, in the workspace's score buffer.

    The scale goes on the queries: a ``(block, d)`` product instead of a ``(block, keys)`` one.
    """
    shape = (*_lead_shape(qc, kc), qc.shape[-2], kc.shape[-2])
    scores = torch.matmul(qc * scale, kc.transpose(-2, -1), out=workspace.get("scores", shape, qc.dtype))
    if bias is not None:
        scores.add_(bias.to(scores.dtype))
    return scores


def _softmax_in_place(scores: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused softmax over the last axis, in place on CPU: one pass where logsumexp-then-exp takes several."""
    if scores.device.type == "cpu":
        probs: torch.Tensor = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        return probs
    return torch.softmax(scores, dim=-1)


def _block_probs(
    qc: torch.Tensor,
    kc: torch.Tensor,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
    scale: float,
    workspace: _Workspace,
) -> torch.Tensor:
    """Softmax of one block's scores, ``(b, h, block, keys)``, computed in the workspace's score buffer."""
    return _modified_block_probs(
        qc, kc, bias, visible, scale, workspace, softcap=None, sinks=None, want_slope=False
    ).probs


class _ModifiedProbs(NamedTuple):
    probs: torch.Tensor  # (b, h, block, keys), rows sum to 1 - sink
    sink: torch.Tensor | None  # (b, h, block): the weight the sink takes
    cap_slope: torch.Tensor | None  # (b, h, block, keys): d capped / d logit = 1 - tanh^2


def _modified_block_probs(
    qc: torch.Tensor,
    kc: torch.Tensor,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
    scale: float,
    workspace: _Workspace,
    *,
    softcap: float | None,
    sinks: torch.Tensor | None,
    want_slope: bool,
) -> _ModifiedProbs:
    """:func:`_block_probs` with the logits capped by ``softcap * tanh(. / softcap)`` and ``(h,)`` sink logits.

    The sink joins each row's denominator: the keys' weights are the plain softmax times
    ``sigmoid(lse - sink)``, and the sink's own weight is ``sigmoid(sink - lse)`` (``lse``: the
    row's log-sum-exp over the keys it sees).
    """
    scores = _block_scores(qc, kc, bias, scale, workspace)
    slope = None if softcap is None else _cap_in_place(scores, softcap, workspace, want_slope=want_slope)
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    sink_weight = None
    if sinks is not None:
        lse = torch.logsumexp(scores, dim=-1)  # (b, h, block)
        sink_logits = sinks.to(scores.dtype)[:, None]  # (h, 1)
        sink_weight = torch.sigmoid(sink_logits - lse)
        keys_share = torch.sigmoid(lse - sink_logits)
    probs = _softmax_in_place(scores)
    if sinks is not None:
        probs.mul_(keys_share.unsqueeze(-1))
        # Every score -inf (an infinite query against opposed keys): the softmax's NaN times the keys' share 0; the
        # sink takes the whole row, and the formula gives its keys 0 (a NaN score keeps its NaN lse and row).
        probs.masked_fill_((lse == float("-inf")).unsqueeze(-1), 0.0)
    return _ModifiedProbs(probs, sink_weight, slope)


def _cap_in_place(
    scores: torch.Tensor, softcap: float, workspace: _Workspace, *, want_slope: bool, divided: bool = False
) -> torch.Tensor | None:
    """``scores <- softcap * tanh(scores / softcap)`` in place; with ``want_slope``, ``1 - tanh^2`` (the cap's derivative).

    ``divided``: the scores come already divided by ``softcap`` (the division went on the queries).
    """
    _tanh_in_place(scores if divided else scores.div_(softcap))
    slope = None
    if want_slope:
        one = torch.ones((), dtype=scores.dtype, device=scores.device)
        slope = torch.addcmul(
            one, scores, scores, value=-1.0, out=workspace.get("cap_slope", scores.shape, scores.dtype)
        )
    scores.mul_(softcap)
    return slope


def _tanh_in_place(t: torch.Tensor) -> torch.Tensor:
    """``t.tanh_()``, through NumPy's tanh on CPU when NumPy is installed.

    PyTorch's CPU tanh (2.13) runs at about 0.4 G values/s on one AVX-512 core, slower than a
    tile's matrix product; NumPy's vectorized tanh runs about 7 times faster on the same
    float32 tile, to the same accuracy (one unit in the last place), and releases the GIL
    for the worker threads. NumPy stays optional: without it the cap is only slower.
    """
    if t.device.type == "cpu" and not t.requires_grad and _numpy is not None:
        array = t.numpy()
        _numpy.tanh(array, out=array)
        return t
    return t.tanh_()


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError:  # a torch-only install
        return None
    return numpy


_numpy = _import_numpy()


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
