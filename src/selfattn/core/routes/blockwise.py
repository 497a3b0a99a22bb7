"""Score terms, value terms and dropout one block of queries at a time, in O(block) memory.

Three routes share the engine (:class:`~selfattn.functional._block_autograd._BlockwiseAttention`)
and differ in how a block's bias is made: Shaw's clipped tables without gathers, one band of a
relative term read by every block, or the term called per block (any term at all).

Shape legend: b batch, h heads, lq queries, dv value size.
"""

from __future__ import annotations

from selfattn._mask_selection import Selected
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import block_for, blocks_decline, clipped_for, plan_for, reached_share, run_plan
from selfattn.core.routes._decode import decode_step, decode_step_for, takes_decode_step
from selfattn.masks import Causal, Dense, Documents, KeyPadding, ValidLengths

__all__ = ["BLOCKWISE", "BLOCKWISE_ANY", "BLOCKWISE_BAND", "BLOCKWISE_CLIPPED"]


#: A call with nothing else for blocks goes blockwise when its blocks compute at most this share of the pairs,
#: and it has at least SKIPPING_MIN_PAIRS (query, key) pairs (below, one fused call with a mask is cheaper).
SKIPPED_BLOCKS_WORTH = 0.5
SKIPPING_MIN_PAIRS = 1 << 16
#: The share for a call holding a top-k selection (:func:`selfattn.masks.selected`) the "sparse selection"
#: route declined: the fused kernel would take it only with a dense mask over every pair, so causal blocks,
#: which compute a little over half of them, pay at once (n=4096, top-k 512, 16 heads 192/128, one thread:
#: blockwise at 52% of the pairs 17-19 s, the masked fused pass 34-37 s; ``benchmarks/sparse_selection.py``).
SELECTION_BLOCKS_WORTH = 0.6


def _nothing_for_blocks(call: AttentionCall) -> str | None:
    return call.remember("blocks_skip_nothing", _blocks_skip_nothing)  # three routes ask: worked out once per call


def _blocks_skip_nothing(call: AttentionCall) -> str | None:
    reason = blocks_decline(call)
    if reason is not None or call.term is not None or call.dropout_p > 0 or call.modifies_scores:
        return reason
    if call.visibility.kernel_causal or call.visibility.only(Causal, ValidLengths, KeyPadding, Dense, Documents):
        return "no score term, no dropout, no softcap, no sinks, and no key range to skip"
    if call.num_queries * call.num_keys < SKIPPING_MIN_PAIRS:
        return (
            f"no score term, no dropout, no softcap, no sinks, and only {call.num_queries * call.num_keys:,} (query, key) "
            f"pairs: below {SKIPPING_MIN_PAIRS:,}, one fused call with a mask is cheaper than blocks that skip some"
        )
    share = reached_share(call, block_for(call))
    worth = SELECTION_BLOCKS_WORTH if call.visibility.find(Selected) is not None else SKIPPED_BLOCKS_WORTH
    if share > worth:
        return (
            f"no score term, no dropout, no softcap, no sinks, and blocks would compute {share:.0%} of the pairs "
            f"(more than {worth:.0%})"
        )
    return None


#: Why the clipped and band routes leave a decoding step to the plain blockwise route: each would compute it as that
#: route does (one pass over the keys), after reading whether the positions count up, which waits for a GPU.
_DECODING = "a decoding step: the blockwise route computes it in one pass, without reading the positions"


def _declines_clipped(call: AttentionCall) -> str | None:
    reason = _nothing_for_blocks(call)
    if reason is None and (call.term is None or call.term.clipped_embeddings() is None):
        reason = "the term has no clipped tables"
    if reason is None and takes_decode_step(call):
        reason = _DECODING
    if reason is None and call.consecutive is None:
        reason = "positions are not consecutive"
    return reason


def _run_clipped(call: AttentionCall) -> Output:
    return Output(run_plan(call, plan_for(call, clipped=clipped_for(call))))


def _band_base(call: AttentionCall, block: int) -> int:
    consecutive: tuple[int, int] | None = call.consecutive
    assert consecutive is not None
    first_query, first_key = consecutive
    last_start = (call.num_queries - 1) // block * block
    return first_key - first_query - last_start


def _declines_band(call: AttentionCall) -> str | None:
    reason = _nothing_for_blocks(call)
    if reason is None and (call.term is None or not call.term.is_relative):
        reason = "no score term" if call.term is None else "the score term is not relative (its is_relative is False)"
    elif reason is None and call.term_reads_queries:
        reason = "the term reads the queries"
    elif reason is None and takes_decode_step(call):
        reason = _DECODING
    elif reason is None and call.consecutive is None:
        reason = "positions are not consecutive"
    elif reason is None and call.visibility.causal and call.num_queries > call.num_keys:
        reason = "causal with more queries than keys"
    return reason


def _run_band(call: AttentionCall) -> Output:
    plan = plan_for(call, skip_leading_keys=True)
    plan.band_base = _band_base(call, plan.block)
    return Output(run_plan(call, plan))


def _run_any(call: AttentionCall) -> Output:
    if takes_decode_step(call):
        return Output(decode_step(call, call.full_bias()))
    return Output(run_plan(call, plan_for(call, skip_leading_keys=True)))


BLOCKWISE_CLIPPED = Route("blockwise clipped", _declines_clipped, _run_clipped)
BLOCKWISE_BAND = Route("blockwise band", _declines_band, _run_band, modifies_scores=True)
BLOCKWISE = Route("blockwise", _nothing_for_blocks, _run_any, modifies_scores=True, step_for=decode_step_for)
#: The last resort of :func:`~selfattn.functional.blockwise_attention`, which is asked for blocks.
BLOCKWISE_ANY = Route("blockwise", lambda call: None, _run_any, modifies_scores=True, step_for=decode_step_for)
