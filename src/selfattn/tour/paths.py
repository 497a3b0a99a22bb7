"""Shortest dependency paths through a real layer, counted in matrix products.

The chapter's maximum path length is the number of steps a signal takes from one position
to another. Here it is read off the computation the layer really runs: every ATen operation
of a forward pass is intercepted (``TorchDispatchMode``) and, beside each tensor, a tensor of
the same shape records for every element the fewest matrix products (matmul, linear,
convolution) on any chain of operations from input position ``source`` to that element
(``inf`` when the element does not depend on it). The rules are structural, one per kind of
operation:

* products ``C = A @ B``: ``C[i, j]`` reads row i of A and column j of B, so its distance is
  ``1 + min(min_k A[i, k], min_k B[k, j])``; a convolution's output reads every channel of
  its window, plus 1;
* element-wise operations: the smallest distance among the inputs, broadcast;
* softmax and reductions: the smallest distance along the reduced axis;
* shape operations (views, transposes, slices, stacks, padding): the same operation applied
  to the distances.

Nothing depends on which layer runs: an RNN run over the whole sequence in one call gives
one product for its input projection plus one per recurrent step, a recurrence that skips a
step gives about half as many, attention gives its three products whatever n is. An
operation without a rule raises ``NotImplementedError`` rather than guess.

Shape legend: b batch, n positions, d features.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["product_path_length", "stack_path_length"]

_aten = torch.ops.aten
_INF = math.inf

# Operations whose output is a rearrangement of their inputs: the same call moves distances.
_SHAPE_OPS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.select.int,
    _aten.slice.Tensor,
    _aten.unbind.int,
    _aten.stack.default,
    _aten.cat.default,
    _aten.expand.default,
    _aten.clone.default,
    _aten.contiguous.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.squeeze.default,
    _aten.unsqueeze.default,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.alias.default,
    _aten.detach.default,
    _aten.lift_fresh.default,
    _aten.index_select.default,
    _aten.narrow.default,
    _aten.unfold.default,
}
_CREATION_OPS = {
    _aten.zeros.default,
    _aten.ones.default,
    _aten.empty.memory_format,
    _aten.full.default,
    _aten.arange.default,
    _aten.arange.start,
    _aten.arange.start_step,
    _aten.zeros_like.default,
    _aten.ones_like.default,
    _aten.empty_like.default,
    _aten.scalar_tensor.default,
    _aten.eye.default,
}
# In-place shape operations move distances as their out-of-place twins do.
_IN_PLACE_SHAPE_OPS = {
    _aten.transpose_.default: _aten.transpose.int,
    _aten.t_.default: _aten.t.default,
    _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.squeeze_.dim: _aten.squeeze.dim,
}
_REDUCTIONS = {_aten._softmax.default, _aten._log_softmax.default, _aten.sum.dim_IntList, _aten.mean.dim}
# Reductions to one element, and reading it back on the host (attention checks its queries are finite).
_WHOLE_REDUCTIONS = {_aten.all.default, _aten.any.default, _aten._local_scalar_dense.default}


class _Distances(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every operation and keeps, per tensor, the product distance of each element."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # id(tensor) -> (weak reference to it, its distances); an entry leaves with its tensor,
        # so a long stack keeps only the distances of the tensors still alive.
        self.distances: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def track(self, tensor: torch.Tensor, distance: torch.Tensor) -> None:
        key = id(tensor)

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            if self.distances.get(key, (None,))[0] is ref:
                del self.distances[key]

        self.distances[key] = (weakref.ref(tensor, forget), distance)

    def tracked(self, tensor: torch.Tensor) -> bool:
        entry = self.distances.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def of(self, value: Any) -> Any:
        """The distance tensor of ``value`` (all ``inf`` for an untracked tensor)."""
        if not isinstance(value, torch.Tensor):
            return value
        if self.tracked(value):
            return self.distances[id(value)][1]
        return torch.full(value.shape, _INF, dtype=torch.float64)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in _CREATION_OPS or not any(self.tracked(t) for t in tensors):
            return out  # depends on nothing tracked: every element is at distance inf
        distance = self._rule(func, args, kwargs, out)
        outs, _ = tree_flatten(out)
        dists, _ = tree_flatten(distance)
        for tensor, dist in zip(outs, dists, strict=False):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor, dist)
        return out

    def _rule(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        of = self.of
        if func in _IN_PLACE_SHAPE_OPS:
            func = _IN_PLACE_SHAPE_OPS[func]
        if func in _SHAPE_OPS:
            return func(*tree_map(of, args), **tree_map(of, kwargs))
        if func is _aten.constant_pad_nd.default:
            return F.pad(of(args[0]), list(args[1]), value=_INF)
        if func in (_aten.mm.default, _aten.bmm.default):
            return _product(of(args[0]), of(args[1]))
        if func in (_aten.addmm.default, _aten.baddbmm.default):
            return torch.minimum(of(args[0]).expand(out.shape), _product(of(args[1]), of(args[2])))
        if func is _aten.convolution.default:
            bias = None if args[2] is None else of(args[2])
            return _convolution(of(args[0]), of(args[1]), bias, *args[3:6])
        if func is _aten._scaled_dot_product_flash_attention_for_cpu.default:
            return _fused_attention(of(args[0]), of(args[1]), of(args[2]), args[4:], kwargs, out)
        if func in _REDUCTIONS:
            dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            keep = func in (_aten._softmax.default, _aten._log_softmax.default) or bool(args[2])
            reduced = of(args[0])
            for dim in dims:
                reduced = reduced.amin(dim=dim, keepdim=True)
            return reduced.expand(out.shape) if keep else reduced.squeeze([d % of(args[0]).dim() for d in dims])
        if func in _WHOLE_REDUCTIONS:
            return of(args[0]).amin()
        if func is _aten.copy_.default:  # the destination takes the source's values
            return of(args[1]).expand(out.shape).clone()
        if torch.Tag.pointwise in func.tags or func in (_aten.where.self, _aten.masked_fill.Scalar):
            dists = [of(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            result = dists[0].expand(out.shape)
            for dist in dists[1:]:
                result = torch.minimum(result, dist.expand(out.shape))
            return result.clone()
        raise NotImplementedError(f"no dependency rule for {func}; add one to selfattn.tour.paths")


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distances of ``a @ b`` for (batched) matrices: one more product than the nearest input."""
    rows = a.amin(dim=-1, keepdim=True)  # (..., m, 1)
    columns = b.amin(dim=-2, keepdim=True)  # (..., 1, p)
    return torch.minimum(rows, columns) + 1  # (..., m, p)


