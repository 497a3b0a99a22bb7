"""Split keys (split-K): one head of a few query rows over many keys, its keys cut into chunks the threads share.

PyTorch's CPU flash kernel shares its work out by (batch row, head, block of query rows). A call
of one head and a few rows (absorbed MLA decoding: every head's query stacked as one head's rows
over the one latent key) is a single such item, so one thread computes it however many there
are. Here the keys are cut into ``c`` chunks of ``L`` keys laid along the kernel's head
dimension (a view of the keys, nothing copied; the queries are repeated as a view too), one
kernel call gives each chunk's partial output and log-sum-exp, and the partial outputs are
merged by their log-sum-exps::

    out = sum_i exp(lse_i - m) out_i / sum_i exp(lse_i - m),    m = max_i lse_i

which is the softmax over all the keys, to float rounding. Keys past ``c L`` (fewer than ``c``)
go through one more call merged the same way. The number of chunks follows from the shapes and
the thread count alone (no value is read on the host): :func:`split_chunks`.

Shape legend: b batch, r query rows, lk keys, c chunks, L keys per chunk, d head (and value) size.
"""

from __future__ import annotations

import math

import torch

from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._reasons import holding
from selfattn.functional._few_keys import few_keys, few_keys_forward

__all__ = ["SPLIT_KEYS", "SPLIT_MIN_KEYS", "split_chunks", "split_keys_attention"]

#: Each chunk holds at least this many keys: shorter ones cost more in calls and merging than they share out.
#: Measured (2 threads, 16 rows of 576 features, float32): 1,024 keys in 4 chunks 0.43 ms against the
#: unsplit kernel's 0.67; 16,384 keys 6.95 ms against 9.21.
SPLIT_MIN_KEYS = 256

#: Chunks per thread: two balance threads that finish unevenly (at 2 threads, 16,384 keys: 2 chunks 7.4 ms,
#: 4 chunks 6.95, 8 chunks 7.2).
CHUNKS_PER_THREAD = 2

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _kernel_items(batch: int, heads: int, rows: int) -> int:
    """The work items PyTorch's CPU flash kernel shares among threads: (batch row, head, block of query rows).

    Its query blocks are 32 rows below 192 rows, 64 below 768, else 256 (``q_split_size``).
    """
    block = 32 if rows < 192 else 64 if rows < 768 else 256
    return batch * heads * math.ceil(rows / block)


def _conditions(call: AttentionCall) -> tuple[tuple[str, bool], ...]:
    """Each condition that keeps the route from a call, and whether it holds."""
    return (
        ("not on CPU (the chunks' log-sum-exps come from PyTorch's CPU flash kernel)", not call.on_cpu),
        ("grad mode is on (the kernel's log-sum-exp carries no gradient for the merge)", torch.is_grad_enabled()),
        ("a score term", call.term is not None),
        ("a float bias (attn_mask)", call.bias is not None),
        ("the weights were asked for", call.return_weights),
        ("dropout", call.dropout_p > 0),
        ("heads not (b, h, l, d)", not call.four_d),
        ("compiling", call.compiling),
        ("inside torch.func", call.transformed),
        (f"{call.heads} query and {call.kv_heads} key heads, not one of each", call.heads != 1 or call.kv_heads != 1),
        (f"head size {call.head_dim} and value size {call.value_dim} differ", call.head_dim != call.value_dim),
    )


