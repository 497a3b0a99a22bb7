"""torch's ``nn.MultiheadAttention`` inputs and masks, checked and read as selfattn's (the drop-in's helpers).

Shape legend: b batch, h heads, l queries, s keys, e ``embed_dim``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_torch_inputs", "describe_tensor", "torch_masks"]


def describe_tensor(t: torch.Tensor) -> str:
    """``dtype (shape)``, as an error message names a tensor it got."""
    return f"{t.dtype} {tuple(t.shape)}"


def check_torch_inputs(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the inputs are batched; raise for ranks or sizes that do not fit."""
    for name, t, size in (("query", query, module.embed_dim), ("key", key, module.kdim), ("value", value, module.vdim)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or t.shape[-1] != size:
            got = describe_tensor(t) if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must have shape (l, {size}) or (l, b, {size}) / (b, l, {size}), got {got}")
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(
            f"query, key and value must all be batched (3-D) or all unbatched (2-D), got "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    batched = query.dim() == 3
    batch_dim, length_dim = (0, 1) if module.batch_first or not batched else (1, 0)
    if batched and not query.shape[batch_dim] == key.shape[batch_dim] == value.shape[batch_dim]:
        raise ValueError(
            f"query, key and value must share the batch size (dimension {batch_dim}), got "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    length_dim = length_dim if batched else 0
    if key.shape[length_dim] != value.shape[length_dim]:
        raise ValueError(f"key and value must have the same length, got {tuple(key.shape)} and {tuple(value.shape)}")
    return batched


def torch_masks(
    module: Any,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    batched: bool,
    batch: int,
    num_queries: int,
    num_keys: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Torch's masks as selfattn's: a bool ``mask`` (True = attend) and a float ``bias``, ``(b or 1, h or 1, l, s)``."""
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    if attn_mask is not None:
        heads = (module.num_heads,) if not batched else (batch * module.num_heads,)
        shapes = ((num_queries, num_keys), (*heads, num_queries, num_keys))
        if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) not in shapes:
            got = describe_tensor(attn_mask) if isinstance(attn_mask, torch.Tensor) else repr(attn_mask)
            raise ValueError(f"attn_mask must have shape {' or '.join(map(str, shapes))}, got {got}")
        term = attn_mask.reshape(-1, module.num_heads, num_queries, num_keys) if attn_mask.dim() == 3 else attn_mask
        if term.dtype == torch.bool:
            mask = ~term
        elif term.is_floating_point():
            bias = term
        else:
            raise ValueError(f"attn_mask must be bool (True = not allowed) or floating point, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (batch, num_keys):
            want = (batch, num_keys) if batched else (num_keys,)
            got = (
                describe_tensor(key_padding_mask)
                if isinstance(key_padding_mask, torch.Tensor)
                else repr(key_padding_mask)
            )
            raise ValueError(f"key_padding_mask must have shape {want}, got {got}")
        padding = key_padding_mask[:, None, None, :]  # (b, 1, 1, s)
        if padding.dtype == torch.bool:
            mask = ~padding if mask is None else mask & ~padding
        elif padding.is_floating_point():
            bias = padding if bias is None else bias + padding
        else:
            raise ValueError(
                f"key_padding_mask must be bool (True = ignore) or floating point, got {key_padding_mask.dtype}"
            )
    return mask, bias
