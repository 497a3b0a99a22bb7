"""A sliding window and nothing else, in O(l * window): every inner block of queries sees one band pattern.

Shape legend: b batch, h heads, hk key/value heads, l queries and keys, dh head size.
"""

from __future__ import annotations

import math

import torch

import selfattn.core.routes._window as _window
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._reasons import holding
from selfattn.core.routes._window import PER_ROW_BAND_ELEMENTS, window_declines
from selfattn.functional._kernels import _fused_kernel, fused_attention
from selfattn.masks import Causal, Visibility, Window

__all__ = ["BAND_ONLY"]


def _declines(call: AttentionCall) -> str | None:
    reason = window_declines(call)
    if reason is None and not call.visibility.only(Causal, Window):
        reason = "other masks than the window"
    elif reason is None and (call.dropout_p > 0 or call.term is not None):
        reason = holding(("dropout", call.dropout_p > 0), ("a score term", call.term is not None))
    return reason


def _band_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visibility: Visibility, scale: float) -> torch.Tensor:
    """``(b, h, l, dh)``: a leading part, inner blocks sharing one ``(block, span)`` mask, a trailing part.

    The leading part's window reaches before key 0 and the trailing part's past the last key;
    the inner blocks read their keys as overlapping views of the keys and share one float mask,
    which the fused kernel broadcasts without a copy; the two edges are small dense problems.
    """
    window = visibility.window
    assert window is not None
    batch, heads, length, head_dim = q.shape
    block, before = _window.window_block(window), window - 1
    after = 0 if visibility.causal else before
    span = block + before + after
    first = math.ceil(before / block)  # blocks before it see keys before index 0
    last = (length - after) // block  # blocks from it on see keys past the end
    start, stop = first * block, last * block  # the inner queries
    num_blocks = last - first  # >= 1: the route wants length > 2 * span
    if batch > 1 and 2 * num_blocks * span * k.shape[1] * head_dim >= PER_ROW_BAND_ELEMENTS:
        # Overlapping views of the keys cannot span sequences (the batch stride is no multiple of
        # a block's), so a batch copies every band: long rows go one at a time, as views.
        rows = [_band_only(q[r : r + 1], k[r : r + 1], v[r : r + 1], visibility, scale) for r in range(batch)]
        return torch.cat([row.transpose(1, 2) for row in rows]).transpose(1, 2)  # (b, h, l, dh)

    def band(q_start: int, q_stop: int, k_start: int, k_stop: int) -> torch.Tensor:
        """Bool ``(lq, lk)``, True where query ``i`` may see key ``j`` (indices in the whole sequence)."""
        rows = torch.arange(q_start, q_stop, device=q.device)[:, None]
        columns = torch.arange(k_start, k_stop, device=q.device)
        seen = visibility.at(rows, columns)
        assert seen is not None
        return seen

    def edge(q_start: int, q_stop: int) -> torch.Tensor:
        k_start, k_stop = max(0, q_start - before), min(length, q_stop + after)
        out = fused_attention(
            q[..., q_start:q_stop, :], k[..., k_start:k_stop, :], v[..., k_start:k_stop, :],
            mask=band(q_start, q_stop, k_start, k_stop), bias=None, causal=False, dropout_p=0.0, scale=scale,
        )  # fmt: skip
        return out.transpose(1, 2)  # (b, lq, h, dh)

    def kv_bands(x: torch.Tensor) -> torch.Tensor:
        banded = x[..., start - before : stop + after, :].unfold(-2, span, block)  # (b, hk, blocks, dh, span)
        # (b * blocks, hk, span, dh or dv): a view of x for one sequence, a copy for more
        return banded.permute(0, 2, 1, 4, 3).reshape(batch * num_blocks, x.shape[1], span, x.shape[-1])

    q_b = q[..., start:stop, :].reshape(batch, heads, num_blocks, block, head_dim).transpose(1, 2)
    q_b = q_b.reshape(batch * num_blocks, heads, block, head_dim)  # (b * blocks, h, block, dh)
    pattern = q.new_zeros(block, span).masked_fill_(~band(before, before + block, 0, span), float("-inf"))
    inner = _fused_kernel(q_b, kv_bands(k), kv_bands(v), pattern, dropout_p=0.0, is_causal=False, scale=scale)
    inner = inner.transpose(1, 2).reshape(batch, num_blocks * block, heads, -1)  # (b, stop - start, h, dh)
    out = torch.cat((edge(0, start), inner, edge(stop, length)), dim=1)  # (b, l, h, dh)
    return out.transpose(1, 2)


def _run(call: AttentionCall) -> Output:
    return Output(_band_only(call.q, call.k, call.v, call.visibility, call.scale))


BAND_ONLY = Route("band only", _declines, _run)