def split_chunks(call: AttentionCall) -> int:
    """The chunks :data:`SPLIT_KEYS` cuts ``call``'s keys into, or 0 when it declines (from sizes and threads only).

    ``CHUNKS_PER_THREAD`` per thread the kernel's own work items leave idle, at most one per
    :data:`SPLIT_MIN_KEYS` keys; 0 when that is fewer than 2 or the call is not of the route's kind.
    The dispatcher asks at every decoding step (its memory of choices counts the chunks), so the
    conditions are tested here without wording them.
    """
    if (
        call.heads != 1
        or call.kv_heads != 1
        or call.head_dim != call.value_dim
        or call.num_keys < 2 * SPLIT_MIN_KEYS
        or not call.on_cpu
        or torch.is_grad_enabled()
        or call.term is not None
        or call.bias is not None
        or call.return_weights
        or call.dropout_p > 0
        or not call.four_d
        or call.compiling
        or call.transformed
    ):
        return 0
    threads = torch.get_num_threads()
    items = _kernel_items(call.batch, call.heads, call.num_queries)
    if items >= threads:
        return 0
    chunks = min(CHUNKS_PER_THREAD * threads // items, call.num_keys // SPLIT_MIN_KEYS)
    return chunks if chunks >= 2 else 0


def _declines(call: AttentionCall) -> str | None:
    if split_chunks(call):
        return None
    reason = holding(*_conditions(call))
    if reason:
        return reason
    threads = torch.get_num_threads()
    items = _kernel_items(call.batch, call.heads, call.num_queries)
    if items >= threads:
        return f"the fused kernel's {items} work item(s) already keep {threads} thread(s) busy"
    return f"{call.num_keys} keys: too few for 2 chunks of {SPLIT_MIN_KEYS}"


def _float_mask(call: AttentionCall) -> torch.Tensor | None:
    """The visibility as a float mask ``(b or 1, 1, r or 1, lk)`` of the call's dtype (0 or -inf), or None if all is seen."""
    mask = call.dense_mask()
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask[None]
    return torch.zeros(mask.shape, dtype=call.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's output ``(b, c, r, d)`` and log-sum-exp ``(b, c, r)``; ``-inf`` where a chunk shows a row no key.

    ``q`` ``(b, 1, r, d)`` is repeated (a view) over the ``c`` heads of ``k`` and ``v`` ``(b, c, L, d)``.
    The kernel gives a row that sees no key a zero output and a log-sum-exp of 0.
    """
    q = q.expand(-1, k.shape[1], -1, -1)  # (b, c, r, d)
    if few_keys(q, k):  # the kernel passes over a NaN score there (a chunk of NaN keys would weigh nothing)
        out, lse = few_keys_forward(q, k, v, mask, is_causal=False, scale=scale)
    else:
        out, lse = _FLASH_CPU(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None:
        lse = lse.masked_fill(~(mask > float("-inf")).any(dim=-1), float("-inf"))
    return out, lse


def split_keys_attention(call: AttentionCall, chunks: int) -> torch.Tensor:
    """``call``'s output ``(b, 1, r, d)`` computed over its keys cut into ``chunks`` (2 or more) of equal length.

    The route's computation, with the number of chunks given (tests take any, on any thread count).
    """
    # The kernel reads each row's features as contiguous (scaled_dot_product_attention makes them so before it).
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (call.q, call.k, call.v))  # (b, 1, r or lk, d)
    length = call.num_keys // chunks
    split = chunks * length
    mask = _float_mask(call)  # (b or 1, 1, r or 1, lk)
    main_keys, main_values = (t[:, 0, :split].view(t.shape[0], chunks, length, -1) for t in (k, v))  # (b, c, L, d)
    main_mask = None  # (b or 1, c, r or 1, L)
    if mask is not None:
        main_mask = mask[:, 0, :, :split].view(mask.shape[0], mask.shape[2], chunks, length).transpose(1, 2)
    outs, lses = _partials(q, main_keys, main_values, main_mask, call.scale)
    if split < call.num_keys:  # the last keys, fewer than the chunks
        tail_mask = None if mask is None else mask[..., split:]
        tail_out, tail_lse = _partials(q, k[:, :, split:], v[:, :, split:], tail_mask, call.scale)
        outs, lses = torch.cat((outs, tail_out), dim=1), torch.cat((lses, tail_lse), dim=1)
    largest = lses.amax(dim=1, keepdim=True)  # (b, 1, r)
    weights = torch.exp(lses - largest.masked_fill(largest == float("-inf"), 0.0))  # (b, c, r): 0 for unseen chunks
    merge = torch.promote_types(outs.dtype, torch.float32)
    total = weights.sum(dim=1, keepdim=True)[..., None]  # (b, 1, r, 1): 0 where a row sees no key
    out = (outs.to(merge) * weights[..., None]).sum(dim=1, keepdim=True)
    # a row that sees no key gets zeros, as from the fused route; a NaN (a NaN score in a chunk) stays NaN
    out = torch.where(total == 0, 0.0, out / total)
    # The kernel gives a query holding NaN or inf a zero row; the formula gives NaN (as the fused route does).
    out = out + q.sum(dim=-1, keepdim=True, dtype=merge).mul(0)
    return out.to(call.dtype)  # (b, 1, r, d)


def _run(call: AttentionCall) -> Output:
    return Output(split_keys_attention(call, split_chunks(call)))


SPLIT_KEYS = Route("split keys", _declines, _run)
