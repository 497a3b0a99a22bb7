"""Causal attention with a key-only score term, chunk by chunk through the flash kernel (the language-model case).

Shape legend: b batch, h heads, l queries and keys, dv value size.
"""

from __future__ import annotations

import torch

import selfattn.functional._block_key_rows as _block_key_rows
from selfattn.core.call import AttentionCall
from selfattn.core.route import Output, Route
from selfattn.core.routes._blocks import cpu_term_declines, heads
from selfattn.core.routes._reasons import not_simple_term
from selfattn.functional._block_common import _compute_dtype

__all__ = ["CAUSAL_KEY_ROWS"]


def _declines(call: AttentionCall) -> str | None:
    reason = cpu_term_declines(call)
    if reason is None and not call.visibility.kernel_causal:
        reason = "not causal alone on a square"
    elif reason is None and call.block_size is not None:
        reason = "a block size was set"
    elif reason is None and not call.simple_term:
        reason = not_simple_term(call)
    elif reason is None and not call.key_only:
        reason = "the term has no key-only form"
    return reason


def _run(call: AttentionCall) -> Output:
    assert call.term is not None and call.k_positions is not None
    rows = _block_key_rows._causal_key_rows(call.term, call.k_positions, call.num_keys, _compute_dtype(call.dtype))
    assert rows is not None
    q, k, v = heads(call)
    out: torch.Tensor = _block_key_rows._CausalKeyRows.apply(rows, call.scale, q, k, v)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return Output(out)


CAUSAL_KEY_ROWS = Route("causal key rows", _declines, _run)