def _fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: Any, kwargs: dict[str, Any], out: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances of ``softmax(q k^T) v`` in one kernel: two products from q and k, one from v."""
    causal = bool(flags[0]) if flags else bool(kwargs.get("is_causal", False))
    if causal or kwargs.get("attn_mask") is not None:
        raise NotImplementedError("the fused attention rule covers unmasked attention only")
    every_key = torch.minimum(k.amin(dim=(-2, -1), keepdim=True) + 2, v.amin(dim=(-2, -1), keepdim=True) + 1)
    rows = torch.minimum(q.amin(dim=-1, keepdim=True) + 2, every_key)  # (b, h, n, 1)
    values = rows.expand(out[0].shape).clone()
    return values, rows[..., 0].expand(out[1].shape).clone()


def _convolution(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any, dilation: Any
) -> torch.Tensor:
    """Distances of a 1-D convolution: an output reads every channel of its window, plus 1."""
    if x.dim() != 3:
        raise NotImplementedError("only 1-D convolutions have a dependency rule")
    nearest = x.amin(dim=1, keepdim=True)  # (b, 1, n): any channel will do
    nearest = F.pad(nearest, (padding[0], padding[0]), value=_INF)
    window = -F.max_pool1d(-nearest, weight.shape[-1], stride[0], 0, dilation[0])  # min over the window
    window = torch.minimum(window, weight.amin()) + 1  # (b, 1, n_out)
    if bias is not None:
        window = torch.minimum(window, bias.amin())
    return window.expand(x.shape[0], weight.shape[0], window.shape[-1]).clone()


def product_path_length(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, source: int = 0, target: int = -1
) -> float:
    """Fewest matrix products on any dependency chain from ``x[:, source]`` to ``layer(x)[:, target]``.

    Args:
        layer: maps ``(b, n, d)`` to ``(b, n, d)``; run once under a dispatch mode, without autograd.
        x: the input ``(b, n, d)``.
        source: the input position the path starts at.
        target: the output position it ends at.

    Returns:
        The number of products, or ``inf`` when the output does not depend on that input at all.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, positions, features), got shape {tuple(x.shape)}")
    n = x.shape[1]
    if not -n <= source < n or not -n <= target < n:
        raise ValueError(f"source and target must index one of the {n} positions, got {source} and {target}")
    start = torch.full(x.shape, _INF, dtype=torch.float64)
    start[:, source] = 0.0
    mode = _Distances()
    x = x.detach().clone()
    with torch.no_grad(), mode:
        mode.track(x, start)
        y = layer(x)
        distance = mode.of(y)
    return float(distance[:, target].min())


def stack_path_length(
    layer_at: Callable[[int], Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    *,
    max_depth: int,
    source: int = 0,
    target: int = -1,
) -> tuple[int, float]:
    """The smallest depth of a stack at which output ``target`` depends on input ``source``.

    Runs ``layer_at(0)``, ``layer_at(1)``, ... on ``x`` one after another, once, and stops at
    the first depth whose output depends on the source position. Returns that depth and the
    fewest matrix products on a chain between them (as :func:`product_path_length`).

    Raises:
        ValueError: if ``max_depth`` layers do not connect the two positions.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, positions, features), got shape {tuple(x.shape)}")
    n = x.shape[1]
    if not -n <= source < n or not -n <= target < n:
        raise ValueError(f"source and target must index one of the {n} positions, got {source} and {target}")
    start = torch.full(x.shape, _INF, dtype=torch.float64)
    start[:, source] = 0.0
    mode = _Distances()
    h = x.detach().clone()
    with torch.no_grad(), mode:
        mode.track(h, start)
        for depth in range(1, max_depth + 1):
            h = layer_at(depth - 1)(h)
            products = float(mode.of(h)[:, target].min())
            if math.isfinite(products):
                return depth, products
    raise ValueError(f"output {target} does not depend on input {source} within max_depth={max_depth} layers")
