"""Do shorter paths make long-range dependencies easier to learn? CNN, RNN and self-attention, trained.

The chapter: "a shorter path between any combination of sequence positions makes it easier to
learn long-range dependencies". Measured here by training. A sample is ``n + 1`` random tokens;
the answer, read at the last position, is the first token: it sits at distance ``n`` and
nothing else in the sequence says anything about it. Three models of one width ``d`` read the
tokens' embeddings and are trained on the same batches:

* ``cnn``: residual causal convolutions of width ``k`` (``x + gelu(conv(norm(x)))``); by default
  ``ceil(2 n / (k - 1))`` layers (``cnn_reach=2``): a receptive field of twice the distance, so
  the answer sits inside it, reached by many paths, not at its edge by the one path of the
  fewest layers that reach ``n`` (``cnn_reach=1``); its path, and so its parameter count, grow
  with ``n`` (a CNN of fixed depth cannot see that far);
* ``rnn``: a two-layer tanh RNN (``nn.RNN``): path ``n`` steps;
* ``self_attention``: one attention layer (``x + attention(norm(x))``) on ``E[x] + P`` with the
  chapter's sinusoidal P: path one layer.

Reported per model and distance: the steps taken to reach ``target`` held-out accuracy (None
if never within ``max_steps``), the accuracy after ``budget`` steps, the parameter count and
the accuracy curve. ``cnn_layers`` fixes the CNN's depth instead: a CNN whose receptive field
is shorter than ``n`` cannot see the answer and stays at chance (the control that shows the
experiment can fail).

Shape legend: b batch, n positions, d model size, v vocabulary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import require_positive_int
from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table

__all__ = ["MODELS", "LongRangeModel", "cnn_depth", "distance_batch", "summarize_by_distance", "train_at_distance"]

MODELS = ("cnn", "rnn", "self_attention")


def cnn_depth(distance: int, kernel_size: int) -> int:
    """The fewest causal convolutions of width ``kernel_size`` whose receptive field reaches ``distance`` back."""
    return max(1, math.ceil(distance / (kernel_size - 1)))


def distance_batch(
    batch_size: int, distance: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens ``(b, distance + 1)`` and the answer ``(b,)``: the first token, ``distance`` before the last."""
    tokens = torch.randint(0, vocab_size, (batch_size, distance + 1), generator=generator)
    return tokens, tokens[:, 0]


