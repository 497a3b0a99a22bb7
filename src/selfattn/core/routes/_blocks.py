"""What the blockwise routes share: when blocks can serve a call at all, and the plan they run.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import torch

from selfattn.core.call import AttentionCall
from selfattn.functional._block_autograd import _BlockwiseAttention
from selfattn.functional._block_clipped import _Clipped
from selfattn.functional._block_common import MIN_BLOCK, choose_block_size
from selfattn.functional._block_plan import _Plan
from selfattn.functional._kernels import _repeat_kv
from selfattn.masks import Causal, Dense, Documents, KeyPadding, ValidLengths

#: A smaller block is chosen only when the blocks' computed pairs shrink by more than this factor.
SMALLER_BLOCKS_WORTH = 1.25

__all__ = ["SMALLER_BLOCKS_WORTH", "block_for", "blocks_decline", "plan_for", "reached_share", "run_plan"]


def blocks_decline(call: AttentionCall) -> str | None:
    """Why no blockwise route can take the call (the weights wanted, a float bias, a compiled graph), or None.

    Worked out once per call: most routes ask.
    """
    return call.remember("blocks_decline", _blocks_decline)


def _blocks_decline(call: AttentionCall) -> str | None:
    if call.return_weights:
        return "the weights were asked for"
    if call.bias is not None:
        return "a float bias (attn_mask) is given"
    if call.compiling:
        return "compiling: the blockwise loop is eager Python with a custom autograd Function"
    if call.transformed:
        return "inside a torch.func transform (the blockwise autograd Function has no functorch rule)"
    if not call.four_d:
        return "q, k, v are not (b, h, l, d)"
    return None


def cpu_term_declines(call: AttentionCall) -> str | None:
    """Why a route that hands a score term's blocks to the CPU flash kernel cannot take the call, or None."""
    if call.term is None:
        return "no score term"
    reason = blocks_decline(call)
    if reason is None and not call.on_cpu:
        reason = "not on CPU (the flash kernel of these blocks is the CPU one)"
    return reason


def heads(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (b, h, lq, d)``, and ``k, v`` repeated to every query head ``(b, h, lk, d)``: blocks take every head."""
    q = call.q
    return q, _repeat_kv(q, call.k), _repeat_kv(q, call.v)


def block_for(call: AttentionCall) -> int:
    """Queries per block: the call's ``block_size``, or :func:`choose_block_size` of its sizes made smaller
    while that lets the blocks skip many more keys (chunks, windows: a block should not straddle many).

    Of the powers of two from the chosen size down to ``MIN_BLOCK``, the largest whose blocks
    compute at most :data:`SMALLER_BLOCKS_WORTH` times the fewest pairs any of them computes.
    """
    if call.block_size:
        return max(1, min(call.block_size, call.num_queries))
    block = choose_block_size(call.batch, call.heads, call.num_queries, call.num_keys, dtype=call.dtype)
    block = max(1, min(block, call.num_queries))
    if call.visibility.only(Causal, ValidLengths, KeyPadding, Dense, Documents):
        return block  # no rule bounds the keys from below: smaller blocks skip nothing more
    candidates = [block >> halvings for halvings in range(block.bit_length()) if block >> halvings >= MIN_BLOCK]
    shares = {size: reached_share(call, size) for size in candidates or [block]}
    fewest = min(shares.values())
    return next(size for size, share in shares.items() if share <= SMALLER_BLOCKS_WORTH * fewest)


def reached_share(call: AttentionCall, block: int) -> float:
    """The share of the ``(lq, lk)`` pairs that blocks of ``block`` queries compute, skipping keys no query of a block reaches."""
    visibility, pairs = call.visibility, 0
    for start in range(0, call.num_queries, block):
        end = min(start + block, call.num_queries)
        low, high = visibility.key_range(start, end)
        pairs += (end - start) * (high - low)
    return pairs / max(call.num_queries * call.num_keys, 1)


def plan_for(call: AttentionCall, *, block: int | None = None, **choices: object) -> _Plan:
    """The plan of a blockwise call; ``choices`` set the route's own fields (``band_base``, ``clipped``, ``key_bias``)."""
    block = block_for(call) if block is None else max(1, min(block, call.num_queries))
    seed = int(torch.randint(0, 2**62, (1,)).item()) if call.dropout_p > 0 else 0
    grad = torch.is_grad_enabled()
    queries_in_term = bool(grad and call.q.requires_grad and call.term_reads_queries)
    names = []
    if call.term is not None and call.term_parameters:
        wanted = {id(p) for p in call.term_parameters}
        names = [name for name, p in call.term.named_parameters() if id(p) in wanted]
    return _Plan(
        term=call.term,
        q_positions=call.q_positions,
        k_positions=call.k_positions,
        visibility=call.visibility,
        scale=call.scale,
        block=block,
        dropout_p=call.dropout_p,
        seed=seed,
        bias_needs_grad=bool(call.term_parameters) or queries_in_term,
        queries_in_term=queries_in_term,
        value_term=call.value_term,
        num_queries=call.num_queries,
        num_keys=call.num_keys,
        on_cpu=call.on_cpu,
        param_names=names,
        softcap=call.softcap,
        sink_param=None if call.sinks is None else len(call.term_parameters),
        **choices,  # type: ignore[arg-type]
    )


def run_plan(call: AttentionCall, plan: _Plan) -> torch.Tensor:
    """The plan through :class:`_BlockwiseAttention`, ``(b, h, lq, dv)``."""
    q, k, v = heads(call)
    sinks = [] if call.sinks is None else [call.sinks]
    out: torch.Tensor = _BlockwiseAttention.apply(plan, q, k, v, *call.term_parameters, *sinks)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return out


def clipped_for(call: AttentionCall) -> _Clipped | None:
    """Shaw's clipped tables at consecutive positions, or None."""
    embeddings = None if call.term is None else call.term.clipped_embeddings()
    if embeddings is None or call.consecutive is None:
        return None
    first_query, first_key = call.consecutive
    reach, key_table, value_table, key_scale = embeddings
    params = call.term_parameters
    return _Clipped(
        max_distance=reach,
        key_table=key_table,
        value_table=value_table,
        key_scale=key_scale,
        offset=first_key - first_query,
        key_param=next((i for i, p in enumerate(params) if p is key_table), None),
        value_param=next((i for i, p in enumerate(params) if p is value_table), None),
    )
