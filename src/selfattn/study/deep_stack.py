"""Exercise 1: what happens to position in a deep stack of self-attention layers.

Each layer's hidden states are read with *linear probes* fitted on some sequences and scored on
others (held out):

* **absolute position**: ridge regression from a hidden state ``h_i`` to its position ``i``;
  the score is R^2 on the held-out sequences (1: position read off exactly, 0: no better than
  the mean position; it can go below 0).
* **relative order**: a ridge least-squares classifier from a pair ``[h_i, h_j]`` (both taken
  from one sequence) to "``i`` comes before ``j``"; the score is held-out accuracy (0.5 is
  chance).
* **rank collapse** (no probe): how close the rows of a layer's ``(n, d)`` output get, as the
  relative residual of the best mean-row approximation ``|H - 1 mean(H)| / |H|`` and of the
  best rank-1 approximation ``sqrt(sum_{k>=2} s_k^2) / |H|`` (``s_k`` the singular values).
* **position share**: the same mean-row residual on a sequence whose tokens are all the same,
  so whatever tells its rows apart is position (0 when nothing does).

:func:`measure_deep_stack` runs these on stacks of :class:`selfattn.models.TransformerBlock`
for each encoding, with and without residual connections and MLPs, for several seeds, on
freshly initialized (untrained) stacks and on stacks trained briefly on a task that needs
positions (predict the previous token).

The probes are ridge-regularized relative to the hidden states' own size: a component whose
amplitude is below about ``sqrt(ridge)`` of the hidden states' root mean square (1e-3 by
default) counts as gone; larger penalties (``RIDGE_STEPS``) are tried on a quarter of the
training sequences held out from the fit, so a probe does not chase directions that do not
carry over to new sequences. Without that, a probe in float64 would read positions out of
differences of 1e-12 that no float32 network could use.

Shape legend: b sequences, n positions, d model size, N probe samples, f probe features.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import require_non_negative_int, require_positive_int
from selfattn.models import TransformerBlock
from selfattn.positional import NAMES, InputEncoding, PositionalEncoding, build

__all__ = [
    "ENCODINGS",
    "METRICS",
    "RIDGE_STEPS",
    "VARIANTS",
    "DeepStack",
    "layer_metrics",
    "measure_deep_stack",
    "order_accuracy",
    "position_r2",
    "rank_collapse",
    "ridge_fit",
    "train_previous_token",
    "train_until_level",
    "trained_by_depth",
]

ENCODINGS: tuple[str, ...] = ("none", "sinusoidal", "rotary", "alibi", "t5", "shaw")
"""The encodings the exercise compares (``none`` is NoPE)."""

VARIANTS: dict[str, dict[str, bool]] = {
    "residual": {"residual": True, "mlp": True},
    "residual_no_mlp": {"residual": True, "mlp": False},
    "no_residual": {"residual": False, "mlp": True},
    "no_residual_no_mlp": {"residual": False, "mlp": False},
}
"""The four kinds of block: with or without residual connections, with or without the MLP."""

METRICS: tuple[str, ...] = ("position_r2", "order_accuracy", "mean_row_residual", "rank_one_residual", "position_share")
"""What is measured after every layer, in the order the result lists them."""

DEFAULT_RIDGE = 1e-6


# Probes and metrics: pure functions on hidden states ------------------------------------------


def _check_hidden(name: str, h: torch.Tensor) -> torch.Tensor:
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise ValueError(
            f"{name} must be a (sequences, positions, features) tensor, got {tuple(getattr(h, 'shape', ()))}"
        )
    if not h.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {h.dtype}")
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    return h.detach().to(torch.float64)


def _check_ridge(ridge: float) -> float:
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not math.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge!r}")
    return float(ridge)


def ridge_fit(
    features: torch.Tensor, targets: torch.Tensor, ridge: float = DEFAULT_RIDGE
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Fit ``targets ~ features @ w + c`` by ridge least squares; returns the fitted predictor.

    The penalty is ``lambda |w|^2`` with ``lambda = ridge * N * mean(features^2)``: scaled by the
    features' own (uncentred) size, so a direction whose spread is below about ``sqrt(ridge)``
    of that size is shrunk away whatever the units. ``ridge=0`` is plain least squares
    (minimum-norm where the features are rank deficient).

    Args:
        features: ``(N, f)``.
        targets: ``(N,)`` or ``(N, k)``.
        ridge: relative penalty, >= 0.

    Returns:
        A function mapping ``(M, f)`` features to ``(M,)`` (or ``(M, k)``) predictions.
    """
    ridge = _check_ridge(ridge)
    x_mean, y_mean, weights = _ridge_weights(features, targets, [ridge])
    return _predictor(x_mean, y_mean, weights[0], targets.dim())


