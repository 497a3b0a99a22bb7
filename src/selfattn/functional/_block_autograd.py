"""The blockwise forward and backward passes: one block of queries at a time, flash or explicit per block.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from selfattn.functional._block_clipped import _clipped_probs, _ends, _per_distance, _with_indicators
from selfattn.functional._block_common import (
    _add_matmul,
    _compute_dtype,
    _flash_backward,
    _flash_forward,
    _float_mask,
    _keys_share,
    _modified_block_probs,
    _settle_empty_rows,
    _softmax_backward,
    _Workspace,
)
from selfattn.functional._block_plan import _Plan
from selfattn.functional._dropout_masks import dropout_keep_probability


def _differentiable_forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The forward of :class:`_BlockwiseAttention` block by block in differentiable ops (for double backward)."""
    compute = _compute_dtype(q.dtype)
    inverse_keep = 1.0 / dropout_keep_probability(plan.dropout_p)
    pieces = []
    for index, start, end, keys in plan.blocks():
        qc, kc, vc = q[..., start:end, :].to(compute), k[..., keys, :].to(compute), v[..., keys, :].to(compute)
        visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
        bias = plan.bias(qc, start, end, keys)
        scores = torch.matmul(qc, kc.transpose(-2, -1)) * plan.scale  # (b, h, block, keys)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if plan.softcap is not None:
            scores = torch.tanh(scores / plan.softcap) * plan.softcap
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            sink_column = sinks.to(compute)[:, None, None].expand(*scores.shape[:-1], 1)  # (b, h, block, 1)
            weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
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
        sinks = plan.sinks(params)
        sink_logits = None if sinks is None else sinks.detach().to(compute)  # (h,)
        workspace = _Workspace(q.device)
        value_sums: torch.Tensor | None = None
        for index, start, end, keys in plan.blocks():
            qb, kb, vb = q[..., start:end, :], k[..., keys, :], v[..., keys, :]
            visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
            block_lse: torch.Tensor | None
            if plan.flash_forward:
                block_out, block_lse = _flash_block(plan, qb, kb, vb, visible, band, sink_logits, start, end, keys)
            else:  # the explicit backward recomputes the probabilities with the fused softmax: no lse
                qc, kc, vc = qb.to(compute), kb.to(compute), vb.to(compute)
                clipped = plan.clipped
                if clipped is not None:
                    split = clipped.split(start, end, keys.stop, q.device)
                    weights, _ = _clipped_probs(clipped, qc, kc, visible, plan.scale, split, workspace)
                else:
                    bias = plan.bias(qc, start, end, keys) if band is None else plan.window(band, start, end, keys)
                    weights = _modified_block_probs(
                        qc,
                        kc,
                        bias,
                        visible,
                        plan.scale,
                        workspace,
                        softcap=plan.softcap,
                        sinks=sink_logits,
                        want_slope=False,
                    ).probs  # (b, h, block, keys)
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
        q, k, v, _, _, *params = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate a recomputation made of plain ops
            inputs = [q, k, v, *params]
            wanted = [t.requires_grad for t in inputs]
            with ctx.plan.using(params):
                out = _differentiable_forward(ctx.plan, q, k, v, ctx.plan.sinks(params))
            sources = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, sources, grad_out, create_graph=True, allow_unused=True))
            return (None, *(next(grads) if w else None for w in wanted))
        with torch.no_grad(), ctx.plan.using(params):
            return _Backward(ctx, grad_out).run()


