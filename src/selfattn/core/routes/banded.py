"""Sliding-window attention in O(l * window): each block of queries sees only its band of keys.

Shape legend: b batch, h heads, hk key/value heads, l queries and keys, dh head size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import selfattn.core.routes._window as _window
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._window import window_declines
from selfattn.functional._kernels import fused_attention
from selfattn.masks import Causal, Dense, Documents, KeyPadding, ValidLengths, Window

__all__ = ["BANDED"]


def _declines(call: AttentionCall) -> str | None:
    reason = window_declines(call)
    if reason is None and not call.visibility.only(Causal, Window, ValidLengths, KeyPadding, Documents):
        reason = "an attn_mask" if call.visibility.find(Dense) is not None else "a mask rule the bands cannot gather"
    elif reason is None and any(isinstance(rule, ValidLengths) and rule.per_query for rule in call.visibility.rules):
        reason = "per-query valid_lens"
    return reason


def _run(call: AttentionCall) -> Output:
    visibility, window = call.visibility, call.visibility.window
    assert window is not None
    q, k, v = call.q, call.k, call.v
    batch, heads, length, head_dim = q.shape
    block, before = _window.window_block(window), window - 1
    after = 0 if visibility.causal else window - 1
    num_blocks = math.ceil(length / block)
    span = block + before + after
    tail = num_blocks * block - length

    def bands(x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``(..., l)`` per key -> ``(..., blocks, span)``: the keys each block of queries may see."""
        return F.pad(x, (before, tail + after), value=fill).unfold(-1, span, block)

    def kv_bands(x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x, (0, 0, before, tail + after))  # (b, hk, before + l + tail + after, dh)
        banded = padded.unfold(-2, span, block)  # (b, hk, blocks, dh, span)
        return banded.permute(0, 2, 1, 4, 3).reshape(batch * num_blocks, x.shape[1], span, x.shape[-1])

    def q_blocks(x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x, (0, tail))
        return padded.view(*padded.shape[:-1], num_blocks, block)  # (..., blocks, block)

    q_b = F.pad(q, (0, 0, 0, tail)).view(batch, heads, num_blocks, block, head_dim)
    q_b = q_b.transpose(1, 2).reshape(batch * num_blocks, heads, block, head_dim)  # (b * blocks, h, block, dh)
    index = torch.arange(length, device=q.device)
    q_index, k_index = q_blocks(index), bands(index, -1)  # (blocks, block), (blocks, span); -1 marks padding
    seen = visibility.at(q_index[:, :, None], k_index[:, None, :])  # (.., blocks, block, span)
    assert seen is not None
    mask = torch.broadcast_to(seen & (k_index >= 0)[:, None, :], (batch, 1, num_blocks, block, span))
    mask = mask.reshape(batch * num_blocks, 1, block, span)
    bias = None
    if call.term is not None:
        assert call.q_positions is not None and call.k_positions is not None
        q_pos = q_blocks(call.q_positions.expand(batch, length)).reshape(batch * num_blocks, block)
        k_pos = bands(call.k_positions.expand(batch, length)).reshape(batch * num_blocks, span)
        bias = call.term(q_b, q_positions=q_pos, k_positions=k_pos)  # (b * blocks, h, block, span)
    out = fused_attention(
        q_b, kv_bands(k), kv_bands(v), mask=mask, bias=bias, causal=False, dropout_p=call.dropout_p, scale=call.scale
    )  # (b * blocks, h, block, dh)
    out = out.view(batch, num_blocks, heads, block, -1).transpose(1, 2)  # (b, h, blocks, block, dh)
    out = out.reshape(batch, heads, num_blocks * block, -1)[:, :, :length]
    if bias is not None:  # a term's bias formed from an infinite query can hide every key (-inf): NaN, as the formula
        out = out + q.sum(dim=-1, keepdim=True).mul(0).to(out.dtype)
    return Output(out)


BANDED = Route("banded", _declines, _run)
