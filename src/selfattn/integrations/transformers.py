"""selfattn as an attention implementation of Hugging Face transformers: ``attn_implementation="selfattn"``.

Every keyword transformers' models pass to an attention function is honoured as their eager
function would honour it, or known not to change the answer, or refused with a ``ValueError``
naming it (:mod:`selfattn.integrations._hf_keywords` keeps the tables; a test re-scans the
installed transformers for keywords in none of them).

Refused combinations (eager computes them otherwise): ``softcap`` with a float ``attention_mask``
(other than one of only 0 and the dtype's lowest, read as a bool mask), a ``position_bias`` or
per-query ``sinks`` (transformers adds those after the capping, selfattn would cap them too);
``s_aux`` with ``sinks``; ``indices`` with ``topk_indices``; ``output_attentions`` with dropout
(eager returns the weights after dropout, selfattn before).

Shape legend:
    b: batch, h: query heads, hk: key/value heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.functional import attention, sparse_attention
from selfattn.functional._attention import describe_attention
from selfattn.integrations import _hf_plan
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

    Args:
        module: the model's attention layer (read: ``is_causal``; ``indexer.block_size``).
        query: ``(b, h, lq, d)``.
        key: ``(b, hk, lk, d)``; ``hk`` may divide ``h`` (grouped-query attention).
        value: ``(b, hk, lk, dv)``.
        attention_mask: ``sdpa``'s bool ``(b, 1, lq, lk)`` (True = attend), eager's float one (0 and ``-inf`` or the
            lowest: read as ``== 0``), a float mask added, or None (``is_causal`` decides, as for ``sdpa``); "and"-ed
            with the restrictions below. A query seeing no key weighs all evenly, as eager (sinks, shared indices: 0).
        dropout: dropout on the weights (the model passes 0 in evaluation).
        scaling: score scale (default ``1 / sqrt(d)``).
        is_causal: overrides ``module.is_causal`` (query ``i`` of several sees keys ``0 .. i``; one query every key).
        sliding_window: window of a local layer (applied here only when there is no mask).
        softcap: each scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` before the mask (Gemma 2).
        s_aux: sinks ``(h,)`` (gpt-oss): a logit per query head in the softmax's denominator, no value.
        position_bias: float ``(b or 1, h, lq, lk)`` added to the scores (T5-style models).
        sinks: ``(h,)`` as ``s_aux``, or per query ``(b, h, lq, 1)`` (Inkling 2: run as one more key).
        indices: sparse attention's selected keys ``(b, lq, t)``, ``-1`` unused (DeepSeek-V3.2 ...).
        topk_indices: the same, under that name.
        block_indices: selected blocks of ``module.indexer.block_size`` keys ``(b, hk, lq, t)`` (MiniMax-M3).
        head_mask: factor of the weights per head, ``(h,)`` or broadcastable to ``(b, h, lq, 1)``.
        cu_seq_lens_q: cumulative lengths ``(n + 1,)`` of the queries of sequences packed in a batch of 1.
        cu_seq_lens_k: cumulative key lengths; may be omitted when ``lk == lq``.
        seq_idx: ``(b, l)`` sequence ids of the tokens of packed rows; a query sees keys of its id.
        output_attentions: also return the weights, as eager does (also when transformers records them: GPT-2).
        **kwargs: keywords known not to change the answer are not read; any other not None is refused.

    Returns:
        ``((b, lq, h, dv) output, (b, h, lq, lk) weights or None)``.

    Raises:
        ValueError: an unknown keyword, a bad value of a known one, or a combination the module's docstring refuses.
    """
    unmasked = (attention_mask is None and position_bias is None and sinks is None and indices is None
                and topk_indices is None and block_indices is None and head_mask is None and cu_seq_lens_q is None
                and cu_seq_lens_k is None and seq_idx is None and not output_attentions)  # fmt: skip
    replayed, kind = _hf_plan.replay(module, query, key, value, dropout, scaling, is_causal, sliding_window, softcap,
                                     s_aux, kwargs) if unmasked else (None, None)  # fmt: skip
    if replayed is not None:  # an unmasked call of a planned kind (kind None: a call no plan serves)
        return replayed.transpose(1, 2).contiguous(), None
    output_attentions = bool(output_attentions) or _hf_plan.recording_attentions()
    check_keywords(kwargs)
    attention_mask = _bool_if_only_visibility(attention_mask)
    sinks, per_query_sinks = _split_sinks(s_aux, sinks, query)
    _check_combinations(query, attention_mask, dropout, softcap, position_bias, per_query_sinks, output_attentions)
    picks, selections = _selected(module, query, key.shape[-2], indices, topk_indices, block_indices, seq_idx)
    key, value, mask, bias, causal, slots = _visibility(module, query, key, value, attention_mask, is_causal,
                                                        sliding_window, cu_seq_lens_q, cu_seq_lens_k)  # fmt: skip
    query, key, value, mask, bias, picks = _restricted(query, key, value, mask, bias, picks, selections,
                                                       position_bias, sinks, per_query_sinks)  # fmt: skip
    options: dict[str, Any] = dict(mask=mask, bias=bias, causal=causal, dropout_p=dropout, scale=scaling,
                                   softcap=softcap, sinks=sinks, return_weights=bool(output_attentions))  # fmt: skip
    out, weights = _attend(query, key, value, picks, options, per_query_sinks is not None, head_mask, slots)
    _hf_plan.remember(module, kind, None if kind is None else describe_attention(query, key, value, **options), kwargs)
    return out.transpose(1, 2).contiguous(), weights


