"""Multi-head latent attention (MLA) on the library's attention core, in two computations.

Keys and values come from one compressed latent per token: ``c`` (``r`` features, shared by
every head) and one rotated key ``k_rope`` (``dr`` features, shared too). The up-projection
``W_ukv`` (``kv_b_proj``'s weight) gives each head ``k_nope = c W_uk_h`` and ``v = c W_uv_h``.
Attention is then computed either

* **expanded**: every head's ``k = [k_nope, k_rope]`` and ``v`` are made from the latent and the
  dispatcher runs ordinary multi-head attention (head sizes ``dn + dr`` and ``dv``); cheapest when
  many queries share the keys (prefill, training);
* **absorbed**: ``W_uk`` is folded into the query (``q_nope W_uk_h^T``: an ``r``-wide query per head)
  and ``W_uv`` into the output, so the dispatcher runs multi-query attention over the latent itself,
  one key "head" ``[c, k_rope]`` of ``r + dr`` features and one value "head" ``c`` of ``r``; cheapest
  when queries are few next to the keys (decoding), since no key is ever expanded.

Both compute the same numbers up to float rounding. :func:`choose_computation` picks one by
counting multiply-adds; :func:`latent_attention` runs it; :func:`explain_latent` says which, why,
and the route the dispatcher chose for the attention itself.

Shape legend:
    b: batch, h: heads, lq: queries, lk: keys, r: latent size (kv_lora_rank), dn: per-head
    key features without rotary (qk_nope_head_dim), dr: rotary features (qk_rope_head_dim),
    dv: value head size (v_head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

import selfattn.core.dispatch as dispatch
import selfattn.masks as masks
from selfattn._mask_selection import Selected
from selfattn._validation import is_compiling, require_positive_finite, require_probability
from selfattn.core.call import AttentionCall, causal_hides_nothing
from selfattn.core.explanation import Explanation
from selfattn.core.routes.sparse import SPARSE_MANY_QUERIES, SPARSE_MAX_SHARE, SPARSE_MIN_GROUP
from selfattn.masks import Visibility

__all__ = [
    "COMPUTATIONS",
    "Computation",
    "LatentExplanation",
    "LatentPlan",
    "choose_computation",
    "explain_latent",
    "latent_attention",
    "latent_visibility",
]

Computation = Literal["expanded", "absorbed"]
#: What ``computation=`` accepts: ``"auto"`` (decide by the sizes) or one of the two.
COMPUTATIONS = ("auto", "expanded", "absorbed")


@dataclass(frozen=True)
class LatentExplanation:
    """How a latent attention call is computed: the computation, why, and the dispatcher's route.

    Attributes:
        computation: ``"expanded"`` or ``"absorbed"``.
        reason: why, in words (the multiply-adds each would cost, or that it was asked for).
        attention: the dispatcher's :class:`~selfattn.core.explanation.Explanation` of the
            attention it runs (``.route`` is the route's name).
    """

    computation: Computation
    reason: str
    attention: Explanation

    @property
    def route(self) -> str:
        """The route the dispatcher chose for the attention itself."""
        return self.attention.route

    def __str__(self) -> str:
        return f"computation: {self.computation} ({self.reason})\n{self.attention}"


#: What one multiply-add over gathered latent rows costs, in multiply-adds of a dense pass. Per query the
#: route multiplies ``h`` query rows by ``t`` gathered rows of ``r + dr``: a matrix product of ``h`` (16)
#: rows, slower per multiply-add than the fused dense kernel's tiles, and more so as the ``t x (r + dr)``
#: rows outgrow the cache. Measured on CPU, one thread, DeepSeek-V3's sizes, layer forward with the
#: projections: at n=8192, top-k 2048, absorbed on the sparse route 86.1 s, expanded (a masked fused
#: pass over every key) 49.7 s, dense causal 20.3 s: 1.9x the time per multiply-add of the masked pass
#: (0.9x at n=4096, top-k 512, whose gathered rows fit the cache better).
GATHERED_COST = 2


def _costs(
    num_queries: int,
    num_keys: int,
    heads: int,
    rank: int,
    nope: int,
    rope: int,
    value: int,
    picks: int | None,
    pairs: int | None = None,
) -> tuple[int, int]:
    """Multiply-adds of (expanded, absorbed) per batch row, projections in and out of the heads included.

    With ``picks`` (a top-k selection the "sparse selection" route takes when absorbed), the
    absorbed queries each attend to ``picks`` keys; expanded, one query head per key head, the
    route declines many queries and a dense masked pass attends to ``pairs`` (query, key) pairs
    (default all of them; the causal ones when the selection is causal: the blockwise route then
    skips the hidden half).
    """
    pairs = num_queries * num_keys if pairs is None else pairs
    expanded = num_keys * heads * rank * (nope + value) + pairs * heads * (nope + rope + value)
    if picks is None:
        absorbed = num_queries * heads * (rank * (nope + value) + num_keys * (2 * rank + rope))
    else:
        gathered = GATHERED_COST * min(picks, num_keys) * (2 * rank + rope)
        absorbed = num_queries * heads * (rank * (nope + value) + gathered)
    return expanded, absorbed


def choose_computation(
    requested: str,
    num_queries: int,
    num_keys: int,
    heads: int,
    rank: int,
    nope: int,
    rope: int,
    value: int,
    picks: int | None = None,
    pairs: int | None = None,
) -> tuple[Computation, str]:
    """The computation for these sizes and the reason, in words.

    ``"auto"`` takes the one with fewer multiply-adds: expanding costs ``lk h r (dn + dv)`` once
    plus ``lq h lk (dn + dr + dv)``; absorbing costs ``lq h (r (dn + dv) + lk (2 r + dr))``. With
    DeepSeek-V3's sizes absorbing wins below about 170 queries, whatever the number of keys.
    With ``picks`` keys per query (a top-k selection small enough for the "sparse selection"
    route) absorbing attends to ``picks`` keys, not ``lk``: the gathered latent rows serve every
    head at once; each gathered multiply-add counts :data:`GATHERED_COST` dense ones. ``pairs``: the
    (query, key) pairs the expanded pass computes (default ``lq lk``; a causal selection's blocks skip
    the hidden half: at n=4096, top-k 512, 16 heads, the layer took 8.8-10.3 s expanded in causal
    blocks, 12.4-13.6 s absorbed on the sparse route, 7.0-7.6 s dense causal, one thread, load 7).

    Raises:
        ValueError: ``requested`` not one of :data:`COMPUTATIONS`.
    """
    if requested not in COMPUTATIONS:
        raise ValueError(f"computation must be one of {COMPUTATIONS}, got {requested!r}")
    expanded, absorbed = _costs(num_queries, num_keys, heads, rank, nope, rope, value, picks, pairs)
    counts = f"expanded {expanded:,} vs absorbed {absorbed:,} multiply-adds per sequence"
    if picks is not None:
        counts += f" (absorbed attends to the {picks} selected keys per query)"
    if requested != "auto":
        return requested, f"asked for; {counts}"  # type: ignore[return-value]
    if absorbed < expanded:
        return "absorbed", f"{num_queries} queries over {num_keys} keys: {counts}"
    return "expanded", f"{num_queries} queries over {num_keys} keys: {counts}"


def latent_visibility(
    num_queries: int,
    num_keys: int,
    *,
    causal: bool,
    mask: masks.Rule | torch.Tensor | None = None,
    q_first: int | None = None,
    k_first: int = 0,
) -> Visibility:
    """What each query sees: ``causal``, joined by "and" to a ``masks`` rule or a bool mask ``(.., lq, lk)``.

    Queries are the last ``lq`` of the keys unless ``q_first`` (index of the first query in the
    whole sequence) says otherwise.
    """
    if mask is not None and not isinstance(mask, (masks.Rule, torch.Tensor)):
        raise ValueError(f"mask must be a selfattn.masks rule or a bool tensor, got {type(mask).__name__}")
    rule = masks.dense(mask) if isinstance(mask, torch.Tensor) else mask
    first_query = num_keys + k_first - num_queries if q_first is None else q_first
    return Visibility(num_queries, num_keys, first_query, k_first).with_rules(masks.causal() if causal else None, rule)


def _split_up_projection(kv_b_weight: torch.Tensor, heads: int, nope: int, value: int) -> tuple[torch.Tensor, ...]:
    """``kv_b_proj.weight`` ``(h (dn + dv), r)`` as ``W_uk`` ``(h, dn, r)`` and ``W_uv`` ``(h, dv, r)``."""
    per_head = kv_b_weight.view(heads, nope + value, kv_b_weight.shape[-1])
    return per_head[:, :nope], per_head[:, nope:]


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero features appended up to ``width`` (unchanged when it has them)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _expanded_call(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_key: torch.Tensor,
    kv_b_weight: torch.Tensor,
    visibility: Visibility,
    scale: float,
    dropout_p: float,
) -> AttentionCall:
    """Per-head keys ``[c W_uk_h^T, k_rope]`` and values ``c W_uv_h^T`` as one multi-head call (made on first use).

    The query/key and value heads are padded with zeros to one size (scores and the kept outputs
    are unchanged): PyTorch's flash kernels take only equal head sizes, and on CPU its math
    fallback is slower than the padding costs (1.6x forward and backward, causal n=2048, 192/128).
    """
    batch, heads, num_queries, nope = q_nope.shape
    value = kv_b_weight.shape[0] // heads - nope
    num_keys, rank, rope = latent_key.shape[-2], kv_b_weight.shape[-1], q_rope.shape[-1]
    latent, k_rope = latent_key[..., :rank], latent_key[..., rank:]  # views: (b, 1, lk, r), (b, 1, lk, dr)
    key_width = value_width = max(nope + rope, value)

    def make_kv() -> tuple[torch.Tensor, torch.Tensor]:
        kv = (latent[:, 0] @ kv_b_weight.t()).view(batch, num_keys, heads, nope + value).transpose(1, 2)
        k_nope, v = kv[..., :nope], kv[..., nope:]  # (b, h, lk, dn), (b, h, lk, dv)
        k = torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1)  # (b, h, lk, dn + dr)
        return _padded(k, key_width), _padded(v, value_width)

    return AttentionCall(
        shape=(batch, heads, heads, num_queries, num_keys, key_width, value_width),
        visibility=visibility, device=q_nope.device, dtype=q_nope.dtype,
        make_q=lambda: _padded(torch.cat((q_nope, q_rope), dim=-1), key_width),  # (b, h, lq, dn + dr)
        make_kv=make_kv, scale=scale, dropout_p=dropout_p,
    )  # fmt: skip


def _sparse_picks(visibility: Visibility, heads: int | None = None) -> int | None:
    """Picks per query of a top-k selection small enough for the "sparse selection" route, else None.

    With ``heads``: only if the route also takes the absorbed call (``heads`` query heads over
    one latent key head; past :data:`SPARSE_MANY_QUERIES` queries it wants :data:`SPARSE_MIN_GROUP`).
    """
    selection = visibility.find(Selected)
    if not isinstance(selection, Selected) or selection.indices.shape[-1] > SPARSE_MAX_SHARE * visibility.num_keys:
        return None
    if heads is not None and visibility.num_queries > SPARSE_MANY_QUERIES and heads < SPARSE_MIN_GROUP:
        return None
    return int(selection.indices.shape[-1])


#: Absorbed calls of at most this many queries fold the heads into the queries (see :func:`_folded_visibility`).
FOLD_MAX_QUERIES = 64


def _folded_visibility(visibility: Visibility, heads: int, device: torch.device) -> Visibility | None:
    """The visibility of ``h x lq`` query rows (head-major) of one head, or None when it differs by head.

    Multi-query attention over the latent is one key head for ``h`` query heads; handed over as
    ``h`` heads it would make a kernel repeat the keys ``h`` times. With few queries, the heads'
    rows of queries are instead stacked into one head, ``(b, 1, h lq, r + dr)``, which sees one
    copy of the keys. Their rules are the call's rows rendered as a bool mask repeated per head.
    A top-k selection (:func:`selfattn.masks.selected`) small enough for the "sparse selection"
    route keeps the heads apart instead: rendered dense it would hide the selection from that
    route, which gathers each query's picks once for all the heads. A causal rule that hides no key
    (a decoding step) is dropped first, as :class:`~selfattn.core.call.AttentionCall` drops it:
    rendered, its all-True mask would cost a pass over every key and give the kernel a mask to read.
    """
    if _sparse_picks(visibility) is not None:
        return None
    if visibility.only(masks.Causal) and not is_compiling() and causal_hides_nothing(visibility):
        visibility = visibility.without(masks.Causal)  # decoding: the queries after the keys see them all
    rows = visibility.dense(device)  # (.., lq, lk) bool, or None when every key is visible
    folded = Visibility(heads * visibility.num_queries, visibility.num_keys, visibility.q_first, visibility.k_first)
    if rows is None:
        return folded
    while rows.dim() < 4:
        rows = rows[None]
    if rows.shape[1] != 1:
        return None  # a rule that differs by head: keep the heads apart
    stacked = rows.expand(-1, heads, -1, -1).reshape(rows.shape[0], 1, heads * rows.shape[2], rows.shape[3])
    return folded.with_rules(masks.dense(stacked))  # (b or 1, 1, h lq, lk)


def _absorbed_call(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_key: torch.Tensor,
    w_uk: torch.Tensor,
    visibility: Visibility,
    scale: float,
    dropout_p: float,
) -> tuple[AttentionCall, bool]:
    """Queries ``[q_nope W_uk_h, q_rope]`` over the one latent key ``[c, k_rope]`` and value ``c`` (MQA).

    A dense pass takes the whole latent key as the value (its last ``dr`` output features are
    dropped): with equal head sizes PyTorch's CPU flash kernel takes the call (3x faster than its
    math fallback on a 16,384-token latent, which also copies the keys to scale them). The
    "sparse selection" route instead takes the value as it is, ``c``, a view of the key's first
    ``r`` features: it gathers the key rows once and reads the values from them, so the weighted
    sum is ``r`` wide, not ``r + dr`` (512 of 576 in DeepSeek's sizes).

    Returns the call and whether its heads are folded into one (its output is then ``(b, 1, h lq, r + dr)``).
    """
    batch, heads, num_queries, _ = q_nope.shape
    num_keys, rank, rope = latent_key.shape[-2], w_uk.shape[-1], q_rope.shape[-1]
    folded = _folded_visibility(visibility, heads, q_nope.device) if num_queries <= FOLD_MAX_QUERIES else None
    query_heads, query_rows = (heads, num_queries) if folded is None else (1, heads * num_queries)
    sparse = folded is None and dropout_p == 0.0 and _sparse_picks(visibility, heads) is not None
    value_width = rank if sparse else rank + rope

    def make_q() -> torch.Tensor:
        q_latent = torch.einsum("bhqn,hnr->bhqr", q_nope, w_uk)  # (b, h, lq, r)
        q = torch.cat((q_latent, q_rope), dim=-1)  # (b, h, lq, r + dr)
        return q.reshape(batch, query_heads, query_rows, rank + rope)

    call = AttentionCall(
        shape=(batch, query_heads, 1, query_rows, num_keys, rank + rope, value_width),
        visibility=visibility if folded is None else folded, device=q_nope.device, dtype=q_nope.dtype,
        make_q=make_q,
        make_kv=lambda: (latent_key, latent_key[..., :value_width]),  # (b, 1, lk, r + dr), (b, 1, lk, r or r + dr)
        scale=scale, dropout_p=dropout_p,
    )  # fmt: skip
    return call, folded is not None


def _check(q_nope: torch.Tensor, q_rope: torch.Tensor, latent_key: torch.Tensor, kv_b_weight: torch.Tensor) -> None:
    """Shapes that fit each other, named when they do not."""
    for name, t in (("q_nope", q_nope), ("q_rope", q_rope), ("latent_key", latent_key)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (b, heads, l, features), got {getattr(t, 'shape', t)!r}")
    if not isinstance(kv_b_weight, torch.Tensor) or kv_b_weight.dim() != 2:
        raise ValueError(
            f"kv_b_weight must be a 2-D tensor (h * (dn + dv), r), got {getattr(kv_b_weight, 'shape', kv_b_weight)!r}"
        )
    batch, heads, num_queries, nope = q_nope.shape
    rank, rope = kv_b_weight.shape[1], q_rope.shape[-1]
    if q_rope.shape[:3] != (batch, heads, num_queries):
        raise ValueError(f"q_rope {tuple(q_rope.shape)} must be (b, h, lq, dr) beside q_nope {tuple(q_nope.shape)}")
    if latent_key.shape[:2] != (batch, 1) or latent_key.shape[-1] != rank + rope:
        raise ValueError(
            f"latent_key {tuple(latent_key.shape)} must be ({batch}, 1, lk, r + dr) = ({batch}, 1, lk, {rank + rope}) "
            f"for kv_b_weight {tuple(kv_b_weight.shape)} and q_rope {tuple(q_rope.shape)}"
        )
    if kv_b_weight.shape[0] % heads or kv_b_weight.shape[0] // heads <= nope:
        raise ValueError(
            f"kv_b_weight {tuple(kv_b_weight.shape)} must be (h * (dn + dv), r) with h={heads}, dn={nope} and dv >= 1"
        )


class LatentPlan(NamedTuple):
    """How one latent attention call runs: the dispatcher's call and what to do with its output.

    Attributes:
        call: the :class:`~selfattn.core.call.AttentionCall` handed to the dispatcher.
        computation: ``"expanded"`` or ``"absorbed"``.
        reason: why, in words.
        w_uv: ``(h, dv, r)``, the value up-projection applied after absorbed attention (else empty).
        folded: whether the absorbed call stacked the heads into one head's queries.
    """

    call: AttentionCall
    computation: Computation
    reason: str
    w_uv: torch.Tensor
    folded: bool


def describe_latent(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_key: torch.Tensor,
    kv_b_weight: torch.Tensor,
    visibility: Visibility,
    *,
    scale: float,
    dropout_p: float = 0.0,
    computation: str = "auto",
) -> LatentPlan:
    """The dispatcher's call for these arguments, and how its output becomes ``(b, h, lq, dv)``."""
    _check(q_nope, q_rope, latent_key, kv_b_weight)
    heads, num_queries, nope = q_nope.shape[1], q_nope.shape[2], q_nope.shape[3]
    rank, rope, num_keys = kv_b_weight.shape[-1], q_rope.shape[-1], latent_key.shape[-2]
    value = kv_b_weight.shape[0] // heads - nope
    picks = _sparse_picks(visibility, heads)
    pairs = None
    if picks is not None and visibility.causal and num_queries <= num_keys:  # lower-right: query i sees lk - lq + i + 1
        pairs = num_queries * (num_keys - num_queries) + num_queries * (num_queries + 1) // 2
    chosen, reason = choose_computation(
        computation, num_queries, num_keys, heads, rank, nope, rope, value, picks, pairs
    )
    scale, dropout_p = require_positive_finite("scale", scale), require_probability("dropout_p", dropout_p)
    visibility.check(q_nope.shape[0], heads)  # the rules' tensors fit the call, before any is rendered
    if chosen == "expanded":
        call = _expanded_call(q_nope, q_rope, latent_key, kv_b_weight, visibility, scale, dropout_p)
        return LatentPlan(call, chosen, reason, kv_b_weight.new_empty(0), False)
    w_uk, w_uv = _split_up_projection(kv_b_weight, heads, nope, value)
    call, folded = _absorbed_call(q_nope, q_rope, latent_key, w_uk, visibility, scale, dropout_p)
    if folded:
        reason += f"; the {heads} heads' queries stacked as one head over the one latent key"
    return LatentPlan(call, chosen, reason, w_uv, folded)


def latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_key: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: masks.Rule | torch.Tensor | None = None,
    visibility: Visibility | None = None,
    dropout_p: float = 0.0,
    computation: str = "auto",
) -> torch.Tensor:
    """Multi-head latent attention of rotated queries over a latent, the per-head output before ``o_proj``.

    Args:
        q_nope: ``(b, h, lq, dn)`` query features without rotary.
        q_rope: ``(b, h, lq, dr)`` rotated query features (``dr`` may be 0: NoPE).
        latent_key: ``(b, 1, lk, r + dr)``: each key's normalized latent ``c`` (first ``r``) and its
            rotated key ``k_rope`` shared by every head (last ``dr``), side by side as a
            :class:`~selfattn.latent.LatentCache` stores them.
        kv_b_weight: ``(h * (dn + dv), r)``, ``kv_b_proj.weight``: head ``i``'s rows
            ``i (dn + dv) ..`` give its ``k_nope`` (first ``dn``) and ``v`` (last ``dv``).
        scale: the softmax's score scale (``(dn + dr) ** -0.5`` times YaRN's ``mscale ** 2`` in
            DeepSeek's families).
        causal: query ``i`` sees keys ``j <= i + lk - lq`` (lower-right aligned).
        mask: a :mod:`selfattn.masks` rule, or a bool tensor ``(.., lq, lk)`` (True = attend), joined
            to ``causal`` by "and": e.g. a top-k selection.
        visibility: instead of ``causal`` and ``mask``, a whole
            :class:`~selfattn.masks.Visibility` (what the module passes: a cache shifts the indices).
        dropout_p: dropout on the attention weights.
        computation: ``"auto"``, ``"expanded"`` or ``"absorbed"`` (see the module's docstring).

    Returns:
        ``(b, h, lq, dv)``.

    Raises:
        ValueError: shapes that do not fit, a bad ``scale``, ``dropout_p`` or ``computation``.
    """
    if visibility is None:
        visibility = latent_visibility(q_nope.shape[-2], latent_key.shape[-2], causal=causal, mask=mask)
    plan = describe_latent(
        q_nope, q_rope, latent_key, kv_b_weight, visibility, scale=scale, dropout_p=dropout_p,
        computation=computation,
    )  # fmt: skip
    out = dispatch.run(
        plan.call
    ).out  # (b, h, lq, dv or more); absorbed (b, h, lq, r or r + dr) or (b, 1, h lq, r + dr)
    if plan.computation == "absorbed":
        latent_out = out.reshape(*q_nope.shape[:3], -1)[..., : plan.w_uv.shape[-1]]  # (b, h, lq, r)
        return torch.einsum("bhqr,hvr->bhqv", latent_out, plan.w_uv)  # (b, h, lq, dv)
    return out[..., : kv_b_weight.shape[0] // q_nope.shape[1] - q_nope.shape[-1]]  # (b, h, lq, dv)


def explain_latent(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_key: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: masks.Rule | torch.Tensor | None = None,
    visibility: Visibility | None = None,
    computation: str = "auto",
    verbose: bool = False,
) -> LatentExplanation:
    """How :func:`latent_attention` computes these arguments (the computation and the route), computing no attention.

    Neither the keys nor the absorbed queries are formed: the call is described by its sizes.
    """
    if visibility is None:
        visibility = latent_visibility(q_nope.shape[-2], latent_key.shape[-2], causal=causal, mask=mask)
    plan = describe_latent(q_nope, q_rope, latent_key, kv_b_weight, visibility, scale=scale, computation=computation)
    return LatentExplanation(plan.computation, plan.reason, dispatch.explain(plan.call, verbose=verbose))
