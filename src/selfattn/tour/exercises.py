"""The chapter's exercises and its long-range claim, answered by small models the tour trains itself.

The chapter closes with three exercises: what goes wrong in a deep stack of self-attention
layers with positional encoding, a learnable positional encoding, and learned embeddings by
the offset between query and key (Shaw et al. 2018; Huang et al. 2018). ``selfattn study
--exercises`` answers them with long runs (an hour and more); this module answers them in
the tour's own time budget with tiny models and few steps, so that a fresh ``selfattn tour``
shows a trained answer to each:

* :func:`deep_stacks`: stacks of depth 1 and 4 (sinusoidal P, with and without residual
  connections) trained on the previous-token task until their accuracy levels off or a step
  limit (:func:`selfattn.study.deep_stack.trained_by_depth`), then probed;
* :func:`encodings_by_length`: one attention layer trained to output the token ``delta``
  back, on sequences of ``train_len`` tokens, with four encodings: the chapter's sinusoidal
  P, a learned table (:class:`~selfattn.positional.LearnedPositionalEncoding`, exercise 2),
  Shaw's embeddings by offset and T5's bias by offset (exercise 3); each evaluated on fresh
  sequences of ``train_len`` tokens and of longer ones, where the positions past ``train_len``
  are rows of the learned table that no training step reached;
* :func:`long_range`: a CNN, an RNN and self-attention trained on an answer at distance n
  (:func:`selfattn.study.long_range.train_at_distance`), for two distances.

Every result says how many steps it trained and its accuracy against chance, so the report
states what was trained, not more.

Shape legend: b batch, n positions, d model size, v vocabulary.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table
from selfattn.positional import LearnedPositionalEncoding, ShawRelativePositionEncoding, T5RelativePositionBias
from selfattn.study.deep_stack import trained_by_depth
from selfattn.study.long_range import MODELS, summarize_by_distance, train_at_distance
from selfattn.tour._common import seeded, single_threaded

__all__ = ["ENCODINGS", "deep_stacks", "encodings_by_length", "long_range"]

ENCODINGS = ("sinusoidal", "learned", "shaw", "t5")


class _CopyBack(nn.Module):
    """Embedding, an encoding (added to the input, or inside attention), one attention layer, a read-out."""

    table: torch.Tensor

    def __init__(self, encoding: str, *, vocab_size: int, num_hiddens: int, max_len: int) -> None:
        super().__init__()
        self.encoding = encoding
        self.embed = nn.Embedding(vocab_size, num_hiddens)
        self.learned = LearnedPositionalEncoding(num_hiddens, max_len) if encoding == "learned" else None
        self.register_buffer("table", sinusoidal_table(max_len, num_hiddens), persistent=False)
        inside: nn.Module | None = None
        if encoding == "shaw":
            inside = ShawRelativePositionEncoding(num_hiddens, max_distance=8)
        elif encoding == "t5":
            inside = T5RelativePositionBias(1, num_buckets=16, max_distance=max_len)
        self.attention = MultiHeadAttention(num_hiddens, 1, position=inside)  # type: ignore[arg-type]
        self.out = nn.Linear(num_hiddens, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (b, n): logits (b, n, v)."""
        x = self.embed(tokens)  # (b, n, d)
        if self.encoding == "sinusoidal":
            x = x + self.table[: tokens.shape[1]]
        elif self.learned is not None:
            x = self.learned(x)
        attended: torch.Tensor = self.attention(x, x, x)
        logits: torch.Tensor = self.out(attended)
        return logits


def _copy_back_accuracy(model: _CopyBack, tokens: torch.Tensor, delta: int, start: int) -> float:
    """Share of positions ``i >= max(delta, start)`` whose output is the token at ``i - delta``."""
    with torch.no_grad():
        guess = model(tokens).argmax(-1)  # (b, n)
    first = max(delta, start)
    return float((guess[:, first:] == tokens[:, first - delta : tokens.shape[1] - delta]).float().mean())


