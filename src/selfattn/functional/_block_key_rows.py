"""Key-only score terms (ALiBi's causal form): one row of bias per call, or per chunk of a causal call.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.functional._block_common import ScoreTerm, _as_4d, _compute_dtype, _flash_backward, _flash_forward
from selfattn.masks import Visibility


def _key_only_bias(
    term: ScoreTerm, k_positions: torch.Tensor, visibility: Visibility, dtype: torch.dtype
) -> torch.Tensor | None:
    """One ``(1 or b, h, 1, lk)`` row of float mask serving every query, or None if the term has none.

    A term that is a function of the key alone up to a constant per query (ALiBi's causal form,
    ``m (j - a)``; see :meth:`~selfattn.positional.ScoreEncoding.key_only_term`) needs no
    ``(lq, lk)`` bias, only this row, so one expanded view is the mask of any block. The anchor
    ``a`` is the last visible key of each sequence: the keys a query weighs most then get a bias
    near zero, where float32 is as exact as on the term itself. Hidden keys hold ``-inf``; a
    sequence that sees no key sees them all here (its rows are zeroed afterwards). Only for
    visibility that is the same for every query (``visibility.same_for_every_query``).
    """
    num_keys = k_positions.shape[-1]
    positions = k_positions.long().reshape(-1, 1, 1, num_keys)  # (1 or b, 1, 1, lk)
    visible = torch.ones(1, 1, 1, num_keys, dtype=torch.bool, device=positions.device)
    row_mask = visibility.key_row(positions.device)
    if row_mask is not None:
        visible = visible & _as_4d(row_mask)
    anyone = visible.any(dim=-1, keepdim=True)  # (.., 1): sequences with a visible key
    anchor = torch.where(visible, positions, positions.min()).amax(dim=-1, keepdim=True)
    anchor = torch.where(anyone, anchor, 0)
    row = term.key_only_term(positions - anchor, dtype)  # (1 or b, h, 1, lk)
    if row is None:
        return None
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
    positions = k_positions.long().reshape(-1, 1, 1, num_keys)  # (1 or b, 1, 1, lk)
    rows = []
    for start in range(0, num_keys, CAUSAL_CHUNK):
        end = min(start + CAUSAL_CHUNK, num_keys)
        anchor = positions[..., end - 1 : end]  # (1 or b, 1, 1, 1)
        row = term.key_only_term(positions[..., :end] - anchor, dtype)
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
                # Divided by their sum, the two shares sum to 1: merged's rounding (5e-4 at scores of 1e4 in
                # float32) would otherwise scale the row (a convex sum of values 200 gave 200.1).
                share, early_share = (block_lse - merged).exp(), (early_lse.to(compute) - merged).exp()
                total = (share + early_share)[..., None]
                block_out = block_out.to(compute) * share[..., None] + early_out.to(compute) * early_share[..., None]
                block_out = block_out / total
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