class _ConvBlock(nn.Module):
    def __init__(self, num_hiddens: int, kernel_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(num_hiddens)
        self.conv = nn.Conv1d(num_hiddens, num_hiddens, kernel_size)
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(self.norm(x).transpose(1, 2), (self.kernel_size - 1, 0))  # (b, d, n + k - 1): causal
        return x + F.gelu(self.conv(padded)).transpose(1, 2)  # (b, n, d)


class _AttentionBlock(nn.Module):
    table: torch.Tensor

    def __init__(self, num_hiddens: int, num_heads: int, max_len: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(num_hiddens)
        self.attention = MultiHeadAttention(num_hiddens, num_heads)
        self.register_buffer("table", sinusoidal_table(max_len, num_hiddens), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table[: x.shape[1]]  # (b, n, d): the chapter's E[x] + P
        h = self.norm(x)
        attended: torch.Tensor = self.attention(h, h, h)
        return x + attended


class LongRangeModel(nn.Module):
    """Embedding, one body (``cnn``, ``rnn`` or ``self_attention``), a norm and a read-out at the last position.

    Args:
        kind: one of :data:`MODELS`.
        vocab_size: tokens ``v``.
        num_hiddens: width ``d`` of every model.
        max_len: longest sequence (the sinusoidal table of ``self_attention``).
        cnn_layers: convolutions of the ``cnn``.
        kernel_size: their width ``k``.
        num_heads: heads of ``self_attention``.
    """

    def __init__(
        self,
        kind: str,
        *,
        vocab_size: int,
        num_hiddens: int,
        max_len: int,
        cnn_layers: int = 1,
        kernel_size: int = 3,
        num_heads: int = 2,
    ) -> None:
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"kind must be one of {', '.join(MODELS)}, got {kind!r}")
        self.kind = kind
        self.embed = nn.Embedding(require_positive_int("vocab_size", vocab_size), num_hiddens)
        self.body: nn.Module
        if kind == "cnn":
            self.body = nn.Sequential(*(_ConvBlock(num_hiddens, kernel_size) for _ in range(cnn_layers)))
        elif kind == "rnn":
            self.body = nn.RNN(num_hiddens, num_hiddens, num_layers=2, batch_first=True)
        else:
            self.body = _AttentionBlock(num_hiddens, num_heads, max_len)
        self.norm = nn.LayerNorm(num_hiddens)
        self.out = nn.Linear(num_hiddens, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, v)`` at the last position of ``tokens`` ``(b, n)``."""
        h = self.body(self.embed(tokens))
        if self.kind == "rnn":
            h = h[0]  # nn.RNN returns (states, last hidden)
        logits: torch.Tensor = self.out(self.norm(h[:, -1]))
        return logits

    def body_parameters(self) -> int:
        """Parameters of the body alone (the embedding and read-out are the same for every kind)."""
        return sum(p.numel() for p in self.body.parameters())


def train_at_distance(
    kind: str,
    distance: int,
    *,
    seed: int = 0,
    num_hiddens: int = 32,
    vocab_size: int = 10,
    kernel_size: int = 3,
    cnn_layers: int | None = None,
    cnn_reach: int = 2,
    batch_size: int = 64,
    lr: float = 3e-3,
    budget: int = 1000,
    max_steps: int = 3000,
    check_every: int = 50,
    target: float = 0.9,
    eval_samples: int = 512,
) -> dict[str, Any]:
    """Train one model on the answer at ``distance``; see the module doc.

    Training stops once the held-out accuracy (``eval_samples`` sequences of their own generator,
    checked every ``check_every`` steps) has reached ``target`` and ``budget`` steps are done,
    or at ``max_steps``. The CNN has ``cnn_layers`` convolutions, or by default the fewest whose
    receptive field reaches ``cnn_reach * distance``.

    Returns:
        ``{"kind", "distance", "seed", "layers" (the CNN's convolutions, else 1), "parameters"
        (the body's), "receptive_field" (the CNN's, else None), "steps_to_target" (None if never),
        "accuracy_at_budget", "accuracy" (at the end), "steps", "curve" ([step, accuracy]),
        "seconds"}``.

    Raises:
        ValueError: an argument is out of range (named in the message).
    """
    if kind not in MODELS:
        raise ValueError(f"kind must be one of {', '.join(MODELS)}, got {kind!r}")
    distance = require_positive_int("distance", distance)
    if kernel_size < 2:
        raise ValueError(f"kernel_size must be at least 2, got {kernel_size}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    check_every = require_positive_int("check_every", check_every)
    budget = require_positive_int("budget", budget)
    max_steps = require_positive_int("max_steps", max_steps)
    if budget % check_every or budget > max_steps:
        raise ValueError(
            f"budget={budget} must be a multiple of check_every={check_every} and at most max_steps={max_steps}"
        )
    cnn_reach = require_positive_int("cnn_reach", cnn_reach)
    layers = (
        cnn_depth(cnn_reach * distance, kernel_size)
        if cnn_layers is None
        else require_positive_int("cnn_layers", cnn_layers)
    )
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LongRangeModel(
            kind, vocab_size=vocab_size, num_hiddens=num_hiddens, max_len=distance + 1,
            cnn_layers=layers, kernel_size=kernel_size,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(seed + 1)
    held_out = distance_batch(eval_samples, distance, vocab_size, torch.Generator().manual_seed(seed + 10_007))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            right = model(held_out[0]).argmax(-1) == held_out[1]
        model.train()
        return float(right.to(torch.float64).mean())

    curve: list[list[float]] = []
    reached: int | None = None
    at_budget = float("nan")
    step = 0
    while step < max_steps and (reached is None or step < budget):
        tokens, answers = distance_batch(batch_size, distance, vocab_size, generator)
        loss = F.cross_entropy(model(tokens), answers)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % check_every == 0:
            curve.append([step, accuracy()])
            if reached is None and curve[-1][1] >= target:
                reached = step
            if step == budget:
                at_budget = curve[-1][1]
    return {
        "kind": kind,
        "distance": distance,
        "seed": seed,
        "layers": layers if kind == "cnn" else 1,
        "parameters": model.body_parameters(),
        "receptive_field": layers * (kernel_size - 1) + 1 if kind == "cnn" else None,
        "steps_to_target": reached,
        "accuracy_at_budget": at_budget,
        "accuracy": curve[-1][1] if curve and curve[-1][0] == step else accuracy(),
        "steps": step,
        "curve": curve,
        "seconds": time.perf_counter() - start,
    }


def summarize_by_distance(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{kind: {str(distance): {...}}}``: over seeds, the mean accuracy at the budget and the steps to target.

    ``steps_to_target`` is the mean over the seeds that reached it, ``reached`` how many did;
    ``steps_interval`` its 95% interval over the seeds when every seed reached it (else None):
    a claim that one model learns sooner than another needs the two intervals apart
    (:func:`~selfattn.study.spread.differs`).
    """
    from selfattn.study.spread import interval95

    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["kind"], int(run["distance"])), []).append(run)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (kind, distance), members in sorted(groups.items()):
        steps = [r["steps_to_target"] for r in members if r["steps_to_target"] is not None]
        out.setdefault(kind, {})[str(distance)] = {
            "accuracy_at_budget": sum(r["accuracy_at_budget"] for r in members) / len(members),
            "accuracy_at_budget_by_seed": [r["accuracy_at_budget"] for r in members],
            "steps_to_target": sum(steps) / len(steps) if steps else None,
            "steps_interval": interval95(steps) if steps and len(steps) == len(members) else None,
            "steps_to_target_by_seed": [r["steps_to_target"] for r in members],
            "reached": len(steps),
            "seeds": len(members),
            "parameters": members[0]["parameters"],
            "layers": members[0]["layers"],
        }
    return out
