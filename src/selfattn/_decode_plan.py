"""A decoding plan: what a layer's first decoding step of one kind worked out, replayed by the next steps of that kind.

A decoding step of :class:`~selfattn.MultiHeadAttention` is one query against a cache, and its full path
(check every argument, describe the call, ask the dispatcher, finish) costs more than the step's own
work. The first step of a kind runs that full path; :func:`remember` then keeps on the layer a small
:class:`DecodePlan`: the route the dispatcher chose for the call (read from the dispatcher's memory,
so the same code decides and ``explain`` names it), the call's fixed options (scale, softcap, sinks,
dropout), whether the projections run bare (no parts, no encoding or a plain rotary read from its
cos/sin table) or through the layer's projection methods, and the cache's write. Later steps of the same
kind (:func:`replay`) run: projections, rotation, the cache write, the remembered route, ``W_o``. A route
with a step form for the call's kind (:attr:`~selfattn.core.route.Route.step_for`: the fused kernel's, and in
inference the decoding step of the routes that apply a softcap or sinks) runs from the heads alone; any other
route gets the step's call described again,
from what the plan holds. A score term is planned where the dispatcher remembers its route
(:func:`~selfattn.core.dispatch.remembered_route`: ALiBi's causal term, one row of bias for the step,
in inference); the term reads the keys' positions as the cache's write returns them
(:meth:`~selfattn.KVCache.write_positioned_step`: what its ``update`` returns to the full path).

A layer with a ``window`` or ``chunk_size`` has no plan: its rule hides nothing while the cache is short
and hides keys later, so the kind would move with the cache's length.

The kind (:func:`kind_of`): one query; self-attention (``keys`` and ``values`` are ``queries``); a
:class:`~selfattn.KVCache` (exactly that class) holding no padding and no document ids; every other
argument left out (``offset`` may be an int); the queries' shape, dtype and device; ``causal``; the
layer's ``training``; grad mode; a ``torch.func`` transform or not; and the one fact of the
dispatcher's choice that moves with the cache's length (whether the step's scores reach
``SLICED_MIN_SCORES``). Any other call runs in full and drops the plan (:func:`remember`), and so does
setting any attribute of the layer (an option, a part, a new encoding, ``train()``) and moving or
casting it (``MultiHeadAttention.__setattr__`` and ``_apply``). Plans are kept beside the layers (a weak
dictionary), so copying, pickling or saving a layer carries none. A replay that finds its rotary's table
unusable (a length-dependent scaling set on it since) returns None before writing anything, and the
step runs in full. No tensor value is read: nothing here synchronises with a device.

Shape legend: b batch, h heads, hk key/value heads, lk keys, dh head size, dv value head size.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

import selfattn._validation as _validation
import selfattn.core.dispatch as dispatch
from selfattn._layer_call import describe, finish, updates_cached_keys
from selfattn.cache import KVCache
from selfattn.core.call import AttentionCall
from selfattn.core.inputs import check_request
from selfattn.core.route import Route, Step
from selfattn.masks import Visibility
from selfattn.positional.base import QueryKeyEncoding, ScoreEncoding
from selfattn.positional.rotary import RotaryPositionalEncoding

__all__ = ["ENABLED", "DecodePlan", "drop", "kind_of", "plan_of", "remember", "replay", "run_call"]

#: Tests switch plans off to compare a replayed step with the full path.
ENABLED = True


class DecodePlan(NamedTuple):
    """What later steps of one kind replay (see the module's docstring)."""

    kind: tuple[object, ...]
    routes: Sequence[Route]  # the dispatcher's list the route came from: a replaced list voids the plan
    route: Route
    options: dict[str, Any]  # AttentionCall's fixed keywords: scale, softcap, sinks, dropout_p, block_size
    bare: tuple[Any, Any, Any, Any] | None  # W_q, W_k, W_v, W_o when there are no parts and no encoding, a
    # plain rotary or a score term: the projections and the heads' views inline (setting any drops the plan)
    heads: tuple[int, int, int, int]  # h, hk, dh, dv
    rotary: RotaryPositionalEncoding | None  # the bare projections' rotation, from its table
    few_scores: bool  # the dispatcher's size fact when the plan was made
    step: Step | None  # the route's step form when it has one for the kind (no term or dropout): no call described
    term: ScoreEncoding | None  # the score term, whose key-only form the remembered route reads


def run_call(module: Any, given: tuple[Any, ...]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``module.forward(*given)``: by the layer's plan where it has one for this kind of call, else in full
    (check, describe, the dispatcher, finish), after which the layer remembers a plan for the kind, or none."""
    compiling = torch.compiler.is_compiling()  # a graph keeps no plan, and must not read the plans' weak dictionary
    out = None if compiling else replay(module, given)
    if out is not None:
        return out
    request = check_request(module, *given)
    call = describe(module, request)
    result = finish(module, request, call, dispatch.run(call))
    if not compiling:
        remember(module, given, call)
    return result


def kind_of(module: Any, given: tuple[Any, ...]) -> tuple[object, ...] | None:
    """The kind of a call of ``module.forward`` with arguments ``given`` (its order), or None if no plan serves it."""
    (queries, keys, values, valid_lens, causal, return_weights, offset, cache, positions, key_positions, attn_mask,
     key_padding_mask, document_ids, cumulative_lengths, mask) = given  # fmt: skip
    if (
        keys is not queries
        or values is not queries
        or type(cache) is not KVCache
        or not isinstance(queries, torch.Tensor)
        or type(causal) is not bool
        or return_weights is not False
        or not (offset is None or (type(offset) is int and offset >= 0))
        or valid_lens is not None
        or positions is not None
        or key_positions is not None
        or attn_mask is not None
        or key_padding_mask is not None
        or document_ids is not None
        or cumulative_lengths is not None
        or mask is not None
        or queries.dim() != 3
        or queries.shape[1] != 1
        or torch.compiler.is_compiling()
    ):
        return None
    grad, transformed = torch.is_grad_enabled(), _validation.in_func_transform()
    return (queries.shape, queries.dtype, queries.device, causal, module.training, grad, transformed)


#: Each layer's plan, beside the layer rather than in it: a copy, a pickle or a state dict of the layer never holds one.
_PLANS: weakref.WeakKeyDictionary[Any, DecodePlan] = weakref.WeakKeyDictionary()


def plan_of(module: Any) -> DecodePlan | None:
    """The plan ``module`` holds now, or None."""
    return _PLANS.get(module)


def drop(module: Any) -> None:
    """Forget ``module``'s plan (while compiling there is none to forget: a graph neither keeps nor reads one)."""
    if not torch.compiler.is_compiling():
        _PLANS.pop(module, None)


def remember(module: Any, given: tuple[Any, ...], call: AttentionCall) -> None:
    """After a call run in full: keep a plan for its kind where one serves it, else drop the layer's plan."""
    drop(module)
    kind = kind_of(module, given) if ENABLED else None
    if kind is None or call.bias is not None or call.visibility.rules or call.num_keys <= call.num_queries:
        return  # (no earlier key: the routes run their blocks, not the decoding step later steps replay)
    if call.heads == 1 and call.kv_heads == 1:
        return  # the "split keys" route's kind of call: its choice moves with the cache's length and the threads
    chosen = dispatch.remembered_route(call)
    position = module.position
    if chosen is None or module.shared_kv or getattr(position, "position_axes", 1) != 1:
        return
    if module.window is not None or module.chunk_size is not None:
        return  # the rule hid nothing in this step (so the call has none) and hides keys once the cache grows
    term = call.term
    if isinstance(position, QueryKeyEncoding) and updates_cached_keys(position):
        return  # an encoding that re-rotates the cache: every step in full
    if position is not None and not isinstance(position, (QueryKeyEncoding, ScoreEncoding)):
        return
    routes, route = chosen
    no_parts = not any(module.part_names.values())
    config = getattr(position, "scaling_config", None)
    table = type(position) is RotaryPositionalEncoding and (config is None or not config.depends_on_length)
    rotary = position if table and isinstance(position, RotaryPositionalEncoding) else None
    plain = no_parts and module.W_v is not None and (position is None or rotary is not None or term is not None)
    bare = (module.W_q, module.W_k, module.W_v, module.W_o) if plain else None
    heads = (module.num_heads, module.num_kv_heads, module.head_dim, module.value_head_dim)
    options = {
        "scale": call.scale, "softcap": call.softcap, "sinks": call.sinks, "dropout_p": call.dropout_p,
        "block_size": call.block_size,
    }  # fmt: skip
    few = dispatch.few_scores(call.num_queries, call.num_keys)
    step_for = route.step_for
    step = step_for(call, False) if step_for is not None and term is None and call.dropout_p == 0 else None
    _PLANS[module] = DecodePlan(kind, routes, route, options, bare, heads, rotary, few, step, term)


def replay(module: Any, given: tuple[Any, ...]) -> torch.Tensor | None:
    """The output of ``module.forward(*given)`` by the layer's plan, or None when it has none for this call."""
    plan = _PLANS.get(module)
    if plan is None or dispatch.ROUTES is not plan.routes or kind_of(module, given) != plan.kind:
        return None
    queries, cache, offset = given[0], given[7], given[6]
    if (writer := cache._writer) is not None and writer() is not module:
        return None  # another layer's cache: the full path refuses it
    if cache.holds_marks or cache.stored == 0 or plan.few_scores != dispatch.few_scores(1, cache.stored + 1):
        return None  # a step with no earlier key is no decoding step (the routes run their blocks on it)
    term = plan.term
    if term is not None and not term.has_key_only_form():
        return None  # the term lost its key-only form since
    first = cache.length if offset is None else offset
    heads = _project(module, plan, queries, first)
    if heads is None:
        return None
    q, k, v = heads
    first_key, key_positions = 0, None
    if term is None:
        written = cache.write_step(k, v, first)
    else:  # the term reads the keys' positions
        positioned = cache.write_positioned_step(k, v, first)
        written, key_positions = (None, None) if positioned is None else (positioned[:2], positioned[2])
    if written is None:  # a windowed cache: its step; or a call that must raise: the full update
        seen = cache.write_window_step(k, v, first)
        if seen is None:
            seen = cache.update(k, v, positions=torch.arange(first, first + 1, device=k.device), commit=False)
        written, first_key, key_positions = (seen.keys, seen.values), seen.first_index, seen.positions
    keys, values = written
    verify = dispatch.VERIFY_REMEMBERED_CHOICES  # tests: every route asked again must choose the plan's
    call = None
    if verify or plan.step is None:  # the step described: the route reads it, or the tests' check does
        num_keys = keys.shape[-2]
        call = AttentionCall(
            shape=(q.shape[0], q.shape[1], keys.shape[1], 1, num_keys, q.shape[-1], values.shape[-1]),
            visibility=Visibility(1, num_keys, cache.length, first_key), device=q.device, dtype=q.dtype,
            q=q, k=keys, v=values, term=term, k_positions=key_positions,
            q_positions=None if term is None else torch.arange(first, first + 1, device=q.device), **plan.options,
        )  # fmt: skip
    if call is not None and verify:
        dispatch.check_remembered(call, plan.routes, plan.route)
    if plan.step is not None:
        out, stage = dispatch.run_step(plan.route, plan.step, q, keys, values), "heads"  # (b, h, 1, dv)
    else:
        assert call is not None
        result = dispatch.run_route(plan.route, call)
        out, stage = result.out, result.stage
    if stage == "heads":
        out = out.transpose(1, 2).flatten(2)  # (b, h, 1, dv) -> (b, 1, h * dv)
    if stage != "projected":
        out = module.project_output(out, queries) if plan.bare is None else plan.bare[3](out)  # (b, 1, d)
    cache.commit()
    return out


def _project(
    module: Any, plan: DecodePlan, x: torch.Tensor, first: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Query, key and value heads ``(b, h, 1, dh)``, ``(b, hk, 1, dh)``, ``(b, hk, 1, dv)`` of ``x`` at ``first``;
    None where the bare rotation cannot read its table (nothing is written then)."""
    if plan.bare is None:  # parts or another encoding: the layer's own projections, with the step's positions
        positions = torch.arange(first, first + 1, device=x.device)
        k = module.project_keys(x, positions, first)
        return module.project_queries(x, positions, first), k, module.project_values(x, x)
    (W_q, W_k, W_v, _), (heads, kv_heads, head_dim, value_dim) = plan.bare, plan.heads
    batch = x.shape[0]
    q = W_q(x).view(batch, 1, heads, head_dim).transpose(1, 2)  # as split_heads
    k = W_k(x).view(batch, 1, kv_heads, head_dim).transpose(1, 2)
    v = W_v(x).view(batch, 1, kv_heads, value_dim).transpose(1, 2)
    rotary = plan.rotary
    if rotary is None:
        return q, k, v
    rotated = rotary.rotate_consecutive_pair(q, k, first)
    return None if rotated is None else (*rotated, v)
