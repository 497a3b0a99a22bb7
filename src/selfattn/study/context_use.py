"""Does a model use context past its training length? Three readings of the same scored tokens.

A perplexity that "holds" at ``16 L`` does not show that a model *uses* the bytes past ``L``:
averaged over whole windows, a long window holds fewer bytes with little context than a short
one (Press et al.'s "early token curse"), so the average can fall with no gain from distant
bytes. The readings here separate the two:

* **by position** (:func:`nll_by_position`): the mean loss of the byte at each position of
  non-overlapping windows, so positions past ``L`` are read on their own;
* **truncated context** (:func:`truncated_context_nll`): the same bytes scored again from only
  their last ``context`` bytes (a window of its own, starting at position 0), one window per
  scored byte (``stride=1``) or per ``stride`` bytes (the sliding-window evaluation, where each
  scored byte has between ``context - stride + 1`` and ``context`` bytes before it);
* **context gain** (:func:`context_gain`): truncated minus full loss on the same bytes, by band
  of positions: positive where the model gains from the bytes it was given beyond ``context``.

Length-dependent rotary scaling (dynamic NTK) changes its factor with the current length; one
pass over a window gives every byte the window's factor. :func:`nll_token_by_token` feeds a
window one byte at a time through the model's caches, so the byte at position ``t`` is scored
with the factor of length ``t + 1``: dynamic scaling as it works when a model generates.

Shape legend: w windows, l window length, v vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import require_positive_int

__all__ = ["context_gain", "nll_by_position", "nll_token_by_token", "position_bands", "truncated_context_nll"]


def _windows(
    data: torch.Tensor, length: int, tokens: int, starts: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of ``tokens // length`` windows: two ``(w, l)`` int64.

    The windows are ``data[s : s + length]`` (targets one byte on) for ``s`` in ``starts``, or by
    default the non-overlapping windows from the start, ``s = 0, length, .., tokens - length``.
    """
    require_positive_int("length", length)
    require_positive_int("tokens", tokens)
    if tokens % length:
        raise ValueError(f"tokens={tokens} must be a multiple of length={length}")
    if starts is None:
        if len(data) < tokens + 1:
            raise ValueError(f"data holds {len(data)} bytes; {tokens + 1} are needed")
        return data[:tokens].long().view(-1, length), data[1 : tokens + 1].long().view(-1, length)
    offsets = torch.as_tensor(list(starts), dtype=torch.long)
    if offsets.numel() * length != tokens:
        raise ValueError(f"starts must give tokens // length = {tokens // length} windows, got {offsets.numel()}")
    if bool((offsets < 0).any()) or int(offsets.max()) + length + 1 > len(data):
        raise ValueError(
            f"every window of {length} bytes (and its next byte) must lie in the {len(data)} bytes of data"
        )
    index = offsets[:, None] + torch.arange(length)  # (w, l)
    return data[index].long(), data[index + 1].long()


