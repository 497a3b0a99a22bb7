"""selfattn as an attention implementation of Hugging Face transformers: ``attn_implementation="selfattn"``.

Shape legend:
    b: batch, h: query heads, hk: key/value heads, lq: queries, lk: keys, d: head size.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.functional import attention

__all__ = ["NAME", "attention_forward", "register"]

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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature over :func:`selfattn.functional.attention`.

    ``attention_mask`` is the mask transformers builds for ``sdpa`` (bool ``(b, 1, lq, lk)``,
    True = attend; it already holds causality, padding and sliding windows), a float mask
    added to the scores, or None. None means no padding: the module's ``is_causal`` (or the
    ``is_causal`` passed) then decides, as for ``sdpa``: with more than one query, query ``i``
    sees keys ``0 .. i`` (and the last ``sliding_window`` of them); a single query sees every key.

    Args:
        module: the model's attention layer (read: ``is_causal``).
        query: ``(b, h, lq, d)``.
        key: ``(b, hk, lk, d)``; ``hk`` may divide ``h`` (grouped-query attention).
        value: ``(b, hk, lk, d)``.
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
        **kwargs: what else the model passes (ignored).

    Returns:
        ``((b, lq, h, d) output, None)``.

    Raises:
        ValueError: ``softcap`` with a float ``attention_mask`` or a ``position_bias``: transformers
            adds those after the capping, selfattn caps them with the scores.
    """
    if softcap is not None and (
        position_bias is not None or (attention_mask is not None and attention_mask.is_floating_point())
    ):
        raise ValueError(
            f"softcap={softcap} with a float attention_mask or a position_bias: transformers adds them after the "
            "capping and selfattn would cap them too; register() builds bool masks, use them"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    num_queries = query.shape[-2]
    causal = bool(causal) and attention_mask is None and num_queries > 1
    if causal and key.shape[-2] > num_queries:
        # No mask and more keys than queries: a prefill into a preallocated (static) cache, whose
        # first lq slots hold these tokens (transformers aligns causal masks top-left).
        key, value = key[..., :num_queries, :], value[..., :num_queries, :]
    if causal and sliding_window is not None and sliding_window < num_queries:
        index = torch.arange(num_queries, device=query.device)
        distance = index[:, None] - index[None, :]  # (lq, lk): i - j
        mask, causal = (distance >= 0) & (distance < sliding_window), False
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    out = attention(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        causal=causal,
        dropout_p=dropout,
        scale=scaling,
        softcap=softcap,
        sinks=s_aux,
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous(), None  # (b, lq, h, d)


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` with transformers as ``name`` (default ``"selfattn"``).

    It takes the masks transformers builds for ``sdpa``. Then load or build a model with
    ``attn_implementation=name``, or switch one with ``model.set_attn_implementation(name)``.

    Returns:
        ``name``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