def _restricted(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    picks: torch.Tensor | None,
    selections: list[torch.Tensor],
    position_bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    per_query_sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(query, key, value, mask, bias, picks)`` for the route, from :func:`_visibility`'s.

    The selections are "and"-ed into the mask, the position bias is added to the bias, a query that
    the mask lets see no key is given eager's answer (:func:`_uniform_where_blind`; not with sinks,
    where eager's answer is zeros, as selfattn's, nor with shared picks, whose sparse route gives
    zeros), and per-query sinks become a first key. The selections, picks and position bias were made over the
    keys passed; :func:`_visibility` keeps the first ``lq`` of them in a static cache's prefill, so they are cut
    to the keys kept.
    """
    if picks is not None:
        picks = picks.masked_fill(picks >= key.shape[-2], -1)
    for selection in selections:
        selection = selection[..., : key.shape[-2]]
        mask = selection if mask is None else mask & selection
    if position_bias is not None:
        position_bias = position_bias[..., : key.shape[-2]]  # (b or 1, h, lq, lk kept)
        bias = position_bias if bias is None else bias + position_bias
    if mask is not None and sinks is None and per_query_sinks is None and picks is None:
        query, mask, bias = _uniform_where_blind(query, mask, bias)
    if per_query_sinks is not None:
        key, value, mask, bias = prepend_sink_key(per_query_sinks, query, key, value, mask, bias)
        if picks is not None:  # the sink went first: every pick moves one on, and every query sees the sink
            moved = torch.where(picks >= 0, picks + 1, -1)
            picks = torch.cat([moved.new_zeros(*moved.shape[:-1], 1), moved], dim=-1)
    return query, key, value, mask, bias, picks


def _uniform_where_blind(
    query: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(query, mask, bias)`` with which a query that ``mask`` lets see no key weighs every key ``1 / lk``, as in eager.

    Eager adds the dtype's lowest value to each hidden score: in a row that hides every key the
    scores vanish beside it, and the softmax spreads the row evenly over all ``lk`` keys (their
    mean value). selfattn would give zeros there, and a model may break on those: Gemma 3n's
    ``mean(h ** 2) ** 0.5`` of a padded token whose every input is zero has an infinite
    derivative (NaN gradients). Here such a row sees every key with a zero query and no bias, so
    every score is 0; rows that see a key are untouched. No host sync: all of it is masking.
    """
    blind = ~mask.any(dim=-1, keepdim=True)  # (b or 1, 1 or h, lq, 1)
    query = query.masked_fill(blind, 0)
    bias = None if bias is None else bias.masked_fill(blind, 0)
    return query, mask | blind, bias


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    picks: torch.Tensor | None,
    options: dict[str, Any],
    sink_key: bool,
    head_mask: torch.Tensor | None,
    slots: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``((b, h, lq, dv) output, (b, h, lq, slots) weights or None)``: the dense route, or the sparse one over
    ``picks`` ``(b, lq, t)``.

    ``sink_key``: the first key is per-query sinks' (:func:`prepend_sink_key`), whose weights are no
    key's and are dropped. ``head_mask`` scales the output and the weights per head. ``slots``: the keys
    passed, of which a static cache's prefill kept the first (the weights of the others are zeros, as eager's).
    """
    result = (
        attention(query, key, value, **options)
        if picks is None
        else sparse_attention(query, key, value, picks, **options)
    )
    out, weights = result if isinstance(result, tuple) else (result, None)
    if weights is not None and sink_key:
        weights = weights[..., 1:]
    if weights is not None and weights.shape[-1] < slots:
        weights = torch.nn.functional.pad(weights, (0, slots - weights.shape[-1]))  # (b, h, lq, slots)
    if head_mask is not None:
        factor = head_scale(head_mask, query).to(out.dtype)
        out = out * factor
        weights = None if weights is None else weights * factor
    return out, weights


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
    """Refuse the combinations that eager computes otherwise (see the module's docstring)."""
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool, int]:
    """``(key, value, mask, bias, causal, slots)`` from the mask, the layer's causality, its window and packed
    lengths; ``slots``, the number of keys passed (a static cache's prefill keeps the first ``lq``)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    slots = key.shape[-2]
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
        return key, value, packed if mask is None else mask & packed, bias, False, slots
    if causal and key.shape[-2] > num_queries:
        # No mask and more keys than queries: a prefill into a preallocated (static) cache, whose
        # first lq slots hold these tokens (transformers aligns causal masks top-left).
        key, value = key[..., :num_queries, :], value[..., :num_queries, :]
    if causal and sliding_window is not None and sliding_window < num_queries:
        index = torch.arange(num_queries, device=query.device)
        distance = index[:, None] - index[None, :]  # (lq, lk): i - j
        mask, causal = (distance >= 0) & (distance < sliding_window), False
    return key, value, mask, bias, causal, slots


def _bool_if_only_visibility(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A float mask that only says which keys are seen as the bool mask ``entry == 0``; any other as it is.

    transformers' eager masks put ``finfo.min`` where a key is hidden, and models add ``-inf``
    blocks to them (DeepSeek-V4's compressed keys); such a score gets no weight in the softmax, so
    a mask of only 0 and entries at most the dtype's lowest is exactly the bool mask (a row that sees no
    key: :func:`_uniform_where_blind`). The bool form takes the fast routes, and allows ``softcap``.
    """
    if attention_mask is None or not attention_mask.is_floating_point():
        return attention_mask
    hidden = attention_mask <= torch.finfo(attention_mask.dtype).min
    return attention_mask == 0 if bool(((attention_mask == 0) | hidden).all()) else attention_mask