def _ridge_weights(
    features: torch.Tensor, targets: torch.Tensor, ridges: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means of ``features`` ``(f,)`` and ``targets`` ``(k,)``, and the weights ``(c, f, k)`` for each ridge."""
    x = features.to(torch.float64)
    y = targets.to(torch.float64)
    if x.dim() != 2 or y.shape[0] != x.shape[0] or y.dim() not in (1, 2):
        raise ValueError(
            f"features (N, f) and targets (N,) or (N, k) must agree, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    x_mean = x.mean(dim=0)
    y = y.reshape(x.shape[0], -1)  # (N, k)
    y_mean = y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean  # (N, f), (N, k)
    scale = x.shape[0] * float(x.pow(2).mean())
    penalties = torch.tensor([r * scale for r in ridges], dtype=torch.float64)  # (c,)
    if bool((penalties > 0).all()):
        # The penalty bounds the condition number, so the normal equations are safe in float64 (and fast).
        eye = torch.eye(x.shape[1], dtype=torch.float64)
        gram = xc.T @ xc + penalties[:, None, None] * eye  # (c, f, f)
        weights = torch.linalg.solve(gram, (xc.T @ yc).expand(len(ridges), -1, -1))  # (c, f, k)
    else:
        weights = torch.stack([_one_ridge(xc, yc, float(p)) for p in penalties])  # (c, f, k)
    return x_mean, y_mean, weights


def _one_ridge(xc: torch.Tensor, yc: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty > 0:
        gram = xc.T @ xc + penalty * torch.eye(xc.shape[1], dtype=xc.dtype)  # (f, f)
        solved: torch.Tensor = torch.linalg.solve(gram, xc.T @ yc)  # (f, k)
        return solved
    # Plain least squares, minimum-norm where the features are rank deficient.
    fitted: torch.Tensor = torch.linalg.lstsq(xc, yc, driver="gelsd").solution  # (f, k)
    return fitted


def _predictor(
    x_mean: torch.Tensor, y_mean: torch.Tensor, weights: torch.Tensor, target_dims: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    def predict(new: torch.Tensor) -> torch.Tensor:
        predicted: torch.Tensor = (new.to(torch.float64) - x_mean) @ weights + y_mean  # (M, k)
        return predicted[:, 0] if target_dims == 1 else predicted

    return predict


RIDGE_STEPS = (1.0, 1e2, 1e4, 1e6)
"""The penalties a probe tries, as multiples of its ``ridge``: the one that predicts held-out training sequences best wins."""


def _fit_probe(
    features: torch.Tensor, targets: torch.Tensor, num_sequences: int, ridge: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Ridge fit whose penalty is chosen among ``ridge * RIDGE_STEPS`` on a split of the sequences.

    ``features`` ``(N, f)`` hold ``num_sequences`` sequences' rows one after another. The last
    quarter of the sequences (at least one) validates each penalty by mean squared error; the
    winner is refitted on all of them. With fewer than 4 sequences, or ``ridge == 0``, ``ridge`` is used.
    """
    candidates = sorted({ridge * step for step in RIDGE_STEPS})
    if num_sequences < 4 or len(candidates) == 1:
        return ridge_fit(features, targets, ridge)
    split = features.shape[0] // num_sequences * (num_sequences - max(1, num_sequences // 4))
    x_mean, y_mean, weights = _ridge_weights(features[:split], targets[:split], candidates)  # (c, f, k)
    held_out = features[split:].to(torch.float64) - x_mean  # (M, f)
    predicted = held_out @ weights + y_mean  # (c, M, k)
    errors = (predicted - targets[split:].to(torch.float64).reshape(held_out.shape[0], -1)).pow(2).mean(dim=(1, 2))
    return ridge_fit(features, targets, candidates[int(errors.argmin())])


def position_r2(train: torch.Tensor, test: torch.Tensor, *, ridge: float = DEFAULT_RIDGE) -> float:
    """Held-out R^2 of a linear probe from a hidden state to its position.

    Fitted on every position of the ``train`` sequences, scored on every position of the
    ``test`` sequences: ``1 - sum (i - pred)^2 / sum (i - mean i)^2``. The penalty is the best of
    ``ridge * RIDGE_STEPS`` on a quarter of the ``train`` sequences held out from the fit.

    Args:
        train: ``(b_train, n, d)`` hidden states.
        test: ``(b_test, n, d)`` hidden states of other sequences.
        ridge: smallest relative penalty of :func:`ridge_fit`.
    """
    train, test = _check_hidden("train", train), _check_hidden("test", test)
    if train.shape[1:] != test.shape[1:]:
        raise ValueError(
            f"train and test must share (positions, features), got {tuple(train.shape)} and {tuple(test.shape)}"
        )
    n, d = train.shape[1], train.shape[2]
    if n < 2:
        raise ValueError(f"the position probe needs at least 2 positions, got {n}")
    positions = torch.arange(n, dtype=torch.float64)
    predict = _fit_probe(train.reshape(-1, d), positions.repeat(train.shape[0]), train.shape[0], ridge)  # (b * n, d)
    target = positions.repeat(test.shape[0])
    residual = (target - predict(test.reshape(-1, d))).pow(2).sum()
    return float(1.0 - residual / (target - target.mean()).pow(2).sum())


def _pairs(h: torch.Tensor, pairs_per_sequence: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pairs ``i != j`` of each sequence, each in both orders: features ``[h_i, h_j]`` and labels +-1."""
    b, n, _ = h.shape
    i = torch.randint(0, n, (b, pairs_per_sequence), generator=generator)
    j = (i + torch.randint(1, n, (b, pairs_per_sequence), generator=generator)) % n  # never equal to i
    rows = torch.arange(b)[:, None]
    first, second = h[rows, i], h[rows, j]  # (b, p, d)
    features = torch.cat([torch.cat([first, second], -1), torch.cat([second, first], -1)], 1)  # (b, 2p, 2d)
    before = (i < j).to(torch.float64) * 2 - 1  # (b, p)
    labels = torch.cat([before, -before], 1)  # (b, 2p)
    return features.reshape(-1, 2 * h.shape[-1]), labels.reshape(-1)


def order_accuracy(
    train: torch.Tensor,
    test: torch.Tensor,
    *,
    pairs_per_sequence: int = 32,
    ridge: float = DEFAULT_RIDGE,
    seed: int = 0,
) -> float:
    """Held-out accuracy of a linear probe telling from ``[h_i, h_j]`` whether ``i < j``.

    Pairs are drawn within each sequence and used in both orders, so the two answers are
    equally frequent and a probe that sees nothing scores 0.5. The penalty is chosen as in
    :func:`position_r2`.

    Args:
        train: ``(b_train, n, d)`` hidden states the probe is fitted on.
        test: ``(b_test, n, d)`` hidden states of other sequences it is scored on.
        pairs_per_sequence: pairs ``(i, j)`` drawn per sequence (each used in both orders).
        ridge: smallest relative penalty of :func:`ridge_fit`.
        seed: seed of the pair draw.
    """
    train, test = _check_hidden("train", train), _check_hidden("test", test)
    pairs_per_sequence = require_positive_int("pairs_per_sequence", pairs_per_sequence)
    if train.shape[1:] != test.shape[1:]:
        raise ValueError(
            f"train and test must share (positions, features), got {tuple(train.shape)} and {tuple(test.shape)}"
        )
    if train.shape[1] < 2:
        raise ValueError(f"the order probe needs at least 2 positions, got {train.shape[1]}")
    generator = torch.Generator().manual_seed(seed)
    train_x, train_y = _pairs(train, pairs_per_sequence, generator)
    test_x, test_y = _pairs(test, pairs_per_sequence, generator)
    predicted = torch.where(_fit_probe(train_x, train_y, train.shape[0], ridge)(test_x) > 0, 1.0, -1.0)
    return float((predicted == test_y).to(torch.float64).mean())


def rank_collapse(h: torch.Tensor) -> dict[str, float]:
    """How close the rows of each ``(n, d)`` matrix of ``h`` ``(b, n, d)`` are, averaged over ``b``.

    Returns:
        ``mean_row_residual``: ``|H - 1 mean(H)|_F / |H|_F``, 0 when every row is the same;
        ``rank_one_residual``: ``sqrt(sum_{k>=2} s_k^2) / |H|_F``, 0 when ``H`` has rank 1
        (rows all multiples of one vector). An all-zero ``H`` counts as collapsed (0).
    """
    h = _check_hidden("h", h)
    norm = torch.linalg.matrix_norm(h)  # (b,)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    centred = torch.linalg.matrix_norm(h - h.mean(dim=1, keepdim=True))  # (b,)
    singular = torch.linalg.svdvals(h)  # (b, min(n, d)), descending
    rest = singular[:, 1:].pow(2).sum(-1).sqrt()  # (b,)
    return {
        "mean_row_residual": float((centred / safe).mean()),
        "rank_one_residual": float((rest / safe).mean()),
    }


def layer_metrics(
    train: torch.Tensor, test: torch.Tensor, constant: torch.Tensor, *, ridge: float = DEFAULT_RIDGE, seed: int = 0
) -> dict[str, float]:
    """Every metric of :data:`METRICS` for one layer.

    Args:
        train: ``(b_train, n, d)`` hidden states the probes are fitted on.
        test: ``(b_test, n, d)`` held-out hidden states: probe scores and rank collapse.
        constant: ``(b_c, n, d)`` hidden states of sequences of one repeated token (position share).
        ridge: relative penalty of the probes.
        seed: seed of the order probe's pairs.
    """
    return {
        "position_r2": position_r2(train, test, ridge=ridge),
        "order_accuracy": order_accuracy(train, test, ridge=ridge, seed=seed),
        **rank_collapse(test),
        "position_share": rank_collapse(constant)["mean_row_residual"],
    }


# The stacks --------------------------------------------------------------------------------------


class DeepStack(nn.Module):
    """A token embedding, an encoding, ``depth`` transformer blocks, a final norm and a linear head.

    An input encoding (``none``, ``sinusoidal``, ``learned``) is added to the embeddings once;
    any other encoding is given to every block's attention (one instance per block). The
    embedding is drawn from N(0, 1), the scale of a sinusoidal table's rows, as in the chapter
    where P is added to X.

    Args:
        encoding: a name of :data:`selfattn.positional.NAMES`.
        depth: number of blocks.
        num_hiddens: model size ``d``.
        num_heads: attention heads.
        ffn_hiddens: hidden size of each block's MLP.
        vocab_size: number of input tokens.
        num_classes: outputs of the head, one prediction per position.
        residual: residual connections around attention and MLP.
        mlp: whether each block has an MLP.
        causal: causal attention (ALiBi and T5 take their causal form) or bidirectional.
        max_len: longest sequence (for the input table).
    """

    def __init__(
        self,
        *,
        encoding: str,
        depth: int,
        num_hiddens: int,
        num_heads: int,
        ffn_hiddens: int,
        vocab_size: int,
        num_classes: int,
        residual: bool = True,
        mlp: bool = True,
        causal: bool = False,
        max_len: int = 1000,
    ):
        super().__init__()
        if encoding not in NAMES:
            raise ValueError(f"encoding must be one of {', '.join(NAMES)}; got {encoding!r}")
        self.depth = require_positive_int("depth", depth)
        self.causal = bool(causal)
        options: dict[str, Any] = {"alibi": {"causal": self.causal}, "t5": {"bidirectional": not self.causal}}.get(
            encoding, {}
        )
        if encoding in ("sinusoidal", "learned"):
            options = {"max_len": max_len}

        def make() -> PositionalEncoding:
            return build(encoding, num_hiddens=num_hiddens, num_heads=num_heads, **options)

        first = make()
        self.input_encoding = first if isinstance(first, InputEncoding) else None
        self.embedding = nn.Embedding(require_positive_int("vocab_size", vocab_size), num_hiddens)
        nn.init.normal_(self.embedding.weight)
        blocks = []
        for index in range(self.depth):
            position = None if self.input_encoding is not None else (first if index == 0 else make())
            blocks.append(
                TransformerBlock(num_hiddens, num_heads, ffn_hiddens, position=position, residual=residual, mlp=mlp)
            )
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(num_hiddens)
        self.head = nn.Linear(num_hiddens, require_positive_int("num_classes", num_classes))

    def hidden_states(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The input to the first block and each block's output: ``depth + 1`` tensors ``(b, n, d)``."""
        h = self.embedding(tokens)  # (b, n, d)
        if self.input_encoding is not None:
            h = self.input_encoding(h)
        states = [h]
        for block in self.blocks:
            h = block(h, causal=self.causal)
            states.append(h)
        return states

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, n, num_classes)`` for int64 tokens ``(b, n)``."""
        logits: torch.Tensor = self.head(self.norm(self.hidden_states(tokens)[-1]))
        return logits


# Training on a task that needs positions ---------------------------------------------------------


def previous_token_batch(
    batch_size: int, num_steps: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens ``(b, n)`` and targets: the token one position back, class ``vocab_size`` at 0.

    Without positions a bidirectional stack is permutation-equivariant and cannot solve this;
    with them it has to tell the position just before each token apart from the rest.
    """
    tokens = torch.randint(0, vocab_size, (batch_size, num_steps), generator=generator)
    targets = torch.cat([torch.full((batch_size, 1), vocab_size), tokens[:, :-1]], 1)  # (b, n)
    return tokens, targets


def _held_out_accuracy(model: DeepStack, num_steps: int, vocab_size: int, seed: int) -> float:
    """Previous-token accuracy on 256 sequences no training batch holds (their own generator)."""
    model.eval()
    tokens, targets = previous_token_batch(256, num_steps, vocab_size, torch.Generator().manual_seed(seed + 10_007))
    with torch.no_grad():
        accuracy = float((model(tokens).argmax(-1) == targets).to(torch.float64).mean())
    model.train()
    return accuracy


def train_until_level(
    model: DeepStack,
    *,
    max_steps: int,
    num_steps: int,
    vocab_size: int,
    seed: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    check_every: int | None = None,
    patience: int | None = 4,
    min_gain: float = 0.01,
    target: float = 0.99,
) -> dict[str, Any]:
    """Train ``model`` with AdamW on :func:`previous_token_batch`; returns loss, held-out accuracy and steps.

    With ``check_every``, the held-out accuracy is measured every ``check_every`` steps and
    training stops once it reaches ``target``, or once it has not risen by ``min_gain`` over the
    best so far for ``patience`` checks in a row (it has levelled off; None: never, so a stack on a
    plateau trains to ``max_steps`` before it is judged), or at ``max_steps``;
    ``levelled_off`` says whether it stopped before ``max_steps``. Without, it trains exactly
    ``max_steps`` steps.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    curve: list[list[float]] = []
    best, stale, step = -1.0, 0, 0
    while step < max_steps:
        tokens, targets = previous_token_batch(batch_size, num_steps, vocab_size, generator)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if check_every and step % check_every == 0:
            accuracy = _held_out_accuracy(model, num_steps, vocab_size, seed)
            curve.append([step, accuracy])
            stale = 0 if accuracy >= best + min_gain else stale + 1
            best = max(best, accuracy)
            if accuracy >= target or (patience is not None and stale >= patience):
                break
    accuracy = _held_out_accuracy(model, num_steps, vocab_size, seed)
    model.eval()
    return {
        "final_loss": float(loss.detach()),
        "task_accuracy": accuracy,
        "steps": step,
        "curve": curve,
        "levelled_off": step < max_steps,
    }


def train_previous_token(
    model: DeepStack,
    *,
    steps: int,
    num_steps: int,
    vocab_size: int,
    seed: int,
    batch_size: int = 32,
    lr: float = 3e-3,
) -> dict[str, float]:
    """Train ``model`` with AdamW on :func:`previous_token_batch` for ``steps`` steps; returns loss and held-out accuracy."""
    fit = train_until_level(
        model, max_steps=steps, num_steps=num_steps, vocab_size=vocab_size, seed=seed, batch_size=batch_size, lr=lr
    )
    return {"final_loss": fit["final_loss"], "task_accuracy": fit["task_accuracy"]}


# The measurement ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _spread(by_seed: Sequence[Sequence[float]]) -> dict[str, list[Any]]:
    values = torch.tensor(by_seed, dtype=torch.float64)  # (seeds, layers)
    std = values.std(dim=0, correction=1) if values.shape[0] > 1 else torch.zeros(values.shape[1:], dtype=torch.float64)
    return {
        "mean": values.mean(dim=0).tolist(),
        "std": std.tolist(),
        "min": values.min(dim=0).values.tolist(),
        "max": values.max(dim=0).values.tolist(),
        "by_seed": [list(map(float, row)) for row in by_seed],
    }


def _scalar_spread(values: Sequence[float]) -> dict[str, object]:
    spread = _spread([[v] for v in values])
    return {key: (value[0] if key != "by_seed" else [row[0] for row in value]) for key, value in spread.items()}


def _make_stack(
    name: str,
    variant: str,
    seed: int,
    *,
    depth: int,
    sizes: dict[str, Any],
    vocab_size: int,
    causal: bool,
    num_steps: int,
) -> DeepStack:
    with _seeded(seed):
        return DeepStack(
            encoding=name, depth=depth, **sizes, vocab_size=vocab_size, num_classes=vocab_size + 1,
            causal=causal, max_len=max(num_steps, 1000), **VARIANTS[variant],
        )  # fmt: skip


def _probe_tokens(seed: int, num_sequences: int, num_steps: int, vocab_size: int) -> torch.Tensor:
    """``(num_sequences + 1, n)``: random sequences, then one of a repeated token (the position-share sequence)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (num_sequences, num_steps), generator=generator)  # (b, n)
    repeated = torch.full((1, num_steps), int(tokens[0, 0]))  # (1, n)
    return torch.cat([tokens, repeated])