class _Backward:
    """The blockwise backward pass: gradients gathered block by block, the probabilities recomputed.

    A flash block hands its gradient to the CPU kernel; an explicit block recomputes its
    probabilities, applies dropout's mask, the value term's and the clipped tables' gradients,
    and hands the score gradient to the keys, the queries and the term's parameters.
    """

    def __init__(self, ctx: Any, grad_out: torch.Tensor):
        self.plan: _Plan = ctx.plan
        self.value_sums: torch.Tensor | None = ctx.value_sums
        self.q, self.k, self.v, self.out, self.lse, *self.params = ctx.saved_tensors
        self.term_params = list(self.plan.term_params(self.params))
        sinks = self.plan.sinks(self.params)
        self.grad_out = grad_out
        q, k, v = self.q, self.k, self.v
        self.compute = compute = _compute_dtype(q.dtype)
        self.dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        self.dk = torch.zeros(k.shape, dtype=compute, device=k.device)
        self.dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        self.param_grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.sink_logits = None if sinks is None else sinks.detach().to(compute)  # (h,)
        self.sink_grad = None if sinks is None else torch.zeros(sinks.shape, dtype=compute, device=q.device)
        self.inverse_keep = 1.0 / dropout_keep_probability(self.plan.dropout_p)
        self.workspace = _Workspace(q.device)
        self.band = self.band_values = self.band_grad = None
        if self.plan.band_base is not None:
            with torch.set_grad_enabled(self.plan.bias_needs_grad):
                self.band = self.plan.band(q[:1, :, : self.plan.block].to(compute))
            self.band_values = self.plan.hide_future(self.band.detach())
            if self.band.requires_grad:  # the score gradient of every block lands in one band-sized tensor
                self.band_grad = torch.zeros(self.band.shape, dtype=self.band.dtype, device=self.band.device)

    def run(self) -> tuple[torch.Tensor | None, ...]:
        plan, q = self.plan, self.q
        for index, start, end, keys in plan.blocks():
            visible, empty = _settle_empty_rows(plan.visible(start, end, keys, q.device))
            gb = self.grad_out[..., start:end, :]
            if empty is not None:
                gb = gb.masked_fill(empty, 0.0)  # the output of an empty row is a constant zero
            if plan.flash_backward:
                self.flash_block(start, end, keys, visible, gb)
            else:
                self.explicit_block(index, start, end, keys, visible, gb)
        if self.band is not None and self.band_grad is not None:
            self.accumulate(torch.autograd.grad(self.band, self.term_params, self.band_grad, allow_unused=True))
        if self.sink_grad is not None:
            assert self.plan.sink_param is not None
            self.add_param_grad(self.plan.sink_param, self.sink_grad)
        dq, dk, dv = self.dq.to(q.dtype), self.dk.to(self.k.dtype), self.dv.to(self.v.dtype)
        return (None, dq, dk, dv, *self.param_grads)

    def accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        for i, g in enumerate(grads):
            if g is not None:
                previous = self.param_grads[i]
                self.param_grads[i] = g if previous is None else previous + g

    def add_param_grad(self, i: int, g: torch.Tensor) -> None:
        self.accumulate([None] * i + [g.to(self.params[i].dtype)])

    def block_bias(self, q: torch.Tensor, start: int, end: int, keys: slice) -> torch.Tensor | None:
        if self.band_values is None:
            return self.plan.bias(q, start, end, keys)
        return self.plan.window(self.band_values, start, end, keys)

    def flash_block(self, start: int, end: int, keys: slice, visible: torch.Tensor | None, gb: torch.Tensor) -> None:
        plan, q, k, v = self.plan, self.q, self.k, self.v
        qb, kb, vb = q[..., start:end, :], k[..., keys, :], v[..., keys, :]
        if plan.key_bias is not None:
            mask: torch.Tensor | None = plan.key_mask(end - start, keys)
        else:
            mask = _float_mask(self.block_bias(qb.to(self.compute), start, end, keys), visible, self.compute)
        ob, lse = self.out[..., start:end, :].to(q.dtype), self.lse[..., start:end]
        scaled = gb
        if self.sink_logits is not None:  # the kernel's backward of its own lse, the gradient times the keys' share
            scaled = gb * torch.sigmoid(lse - self.sink_logits[:, None]).unsqueeze(-1).to(gb.dtype)
        gq, gk, gv = _flash_backward(
            scaled.contiguous(), qb, kb, vb, ob, lse, 0.0, False, attn_mask=mask, scale=plan.scale
        )
        self.dq[..., start:end, :] = gq
        self.dk[..., keys, :] += gk
        self.dv[..., keys, :] += gv
        if self.sink_logits is not None:
            sink_weight = torch.sigmoid(self.sink_logits[:, None] - lse)  # (b, h, block)
            self.add_sink_grad(sink_weight, (gb.to(self.compute) * ob.to(self.compute)).sum(dim=-1))

    def add_sink_grad(self, sink_weight: torch.Tensor, row_dot: torch.Tensor) -> None:
        """The sink takes weight ``s`` of a row whose ``sum_j p_j dL/dp_j`` is ``row_dot``: its logit's gradient is ``-s * row_dot``."""
        assert self.sink_grad is not None
        self.sink_grad -= (sink_weight * row_dot).sum_to_size(1, *self.sink_grad.shape, 1).flatten()

    def explicit_block(
        self, index: int, start: int, end: int, keys: slice, visible: torch.Tensor | None, gb: torch.Tensor
    ) -> None:
        plan, compute, workspace = self.plan, self.compute, self.workspace
        qc, kc = self.q[..., start:end, :].to(compute), self.k[..., keys, :].to(compute)
        vc, gc = self.v[..., keys, :].to(compute), gb.to(compute)
        q_leaf = qc.detach().requires_grad_(plan.queries_in_term)
        clipped, split, k_wide, bias = plan.clipped, None, None, None
        if clipped is not None:
            split = clipped.split(start, end, keys.stop, self.q.device)
            probs, k_wide = _clipped_probs(clipped, qc, kc, visible, plan.scale, split, workspace)
            sink_weight = cap_slope = None  # the clipped route takes no softcap or sinks
        else:
            with torch.set_grad_enabled(plan.bias_needs_grad and self.band_values is None):
                bias = self.block_bias(q_leaf, start, end, keys)
            probs, sink_weight, cap_slope = _modified_block_probs(
                qc, kc, None if bias is None else bias.detach(), visible, plan.scale, workspace,
                softcap=plan.softcap, sinks=self.sink_logits, want_slope=True,
            )  # fmt: skip
        keep = plan.keep_factors(index, probs.shape, compute, workspace) if plan.dropout_p > 0 else None
        g_scaled = gc if keep is None else gc * self.inverse_keep  # dropout's 1 / keep, on the small side
        # Without a value term the dropped weights serve only the values' gradient: they are
        # made in place from probs after its last use (no buffer, one stream fewer).
        drop_late = keep is not None and not plan.value_term and (clipped is None or clipped.value_table is None)
        dropped = probs
        if keep is not None and not drop_late:
            # the forward's weights, unscaled: probs with the same entries dropped
            dropped = torch.mul(probs, keep, out=workspace.get("dropped", probs.shape, compute))
        if not drop_late:
            _add_matmul(self.dv[..., keys, :], dropped.transpose(-2, -1), g_scaled)
        grad_weights = self.weights_grad(start, end, keys, vc, g_scaled, dropped, split)
        if keep is not None:
            grad_weights = grad_weights.mul_(keep)
        if sink_weight is not None:
            self.add_sink_grad(sink_weight, (grad_weights * probs).sum(dim=-1))
        grad_scores = _softmax_backward(grad_weights, probs)  # (b, h, block, keys)
        if cap_slope is not None:
            grad_scores = grad_scores.mul_(cap_slope)  # through the cap, to the logit before it
        if drop_late:
            assert keep is not None
            _add_matmul(self.dv[..., keys, :], probs.mul_(keep).transpose(-2, -1), g_scaled)
        self.queries_grad(start, end, qc, kc, grad_scores, split, k_wide)
        _add_matmul(self.dk[..., keys, :], grad_scores.transpose(-2, -1), qc * plan.scale)
        self.term_grad(start, end, keys, grad_scores, bias, q_leaf)

    def weights_grad(
        self,
        start: int,
        end: int,
        keys: slice,
        vc: torch.Tensor,
        g_scaled: torch.Tensor,
        dropped: torch.Tensor,
        split: tuple[int, int, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The gradient of the block's (dropped) weights, ``(b, h, block, keys)``; the value tables' on the way."""
        plan, compute = self.plan, self.compute
        grad_buffer = self.workspace.get("grad", dropped.shape, compute)
        clipped = plan.clipped
        if clipped is not None and clipped.value_table is not None:
            assert split is not None
            first, last, distance_index = split
            table = clipped.value_table.to(compute)
            g_by_distance = torch.matmul(g_scaled, table.t())  # (b, h, block, 2K+1)
            g_wide = torch.cat([g_scaled, _ends(g_by_distance)], dim=-1)  # (b, h, block, dv + 2)
            v_wide = _with_indicators(
                vc, first, last, self.workspace.get("v_wide", (*vc.shape[:-1], vc.shape[-1] + 2), compute)
            )
            grad_weights = torch.matmul(g_wide, v_wide.transpose(-2, -1), out=grad_buffer)
            if last > first:
                grad_weights[..., first:last] += torch.gather(
                    g_by_distance, -1, distance_index.expand(*g_by_distance.shape[:-1], -1)
                )
            if clipped.value_param is not None:
                assert self.value_sums is not None
                sums = self.value_sums[..., start:end, :]  # (b, h, block, 2K+1), saved by the forward
                self.add_param_grad(
                    clipped.value_param, sums.reshape(-1, sums.shape[-1]).t() @ g_scaled.reshape(-1, g_scaled.shape[-1])
                )
            return grad_weights
        grad_weights = torch.matmul(g_scaled, vc.transpose(-2, -1), out=grad_buffer)
        if plan.value_term:  # linear in the weights, so g * (1 / keep) gives its gradients with dropout
            with torch.enable_grad():
                weights_leaf = dropped.detach().requires_grad_(True)
                value = plan.value(weights_leaf, start, end, keys)
                grads = torch.autograd.grad(value, [weights_leaf, *self.term_params], g_scaled, allow_unused=True)
            if grads[0] is not None:
                grad_weights += grads[0]
            self.accumulate(grads[1:])
        return grad_weights

    def queries_grad(
        self,
        start: int,
        end: int,
        qc: torch.Tensor,
        kc: torch.Tensor,
        grad_scores: torch.Tensor,
        split: tuple[int, int, torch.Tensor] | None,
        k_wide: torch.Tensor | None,
    ) -> None:
        """The block's query gradient, and with clipped key tables, the tables' gradient."""
        plan, clipped = self.plan, self.plan.clipped
        if clipped is None or clipped.key_table is None or k_wide is None:
            self.dq[..., start:end, :] = torch.matmul(grad_scores, kc) * plan.scale
            return
        assert split is not None
        dq_wide = torch.matmul(grad_scores, k_wide)  # (b, h, block, d + 2)
        table = clipped.key_table.to(self.compute)
        sums = _per_distance(dq_wide, grad_scores, split, table.shape[0])  # (b, h, block, 2K+1)
        self.dq[..., start:end, :] = dq_wide[..., :-2] * plan.scale + torch.matmul(sums, table) * clipped.key_scale
        if clipped.key_param is not None:
            per_distance = sums.reshape(-1, sums.shape[-1]).t()
            queries = qc.expand(*sums.shape[:-1], -1).reshape(-1, qc.shape[-1])
            self.add_param_grad(clipped.key_param, (per_distance @ queries) * clipped.key_scale)

    def term_grad(
        self,
        start: int,
        end: int,
        keys: slice,
        grad_scores: torch.Tensor,
        bias: torch.Tensor | None,
        q_leaf: torch.Tensor,
    ) -> None:
        """The score gradient into the term: its band, or autograd on the block's bias (parameters, queries)."""
        plan = self.plan
        if self.band_grad is not None:
            window = plan.window(self.band_grad, start, end, keys)
            window += grad_scores.sum_to_size(window.shape)
            return
        if bias is None or not bias.requires_grad:
            return
        inputs = ([q_leaf] if plan.queries_in_term else []) + self.term_params
        grads = torch.autograd.grad(bias, inputs, grad_scores.sum_to_size(bias.shape).to(bias.dtype), allow_unused=True)
        if plan.queries_in_term:
            if grads[0] is not None:
                self.dq[..., start:end, :] += grads[0]
            grads = grads[1:]
        self.accumulate(grads)


def _flash_block(
    plan: _Plan, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, visible: Any, band: Any,
    sink_logits: torch.Tensor | None, start: int, end: int, keys: slice,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block on the flash kernel: ``(b, h, block, dv)`` and the kernel's own log-sum-exp ``(b, h, block)``."""
    compute = _compute_dtype(qb.dtype)
    if plan.key_bias is not None:
        mask: torch.Tensor | None = plan.key_mask(end - start, keys)
    else:
        bias = plan.bias(qb.to(compute), start, end, keys) if band is None else plan.window(band, start, end, keys)
        mask = _float_mask(bias, visible, compute)
    block_out, block_lse = _flash_forward(qb, kb, vb, attn_mask=mask, scale=plan.scale)
    block_lse = block_lse.to(compute)
    if sink_logits is not None:
        # The sink joins the denominator: the row times the keys' share, the kernel's own lse kept for the backward.
        block_out = block_out * _keys_share(block_lse, sink_logits).unsqueeze(-1).to(block_out.dtype)
        # A query whose every score is -inf (an infinity against opposed keys) gets zeros, as the formula does: the
        # sink takes the whole row. Any NaN or +inf score the kernel spreads (below one vector: the formula).
        return block_out, block_lse
    # The CPU kernel gives a zero row for a query holding an infinity whose every score is -inf; the formula, NaN.
    query_sums = qb.sum(dim=-1, keepdim=True, dtype=compute)  # (b, h, block, 1)
    return block_out + query_sums.mul(0).to(block_out.dtype), block_lse
