"""selfattn as an attention implementation of Hugging Face transformers: ``attn_implementation="selfattn"``.

Every keyword transformers' models pass to an attention function is honoured as their eager
function would honour it, or known not to change the answer, or refused with a ``ValueError``
naming it (:mod:`selfattn.integrations._hf_keywords` keeps the tables; a test re-scans the
installed transformers for keywords in none of them).

Shape legend:
    b: batch, h: query heads, hk: key/value heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from selfattn.functional import attention, sparse_attention
from selfattn.integrations._hf_keywords import (
    check_keywords,
    checked_selection,
    head_scale,
    packed_documents,
    prepend_sink_key,
    selected_keys,
    sequence_documents,
)

__all__ = ["NAME", "attention_forward", "model_masks", "register"]

NAME = "selfattn"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    block_indices: torch.Tensor | None = None,
    head_mask: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    output_attentions: bool | None = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function signature over :func:`selfattn.functional.attention`.

    ``attention_mask`` is the mask transformers builds for ``sdpa`` (bool ``(b, 1, lq, lk)``,
    True = attend; it already holds causality, padding, packing and sliding windows), eager's
    float form of one (only 0 and ``-inf`` or the dtype's lowest: read as the bool mask
    ``entry == 0``), another float mask added to the scores, or None. None means no padding: the module's ``is_causal`` (or the
    ``is_causal`` passed) then decides, as for ``sdpa``: with more than one query, query ``i``
    sees keys ``0 .. i`` (and the last ``sliding_window`` of them); a single query sees every key.
    Every other restriction below is "and"-ed with it.

    Args:
        module: the model's attention layer (read: ``is_causal``; ``indexer.block_size`` with
            ``block_indices``).
        query: ``(b, h, lq, d)``.
        key: ``(b, hk, lk, d)``; ``hk`` may divide ``h`` (grouped-query attention).
        value: ``(b, hk, lk, dv)``.
        attention_mask: see above.
        dropout: dropout on the weights (the model passes 0 in evaluation).
        scaling: score scale (default ``1 / sqrt(d)``).
        is_causal: overrides ``module.is_causal``.
        sliding_window: window of a local layer (applied here only when there is no mask).
        softcap: attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): each
            scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` before the mask.
        s_aux: attention sinks (gpt-oss passes its ``sinks`` parameter, ``(h,)``): one logit per
            query head that joins the softmax's denominator and adds no value.
        position_bias: float ``(b or 1, h, lq, lk)`` added to the scores (T5-style models).
        sinks: sinks per query (Inkling 2: ``(b, h, lq, 1)``), or ``(h,)`` as ``s_aux``. Per-query
            sinks run as one more key (zero key and value, the sink as its bias) on a route that
            takes a dense bias; ``(h,)`` sinks keep the fused routes.
        indices: sparse attention's selected keys (DeepSeek-V3.2, GLM-MoE-DSA, Mistral Large 4,
            ...): ``(b, lq, t)`` key indices, ``-1`` for an unused slot; a query sees only the
            keys it selected.
        topk_indices: the same, under that name.
        block_indices: selected blocks of keys (MiniMax-M3): ``(b, hs, lq, t)`` block indices per
            key/value head (``-1`` unused) of ``module.indexer.block_size`` keys each.
        head_mask: factor of the weights per head, ``(h,)`` or broadcastable to ``(b, h, lq, 1)``.
        cu_seq_lens_q: packed sequences (flash attention's varlen form; batch 1): cumulative
            query lengths ``(n + 1,)``; a query sees its own sequence only (causal in it when
            the layer is).
        cu_seq_lens_k: cumulative key lengths; may be omitted when ``lk == lq``.
        seq_idx: ``(b, l)`` sequence ids of the tokens of packed rows; a query sees keys of its id.
        output_attentions: also return the ``(b, h, lq, lk)`` weights, as eager does (a query
            that sees no key has zero weights here, a uniform row in eager). They are returned
            too when transformers records them without passing this (GPT-2, OPT ...).
        **kwargs: what else the model passes: keywords known not to change the answer
            (``position_ids``, ``use_cache``, ``max_length_q`` ...) are not read, any other
            that is not None is refused.

    Returns:
        ``((b, lq, h, dv) output, (b, h, lq, lk) weights or None)``.

    Raises:
        ValueError: an unknown keyword, or a bad value of a known one; ``softcap`` with a float
            ``attention_mask``, a ``position_bias`` or per-query ``sinks`` (transformers adds
            those after the capping, selfattn would cap them too); ``s_aux`` with ``sinks``;
            ``indices`` with ``topk_indices``; ``output_attentions`` with dropout (eager returns
            the weights after dropout, selfattn before).
    """
    check_keywords(kwargs)
    output_attentions = bool(output_attentions) or _recording_attentions()
    if attention_mask is not None and attention_mask.is_floating_point() and _only_visibility(attention_mask):
        attention_mask = attention_mask == 0  # eager's form of a bool mask: the fast routes, and softcap allowed
    sinks, per_query_sinks = _split_sinks(s_aux, sinks, query)
    _check_combinations(query, attention_mask, dropout, softcap, position_bias, per_query_sinks, output_attentions)
    picks = _shared_picks(query, key.shape[-2], indices, topk_indices)
    if picks is not None:  # the sparse route gathers them; not a dense mask
        indices = topk_indices = None
    selections = _selections(module, query, key.shape[-2], indices, topk_indices, block_indices, seq_idx)
    key, value, mask, bias, causal = _visibility(
        module, query, key, value, attention_mask, is_causal, sliding_window, cu_seq_lens_q, cu_seq_lens_k
    )
    if picks is not None:  # made over the keys passed; a static-cache prefill keeps the first lk
        picks = picks.masked_fill(picks >= key.shape[-2], -1)
    for selection in selections:  # made over the keys passed; a static-cache prefill keeps the first lk
        selection = selection[..., : key.shape[-2]]
        mask = selection if mask is None else mask & selection
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if per_query_sinks is not None:
        key, value, mask, bias = prepend_sink_key(per_query_sinks, query, key, value, mask, bias)
        if picks is not None:  # the sink went first: every pick moves one on, and every query sees the sink
            moved = torch.where(picks >= 0, picks + 1, -1)
            picks = torch.cat([moved.new_zeros(*moved.shape[:-1], 1), moved], dim=-1)
    options: dict[str, Any] = dict(
        mask=mask, bias=bias, causal=causal, dropout_p=dropout, scale=scaling, softcap=softcap, sinks=sinks,
        return_weights=bool(output_attentions),
    )  # fmt: skip
    result = (
        attention(query, key, value, **options)
        if picks is None
        else sparse_attention(query, key, value, picks, **options)
    )
    out, weights = result if isinstance(result, tuple) else (result, None)
    if weights is not None and per_query_sinks is not None:
        weights = weights[..., 1:]  # the sink's own column is no key's
    if head_mask is not None:
        factor = head_scale(head_mask, query).to(out.dtype)
        out = out * factor
        weights = None if weights is None else weights * factor
    return out.transpose(1, 2).contiguous(), weights  # (b, lq, h, dv)


