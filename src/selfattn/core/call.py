"""One description of an attention call, built alike by the module and by ``selfattn.functional``.

The routes (:mod:`selfattn.core.routes`) read everything they need from it, and the dispatcher
(:mod:`selfattn.core.dispatch`) decides on it alone. Facts that cost something to find out
(whether a score term reads the queries, whether positions are consecutive) are worked out once,
on first use.

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, dh head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

import selfattn._validation as _validation
from selfattn.masks import Causal, Visibility, Window

if TYPE_CHECKING:
    from selfattn.positional.base import ScoreEncoding

__all__ = ["MAX_LENGTH_GROUPS", "AttentionCall", "ModuleInputs", "causal_hides_nothing"]

# Ragged batches run one fused call per distinct valid length; past this many, one masked call.
MAX_LENGTH_GROUPS = 8


class ModuleInputs(NamedTuple):
    """What routes that project for themselves need of a :class:`~selfattn.MultiHeadAttention` call.

    Attributes:
        module: the calling module (its projections and position encoding).
        queries, keys, values: the raw inputs ``(b, l, d*)``; keys past the longest valid
            length already dropped.
        q_positions, k_positions: what the module's query/key encoding reads: ``(lq,)``/``(b, lq)``
            and ``(lk,)``/``(b, lk)``, or M-RoPE's ``(3, b, lq)`` and ``(3, b, lk)``.
        skip_padded_queries: the module's option.
        has_cache: whether a cache takes part.

    A named tuple, not a frozen dataclass: every call of a layer builds one, and a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__`` (microseconds of a decoding step).
    """

    module: Any
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    q_positions: torch.Tensor
    k_positions: torch.Tensor
    skip_padded_queries: bool
    has_cache: bool


T = TypeVar("T")


def _once(method: Callable[[AttentionCall], T]) -> property:
    """A property worked out on first use and kept (``functools.cached_property`` takes a lock dynamo cannot trace)."""
    name = method.__name__

    def get(self: AttentionCall) -> T:
        if name not in self._facts:
            self._facts[name] = method(self)
        value: T = self._facts[name]
        return value

    return property(get, doc=method.__doc__)


class AttentionCall:
    """Queries, keys, values, positions, visibility, the score term, dropout and what the caller wants back.

    ``q``, ``k`` and ``v`` may be given, or made on first use by ``make_q`` / ``make_kv`` (a
    module projects only what the chosen route reads).

    Args:
        shape: ``(b, h, hk, lq, lk, dh, dv)`` of the heads (known before projecting).
        visibility: which keys each query may see.
        q_positions / k_positions: integer positions, or None when there is no score term.
        term: the score encoding, or None.
        bias: a float tensor added to the scaled scores (broadcastable to ``(b, h, lq, lk)``).
        dropout_p: dropout on the weights (0 in evaluation).
        scale: score scale, default ``1 / sqrt(dh)``.
        softcap: ``c`` of ``c * tanh(logit / c)``, applied to each scaled score plus the term's
            bias before the mask (Gemma 2), or None.
        sinks: ``(h,)`` logits, one per query head, that join each softmax's denominator and
            add nothing to the output (gpt-oss), or None.
        return_weights: whether the ``(b, h, lq, lk)`` weights are wanted.
        block_size: queries per block for the blockwise routes, or None to choose.
        device / dtype: of the heads.
        inputs: the module's raw inputs, for the routes that project for themselves.
    """

    def __init__(
        self,
        *,
        shape: tuple[int, int, int, int, int, int, int],
        visibility: Visibility,
        device: torch.device,
        dtype: torch.dtype,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        make_q: Callable[[], torch.Tensor] | None = None,
        make_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        q_positions: torch.Tensor | None = None,
        k_positions: torch.Tensor | None = None,
        term: ScoreEncoding | None = None,
        bias: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        return_weights: bool = False,
        block_size: int | None = None,
        inputs: ModuleInputs | None = None,
    ):
        self.batch, self.heads, self.kv_heads, self.num_queries, self.num_keys, self.head_dim, self.value_dim = shape
        self.compiling = _validation.is_compiling()
        if visibility.rules and not self.compiling and _hides_nothing(visibility):
            visibility = visibility.without(Causal, Window)  # decoding: no mask, and the routes see no rule
        self.visibility = visibility
        self.device, self.dtype = device, dtype
        self._q, self._k, self._v = q, k, v
        self._make_q, self._make_kv = make_q, make_kv
        self.q_positions, self.k_positions = q_positions, k_positions
        self.term = term
        self.bias = bias
        self.dropout_p = dropout_p
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        self.softcap, self.sinks = softcap, sinks
        self.return_weights = return_weights
        self.block_size = block_size
        self.inputs = inputs
        # Inside torch.func.grad / vmap: custom autograd Functions without functorch rules cannot run.
        self.transformed = _validation.in_func_transform()
        self._facts: dict[str, Any] = {}
        self.four_d = (q is None or q.dim() == 4) and (k is None or k.dim() == 4) and (v is None or v.dim() == 4)
        if visibility.rules:
            # Where the rules meet the call: their tensors must fit its sizes (heads of other ranks: only lq, lk).
            visibility.check(self.batch if self.four_d else None, self.heads if self.four_d else None)

    @classmethod
    def of_heads(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visibility: Visibility, **options: Any
    ) -> AttentionCall:
        """The call on given heads ``(b, h, lq, d)`` (other leading dimensions count as one batch and head)."""
        lead = (q.shape[0] if q.dim() == 4 else 1, q.shape[-3] if q.dim() >= 3 else 1)
        kv_heads = k.shape[-3] if k.dim() >= 3 else 1
        shape = (*lead, kv_heads, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
        return cls(shape=shape, visibility=visibility, device=q.device, dtype=q.dtype, q=q, k=k, v=v, **options)

    # ------------------------------------------------------------------ the heads, made on first use

    @property
    def q(self) -> torch.Tensor:
        if self._q is None:
            assert self._make_q is not None
            self._q = self._make_q()
        return self._q

    @property
    def k(self) -> torch.Tensor:
        self._ensure_kv()
        assert self._k is not None
        return self._k

    @property
    def v(self) -> torch.Tensor:
        self._ensure_kv()
        assert self._v is not None
        return self._v

    def _ensure_kv(self) -> None:
        if self._k is None:
            assert self._make_kv is not None
            self._k, self._v = self._make_kv()

    # ------------------------------------------------------------------ facts the routes ask about

    def remember(self, name: str, compute: Callable[[AttentionCall], T]) -> T:
        """``compute(self)``, worked out once for this call and kept as ``name``: the checks several routes
        share (why blocks cannot serve it, why no window route can) run once however many routes ask."""
        if name not in self._facts:
            self._facts[name] = compute(self)
        value: T = self._facts[name]
        return value

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def modifies_scores(self) -> bool:
        """Whether a softcap or sinks change the softmax beyond a bias (only some routes apply them)."""
        return self.softcap is not None or self.sinks is not None

    @property
    def value_term(self) -> bool:
        """Whether the score term also adds to the values (Shaw's value table): the weights are needed."""
        return self.term is not None and self.term.uses_weights

    @_once
    def term_parameters(self) -> list[torch.Tensor]:
        """The score term's parameters that want a gradient (none when grad mode is off)."""
        if self.term is None or not torch.is_grad_enabled():
            return []
        return [p for p in self.term.parameters() if p.requires_grad]

    @_once
    def term_reads_queries(self) -> bool:
        """Whether the term's bias depends on the queries (Shaw's key term does), probed on one pair."""
        if self.term is None:
            return False
        assert self.q_positions is not None and self.k_positions is not None
        with torch.enable_grad():
            compute = torch.float64 if self.dtype == torch.float64 else torch.float32
            probe = self.q[..., :1, :].detach().to(compute).requires_grad_(True)
            bias = self.term(probe, q_positions=self.q_positions[..., :1], k_positions=self.k_positions[..., :1])
            if not bias.requires_grad:
                return False
            (grad,) = torch.autograd.grad(bias.sum(), probe, allow_unused=True)
        return grad is not None

    @_once
    def consecutive(self) -> tuple[int, int] | None:
        """First query and key positions when both are ``(l,)`` and count up by one, else None."""
        if self.q_positions is None or self.k_positions is None:
            return None
        first_query, first_key = _consecutive(self.q_positions), _consecutive(self.k_positions)
        if first_query is None or first_key is None:
            return None
        return first_query, first_key

    @_once
    def key_only(self) -> bool:
        """Whether the term has a key-only form (:meth:`~selfattn.positional.ScoreEncoding.key_only_term`)."""
        return self.term is not None and self.term.has_key_only_form()

    @_once
    def ragged_lengths(self) -> list[int] | None:
        """The ``(b,)`` valid lengths as ints when at most :data:`MAX_LENGTH_GROUPS` distinct ones occur."""
        lengths = self.visibility.valid_lens
        if lengths is None or lengths.dim() != 1 or self.compiling:
            return None
        listed = [int(length) for length in lengths.tolist()]
        return listed if len(set(listed)) <= MAX_LENGTH_GROUPS else None

    def dense_mask(self) -> torch.Tensor | None:
        """The visibility as a bool mask of at most the heads' rank, ``(.., lq, lk)``, or None when every key is visible.

        Rules render ``(b, h, lq, lk)``; heads given as ``(h, l, d)`` or ``(l, d)`` are one batch
        (and one head), so the leading ones go: a mask of higher rank than the scores would grow the output's.
        """
        mask = self.visibility.dense(self.device)
        rank = max(self.q.dim(), 2)
        while mask is not None and mask.dim() > rank and mask.shape[0] == 1:
            mask = mask[0]
        return mask

    def full_bias(self) -> torch.Tensor | None:
        """The score term's whole ``(.., lq, lk)`` bias plus the call's own float bias (dense routes)."""
        bias = self.bias
        if self.term is not None:
            assert self.q_positions is not None and self.k_positions is not None
            term = self.term(self.q, q_positions=self.q_positions, k_positions=self.k_positions)
            bias = term if bias is None else term + bias.to(term.dtype)
        return bias

    @property
    def simple_term(self) -> bool:
        """A score term with nothing to differentiate, no value term and no dropout: a float mask is enough."""
        return not (self.term_reads_queries or self.term_parameters or self.value_term or self.dropout_p > 0)


def causal_hides_nothing(visibility: Visibility) -> bool:
    """Whether a lower-right causal rule would let every query of ``visibility`` see every key (no key after the
    first query: decoding's queries after the cache's keys). From the indices alone; :func:`_hides_nothing` uses it."""
    return visibility.k_first + visibility.num_keys - 1 <= visibility.q_first


def _hides_nothing(visibility: Visibility) -> bool:
    """Whether the rules are causal and windows that let every query see every key of the call.

    Decoding's one query (or a few) after the keys sees them all under a lower-right causal rule.
    Worked out from the indices alone: no tensor is read.
    """
    if not visibility.only(Causal, Window):
        return False
    first_query, last_query = visibility.q_first, visibility.q_first + visibility.num_queries - 1
    first_key, last_key = visibility.k_first, visibility.k_first + visibility.num_keys - 1
    for rule in visibility.rules:
        if isinstance(rule, Causal) and not causal_hides_nothing(visibility):
            return False
        if isinstance(rule, Window) and max(last_key - first_query, last_query - first_key) >= rule.size:
            return False
    return True


def _consecutive(positions: torch.Tensor) -> int | None:
    """The first position if ``positions`` is ``(l,)`` and counts up by one, else None."""
    if positions.dim() != 1 or positions.numel() == 0 or _validation.is_compiling():
        return None
    first = int(positions[0])
    expected = torch.arange(first, first + positions.shape[0], device=positions.device)
    return first if torch.equal(positions.long(), expected) else None
