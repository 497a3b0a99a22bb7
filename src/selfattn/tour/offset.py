"""Can one attention layer learn to attend by offset? Trained, with and without P.

The chapter: the sinusoidal encoding "allows a model to easily learn to attend by relative
positions"; the summary page: "the network can learn to shift attention by 5 tokens"; the
slides: position encoding "lets self-attention remember position". Each is a claim about
learning, so it is measured by training: one self-attention layer reads ``E[x] + P`` and must
output at every position ``i >= delta`` the token at ``i - delta``. That answer is nowhere but
at a fixed offset, so the layer can only get it by attending by offset.

Three variants, same model, data and steps:

* ``sinusoidal``: P is the chapter's table;
* ``none``: no P (the layer is permutation-equivariant and cannot tell the positions apart);
* ``shuffled``: P's rows are shuffled afresh for every sample, so a row says nothing about
  where the token is: the control that shows the experiment can fail.

Reported per variant: accuracy on fresh samples, the steps taken to reach ``target``
(None if never), the mean attention weight on the key at offset ``delta`` (1 means the
layer attends by offset exactly) and ``position_r2``: a linear probe of each token's position
read off the *trained* layer's output (ridge regression fitted on 48 fresh sequences, R^2 on
16 others; :func:`selfattn.study.deep_stack.position_r2`), which tells whether the layer's
output still carries where each token sits (the slides' "remember position").

Shape legend: b batch, n positions, d model size, v vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfattn.attention import MultiHeadAttention
from selfattn.functional import sinusoidal_table
from selfattn.study.deep_stack import position_r2
from selfattn.tour._common import seeded, single_threaded

__all__ = ["VARIANTS", "OffsetModel", "attend_by_offset"]

VARIANTS = ("sinusoidal", "none", "shuffled")


class OffsetModel(nn.Module):
    """Embedding, plus P (or not), one attention layer, a linear read-out."""

    def __init__(self, *, vocab_size: int, num_hiddens: int, num_heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, num_hiddens)
        self.attention = MultiHeadAttention(num_hiddens, num_heads)
        self.out = nn.Linear(num_hiddens, vocab_size)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` (b, n), ``positions`` (b, n, d) or None: logits (b, n, v), weights (b, h, n, n)."""
        x = self.embed(tokens)  # (b, n, d)
        if positions is not None:
            x = x + positions
        attended, weights = self.attention(x, x, x, return_weights=True)
        return self.out(attended), weights


def _positions(variant: str, table: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor | None:
    if variant == "none":
        return None
    rows = table.expand(batch, -1, -1)  # (b, n, d)
    if variant == "shuffled":  # every sample gets the rows in its own random order
        order = torch.argsort(torch.rand(batch, table.shape[0], generator=generator), dim=1)
        rows = torch.gather(rows, 1, order[..., None].expand_as(rows))
    return rows


def _train_one(variant: str, config: dict[str, Any]) -> dict[str, Any]:
    n, d, v, delta = config["num_steps"], config["num_hiddens"], config["vocab_size"], config["delta"]
    table = config["position_scale"] * sinusoidal_table(n, d)  # (n, d)
    with seeded(config["seed"]):
        model = OffsetModel(vocab_size=v, num_hiddens=d, num_heads=config["num_heads"])
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])

    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.randint(v, (size, n), generator=generator), _positions(variant, table, size, generator)

    def accuracy(tokens: torch.Tensor, positions: torch.Tensor | None) -> tuple[float, float]:
        with torch.no_grad():
            logits, weights = model(tokens, positions)
        right = (logits[:, delta:].argmax(-1) == tokens[:, :-delta]).float().mean()
        # Weight of query i on key i - delta, averaged over heads, queries and samples.
        on_offset = torch.diagonal(weights.mean(1), offset=-delta, dim1=-2, dim2=-1).mean()
        return float(right), float(on_offset)

    reached, curve = None, []
    for step in range(1, config["max_train_steps"] + 1):
        tokens, positions = batch(config["batch_size"])
        logits, _ = model(tokens, positions)
        loss = nn.functional.cross_entropy(logits[:, delta:].reshape(-1, v), tokens[:, :-delta].reshape(-1))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step % config["check_every"] == 0:
            acc, _ = accuracy(*batch(config["batch_size"]))
            curve.append([step, acc])
            if reached is None and acc >= config["target"]:
                reached = step
                break  # the target is what is asked; stop here to keep the tour fast
    acc, on_offset = accuracy(*batch(config["eval_samples"]))
    return {
        "accuracy": acc,
        "steps_to_target": reached,
        "weight_on_offset": on_offset,
        "position_r2": _position_probe(model, *batch(64)),
        "curve": curve,
    }


def _position_probe(model: OffsetModel, tokens: torch.Tensor, positions: torch.Tensor | None) -> float:
    """Held-out R^2 of a linear probe from the trained layer's outputs (b, n, d) to the positions 0..n-1."""
    with torch.no_grad():
        x = model.embed(tokens) if positions is None else model.embed(tokens) + positions  # (b, n, d)
        attended = model.attention(x, x, x)  # (b, n, d)
    return position_r2(attended[:48], attended[48:])


def attend_by_offset(
    *,
    delta: int = 5,
    num_steps: int = 16,
    num_hiddens: int = 32,
    num_heads: int = 1,
    vocab_size: int = 16,
    batch_size: int = 64,
    max_train_steps: int = 600,
    check_every: int = 25,
    target: float = 0.9,
    lr: float = 1e-2,
    eval_samples: int = 512,
    seed: int = 0,
    variants: tuple[str, ...] = VARIANTS,
    position_scale: float = 1.0,
) -> dict[str, Any]:
    """Train one attention layer per variant to copy the token at offset ``delta``; see the module doc.

    ``position_scale`` multiplies P (1: the chapter's table; a small scale leaves the tokens
    almost no position to attend by).

    Raises:
        ValueError: ``delta`` is not in ``1..num_steps - 1`` or a variant is unknown.
    """
    if not 1 <= delta < num_steps:
        raise ValueError(f"delta must be in 1..num_steps - 1 = {num_steps - 1}, got {delta}")
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {unknown}")
    config = {
        "delta": delta,
        "num_steps": num_steps,
        "num_hiddens": num_hiddens,
        "num_heads": num_heads,
        "vocab_size": vocab_size,
        "batch_size": batch_size,
        "max_train_steps": max_train_steps,
        "check_every": check_every,
        "target": target,
        "lr": lr,
        "eval_samples": eval_samples,
        "seed": seed,
        "position_scale": position_scale,
    }
    with single_threaded():  # tiny matrices: a second thread costs more than it gives
        runs = {variant: _train_one(variant, config) for variant in variants}
    return {"config": config, "chance": 1 / vocab_size, "variants": runs}
