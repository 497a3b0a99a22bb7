"""The transformers backend's plans: a layer's unmasked calls replay the route its first call of their kind took.

On a decoding step transformers passes most layers no mask (Llama's, Gemma 2's global layers, gpt-oss's
full ones): one query sees every cached key. A prefill with no padding passes none either: each query sees
the keys up to its own (the causal rule on a square). :func:`~selfattn.integrations.transformers.attention_forward`
runs the first such call of a layer in full (every keyword read and checked, the call described, the
dispatcher asked), then keeps for the layer (beside it, by a weak reference) a :class:`StepPlan`: the call's kind,
the route the dispatcher chose for it (from its memory, so ``explain`` names the same), and the
call's checked options (scale, softcap, sinks, dropout). A later call of the same kind runs that route
from the heads, with none of the checks re-done (they hold by the kind): by the route's step form
(:attr:`~selfattn.core.route.Route.step_for`: the fused kernel's, and in inference the decoding step of the
routes that apply a softcap or sinks) when the route has one for the kind, else (one query only) on the call
built from the heads. A layer holds two plans: one for a single
query (decoding steps) and one for several (prefills, encoder passes), so the two replace neither.

The kind (computed by :func:`replay`): no ``attention_mask`` and none of the keywords that restrict or reweigh
attention (``position_bias``, per-query ``sinks``, selections, ``head_mask``, packed lengths, weights wanted
or recorded); query, key and value heads of exactly ``torch.Tensor`` (a subclass runs in full); their shapes
except, for one query, the keys' length (several queries need as many keys, and a window, if any, no shorter than
them); their dtypes and device; ``dropout``, ``scaling``, ``softcap``, ``sliding_window``, ``is_causal`` and,
for several queries, whether the causal rule holds (``is_causal``, else the layer's); the sink tensor itself
(``s_aux``) and its shape; the names of the other keywords, and None still given to each that no table of
:mod:`~selfattn.integrations._hf_keywords` lets through with a value (the full path refuses it then); grad mode;
a ``torch.func`` transform; the dispatcher's one size fact (:func:`~selfattn.core.dispatch.few_scores`); and
whether there are more keys than queries (with no more, the decoding routes run their blocks, not their step). A
call of another kind runs in full and replaces the plan of its number of queries, or drops it; a call no plan
serves (a mask) leaves the plans. No tensor value is read. Every layer of every generated token reads all this,
inside ``generate()``, where a Python function call costs several times what it costs in a tight loop: the kind,
the plan's lookup and the step form's call are one function of this package (torch's ``is_dynamo_compiling`` is
the one other Python call). A graph reads no plan: dynamo traces the full path.

Shape legend: b batch, h heads, hk key/value heads, lq queries, lk keys, d head size, dv value head size.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.autograd.profiler as _autograd_profiler

import selfattn.core.dispatch as dispatch
import selfattn.functional._block_sliced as _block_sliced
from selfattn._validation import _peek_interpreter_stack
from selfattn.core.call import AttentionCall
from selfattn.core.route import Route, Step
from selfattn.integrations._hf_keywords import NOT_READ
from selfattn.masks import Visibility
from selfattn.masks import causal as causal_rule

__all__ = ["StepPlan", "plans_of", "recording_attentions", "remember", "replay"]


class StepPlan(NamedTuple):
    """What later calls of one kind replay (see the module's docstring)."""

    kind: tuple[object, ...]
    routes: Sequence[Route]
    route: Route
    options: dict[str, Any]  # AttentionCall's checked keywords: scale, softcap, sinks, dropout_p
    step: Step | None  # the route's step form when it has one for the kind (no dropout): no call described
    causal: bool  # several queries under the causal rule (a prefill)
    kept_none: tuple[str, ...]  # keywords of no table, None in the planned call: a value makes another kind


#: Each transformers attention layer's plans (one query, several), by ``id(layer)`` beside a weak reference to the
#: layer: a copy or a pickle carries none, and an entry goes with its layer. A step reads it with builtins only
#: (a weak dictionary's ``get`` is a Python call: a decoding step's microsecond).
_PLANS: dict[int, tuple[weakref.ref[Any], tuple[StepPlan | None, StepPlan | None]]] = {}


def plans_of(module: Any) -> tuple[StepPlan | None, StepPlan | None] | None:
    """The layer's plans (one query, several), or None when it has none."""
    entry = _PLANS.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else None


def replay(
    module: Any, query: Any, key: Any, value: Any, dropout: float, scaling: float | None, is_causal: bool | None,
    sliding_window: int | None, softcap: float | None, s_aux: torch.Tensor | None, extra: dict[str, Any],
) -> tuple[torch.Tensor | None, tuple[object, ...] | None]:  # fmt: skip
    """``(output, kind)`` of an ``attention_forward`` call that no mask or restricting keyword was given and whose
    weights are not wanted (the caller has checked): the call's ``(b, h, lq, dv)`` output by the layer's plan of
    its kind, None when it has none (the full path runs), and the kind, None when no plan serves the call (the
    full path then keeps none). ``extra``: the other keywords. One function, its arguments one by one: each frame
    and each helper call is a decoding step's microsecond inside ``generate()``."""
    # Exactly Tensor (cheaper than isinstance, and a decoding step reads it three times): a subclass runs in full,
    # and so do the fake tensors of the tracers that run this code (make_fx, torch.export's non-strict mode). Dynamo
    # traces it with real Tensors and reads torch's check of its own as True (one frame where is_compiling is two).
    if not type(query) is type(key) is type(value) is torch.Tensor or torch.compiler.is_dynamo_compiling():
        return None, None
    collector = _ACTIVE_COLLECTOR if _ACTIVE_COLLECTOR is not None else _find_active_collector()
    if collector is not False and isinstance(collected := collector.get(), dict) and "attentions" in collected:
        return None, None  # recording_attentions inline: its weights are wanted
    query_shape, key_shape, value_shape = query.shape, key.shape, value.shape
    if len(query_shape) != 4 or len(key_shape) != 4 or len(value_shape) != 4:
        return None, None
    batch, kv_heads, num_keys, head_dim = key_shape
    value_batch, value_heads, num_values, value_dim = value_shape
    num_queries = query_shape[2]
    if num_values != num_keys:
        return None, None
    causal = None  # one query sees every key whatever the rule
    if num_queries != 1:
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if num_keys != num_queries or (causal and sliding_window is not None and sliding_window < num_queries):
            return None, None  # a static cache's free slots, or a window that hides keys: the full path's masks
    kind = (
        query_shape, batch, kv_heads, head_dim, value_batch, value_heads, value_dim,
        query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
        dropout, scaling, is_causal, causal, sliding_window, softcap,
        id(s_aux), None if s_aux is None else s_aux.shape,  # the plan holds the tensor: its id is not reused
        tuple(extra),  # every name, None or not: names are what the full path's keyword check reads
        torch.is_grad_enabled(), _peek_interpreter_stack() is not None,  # grad mode; a torch.func transform or not
        num_queries * num_keys < _block_sliced.SLICED_MIN_SCORES,  # dispatch.few_scores inline: a frame less per step
        num_keys > num_queries,  # a step after a cache's keys, or (one key) the decoding routes' blocks
    )  # fmt: skip
    if (entry := _PLANS.get(id(module))) is None or entry[0]() is not module:
        return None, kind
    plan = entry[1][0] if num_queries == 1 else entry[1][1]
    if plan is None or plan.kind != kind or dispatch.ROUTES is not plan.routes:
        return None, kind
    for name in plan.kept_none:  # a keyword the full path let through for being None: given now, it is refused
        if extra[name] is not None:
            return None, kind
    if plan.step is not None and not dispatch.VERIFY_REMEMBERED_CHOICES and not _autograd_profiler._is_profiler_enabled:
        return plan.step(query, key, value), kind  # run_step's own test inline: a frame less per step
    return _run(plan, query, key, value), kind


def recording_attentions() -> bool:
    """Whether transformers is collecting attention weights in this forward (``output_attentions=True``).

    Some models (GPT-2, OPT, StableLM, Nemotron ...) record the weights their attention layers
    return without passing ``output_attentions`` down; eager always returns them, so selfattn
    must see the request where transformers keeps it, its output collector. Under dynamo (which cannot read a
    context variable) it reads the global that transformers' collector keeps instead when the collector was set
    inside the traced code (a compiled model's forward sets it); one set outside it is not seen.
    """
    collector = _ACTIVE_COLLECTOR if _ACTIVE_COLLECTOR is not None else _find_active_collector()
    if collector is False:  # an older transformers passes output_attentions itself
        return False
    if torch.compiler.is_dynamo_compiling():
        collected = collector.global_var if getattr(collector, "compiling", False) else None
    else:
        collected = collector.get()
    return isinstance(collected, dict) and "attentions" in collected


#: transformers' output collector (a context variable), looked up once: an import per call costs each step.
_ACTIVE_COLLECTOR: Any = None


def _find_active_collector() -> Any:
    global _ACTIVE_COLLECTOR
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        _ACTIVE_COLLECTOR = False
    else:
        _ACTIVE_COLLECTOR = _active_collector
    return _ACTIVE_COLLECTOR


def _run(plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``(b, h, lq, dv)``: the plan's route on heads of its kind, in the profiler's record, or asked again (tests:
    :data:`~selfattn.core.dispatch.VERIFY_REMEMBERED_CHOICES`), or (no step form) on the call built from them."""
    verify = dispatch.VERIFY_REMEMBERED_CHOICES  # every route asked again must choose the plan's
    if plan.step is not None and not verify:
        return dispatch.run_step(plan.route, plan.step, query, key, value)
    visibility = Visibility.lower_right(query.shape[2], key.shape[-2], causal_rule() if plan.causal else None)
    call = AttentionCall.of_heads(query, key, value, visibility, **plan.options)
    if verify:
        dispatch.check_remembered(call, plan.routes, plan.route)
    if plan.step is not None:
        return dispatch.run_step(plan.route, plan.step, query, key, value)
    return dispatch.run_route(plan.route, call).out


def remember(
    module: torch.nn.Module, kind: tuple[object, ...] | None, call: AttentionCall | None, extra: dict[str, Any]
) -> None:
    """After a call run in full: keep a plan for its kind (``call`` is the call as ``attention`` described it,
    ``extra`` the keywords its parameters did not take)."""
    if not isinstance(module, torch.nn.Module) or torch.compiler.is_compiling() or kind is None or call is None:
        return  # a stand-in for a layer (tests), a graph (the plans not read), or a call no plan serves
        # (a mask): the layer's plans stay for the unmasked calls that follow
    several, key = call.num_queries != 1, id(module)
    entry = _PLANS.get(key)
    if entry is None or entry[0]() is not module:  # the layer's first plan
        entry = (weakref.ref(module, functools.partial(_forget, key)), (None, None))
    plans, plan = entry[1], _plan(kind, call, several, extra)
    _PLANS[key] = (entry[0], (plans[0], plan) if several else (plan, plans[1]))  # this number of queries' replaced


def _forget(key: int, reference: weakref.ref[Any]) -> None:
    """A layer's reference died: its plans go (unless the id is already another layer's)."""
    if (entry := _PLANS.get(key)) is not None and entry[0] is reference:
        del _PLANS[key]


def _plan(kind: tuple[object, ...], call: AttentionCall, several: bool, extra: dict[str, Any]) -> StepPlan | None:
    """The plan of ``call``'s kind, or None where none serves it."""
    causal = bool(call.visibility.rules)
    if call.term is not None or call.bias is not None or (causal and not (several and call.visibility.kernel_causal)):
        return None
    if call.heads == 1 and call.kv_heads == 1:
        return None  # the "split keys" route's kind of call: its choice moves with the keys' length and the threads
    chosen = dispatch.remembered_route(call)
    if chosen is None or call.return_weights:
        return None
    options = {"scale": call.scale, "softcap": call.softcap, "sinks": call.sinks, "dropout_p": call.dropout_p}
    step_for = chosen[1].step_for
    step = step_for(call, causal) if step_for is not None and call.dropout_p == 0 else None
    if several and step is None:
        return None  # several queries are replayed by a step form only
    kept_none = tuple(name for name in extra if name not in NOT_READ)  # the full path refuses them given a value
    return StepPlan(kind, chosen[0], chosen[1], options, step, causal, kept_none)