def _probe_stack(
    model: DeepStack, tokens: torch.Tensor, num_train: int, ridge: float, seed: int
) -> dict[str, list[float]]:
    """Metrics per layer; ``tokens`` ``(b, n)``: train sequences, then held-out ones, then one of a repeated token."""
    model = model.double().eval()
    with torch.no_grad():
        states = model.hidden_states(tokens)  # depth + 1 of (b, n, d)
    per_layer = [layer_metrics(h[:num_train], h[num_train:-1], h[-1:], ridge=ridge, seed=seed) for h in states]
    return {metric: [layer[metric] for layer in per_layer] for metric in METRICS}


def measure_deep_stack(
    *,
    encodings: Sequence[str] = ENCODINGS,
    variants: Sequence[str] = tuple(VARIANTS),
    depth: int = 16,
    seeds: int = 5,
    num_hiddens: int = 32,
    num_heads: int = 4,
    ffn_hiddens: int = 64,
    num_steps: int = 32,
    num_sequences: int = 64,
    test_sequences: int = 16,
    vocab_size: int = 16,
    causal: bool = False,
    ridge: float = DEFAULT_RIDGE,
    train_steps: int = 120,
    train_seeds: int = 2,
    train_variants: Sequence[str] = ("residual", "no_residual"),
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Probe every layer of untrained and briefly trained deep stacks; JSON-ready numbers.

    For every encoding, variant and seed a :class:`DeepStack` of ``depth`` blocks reads
    ``num_sequences`` random token sequences of length ``num_steps`` (the same tokens for every
    encoding and variant of a seed) in float64; the probes are fitted on the first
    ``num_sequences - test_sequences`` sequences and scored on the last ``test_sequences``.
    Every probed batch also holds one sequence of a single repeated token (``position_share``).
    Trained stacks (``train_steps > 0``, seeds ``0 .. train_seeds - 1``, ``train_variants``) are
    first trained in float32 with AdamW to predict the previous token
    (:func:`previous_token_batch`), then probed the same way.

    Args:
        encodings: names of :data:`selfattn.positional.NAMES` (default :data:`ENCODINGS`).
        variants: keys of :data:`VARIANTS`.
        depth: blocks per stack; every layer 0 (the input) .. depth is measured.
        seeds: untrained stacks per (encoding, variant).
        num_hiddens: model size of each block.
        num_heads: attention heads of each block.
        ffn_hiddens: hidden size of each block's MLP.
        num_steps: sequence length ``n``.
        num_sequences: sequences probed, held-out ones included.
        test_sequences: the held-out sequences.
        vocab_size: tokens drawn uniformly.
        causal: causal attention instead of bidirectional.
        ridge: relative penalty of the probes (:func:`ridge_fit`).
        train_steps: training steps (batches of 16 sequences) of the trained stacks; 0 skips training.
        train_seeds: trained stacks per (encoding, variant).
        train_variants: the variants (among ``variants``) that are also trained; training is the
            expensive part, so by default only the two with an MLP.
        progress: called with a short description after each stack.

    Returns:
        ``{"config": {...the arguments...}, "layers": [0, ..., depth], "variants": VARIANTS
        (the chosen ones), "metrics": METRICS, "untrained": R, "trained": R or None,
        "seconds": wall time}``, where ``R`` maps encoding, then variant, then metric to
        ``{"mean", "std", "min", "max": one value per layer, "by_seed": one per-layer list per seed}``,
        and each trained (encoding, variant) entry also holds ``"task_accuracy"`` and
        ``"final_loss"`` (``{"mean", "std", "min", "max", "by_seed"}`` of one number per seed).
    """
    for name in encodings:
        if name not in NAMES:
            raise ValueError(f"encodings must be names of {', '.join(NAMES)}; got {name!r}")
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}; got {name!r}")
    for name in train_variants if train_steps else ():
        if name not in variants:
            raise ValueError(f"train_variants must be among the variants {', '.join(variants)}; got {name!r}")
    if not encodings or not variants:
        raise ValueError(f"need at least one encoding and one variant, got {list(encodings)} and {list(variants)}")
    depth = require_positive_int("depth", depth)
    seeds = require_positive_int("seeds", seeds)
    num_steps = require_positive_int("num_steps", num_steps)
    if num_steps < 2:
        raise ValueError(f"num_steps must be at least 2 to probe positions, got {num_steps}")
    num_sequences = require_positive_int("num_sequences", num_sequences)
    test_sequences = require_positive_int("test_sequences", test_sequences)
    if test_sequences >= num_sequences:
        raise ValueError(f"test_sequences={test_sequences} must be smaller than num_sequences={num_sequences}")
    train_steps = require_non_negative_int("train_steps", train_steps)
    train_seeds = require_positive_int("train_seeds", train_seeds)
    ridge = _check_ridge(ridge)
    tick = progress or (lambda description: None)
    sizes: dict[str, Any] = {"num_hiddens": num_hiddens, "num_heads": num_heads, "ffn_hiddens": ffn_hiddens}
    num_train = num_sequences - test_sequences
    start = time.perf_counter()

    def stack(name: str, variant: str, seed: int) -> DeepStack:
        return _make_stack(
            name, variant, seed, depth=depth, sizes=sizes, vocab_size=vocab_size, causal=causal, num_steps=num_steps
        )

    def tokens_of(seed: int) -> torch.Tensor:
        return _probe_tokens(seed, num_sequences, num_steps, vocab_size)

    untrained: dict[str, dict[str, dict[str, object]]] = {}
    for name in encodings:
        untrained[name] = {}
        for variant in variants:
            runs = [
                _probe_stack(stack(name, variant, seed), tokens_of(seed), num_train, ridge, seed)
                for seed in range(seeds)
            ]
            untrained[name][variant] = {m: _spread([run[m] for run in runs]) for m in METRICS}
            tick(f"deep stack: {name}, {variant}, untrained")

    trained: dict[str, dict[str, dict[str, object]]] | None = None
    if train_steps:
        trained = {}
        for name in encodings:
            trained[name] = {}
            for variant in train_variants:
                runs, fits = [], []
                for seed in range(train_seeds):
                    model = stack(name, variant, seed)
                    fits.append(
                        train_previous_token(
                            model,
                            steps=train_steps,
                            num_steps=num_steps,
                            vocab_size=vocab_size,
                            seed=seed,
                            batch_size=16,
                        )
                    )
                    runs.append(_probe_stack(model, tokens_of(seed), num_train, ridge, seed))
                entry: dict[str, object] = {m: _spread([run[m] for run in runs]) for m in METRICS}
                entry["task_accuracy"] = _scalar_spread([fit["task_accuracy"] for fit in fits])
                entry["final_loss"] = _scalar_spread([fit["final_loss"] for fit in fits])
                trained[name][variant] = entry
                tick(f"deep stack: {name}, {variant}, trained")

    config = {
        "encodings": list(encodings), "depth": depth, "seeds": seeds, **sizes, "num_steps": num_steps,
        "num_sequences": num_sequences, "test_sequences": test_sequences, "vocab_size": vocab_size,
        "causal": causal, "ridge": ridge, "train_steps": train_steps, "train_seeds": train_seeds,
        "train_variants": list(train_variants), "train_batch_size": 16, "train_task": "previous token",
        "norm_first": True,
    }  # fmt: skip
    return {
        "config": config,
        "layers": list(range(depth + 1)),
        "variants": {name: dict(VARIANTS[name]) for name in variants},
        "metrics": list(METRICS),
        "untrained": untrained,
        "trained": trained,
        "seconds": time.perf_counter() - start,
    }


def trained_by_depth(
    *,
    encodings: Sequence[str] = ENCODINGS,
    variants: Sequence[str] = ("residual", "no_residual"),
    depths: Sequence[int] = tuple(range(1, 9)),
    seed: int = 0,
    max_steps: int = 3000,
    check_every: int = 100,
    patience: int | None = 4,
    num_hiddens: int = 32,
    num_heads: int = 4,
    ffn_hiddens: int = 64,
    num_steps: int = 32,
    num_sequences: int = 64,
    test_sequences: int = 16,
    vocab_size: int = 16,
    causal: bool = False,
    ridge: float = DEFAULT_RIDGE,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Stacks of each depth trained until their task accuracy levels off, each probed after training.

    For every encoding, variant and depth, a :class:`DeepStack` is trained on the previous-token
    task (:func:`train_until_level`: checked every ``check_every`` steps, stopped once the held-out
    accuracy reaches 0.99 or stops rising by 0.01 for ``patience`` checks, at most ``max_steps``),
    then its last layer is probed as in :func:`measure_deep_stack`. A stack whose accuracy stays
    within 0.05 of chance (``1 / vocab_size``) is marked ``trains: False``; one at 0.9 or more
    ``learnt: True`` (without positions a stack can beat chance by guessing among the tokens it
    sees, so ``trains`` alone does not mean it found the previous token).

    Returns:
        ``{"config", "chance", "stacks": {encoding: {variant: [one entry per depth]}}, "seconds"}``;
        each entry: ``depth``, ``steps``, ``task_accuracy``, ``curve`` (``[step, accuracy]``),
        ``levelled_off``, ``trains``, ``learnt``, and the last layer's ``position_r2`` and ``order_accuracy``.
    """
    for name in encodings:
        if name not in NAMES:
            raise ValueError(f"encodings must be names of {', '.join(NAMES)}; got {name!r}")
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}; got {name!r}")
    if not depths or min(depths) < 1:
        raise ValueError(f"depths must be positive, got {list(depths)}")
    max_steps = require_positive_int("max_steps", max_steps)
    check_every = require_positive_int("check_every", check_every)
    tick = progress or (lambda description: None)
    sizes: dict[str, Any] = {"num_hiddens": num_hiddens, "num_heads": num_heads, "ffn_hiddens": ffn_hiddens}
    chance = 1 / vocab_size
    start = time.perf_counter()
    stacks: dict[str, dict[str, list[dict[str, object]]]] = {}
    for name in encodings:
        stacks[name] = {}
        for variant in variants:
            entries: list[dict[str, object]] = []
            for depth in depths:
                model = _make_stack(
                    name, variant, seed, depth=depth, sizes=sizes, vocab_size=vocab_size, causal=causal,
                    num_steps=num_steps,
                )  # fmt: skip
                fit = train_until_level(
                    model, max_steps=max_steps, num_steps=num_steps, vocab_size=vocab_size, seed=seed,
                    batch_size=16, check_every=check_every, patience=patience,
                )  # fmt: skip
                tokens = _probe_tokens(seed, num_sequences, num_steps, vocab_size)
                probes = _probe_stack(model, tokens, num_sequences - test_sequences, ridge, seed)
                entries.append(
                    {
                        "depth": depth,
                        "seed": seed,
                        **fit,
                        "trains": fit["task_accuracy"] >= chance + 0.05,
                        "learnt": fit["task_accuracy"] >= 0.9,
                        "position_r2": probes["position_r2"][-1],
                        "order_accuracy": probes["order_accuracy"][-1],
                    }
                )
                tick(f"deep stack trained: {name}, {variant}, depth {depth}")
            stacks[name][variant] = entries
    config = {
        "encodings": list(encodings), "variants": list(variants), "depths": list(depths), "seed": seed,
        "max_steps": max_steps, "check_every": check_every, "patience": patience, **sizes, "num_steps": num_steps,
        "num_sequences": num_sequences, "test_sequences": test_sequences, "vocab_size": vocab_size, "causal": causal,
        "ridge": ridge, "train_batch_size": 16, "train_task": "previous token",
    }  # fmt: skip
    return {"config": config, "chance": chance, "stacks": stacks, "seconds": time.perf_counter() - start}
