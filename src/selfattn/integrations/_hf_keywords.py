"""The keywords transformers' models pass to an attention function, each honoured, not read (and why) or refused.

:func:`selfattn.integrations.transformers.attention_forward` takes the ones it honours as
parameters; this module classifies the rest and turns the selections and packed lengths into
bool visibility (True = attend) that is "and"-ed with the causal and padding masks.

Shape legend:
    b: batch, h: query heads, hk: key/value heads, hs: heads of a selection (1, hk or h),
    lq: queries, lk: keys, t: selected entries per query, d: head size, dv: value size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.masks import Visibility, documents

__all__ = [
    "HONOURED",
    "NOT_READ",
    "REFUSED",
    "check_keywords",
    "checked_selection",
    "head_scale",
    "packed_documents",
    "prepend_sink_key",
    "selected_keys",
    "sequence_documents",
]

HONOURED = frozenset(
    {
        "module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal", "sliding_window",
        "softcap", "s_aux", "sinks", "position_bias", "indices", "topk_indices", "block_indices", "head_mask",
        "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "output_attentions",
    }
)  # fmt: skip
"""Keywords :func:`~selfattn.integrations.transformers.attention_forward` applies as transformers' eager function would."""

NOT_READ = {
    "position_ids": "transformers folds packed position ids into the mask it builds; eager and sdpa do not read them",
    "max_length_q": "a flash-attention kernel's sizing hint; the lengths themselves are in cu_seq_lens_q",
    "max_length_k": "a flash-attention kernel's sizing hint; the lengths themselves are in cu_seq_lens_k",
    "use_cache": "whether the model keeps a cache; the keys and values passed here already hold it",
    "output_hidden_states": "a model-level output switch",
    "output_router_logits": "a model-level output switch",
    "num_items_in_batch": "a loss normaliser",
    "logits_to_keep": "how many positions' logits the model computes (GOT-OCR2 passes it down to its layers)",
    "deterministic": "a flash-attention kernel's choice of algorithm; the answer is the same",
}
"""Keywords that reach an attention function and do not change its answer, with the reason."""

REFUSED: dict[str, str] = {}
"""Keywords known to change the answer that selfattn cannot honour, with the reason (none at present).

Any keyword in none of :data:`HONOURED`, :data:`NOT_READ` and this table is refused too, unless
it is None: an argument whose meaning is unknown may change the answer, and ignoring it would
give a silent wrong one.
"""


def check_keywords(extra: dict[str, Any]) -> None:
    """Refuse each keyword of ``extra`` (what the parameters did not take) that may change the answer.

    Raises:
        ValueError: a keyword of :data:`REFUSED`, or one of no table with a value other than None.
    """
    for name, value in extra.items():
        if value is None or name in NOT_READ:
            continue
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        reason = REFUSED.get(name, "selfattn does not know how it changes attention, so it refuses it")
        raise ValueError(f"attention_forward got {name}={shown}: {reason}")