def _selected(
    module: torch.nn.Module,
    query: torch.Tensor,
    num_keys: int,
    indices: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    block_indices: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """``(picks, masks)``: the sparse selections and packed ids, checked.

    ``picks`` is a ``(b, lq, t)`` selection every head shares (DeepSeek-V3.2's ``indices``), for the
    sparse route to gather, or None; ``masks`` are bool ``(b or 1, 1 or h, lq, lk)``, to "and" together:
    a selection per head, the blocks of ``block_indices``, the sequences of ``seq_idx``.
    """
    if indices is not None and topk_indices is not None:
        raise ValueError("indices and topk_indices both given: they name the same selection of keys")
    name, given = ("indices", indices) if indices is not None else ("topk_indices", topk_indices)
    picks = None
    masks: list[torch.Tensor] = []
    if given is not None:
        selection = checked_selection(name, given, query, num_keys)
        if selection.shape[1] == 1:
            picks = selection[:, 0]
        else:
            masks.append(selected_keys(name, selection, query, num_keys))
    if block_indices is not None:
        block_size = getattr(getattr(module, "indexer", None), "block_size", None)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(
                f"block_indices needs the size of a key block: selfattn reads module.indexer.block_size, got {block_size!r}"
            )
        masks.append(selected_keys("block_indices", block_indices, query, num_keys, block_size))
    if seq_idx is not None:
        masks.append(sequence_documents(seq_idx, query, num_keys))
    return picks, masks


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
    config = kwargs.get("config")
    # The class's (a ClassVar, what transformers writes into a saved config): read past the config's own
    # __getattribute__ (its attribute map), a microsecond of every decoded token, and traced by dynamo.
    model_type = getattr(type(config), "model_type", None)
    if model_type in CUT_QUERIES and kwargs.get("q_length") != 1:  # one query (decoding) is never cut
        kwargs["allow_is_causal_skip"] = False  # a mask, cut with the queries, rather than None
    build, builds_sdpa_masks = _MASK_BUILDERS.get(model_type) or _mask_builder(model_type)
    if (
        builds_sdpa_masks
        and not args
        and kwargs.get("local_size") is not None
        and _window_hides_nothing(kwargs, config)
    ):
        kwargs["local_size"] = None  # causality and padding alone decide: transformers may skip the mask
    return build(*args, **kwargs)


def _mask_builder(model_type: str | None) -> tuple[Any, bool]:
    """``(transformers' mask function for the model, whether it is sdpa's)``, kept in ``_MASK_BUILDERS`` (a
    dictionary read before this is called: a frame less per token; dynamo traces ``functools.cache`` with a warning)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    builds_sdpa_masks = model_type in PASS_MASKS_THROUGH or _supports_sdpa(model_type)
    _MASK_BUILDERS[model_type] = (sdpa_mask if builds_sdpa_masks else eager_mask), builds_sdpa_masks
    return _MASK_BUILDERS[model_type]


_MASK_BUILDERS: dict[str | None, tuple[Any, bool]] = {}


def _window_hides_nothing(kwargs: dict[str, Any], config: Any) -> bool:
    """Whether a sliding layer's mask for one query shows it every key: the keys end at the query (no free
    slots of a static cache after it) and the oldest is within the window.

    transformers builds that mask (all True) for each decoding step once a sliding layer's cache is full
    (it skips the mask only while there are fewer keys than the window), and a mask is a call the
    step plans cannot replay. Decided from the offsets alone (ints), never from a tensor's values. Only
    for the model's sliding window: chunked attention passes its chunk size in the same keyword, and a
    chunk hides the keys of the one before it however near they are.
    """
    window = kwargs.get("local_size")
    if window is None:
        return False  # no window: nothing to drop (the caller reads it first, the common case)
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if not all(type(n) is int for n in (q_length, kv_length, q_offset, kv_offset, window)):
        return False  # a tensor offset (static caches), or no window
    if window != getattr(config, "sliding_window", None) or window == getattr(config, "attention_chunk_size", None):
        return False  # not (only) the sliding window: a chunk size, or a config that does not say
    return q_length == 1 and kv_offset + kv_length - 1 == q_offset and q_offset - kv_offset < window


#: Models without ``sdpa`` whose code hands the mask to the attention function and reads it nowhere
#: else (they lack ``sdpa`` for its softcap or sinks alone): they get ``sdpa``'s masks, None where
#: causality decides, rather than a float mask per layer and per decoded token (checked in their
#: modeling code: Gemma 2, gpt-oss).
PASS_MASKS_THROUGH = frozenset({"gemma2", "gpt_oss"})

#: Models whose code keeps only the last queries after the masks are built, cutting the masks with
#: them, and trusts a missing mask there only under the name ``sdpa`` (Gemma 4 runs its layers that
#: reuse earlier keys and values on the tokens whose logits are kept: ``_maybe_slice_kv_shared_inputs``).
#: A missing mask would leave the last of 8 queries facing a static cache's empty slots, or 3 of 8
#: queries read as the first 3, so they get a mask for more than one query (a test re-scans transformers
#: for such models).
CUT_QUERIES = frozenset({"gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"})


def _supports_sdpa(model_type: str | None) -> bool:
    """Whether transformers' model of ``model_type`` declares ``sdpa`` support (False when it cannot be found)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    class_name = MODEL_MAPPING_NAMES.get(model_type or "")
    model_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    return bool(getattr(model_class, "_supports_sdpa", False))