def _nll(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-byte negative log-likelihood ``(w, l)`` in float64 of ``targets`` given ``inputs``."""
    device = next(model.parameters()).device
    logits = model(inputs.to(device))  # (w, l, v)
    return F.cross_entropy(logits.transpose(1, 2).double(), targets.to(device), reduction="none").cpu()


@torch.no_grad()
def nll_by_position(
    model: nn.Module,
    data: torch.Tensor,
    length: int,
    tokens: int,
    *,
    chunk_tokens: int = 16384,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Loss of each byte of non-overlapping windows of ``length``: ``(w, l)`` float64 nats.

    Row ``i`` holds window ``i`` (``data[i*l : (i+1)*l]`` predicting the byte after each, or
    ``data[starts[i] : starts[i] + l]`` with ``starts``: a sample of windows spread over ``data``);
    ``.mean(0)`` is the loss by position, ``.mean()`` the log of the usual perplexity.
    """
    inputs, targets = _windows(data, length, tokens, starts)
    per_chunk = max(1, chunk_tokens // length)
    was_training = model.training
    model.eval()
    rows = [
        _nll(model, inputs[i : i + per_chunk], targets[i : i + per_chunk]) for i in range(0, len(inputs), per_chunk)
    ]
    model.train(was_training)
    return torch.cat(rows)


@torch.no_grad()
def truncated_context_nll(
    model: nn.Module,
    data: torch.Tensor,
    length: int,
    tokens: int,
    *,
    context: int,
    scored_from: int = 0,
    stride: int = 1,
    every: int = 1,
    chunk_windows: int = 256,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """The bytes :func:`nll_by_position` scores, each predicted from at most its last ``context`` bytes.

    For the byte at position ``t >= scored_from`` of a window starting at ``s``, the model is run
    on ``data[s + t - c + 1 : s + t + 1]`` alone (``c = min(context, t + 1)``: a window of its
    own, first byte at position 0) and the prediction at its last position is kept. With
    ``stride > 1``, one short window scores ``stride`` consecutive bytes (the sliding-window
    evaluation): those bytes have between ``context - stride + 1`` and ``context`` bytes of
    context. With ``every > 1`` only the positions ``scored_from, scored_from + every, ..`` are
    scored, each from exactly its last ``context`` bytes (a sample of positions: the cost falls
    by ``every``). Bytes not scored are NaN in the result. ``starts`` as in :func:`nll_by_position`.

    Returns:
        ``(w, l)`` float64 nats, aligned with :func:`nll_by_position`.
    """
    inputs, targets = _windows(data, length, tokens, starts)
    context = require_positive_int("context", context)
    stride = require_positive_int("stride", stride)
    every = require_positive_int("every", every)
    if stride > context:
        raise ValueError(f"stride={stride} must be at most context={context}")
    if stride > 1 and every > 1:
        raise ValueError(f"give stride={stride} or every={every}, not both: a group of bytes or a sample of positions")
    if not 0 <= scored_from < length:
        raise ValueError(f"scored_from must lie in [0, length={length}), got {scored_from}")
    result = torch.full(inputs.shape, float("nan"), dtype=torch.float64)
    was_training = model.training
    model.eval()
    # Each group of `stride` scored bytes [t0, t1) is predicted by one window ending at t1 - 1.
    for t0 in range(scored_from, length, stride * every):
        t1 = min(t0 + stride, length)
        start = max(0, t1 - context)
        short_inputs = inputs[:, start:t1]  # (w, t1 - start): the window's bytes up to t1 - 1
        short_targets = targets[:, start:t1]
        for i in range(0, len(inputs), chunk_windows):
            nll = _nll(model, short_inputs[i : i + chunk_windows], short_targets[i : i + chunk_windows])
            result[i : i + chunk_windows, t0:t1] = nll[:, t0 - start :]
    model.train(was_training)
    return result


@torch.no_grad()
def nll_token_by_token(
    model: nn.Module, data: torch.Tensor, length: int, tokens: int, *, starts: Sequence[int] | None = None
) -> torch.Tensor:
    """:func:`nll_by_position` computed one byte at a time through the model's caches.

    ``model`` is a :class:`~selfattn.models.TransformerLM` (it needs ``make_caches`` and a
    ``caches=`` keyword). Each byte is fed alone; the caches hold the bytes before it, so a
    length-dependent scaling sees the current length ``t + 1`` at position ``t``, not the
    window's length. ``starts`` as in :func:`nll_by_position`.
    """
    inputs, targets = _windows(data, length, tokens, starts)
    make_caches = getattr(model, "make_caches", None)
    if make_caches is None:
        raise ValueError(f"model must have make_caches() (a TransformerLM), got {type(model).__name__}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    caches = make_caches(length)
    columns = []
    for t in range(length):
        logits = model(inputs[:, t : t + 1].to(device), caches=caches)  # (w, 1, v)
        columns.append(F.cross_entropy(logits[:, 0].double(), targets[:, t].to(device), reduction="none").cpu())
    model.train(was_training)
    return torch.stack(columns, dim=1)


def position_bands(length: int, train_len: int) -> list[tuple[int, int]]:
    """Bands of positions ``[a, b)`` for a table: ``[0, 16)``, then doubling up to ``length``, cut at ``train_len``.

    The bands up to ``train_len`` show what training reached; those past it what the model
    does with more context than it was trained on.
    """
    require_positive_int("length", length)
    require_positive_int("train_len", train_len)
    edges = {0, length}
    edge = 16
    while edge < length:
        edges.add(edge)
        edge *= 2
    if train_len < length:
        edges.add(train_len)
    ordered = sorted(edges)
    return list(itertools.pairwise(ordered))


def context_gain(
    full: torch.Tensor, truncated: torch.Tensor, bands: Sequence[tuple[int, int]]
) -> list[dict[str, float | int]]:
    """Per band of positions: mean loss with the full window and with the truncated context, and their difference.

    Args:
        full: ``(w, l)`` from :func:`nll_by_position`.
        truncated: ``(w, l)`` from :func:`truncated_context_nll` (NaN where not scored).
        bands: ``[(a, b), ...]`` position ranges.

    Returns:
        One dict per band with scored bytes: ``start``, ``stop``, ``full``, ``truncated``,
        ``gain`` (``truncated - full``, nats per byte: > 0 where the extra context helped),
        ``gain_se`` (its standard error over the band's windows) and ``windows``.
    """
    if full.shape != truncated.shape:
        raise ValueError(
            f"full and truncated must have one shape, got {tuple(full.shape)} and {tuple(truncated.shape)}"
        )
    rows: list[dict[str, float | int]] = []
    for start, stop in bands:
        scored = ~truncated[:, start:stop].isnan().any(dim=0)  # (stop - start,) columns scored in both
        if not bool(scored.any()):
            continue
        full_band = full[:, start:stop][:, scored]
        short_band = truncated[:, start:stop][:, scored]
        per_window = (short_band - full_band).mean(dim=1)  # (w,): one gain per window
        spread = float(per_window.std()) / len(per_window) ** 0.5 if len(per_window) > 1 else float("nan")
        rows.append(
            {
                "start": start,
                "stop": stop,
                "full": float(full_band.mean()),
                "truncated": float(short_band.mean()),
                "gain": float(per_window.mean()),
                "gain_se": spread,
                "windows": len(per_window),
            }
        )
    return rows
