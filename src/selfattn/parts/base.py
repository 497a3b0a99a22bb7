"""What a part of an attention layer is: a small module that acts at one place of the layer's pass.

An attention layer (:class:`~selfattn.MultiHeadAttention`) is its projections ``W_q, W_k, W_v,
W_o``, a position scheme, and the parts given to it, each acting at one *slot* of the pass:

==================== ================================== ==========================================
slot                 what the part receives             examples
==================== ================================== ==========================================
``query_features``   ``W_q``'s output ``(b, l, h*dq)``  OLMo 2's QK-norm over the whole projection
``key_features``     ``W_k``'s output ``(b, l, hk*dq)``
``queries``          query heads ``(b, h, l, dq)``      per-head QK-norm, query scaling by position
``keys``             key heads ``(b, hk, l, dq)``       per-head QK-norm
``rotated_queries``  query heads after the rotation     Hunyuan's QK-norm after the rotation
``rotated_keys``     key heads after the rotation
``values``           value heads ``(b, hk, l, dv)``     Gemma 4's value norm
``output_heads``     attention's output ``(b, lq, h, dv)`` an output norm per head
``merged``           merged heads ``(b, lq, h*dv)`` and the layer's queries ``(b, lq, dq_in)``
                                                        output gates
==================== ================================== ==========================================

Head parts are called ``part(x, positions)`` (positions ``(l,)``, ``(b, l)`` or M-RoPE's
``(3, b, l)``: the first axis counts tokens; None at ``values`` and ``output_heads``);
``merged`` parts ``part(merged, queries)``.
A new kind of part is one subclass in a file of its own: set :attr:`Part.slot` and write
``forward``.

Shape legend:
    b: batch, l / lq: tokens / queries, h: query heads, hk: key/value heads,
    dq: query/key head size, dv: value head size.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["HEAD_SLOTS", "SLOTS", "Part", "token_positions"]

HEAD_SLOTS = (
    "query_features", "key_features", "queries", "keys", "rotated_queries", "rotated_keys", "values",
    "output_heads",
)  # fmt: skip
SLOTS = (*HEAD_SLOTS, "merged")


class Part(nn.Module):
    """A module acting at one slot of an attention layer (see the module's table).

    Attributes:
        slot: where the layer calls it, one of :data:`SLOTS`.
    """

    slot: str

    def describe(self) -> str:
        """The part for ``explain``: its class and ``extra_repr``."""
        return f"{type(self).__name__}({self.extra_repr()})"


def token_positions(positions: torch.Tensor) -> torch.Tensor:
    """The tokens' positions as ``(l,)`` or ``(b, 1, l)``, broadcasting over heads (M-RoPE: its time row)."""
    time = positions[0] if positions.dim() == 3 else positions
    return time[:, None, :] if time.dim() == 2 else time


def require_slot(name: str, slot: str, allowed: tuple[str, ...]) -> str:
    """``slot`` if it is one of ``allowed``, else ``ValueError`` naming the part's argument."""
    if slot not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {slot!r}")
    return slot
