"""Where a positional encoding acts: the three kinds every encoding belongs to.

* :class:`InputEncoding` is added to the token representations before attention
  (sinusoidal, learned). Call it on the input: ``x = encoding(x, offset=...)``.
* :class:`QueryKeyEncoding` transforms the per-head queries and keys at their positions
  (rotary). :class:`~selfattn.MultiHeadAttention` applies it when given as ``position=``.
* :class:`ScoreEncoding` adds a term to the attention scores, and possibly to the values
  (ALiBi, T5, Shaw). :class:`~selfattn.MultiHeadAttention` applies it when given as ``position=``.

Positions are absolute integer positions, ``(l,)`` int64 tensors. In self-attention the
queries are the last ``lq`` of the ``lk`` keys, so with ``offset`` the position of the first
query, key ``j`` sits at ``offset + lq - lk + j``.

Shape legend: b batch, h heads, lq queries, lk keys, dh head size, d model size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn

from selfattn._scripting import NotScriptable

if TYPE_CHECKING:
    from selfattn.cache import KVCache

__all__ = ["InputEncoding", "PositionalEncoding", "QueryKeyEncoding", "ScoreEncoding"]


class PositionalEncoding(NotScriptable, nn.Module):
    """Base class of every encoding.

    Attributes:
        acts_on: ``"input"``, ``"query_key"`` or ``"scores"``.
        is_relative: True when attention outputs do not change if every position shifts by
            the same amount (rotary and every score term); False for absolute encodings.
    """

    acts_on: ClassVar[Literal["input", "query_key", "scores"]]
    is_relative: ClassVar[bool]


def require_positions(positions: object, x: torch.Tensor, offset: object = 0) -> torch.Tensor:
    """Check per-token ``positions`` ``(l,)`` or ``(b, l)`` (non-negative integers) for an input ``(..., l, d)``."""
    if offset != 0:
        raise ValueError(f"give either offset or positions, not both; got offset={offset!r}")
    length = x.shape[-2]
    if (
        not isinstance(positions, torch.Tensor)
        or positions.is_floating_point()
        or positions.is_complex()
        or positions.dtype == torch.bool
        or positions.dim() not in (1, 2)
        or positions.shape[-1] != length
    ):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else repr(positions)
        raise ValueError(f"positions must be integers of shape ({length},) or (batch, {length}), got {got}")
    if positions.dim() == 2 and (x.dim() != 3 or positions.shape[0] not in (1, x.shape[0])):
        # One row per sequence of x (b, l, d): another batch would broadcast x to it, or fail inside the sum.
        raise ValueError(
            f"positions of shape {tuple(positions.shape)} need x of shape (batch, {length}, d) with batch "
            f"{positions.shape[0]} (or 1 row of positions), got x of shape {tuple(x.shape)}"
        )
    if not torch.compiler.is_compiling() and positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be non-negative, got minimum {int(positions.min())}")
    return positions.long().to(x.device)


class InputEncoding(PositionalEncoding):
    """Added to the input: ``forward(x, offset=0)`` with x ``(..., l, d)`` returns ``(..., l, d)``.

    The 1-D encodings also take ``forward(x, positions=p)``: per-token positions ``(l,)`` or
    ``(b, l)`` (left padding, packed documents).
    """

    acts_on = "input"
    is_relative = False

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class QueryKeyEncoding(PositionalEncoding):
    """Applied to queries and keys: ``forward(x, positions)`` with x ``(b, h, l, dh)``, positions ``(l,)``.

    Attention uses three hooks, and a wrapper must forward all three: :meth:`encode_queries`
    (``forward`` by default), :meth:`encode_keys` (the same transform unless overridden, as
    xPos does) and :meth:`update_cached_keys` (dynamic rotary re-rotates a cache).
    """

    acts_on = "query_key"
    is_relative = True
    #: Position axes per token: 1, or 3 for M-RoPE's (time, height, width), which then takes
    #: positions ``(3, ..., l)`` from :class:`~selfattn.MultiHeadAttention`.
    position_axes: ClassVar[int] = 1

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The queries' transform: ``forward``."""
        encoded: torch.Tensor = self(q, positions)
        return encoded

    def encode_keys(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys' transform; the same as the queries' (``forward``) unless overridden (xPos)."""
        encoded: torch.Tensor = self(k, positions)
        return encoded

    def update_cached_keys(self, cache: KVCache, positions: torch.Tensor) -> None:
        """Called before new keys join ``cache``, with the positions of its stored keys and the new ones; no-op here."""


class ScoreEncoding(PositionalEncoding):
    """A term in the attention scores, and optionally in the values.

    ``forward(q, *, q_positions, k_positions)`` returns a float bias broadcastable to
    ``(b, h, lq, lk)`` that is added to the *scaled* scores (it may depend on the queries, as
    Shaw's key term does, and on the absolute positions). That is all a new score term needs:
    every route of attention then gives the right answer, and a term with parameters gets its
    gradient through autograd on each block's bias. :class:`~selfattn.MultiHeadAttention` never
    asks for the whole ``(h, lq, lk)`` term: it calls ``forward`` one block of queries at a
    time (:func:`~selfattn.functional.blockwise_attention`).

    Faster routes are opt-in; each capability below has a safe default:

    * ``is_relative = True`` promises that the term depends on ``j - i`` only (and not on the
      queries): at consecutive positions attention then evaluates it once, on one band, for
      every block. Default False.
    * ``uses_weights = True`` with :meth:`value_term`: the term also adds to the values.
    * :meth:`pair_bias` (or :meth:`to_score_mod`): an elementwise form, which FlexAttention
      needs on CUDA (:attr:`has_elementwise_form`); ``compiles_in_flex = False`` keeps a term
      with one off FlexAttention's compiled kernel.
    * :meth:`key_only_term`: the term as a function of the key alone up to a constant per query
      (and :meth:`has_key_only_form`, whether it gives one).
    * :meth:`clipped_embeddings`: Shaw's clipped tables, computed without gathers.
    """

    acts_on = "scores"
    is_relative = False
    uses_weights: ClassVar[bool] = False
    #: Whether :meth:`to_score_mod` lowers to FlexAttention's compiled CUDA kernel; where it does
    #: not, attention on CUDA takes the blockwise path instead.
    compiles_in_flex: ClassVar[bool] = True

    @property
    def has_elementwise_form(self) -> bool:
        """Whether :meth:`pair_bias` or :meth:`to_score_mod` is defined (FlexAttention can take the term)."""
        cls = type(self)
        return cls.pair_bias is not ScoreEncoding.pair_bias or cls.to_score_mod is not ScoreEncoding.to_score_mod

    def key_only_term(self, key_offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The term up to a constant per query as a function of the key alone, or None (the default).

        Args:
            key_offsets: integer ``j - a`` for an anchor ``a``, ``(..., 1 or h, 1, lk)``.
            dtype: float dtype of the result.
        """
        del key_offsets, dtype
        return None

    def has_key_only_form(self) -> bool:
        """Whether :meth:`key_only_term` gives a term. This default asks it, on a zero offset (a tensor op); a
        subclass that knows without one answers here (ALiBi: its ``causal``), and its decoding steps skip that op."""
        if type(self).key_only_term is ScoreEncoding.key_only_term:
            return False
        held = next(itertools.chain(self.parameters(), self.buffers()), None)
        probe = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=None if held is None else held.device)
        return self.key_only_term(probe, torch.float32) is not None

    def clipped_embeddings(self) -> tuple[int, torch.Tensor | None, torch.Tensor | None, float] | None:
        """``(K, key table, value table, key scale)`` of a Shaw-style clipped term, or None (the default)."""
        return None

    def forward(
        self, q: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def value_term(
        self, weights: torch.Tensor, *, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> torch.Tensor:
        """``(b, h, lq, dh)`` added to the attention output, from the ``(b, h, lq, lk)`` weights."""
        raise NotImplementedError(f"{type(self).__name__} adds nothing to the values")

    def pair_bias(self, heads: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        """The term for head indices and positions given as broadcastable integer tensors, elementwise.

        This is what a FlexAttention ``score_mod`` evaluates (:meth:`to_score_mod`); the result
        has the broadcast shape of the three arguments.
        """
        raise NotImplementedError(f"{type(self).__name__} has no elementwise form")

    def to_score_mod(
        self, *, q_positions: torch.Tensor, k_positions: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[Callable[..., torch.Tensor], list[nn.Parameter]]:
        """A FlexAttention ``score_mod`` adding this term, and the parameters it closes over.

        ``score_mod(score, b, h, q_idx, kv_idx)`` returns ``score + term`` for the query at
        ``q_positions[q_idx]`` and the key at ``k_positions[kv_idx]`` (positions ``(l,)``, or
        ``(b, l)`` indexed by the batch index too). ``q`` is needed only by terms that read the
        queries (Shaw).
        """
        del q  # a pair term does not read the queries

        def score_mod(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            i = q_positions[q_idx] if q_positions.dim() == 1 else q_positions[b, q_idx]
            j = k_positions[kv_idx] if k_positions.dim() == 1 else k_positions[b, kv_idx]
            return score + self.pair_bias(h, i, j).to(score.dtype)

        return score_mod, list(self.parameters())
