"""Does a task model use its input past the training length? Answer accuracy by position, two ways.

The grid's exact match by length says *whether* a model answers past ``L``; it does not say
where in an answer it goes wrong, nor whether the tokens a long sample adds are any use to it.
Two teacher-forced readings of the same answer tokens (answer token ``j`` is right or wrong
given the right tokens before it) answer both:

* **full**: each answer token predicted with the whole sample before it;
* **window**: each answer token predicted from ``BOS`` followed by only the last ``W - 1``
  tokens before it (a sequence of its own, ``BOS`` at position 0), ``W`` the longest sequence
  training showed (``BOS input SEP answer`` at length ``L``). ``BOS`` stays because every
  training sample began with it: a window without it would test a sequence no model has seen.

Both are read at the lengths ``L + 1 .. 2 L`` on the answer tokens that have more than ``W - 1``
tokens before them (the ones a window shortens). The window reaches ``W - 2 = 2 L`` tokens back:
on copy it holds every answer token's source there (answer token ``j`` repeats the input token
``n <= 2 L`` back), on reverse the sources of the first ``L`` answer tokens (``2 j + 1`` back), so
what it takes away there is context, not the answer. Where the window reads higher, the tokens
beyond it hurt the model; where the whole sample reads higher, the model uses them.

Shape legend: b samples, l sample length, t answer tokens, w window length ``W``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.study.spread import interval95
from selfattn.study.tasks import BOS, Task, make_batch

__all__ = [
    "answer_bands",
    "ANSWER_SAMPLES",
    "READINGS",
    "answer_accuracy_by_position",
    "answer_use",
    "summarize_answer_use",
]

# Samples per length: past L = 20 each band of the whole-sample reading holds 9,600-16,160 answer tokens.
ANSWER_SAMPLES = 16
READINGS = ("in_range", "full", "far_full", "far_window")


@torch.no_grad()
def _window_predictions(model: nn.Module, tokens: torch.Tensor, scored: torch.Tensor, window: int) -> torch.Tensor:
    """Argmax at each scored column ``t`` from ``BOS`` + ``tokens[:, t - window + 2 : t + 1]``: ``(b, t)``."""
    b = tokens.shape[0]
    offsets = torch.arange(window - 1, device=tokens.device)
    index = scored[:, None] - window + 2 + offsets  # (t, w - 1): the last w - 1 tokens to each t
    pieces = tokens[:, index]  # (b, t, w - 1)
    starts = torch.full((b, len(scored), 1), BOS, dtype=tokens.dtype, device=tokens.device)
    windows = torch.cat([starts, pieces], dim=-1).reshape(b * len(scored), window)  # (b * t, w)
    per_chunk = max(1, 16384 // window)
    last = [model(windows[i : i + per_chunk])[:, -1].argmax(-1) for i in range(0, len(windows), per_chunk)]
    return torch.cat(last).view(b, len(scored))


@torch.no_grad()
def answer_accuracy_by_position(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """Per answer token, the share of the samples predicting it right, teacher-forced: ``(t,)``.

    Args:
        model: a causal model ``(b, l) -> (b, l, v)``; put in evaluation mode by the caller.
        tokens: ``(b, l)`` samples of one length (:func:`~selfattn.study.tasks.make_batch`), no padding.
        targets: ``(b, l)``, -100 off the answer.
        window: predict each answer token from ``BOS`` and its last ``window - 1`` tokens alone
            (tokens with at most ``window - 1`` before them are predicted as with the whole
            sample, which they are); None: from the whole sample.
    """
    if window is not None and require_positive_int("window", window) < 2:
        raise ValueError(f"window must hold BOS and at least one token, got {window}")
    if tokens.shape != targets.shape or bool((targets != -100).ne(targets[:1] != -100).any()):
        raise ValueError("tokens and targets must share one shape and one answer span (samples of one length)")
    return _right_by_position(model, tokens, targets, window)


@torch.no_grad()
def _right_by_position(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, window: int | None, *, whole: bool = True
) -> torch.Tensor:
    """:func:`answer_accuracy_by_position` on checked arguments; ``whole=False`` reads only the tokens a window
    shortens (NaN at the others) and skips the whole-sample pass."""
    device = next(model.parameters()).device
    tokens, targets = tokens.to(device), targets.to(device)
    scored = (targets[0] != -100).nonzero().flatten()  # columns that predict an answer token
    right = torch.full((len(scored),), float("nan"), device=device)  # (t,)
    if whole:
        right = (model(tokens).argmax(-1)[:, scored] == targets[:, scored]).float().mean(0)
    if window is not None:
        far = scored >= window  # columns with more than window - 1 tokens before them
        if bool(far.any()):
            predicted = _window_predictions(model, tokens, scored[far], window)  # (b, far columns)
            right[far] = (predicted == targets[:, scored[far]]).float().mean(0)
    return right.cpu()


def answer_bands(train_len: int, eval_len: int) -> list[tuple[int, int]]:
    """Bands of answer positions (1-based, inclusive): the two halves of ``1..L``, then ``L+1..2L`` and ``2L+1..eval_len``.

    For the grid's ``L = 20``, ``eval_len = 80``: 1-10, 11-20, 21-40, 41-80. Empty bands are left out.
    """
    edges = [(1, train_len // 2), (train_len // 2 + 1, train_len), (train_len + 1, 2 * train_len),
             (2 * train_len + 1, eval_len)]  # fmt: skip
    return [(first, min(last, eval_len)) for first, last in edges if first <= min(last, eval_len)]


def _banded(right: Sequence[torch.Tensor], bands: Sequence[tuple[int, int]]) -> list[float | None]:
    """Mean over the answer tokens of ``right`` (one ``(t,)`` per length, NaN: not counted) in each band of positions."""
    sums, counts = torch.zeros(len(bands), dtype=torch.float64), torch.zeros(len(bands), dtype=torch.float64)
    for per_token in right:
        for i, (first, last) in enumerate(bands):
            part = per_token[first - 1 : last].double()
            counted = ~part.isnan()
            sums[i] += part[counted].sum()
            counts[i] += counted.sum()
    return [float(s / c) if c else None for s, c in zip(sums, counts, strict=True)]


def answer_use(
    model: nn.Module,
    task: Task,
    *,
    train_len: int,
    eval_len: int,
    samples: int,
    generator: torch.Generator,
) -> dict[str, Any]:
    """Answer tokens right by band of answer positions: in range, past it, and past it with and without a window.

    Returns:
        ``{"window", "bands", "in_range", "full", "far_full", "far_window"}``: the window ``W``
        (:meth:`Task.sequence_len` at ``train_len``), the bands (:func:`answer_bands`) as ``[first, last]``, and per
        band the share of answer tokens right (None where no token falls in the band): ``in_range`` at lengths
        ``1 .. train_len`` (every sample fits in ``W``); ``full`` at ``train_len + 1 .. eval_len``, every answer
        token with the whole sample; ``far_full`` and ``far_window`` the answer tokens of the lengths
        ``train_len + 1 .. 2 train_len`` with more than ``W - 1`` tokens before them (the ones a window
        shortens), with the whole sample and with the window.
    """
    require_positive_int("samples", samples)
    require_positive_int("train_len", train_len)
    if require_positive_int("eval_len", eval_len) <= train_len:
        raise ValueError(f"eval_len={eval_len} must exceed train_len={train_len}")
    window = task.sequence_len(train_len)
    bands = answer_bands(train_len, eval_len)
    was_training = model.training
    model.eval()
    in_range, full, far_full, far_window = [], [], [], []
    for n in range(1, eval_len + 1):
        tokens, targets, _ = make_batch(task, [n] * samples, generator)  # (b, l): the same samples for both readings
        whole = answer_accuracy_by_position(model, tokens, targets)  # (t,)
        if n <= train_len:
            in_range.append(whole)
            continue
        full.append(whole)
        if n > 2 * train_len:  # the window would cut the answer's source off (copy, reverse): no reading of context
            continue
        through = _right_by_position(model, tokens, targets, window, whole=False)  # (t,): NaN where left whole
        far_full.append(whole.masked_fill(through.isnan(), float("nan")))
        far_window.append(through)
    model.train(was_training)
    return {
        "window": window,
        "bands": [list(band) for band in bands],
        "in_range": _banded(in_range, bands),
        "full": _banded(full, bands),
        "far_full": _banded(far_full, bands),
        "far_window": _banded(far_window, bands),
    }


def summarize_answer_use(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Over the seeds of one cell: per reading and band, :func:`~selfattn.study.spread.interval95` of the runs' shares.

    Returns:
        ``{"window", "bands", "seeds", reading: [interval | None per band], "far_gain": [...]}`` over the runs
        that carry ``answer_use`` (None if none does; a band no run reaches is None). ``far_gain`` is ``far_full
        - far_window`` per seed: what the tokens beyond the window add (> 0: the model uses them).
    """
    readings = [run["answer_use"] for run in runs if run.get("answer_use")]
    if not readings:
        return None
    summary: dict[str, Any] = {"window": readings[0]["window"], "bands": readings[0]["bands"], "seeds": len(readings)}
    bands = range(len(summary["bands"]))
    for reading in READINGS:
        values = [[r[reading][i] for r in readings if r[reading][i] is not None] for i in bands]
        summary[reading] = [interval95(v) if v else None for v in values]
    gains = [[r["far_full"][i] - r["far_window"][i] for r in readings if r["far_full"][i] is not None] for i in bands]
    summary["far_gain"] = [interval95(g) if g else None for g in gains]
    return summary