def _split_sinks(
    s_aux: torch.Tensor | None, sinks: torch.Tensor | None, query: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(per-head sinks (h,) or None, per-query sinks (b or 1, h, lq or 1, 1) or None)``."""
    if sinks is None:
        return s_aux, None
    if s_aux is not None:
        raise ValueError("s_aux and sinks both given: a layer has one set of attention sinks")
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor, got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.dim() == 1:
        return sinks, None  # (h,): checked by attention()
    b, h, lq = query.shape[0], query.shape[1], query.shape[2]
    if sinks.dim() != 4 or not all(size in (1, full) for size, full in zip(sinks.shape, (b, h, lq, 1), strict=True)):
        raise ValueError(
            f"sinks must be (h,) or broadcastable to (b, h, lq, 1) = ({b}, {h}, {lq}, 1), got {tuple(sinks.shape)}"
        )
    return None, sinks


def _check_combinations(
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    softcap: float | None,
    position_bias: torch.Tensor | None,
    per_query_sinks: torch.Tensor | None,
    output_attentions: bool | None,
) -> None:
    float_mask = attention_mask is not None and attention_mask.is_floating_point()
    if softcap is not None and (position_bias is not None or float_mask):
        raise ValueError(
            f"softcap={softcap} with a float attention_mask or a position_bias: transformers adds them after the "
            "capping and selfattn would cap them too (a mask of only 0 and -inf or the dtype's lowest is read as a bool mask)"
        )
    if softcap is not None and per_query_sinks is not None:
        raise ValueError(
            f"softcap={softcap} with per-query sinks: selfattn adds those as a bias, which it would cap too"
        )
    if output_attentions and dropout:
        raise ValueError(
            f"output_attentions=True with dropout={dropout}: eager returns the weights after dropout, selfattn "
            "returns them before; ask for the weights in evaluation (dropout=0)"
        )


def _visibility(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool | None,
    sliding_window: int | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """``(key, value, mask, bias, causal)`` from the mask, the layer's causality, its window and packed lengths."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    num_queries = query.shape[-2]
    causal = bool(causal) and attention_mask is None and num_queries > 1
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        # Packed documents, each causal on its own: a dense rule that holds the causality too.
        packed = packed_documents(cu_seq_lens_q, cu_seq_lens_k, query, key.shape[-2], causal)
        return key, value, packed if mask is None else mask & packed, bias, False
    if causal and key.shape[-2] > num_queries:
        # No mask and more keys than queries: a prefill into a preallocated (static) cache, whose
        # first lq slots hold these tokens (transformers aligns causal masks top-left).
        key, value = key[..., :num_queries, :], value[..., :num_queries, :]
    if causal and sliding_window is not None and sliding_window < num_queries:
        index = torch.arange(num_queries, device=query.device)
        distance = index[:, None] - index[None, :]  # (lq, lk): i - j
        mask, causal = (distance >= 0) & (distance < sliding_window), False
    return key, value, mask, bias, causal


def _only_visibility(attention_mask: torch.Tensor) -> bool:
    """Whether a float mask only says which keys are seen: every entry 0 or at most the dtype's lowest (or -inf).

    transformers' eager masks put ``finfo.min`` where a key is hidden, and models add ``-inf``
    blocks to them (DeepSeek-V4's compressed keys); such a score gets no weight in the softmax, so
    the mask is exactly the bool mask ``entry == 0`` (up to rows that see no key, uniform in eager).
    """
    lowest = torch.finfo(attention_mask.dtype).min
    return bool(((attention_mask == 0) | (attention_mask <= lowest)).all())


def _recording_attentions() -> bool:
    """Whether transformers is collecting attention weights in this forward (``output_attentions=True``).

    Some models (GPT-2, OPT, StableLM, Nemotron ...) record the weights their attention layers
    return without passing ``output_attentions`` down; eager always returns them, so selfattn
    must see the request where transformers keeps it, its output collector.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # an older transformers passes output_attentions itself
        return False
    collected = _active_collector.get()  # type: ignore[no-untyped-call]
    return isinstance(collected, dict) and "attentions" in collected


def _shared_picks(
    query: torch.Tensor, num_keys: int, indices: torch.Tensor | None, topk_indices: torch.Tensor | None
) -> torch.Tensor | None:
    """A ``(b, lq, t)`` selection every head shares (DeepSeek-V3.2's ``indices``), checked, for the sparse route; else None."""
    if indices is not None and topk_indices is not None:
        raise ValueError("indices and topk_indices both given: they name the same selection of keys")
    name, given = ("indices", indices) if indices is not None else ("topk_indices", topk_indices)
    if given is None:
        return None
    selection = checked_selection(name, given, query, num_keys)
    return selection[:, 0] if selection.shape[1] == 1 else None


def _selections(
    module: torch.nn.Module,
    query: torch.Tensor,
    num_keys: int,
    indices: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    block_indices: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Bool masks ``(b or 1, 1 or h, lq, lk)`` of the sparse selections and packed ids, to "and" together."""
    if indices is not None and topk_indices is not None:
        raise ValueError("indices and topk_indices both given: they name the same selection of keys")
    chosen: list[torch.Tensor] = []
    for name, selection in (("indices", indices), ("topk_indices", topk_indices)):
        if selection is not None:
            chosen.append(selected_keys(name, selection, query, num_keys))
    if block_indices is not None:
        block_size = getattr(getattr(module, "indexer", None), "block_size", None)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"block_indices needs the size of a key block: selfattn reads module.indexer.block_size, got {block_size!r}"
            )
        chosen.append(selected_keys("block_indices", block_indices, query, num_keys, block_size))
    if seq_idx is not None:
        chosen.append(sequence_documents(seq_idx, query, num_keys))
    return chosen


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` with transformers as ``name`` (default ``"selfattn"``).

    Models that support ``sdpa`` get the masks transformers builds for ``sdpa`` (bool, or None
    where causality alone decides); the others get eager's float masks, because their own code
    may treat the mask as one (GIT adds it to its scores itself, DeepSeek-V4 appends ``-inf``
    blocks to it). Then load or build a model with ``attn_implementation=name``, or switch one
    with ``model.set_attn_implementation(name)``.

    Returns:
        ``name``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, model_masks)
    return name


def model_masks(*args: Any, **kwargs: Any) -> Any:
    """transformers' mask function for selfattn: ``sdpa``'s masks for a model that supports ``sdpa``, eager's otherwise.

    ``kwargs["config"]`` names the model (transformers passes it); a model it cannot look up gets
    eager's masks, the form every model's own code was written for.
    """
    from transformers.masking_utils import eager_mask, sdpa_mask

    config = kwargs.get("config")
    model_type = getattr(config, "model_type", None)
    if model_type in CUT_QUERIES:
        kwargs["allow_is_causal_skip"] = False  # a mask, cut with the queries, rather than None
    build = sdpa_mask if model_type in PASS_MASKS_THROUGH or _supports_sdpa(model_type) else eager_mask
    return build(*args, **kwargs)


#: Models without ``sdpa`` whose code hands the mask to the attention function and reads it nowhere
#: else (they lack ``sdpa`` for its softcap or sinks alone): they get ``sdpa``'s masks, None where
#: causality decides, rather than a float mask per layer and per decoded token (checked in their
#: modeling code: Gemma 2, gpt-oss).
PASS_MASKS_THROUGH = frozenset({"gemma2", "gpt_oss"})

#: Models whose code keeps only the last queries after the masks are built, cutting the masks with
#: them, and trusts a missing mask there only under the name ``sdpa`` (Gemma 4 runs its layers that
#: reuse earlier keys and values on the tokens whose logits are kept: ``_maybe_slice_kv_shared_inputs``).
#: A missing mask would leave the last of 8 queries facing a static cache's empty slots, or 3 of 8
#: queries read as the first 3, so they always get a mask (a test re-scans transformers for such models).
CUT_QUERIES = frozenset({"gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"})


@functools.cache
def _supports_sdpa(model_type: str | None) -> bool:
    """Whether transformers' model of ``model_type`` declares ``sdpa`` support (False when it cannot be found)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    class_name = MODEL_MAPPING_NAMES.get(model_type or "")
    model_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    return bool(getattr(model_class, "_supports_sdpa", False))