def _integer_tensor(name: str, value: object) -> torch.Tensor:
    if (
        not isinstance(value, torch.Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
    ):
        shown = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be an integer tensor, got {shown}")
    return value


def checked_selection(
    name: str, indices: object, query: torch.Tensor, num_keys: int, block_size: int = 1
) -> torch.Tensor:
    """``indices`` as ``(b or 1, hs, lq, t)`` after the checks of :func:`selected_keys` (``(b, lq, t)`` gets ``hs = 1``).

    Raises:
        ValueError: as :func:`selected_keys`.
    """
    selection = _integer_tensor(name, indices)
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    if selection.dim() == 3:
        selection = selection.unsqueeze(1)
    fits = selection.dim() == 4 and selection.shape[0] in (1, b) and selection.shape[2] == lq
    if not fits or h % selection.shape[1]:
        raise ValueError(
            f"{name} must be (b, lq, t) or (b, hs, lq, t) with hs dividing the {h} heads, for b={b}, lq={lq}; "
            f"got {tuple(selection.shape)}"
        )
    num_entries = -(-num_keys // block_size)  # keys, or blocks of keys
    if selection.numel() and (int(selection.min()) < -1 or int(selection.max()) >= num_entries):
        what = "keys" if block_size == 1 else f"blocks of {block_size} keys"
        raise ValueError(
            f"{name} must lie in [-1, {num_entries}) ({num_entries} {what}; -1 = no entry), got values in "
            f"[{int(selection.min())}, {int(selection.max())}]"
        )
    return selection


def selected_keys(name: str, indices: object, query: torch.Tensor, num_keys: int, block_size: int = 1) -> torch.Tensor:
    """The keys a sparse selection lets each query see, as bool ``(b, 1 or h, lq, lk)``.

    ``indices`` is ``(b, lq, t)`` (every head shares it: DeepSeek-V3.2's ``indices``) or
    ``(b, hs, lq, t)`` with ``hs`` dividing ``h`` (MiniMax-M3's ``block_indices``, one selection per
    key/value head, serving its group of query heads as in grouped-query attention). Each entry
    names a key, or with ``block_size > 1`` the block of keys ``[e * block_size, (e + 1) * block_size)``;
    ``-1`` names nothing (an unused slot). The selection says which keys may be seen; causality and
    padding still apply ("and").

    Raises:
        ValueError: not an integer tensor, a shape that does not fit ``query``, or an entry below
            ``-1`` or past the last key (block).
    """
    selection = checked_selection(name, indices, query, num_keys, block_size)
    h = query.shape[1]
    num_entries = -(-num_keys // block_size)
    slots = selection.long().masked_fill(selection < 0, num_entries)  # -1 -> a throwaway last column
    chosen = torch.zeros((*selection.shape[:-1], num_entries + 1), dtype=torch.bool, device=selection.device)
    chosen = chosen.scatter(-1, slots, True)[..., :num_entries]
    if block_size > 1:
        chosen = chosen[..., torch.arange(num_keys, device=chosen.device) // block_size]
    return chosen.repeat_interleave(h // chosen.shape[1], dim=1) if chosen.shape[1] > 1 else chosen


def _document_ids(name: str, cumulative: object, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document ids ``(l,)`` and each document's first token ``(n,)`` from cumulative lengths ``(n + 1,)``."""
    lengths = _integer_tensor(name, cumulative)
    ok = lengths.dim() == 1 and lengths.numel() >= 2
    if not ok or int(lengths[0]) != 0 or int(lengths[-1]) != num_tokens or bool((lengths.diff() < 0).any()):
        raise ValueError(
            f"{name} must be non-decreasing cumulative lengths (n + 1,) from 0 to the {num_tokens} tokens of the "
            f"call, got {lengths.tolist() if lengths.dim() == 1 and lengths.numel() <= 16 else tuple(lengths.shape)}"
        )
    tokens = torch.arange(num_tokens, device=lengths.device)
    return torch.searchsorted(lengths[1:], tokens, right=True), lengths[:-1]


def packed_documents(
    cu_seq_lens_q: object, cu_seq_lens_k: object, query: torch.Tensor, num_keys: int, causal: bool
) -> torch.Tensor:
    """Packed sequences (flash attention's varlen form) as bool ``(lq, lk)``: a query sees its own document only.

    The documents lie one after another in the single row of a batch of 1. With ``causal`` each
    document is causal on its own, aligned to its last key as flash attention aligns it (query
    ``r`` of a document with ``nq`` queries and ``nk`` keys sees its keys ``0 .. r + nk - nq``).
    One of the two lengths may be omitted when there are as many keys as queries.

    Raises:
        ValueError: a batch other than 1, lengths that do not cover the queries and keys, or
            different numbers of documents.
    """
    lq = query.shape[-2]
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q/k pack sequences into one row; the call has a batch of {query.shape[0]}")
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        if lq != num_keys:
            given = "cu_seq_lens_q" if cu_seq_lens_k is None else "cu_seq_lens_k"
            raise ValueError(
                f"{given} alone with {lq} queries and {num_keys} keys: pass cu_seq_lens_q and cu_seq_lens_k"
            )
        cu_seq_lens_q = cu_seq_lens_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    q_docs, q_starts = _document_ids("cu_seq_lens_q", cu_seq_lens_q, lq)
    k_docs, k_starts = _document_ids("cu_seq_lens_k", cu_seq_lens_k, num_keys)
    if q_starts.numel() != k_starts.numel():
        raise ValueError(
            f"cu_seq_lens_q holds {q_starts.numel()} documents and cu_seq_lens_k {k_starts.numel()}; they must match"
        )
    window = Visibility(lq, num_keys, q_first=0).with_rules(documents(q_docs[None], k_docs[None]))
    same_document = window.block(0, lq, device=query.device)
    assert same_document is not None
    same_document = same_document.reshape(lq, num_keys)
    if not causal:
        return same_document
    q_lengths = torch.cat([q_starts[1:], q_starts.new_tensor([lq])]) - q_starts
    k_lengths = torch.cat([k_starts[1:], k_starts.new_tensor([num_keys])]) - k_starts
    # Query r of document n is key r + nk - nq of that document (lower-right alignment).
    q_place = torch.arange(lq, device=query.device) - q_starts[q_docs] + (k_lengths - q_lengths)[q_docs]
    k_place = torch.arange(num_keys, device=query.device) - k_starts[k_docs]
    return same_document & (k_place[None, :] <= q_place[:, None])


def sequence_documents(seq_idx: object, query: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``seq_idx`` ``(b, l)`` (the sequence each token of a packed row belongs to) as bool ``(b, 1, l, l)``.

    Raises:
        ValueError: not an integer ``(b or 1, lq)`` tensor, or queries and keys of different lengths.
    """
    ids = _integer_tensor("seq_idx", seq_idx)
    b, lq = query.shape[0], query.shape[-2]
    if ids.dim() != 2 or ids.shape[0] not in (1, b) or ids.shape[1] != lq or num_keys != lq:
        raise ValueError(
            f"seq_idx must be (b, l) ids of a packed row whose queries are its keys ({b}, {lq}) with {lq} keys; "
            f"got {tuple(ids.shape)} with {num_keys} keys"
        )
    same = Visibility(lq, lq, q_first=0).with_rules(documents(ids)).block(0, lq, device=query.device)
    assert same is not None
    return same


def prepend_sink_key(
    sinks: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-query sinks ``(b or 1, h, lq or 1, 1)`` as one more key: zero key and value, the sink as its bias.

    Its scaled score is ``0 + sink``, so it joins each softmax's denominator as eager's extra
    logit column does and adds nothing to the output. It goes first, so a causal mask aligned to
    the last key stays aligned; every query sees it.

    Returns:
        ``(key, value, mask, bias)`` over ``lk + 1`` keys; the bias is ``(b, h, lq, lk + 1)``.
    """
    b, hk, lk, _ = key.shape
    h, lq = query.shape[1], query.shape[2]
    key = torch.cat([key.new_zeros(b, hk, 1, key.shape[-1]), key], dim=-2)
    value = torch.cat([value.new_zeros(b, hk, 1, value.shape[-1]), value], dim=-2)
    old_bias = sinks.new_zeros(b, h, lq, lk) if bias is None else bias.to(sinks.dtype).expand(b, h, lq, lk)
    bias = torch.cat([sinks.expand(b, h, lq, 1), old_bias], dim=-1)
    if mask is not None:
        mask = torch.cat([mask.new_ones((*mask.shape[:-1], 1)), mask], dim=-1)
    return key, value, mask, bias


def head_scale(head_mask: object, query: torch.Tensor) -> torch.Tensor:
    """``head_mask`` as a factor ``(b or 1, h or 1, lq or 1, 1)`` of the weights (and so of the output).

    ``(h,)`` is one factor per head (as transformers' older eager functions took it). A factor
    that differs between keys would need the weights themselves and is refused.

    Raises:
        ValueError: not a float tensor, or not broadcastable to ``(b, h, lq, 1)``.
    """
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    if isinstance(head_mask, torch.Tensor) and head_mask.is_floating_point():
        factor = head_mask.reshape(1, -1, 1, 1) if head_mask.dim() == 1 else head_mask
        fits = factor.dim() == 4 and all(
            size in (1, full) for size, full in zip(factor.shape, (b, h, lq, 1), strict=True)
        )
        if fits:
            return factor
    shown = f"{head_mask.dtype} {tuple(head_mask.shape)}" if isinstance(head_mask, torch.Tensor) else repr(head_mask)
    raise ValueError(
        f"head_mask must be a float (h,) or one broadcastable to (b, h, lq, 1) = ({b}, {h}, {lq}, 1), got {shown}"
    )