def _train_copy_back(encoding: str, config: dict[str, Any]) -> dict[str, Any]:
    n, v, delta = config["train_len"], config["vocab_size"], config["delta"]
    longest = max(config["eval_lens"])
    with seeded(config["seed"]):
        model = _CopyBack(encoding, vocab_size=v, num_hiddens=config["num_hiddens"], max_len=longest)
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    start = time.perf_counter()
    for _ in range(config["train_steps"]):
        tokens = torch.randint(v, (config["batch_size"], n), generator=generator)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, delta:].reshape(-1, v), tokens[:, :-delta].reshape(-1))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    by_length = {}
    for length in config["eval_lens"]:
        tokens = torch.randint(v, (config["eval_samples"], length), generator=generator)
        by_length[str(length)] = {
            "all": _copy_back_accuracy(model, tokens, delta, 0),
            # Positions past the training length: rows of a learned table no training step reached.
            "past_train_len": _copy_back_accuracy(model, tokens, delta, n) if length > n else None,
        }
    return {"by_length": by_length, "seconds": time.perf_counter() - start}


def encodings_by_length(
    *,
    train_len: int = 16,
    eval_lens: tuple[int, ...] = (16, 32),
    delta: int = 3,
    num_hiddens: int = 32,
    vocab_size: int = 16,
    batch_size: int = 64,
    train_steps: int = 300,
    lr: float = 1e-2,
    eval_samples: int = 256,
    seed: int = 0,
    encodings: tuple[str, ...] = ENCODINGS,
) -> dict[str, Any]:
    """Exercises 2 and 3: each encoding trained to copy the token ``delta`` back, evaluated in and past ``train_len``.

    Returns ``{"config", "chance", "encodings": {name: {"by_length": {length: {"all",
    "past_train_len"}}, "seconds"}}}``: ``all`` is the accuracy over positions ``i >= delta``,
    ``past_train_len`` over positions ``i >= train_len`` (None at the training length).

    Raises:
        ValueError: ``delta`` not in ``1..train_len - 1``, an evaluation length below
            ``train_len``, or an unknown encoding.
    """
    if not 1 <= delta < train_len:
        raise ValueError(f"delta must be in 1..train_len - 1 = {train_len - 1}, got {delta}")
    if min(eval_lens) < train_len:
        raise ValueError(f"eval_lens must be at least train_len={train_len}, got {list(eval_lens)}")
    unknown = [name for name in encodings if name not in ENCODINGS]
    if unknown:
        raise ValueError(f"encodings must be among {', '.join(ENCODINGS)}, got {unknown}")
    config = {
        "train_len": train_len, "eval_lens": list(eval_lens), "delta": delta, "num_hiddens": num_hiddens,
        "vocab_size": vocab_size, "batch_size": batch_size, "train_steps": train_steps, "lr": lr,
        "eval_samples": eval_samples, "seed": seed,
    }  # fmt: skip
    with single_threaded():  # tiny matrices: a second thread costs more than it gives
        runs = {name: _train_copy_back(name, config) for name in encodings}
    return {"config": config, "chance": 1 / vocab_size, "encodings": runs}


def deep_stacks(
    *, depths: tuple[int, ...] = (1, 4), max_steps: int = 200, check_every: int = 50, num_hiddens: int = 16
) -> dict[str, Any]:
    """Exercise 1: sinusoidal stacks with and without residuals trained by depth (``trained_by_depth``'s result)."""
    with single_threaded():
        found = trained_by_depth(
            encodings=("sinusoidal",), variants=("residual", "no_residual"), depths=depths, max_steps=max_steps,
            check_every=check_every, num_hiddens=num_hiddens, num_heads=2, ffn_hiddens=2 * num_hiddens,
            num_steps=16, num_sequences=32, test_sequences=8,
        )  # fmt: skip
    return found


def long_range(
    *, distances: tuple[int, ...] = (4, 16), budget: int = 150, max_steps: int = 300, num_hiddens: int = 16
) -> dict[str, Any]:
    """The chapter's long-range claim: CNN, RNN and self-attention trained on an answer at each distance, one seed.

    Returns the shape of ``exercises.json["long_range"]`` of ``selfattn study --exercises``:
    ``{"settings", "runs", "by_distance", "chance", "seconds"}``.
    """
    settings: dict[str, Any] = {
        "num_hiddens": num_hiddens, "vocab_size": 10, "kernel_size": 3, "batch_size": 64, "lr": 3e-3,
        "budget": budget, "max_steps": max_steps, "check_every": 25, "target": 0.9, "eval_samples": 256,
    }  # fmt: skip
    with single_threaded():
        runs = [train_at_distance(kind, n, seed=0, **settings) for n in distances for kind in MODELS]
    return {
        "settings": settings,
        "runs": runs,
        "by_distance": summarize_by_distance(runs),
        "chance": 1 / settings["vocab_size"],
        "seconds": sum(run["seconds"] for run in runs),
    }
