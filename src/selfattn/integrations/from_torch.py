"""An ``nn.MultiheadAttention`` as a :class:`~selfattn.MultiHeadAttention`, its weights copied."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import torch
from torch import nn

from selfattn.positional.base import PositionalEncoding

# The module class is passed in (MultiHeadAttention.from_torch passes itself), as in from_transformers.
Module = TypeVar("Module", bound=nn.Module)

__all__ = ["from_torch"]


def from_torch(
    module: nn.MultiheadAttention, cls: type[Module], *, position: PositionalEncoding | None = None
) -> Module:
    """The same attention as ``module``; see :meth:`selfattn.MultiHeadAttention.from_torch`."""
    if not isinstance(module, nn.MultiheadAttention):
        raise ValueError(f"module must be an nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("module uses add_bias_kv or add_zero_attn, which MultiHeadAttention does not have")
    has_bias = module.in_proj_bias is not None
    if has_bias != (module.out_proj.bias is not None):
        raise ValueError("module has a bias on only some projections; MultiHeadAttention has all or none")
    weight = module.out_proj.weight
    mha: Any = cls(
        module.embed_dim,
        module.num_heads,
        module.dropout,
        bias=has_bias,
        key_size=module.kdim,
        value_size=module.vdim,
        position=position,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        if module.in_proj_weight is not None:
            weights = module.in_proj_weight.chunk(3)
        else:
            weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        for linear, w in zip((mha.W_q, mha.W_k, mha.W_v), weights, strict=True):
            linear.weight.copy_(w)
        mha.W_o.weight.copy_(module.out_proj.weight)
        if has_bias:
            for linear, b in zip((mha.W_q, mha.W_k, mha.W_v), module.in_proj_bias.chunk(3), strict=True):
                linear.bias.copy_(b)
            mha.W_o.bias.copy_(module.out_proj.bias)
    return cast(Module, mha.train(module.training))
