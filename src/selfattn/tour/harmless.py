"""Is adding P "at least not harmful"? Trained on a task that needs no position, with and without P.

The study note answers the worry that adding P changes the word embeddings: the embeddings
are learned and adjust to the loss, so the effect of the positions on them "至少不会是消极的"
(is at least not negative). Measured here: the task is to name the majority token of a
sequence, which is the same whatever order the tokens come in, so position is useless to it.
The same model (embedding, one self-attention layer with a residual connection, mean over
positions, linear read-out) is trained with the same data, seed and steps twice: on ``E[x]``
and on ``E[x] + P``. Reported: each one's accuracy on fresh samples after ``train_steps``, and
the accuracy after each tenth of the steps (how fast each learns).

Shape legend: b batch, n positions, d model size, v vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table
from selfattn.tour._common import seeded, single_threaded

__all__ = ["majority_task", "with_and_without_p"]


def majority_task(
    batch: int, num_steps: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences whose most frequent token is their label: ``(b, n)`` tokens, ``(b,)`` labels.

    The label token fills ``num_steps // 3 + 1`` random places; the rest are drawn from the
    other tokens, each at most ``num_steps // 3`` times, so the label is the unique majority.
    """
    share = num_steps // 3 + 1
    if vocab_size < 2 or (vocab_size - 1) * (share - 1) < num_steps - share:
        raise ValueError(f"vocab_size={vocab_size} is too small for a unique majority in {num_steps} tokens")
    labels = torch.randint(vocab_size, (batch,), generator=generator)
    tokens = torch.empty(batch, num_steps, dtype=torch.long)
    for row in range(batch):
        others = torch.tensor([t for t in range(vocab_size) if t != int(labels[row])])
        pool = others.repeat_interleave(share - 1)  # each other token at most share - 1 times
        rest = pool[torch.randperm(len(pool), generator=generator)[: num_steps - share]]
        sequence = torch.cat([labels[row].repeat(share), rest])
        tokens[row] = sequence[torch.randperm(num_steps, generator=generator)]
    return tokens, labels


class _Classifier(nn.Module):
    def __init__(self, vocab_size: int, num_hiddens: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, num_hiddens)
        self.attention = MultiHeadAttention(num_hiddens, 2)
        self.out = nn.Linear(num_hiddens, vocab_size)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = self.embed(tokens)  # (b, n, d)
        if positions is not None:
            x = x + positions
        x = x + self.attention(x, x, x)
        logits: torch.Tensor = self.out(x.mean(dim=1))  # (b, v)
        return logits


def with_and_without_p(
    *,
    num_steps: int = 16,
    num_hiddens: int = 32,
    vocab_size: int = 8,
    batch_size: int = 64,
    train_steps: int = 100,
    lr: float = 3e-3,
    eval_samples: int = 512,
    position_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the majority-token classifier without and with P; see the module doc.

    ``position_scale`` multiplies P (1: the chapter's P; the tests use a large one to see the
    measurement report harm when there is some).
    """
    table = position_scale * sinusoidal_table(num_steps, num_hiddens)  # (n, d)
    results: dict[str, Any] = {
        "config": {
            "num_steps": num_steps,
            "num_hiddens": num_hiddens,
            "vocab_size": vocab_size,
            "batch_size": batch_size,
            "train_steps": train_steps,
            "lr": lr,
            "position_scale": position_scale,
            "seed": seed,
        },
        "chance": 1 / vocab_size,
    }
    with single_threaded():
        held_out = majority_task(eval_samples, num_steps, vocab_size, torch.Generator().manual_seed(seed + 7))
        for name, positions in (("without_p", None), ("with_p", table)):
            with seeded(seed):
                model = _Classifier(vocab_size, num_hiddens)
            optimizer = torch.optim.Adam(model.parameters(), lr=lr)
            generator = torch.Generator().manual_seed(seed + 1)  # the same samples for both
            curve = []
            for step in range(1, train_steps + 1):
                tokens, labels = majority_task(batch_size, num_steps, vocab_size, generator)
                loss = nn.functional.cross_entropy(model(tokens, positions), labels)
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                if step % max(1, train_steps // 10) == 0:
                    curve.append([step, _accuracy(model, held_out, positions)])
            results[name] = {"accuracy": _accuracy(model, held_out, positions), "curve": curve}
    return results


def _accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor | None) -> float:
    tokens, labels = data
    with torch.no_grad():
        return float((model(tokens, positions).argmax(-1) == labels).float().mean())
