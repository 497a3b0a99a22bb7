"""Train one model on one task, checkpointing as it goes, and measure accuracy by length.

A run is a function of its :class:`RunSpec` and :class:`StudyConfig`: the batch of step ``s``
is drawn from a generator seeded by ``(seed, task, s)``, so a run resumed from a checkpoint
sees the same data as one that never stopped, and every encoding sees the same samples.

Shape legend: b batch, l sequence length, v vocabulary size.
"""

from __future__ import annotations

import itertools
import math
import pickle
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from selfattn._atomic import atomic_write_path
from selfattn._validation import require_positive_int
from selfattn.models import TransformerLM
from selfattn.study.answer_use import ANSWER_SAMPLES, answer_use
from selfattn.study.encodings import P_ROPE, encoding_setting
from selfattn.study.tasks import TASKS, VOCAB_SIZE, Task, get_task, make_batch

__all__ = [
    "ABSOLUTE_OR_ROTARY",
    "ENCODINGS",
    "P_ROPE",
    "QUICK",
    "TASK_STEPS",
    "RunSpec",
    "encoding_label",
    "StudyConfig",
    "build_model",
    "check_accuracy",
    "check_beyond",
    "check_lengths_beyond",
    "decay_without_gradient",
    "evaluate",
    "evaluate_lengths",
    "evaluated_weights",
    "exact_match",
    "make_optimizer",
    "parameter_count",
    "shaw_max_distance",
    "steps_to_learn",
    "token_accuracy",
    "train_run",
    "training_batch",
]

#: The grid's encodings: the papers' settings, and ``p-rope-scaled`` and ``xpos-scaled`` with
#: settings scaled to the training length beside them (:mod:`selfattn.study.encodings`).
ENCODINGS = (
    "none", "sinusoidal", "learned", "rotary", "p-rope", "p-rope-scaled", "xpos", "xpos-scaled", "alibi", "kerple",
    "fire", "t5", "shaw",
)  # fmt: skip
ABSOLUTE_OR_ROTARY = ("sinusoidal", "learned", "rotary")


#: Default optimizer steps per task: every run of the task takes all of them (compute-matched:
#: no encoding stops sooner, unless :attr:`StudyConfig.stop_at` asks for it). The grid's hour on
#: 2 cores goes mostly to copy and reverse, where the default budget must train every encoding to
#: >= 95% exact match at the training lengths. In one-seed trials at 2700 steps NoPE reached 67-71%
#: on copy and sinusoidal 88% on reverse, at 5000 steps 99.9% and 97.0%. With early stops, runs of
#: the default grid took 1500-4750 steps on copy (median 3500) and 2250-7500 on reverse (median
#: 5250), and the grid took 45 minutes instead of 54 with every run at 5000.
#: Sort gets what is left; addition learned little (at most 4%) even with 2700 steps, so it gets the least.
TASK_STEPS: dict[str, int] = {"copy": 7500, "reverse": 7500, "sort": 1000, "addition": 300, "flipflop": 1000}


@dataclass(frozen=True)
class StudyConfig:
    """Everything that decides a run's numbers (and nothing that does not, like the output folder).

    Attributes:
        steps: optimizer steps per run for every task, or None for each task's own budget in
            :data:`TASK_STEPS` (see :meth:`steps_for`).
        batch_size: samples per step (the global batch under data-parallel training).
        mixed_lengths: each sample of a batch draws its own input length, and the batch is
            right-padded to its longest (a causal model never sees the padding, and padded
            positions have no target); False (the default) draws one length per step for the
            whole batch. Mixed lengths with batch 16 lifted single stalled seeds in trials but
            not in a grid: copy with NoPE gave 57.1, 100.0 and 72.6% (one length per step,
            batch 32: 97.0, 99.9, 75.9%) and reverse with Shaw 84.0, 91.3, 89.7% (99.0, 81.9, 99.5%).
        lr: peak AdamW learning rate (linear warm-up, then cosine decay to a tenth).
        warmup: warm-up steps.
        stop_at: a run stops before its last step once its exact match at the training lengths
            (on a check) reaches this; None (the default) never stops: every encoding trains
            for the same steps, so the comparison is compute-matched. Runs that stop early
            compare snapshots at different points of training (a separate reading).
        learned_at: the exact match at the training lengths whose first check is recorded as
            the run's ``steps_to_learn`` (the early-stopping reading, without stopping).
        check_every: steps between two checks. A check measures exact match at the training
            lengths and beyond them (``check_beyond_lengths`` lengths spread over ``L+1 ..
            eval_len``) on ``check_samples`` samples per length, drawn apart from the training
            and evaluation samples; the run records ``[step, in range, beyond]`` per check:
            accuracy past L over training.
        check_samples: samples per length in a check.
        check_beyond_lengths: lengths past ``train_len`` a check measures (evenly spread).
        ema_decay: the evaluated model is an exponential moving average of the trained weights
            with this decay (None: the trained weights themselves). With one length per step
            the last steps pull the weights toward the last lengths drawn; the average lifted
            the same trained runs by 1-3 points at the training lengths (NoPE: reverse 93.7 to
            95.9%, copy 75.9 to 79.2% and 97.0 to 97.9%).
        weight_decay: AdamW weight decay. At 0.01 one NoPE seed of three stalled on copy in two
            full grids (75.9%, then 86.5% with the averaged weights and 7500 steps); at 0.1 the
            same seed reached 98.4% in a trial, and the other NoPE seeds on copy and reverse 97.6-99.8%.
        train_len: inputs of length U(1, train_len) in training.
        eval_factor: evaluation at every length 1 .. eval_factor * train_len.
        eval_samples: samples per evaluated length.
        num_hiddens / num_heads / num_layers / ffn_hiddens: the model.
        position_range: randomized positions are drawn from ``range(position_range *
            longest evaluated sequence)``.
    """

    steps: int | None = None
    batch_size: int = 32
    mixed_lengths: bool = False
    lr: float = 3e-3
    warmup: int = 100
    stop_at: float | None = None
    learned_at: float = 0.99
    check_every: int = 250
    check_samples: int = 16
    check_beyond_lengths: int = 12
    ema_decay: float | None = 0.995
    weight_decay: float = 0.1
    train_len: int = 20
    eval_factor: int = 4
    eval_samples: int = 64
    num_hiddens: int = 64
    num_heads: int = 4
    num_layers: int = 3
    ffn_hiddens: int = 128
    position_range: int = 2

    def __post_init__(self) -> None:
        if self.stop_at is not None and not 0.0 < self.stop_at <= 1.0:
            raise ValueError(f"stop_at must be in (0, 1] or None, got {self.stop_at!r}")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) or None, got {self.ema_decay!r}")
        if not 0.0 < self.learned_at <= 1.0:
            raise ValueError(f"learned_at must be in (0, 1], got {self.learned_at!r}")
        require_positive_int("check_every", self.check_every)
        require_positive_int("check_samples", self.check_samples)
        require_positive_int("check_beyond_lengths", self.check_beyond_lengths)

    def steps_for(self, task: str) -> int:
        """Optimizer steps of a run of ``task``."""
        return self.steps if self.steps is not None else TASK_STEPS[task]

    @property
    def eval_len(self) -> int:
        return self.eval_factor * self.train_len

    def longest_sequence(self) -> int:
        """Tokens of the longest evaluated sample over all tasks: what every model must serve."""
        return max(task.sequence_len(self.eval_len) for task in TASKS.values())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --quick: a smoke test of the whole pipeline, not a measurement.
QUICK = StudyConfig(
    steps=30,
    batch_size=16,
    warmup=5,
    check_every=10,
    ema_decay=0.9,
    train_len=4,
    eval_factor=2,
    eval_samples=8,
    num_hiddens=16,
    num_heads=2,
    num_layers=1,
    ffn_hiddens=32,
)


@dataclass(frozen=True)
class RunSpec:
    """One cell of the grid."""

    task: str
    encoding: str
    seed: int
    randomized_positions: bool = False

    @property
    def key(self) -> str:
        """A file-name-safe identifier, e.g. ``copy-rotary-rand-s0``."""
        rand = "-rand" if self.randomized_positions else ""
        return f"{self.task}-{self.encoding}{rand}-s{self.seed}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def encoding_label(run: dict[str, Any] | RunSpec) -> str:
    """``"rotary"``, or ``"rotary+rand"`` for randomized positions."""
    encoding, randomized = (
        (run.encoding, run.randomized_positions)
        if isinstance(run, RunSpec)
        else (run["encoding"], run["randomized_positions"])
    )
    return f"{encoding}+rand" if randomized else str(encoding)


def build_model(spec: RunSpec, config: StudyConfig, position_options: dict[str, Any] | None = None) -> TransformerLM:
    """The run's model, initialised from its seed; ``position_options`` override the encoding's (variants).

    ``position_options["bias_init_std"]`` (T5 only) redraws the bias table from N(0, std^2),
    as Hugging Face's T5 does with ``d_model ** -0.5``, instead of ``nn.Embedding``'s N(0, 1).
    """
    torch.manual_seed(spec.seed)
    max_len = config.longest_sequence() * (config.position_range if spec.randomized_positions else 1)
    trained_len = get_task(spec.task).sequence_len(config.train_len)
    position, options, heads = encoding_setting(spec.encoding, trained_len, config.num_hiddens // config.num_heads)
    if spec.encoding == "shaw":
        options["max_distance"] = shaw_max_distance(spec.task, config)
    options.update(position_options or {})
    init_std = options.pop("bias_init_std", None)
    model = TransformerLM(
        VOCAB_SIZE,
        config.num_hiddens,
        heads or config.num_heads,
        config.num_layers,
        position=position,
        max_len=max_len,
        ffn_hiddens=config.ffn_hiddens,
        position_options=options,
    )
    if init_std is not None:
        table = getattr(model.encoding, "relative_attention_bias", None)
        if not isinstance(table, nn.Embedding):
            raise ValueError(f"bias_init_std applies to T5's bias table, not to {position!r}")
        nn.init.normal_(table.weight, std=float(init_std))
    return model


def shaw_max_distance(task: str, config: StudyConfig) -> int:
    """Shaw's clip distance in the study: the farthest a query with a target looks back in training.

    At the paper's 16, every offset past 16 shared one vector, while on copy and reverse at
    ``train_len=20`` an answer looks up to 40 tokens back; reverse with Shaw stalled in one seed
    of three (81.9%). With one vector per offset that training teaches (and the rest of the
    study's budget), that seed reached 97.9% in a trial. Longer offsets, past the training
    lengths, share the last vector.
    """
    return get_task(task).sequence_len(config.train_len) - 2


def _generator(*parts: int | str) -> torch.Generator:
    text = "/".join(str(p) for p in parts)
    return torch.Generator().manual_seed(zlib.crc32(text.encode()))


def _random_positions(rows: int, length: int, max_position: int, generator: torch.Generator) -> torch.Tensor:
    """``(rows, length)``: per row its own sorted random subset of ``range(max_position)`` (Ruoss et al. 2023).

    Each sequence of a batch draws its own positions, as Ruoss et al. draw them per sample: one
    draw shared by a whole batch would give every sequence of a step the same gaps.
    """
    if length > max_position:
        raise ValueError(f"cannot draw {length} distinct positions from range({max_position})")
    keys = torch.rand(rows, max_position, generator=generator)  # a random order of the positions per row
    return keys.argsort(dim=1)[:, :length].sort(dim=1).values


def training_batch(
    task: Task, spec: RunSpec, config: StudyConfig, step: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The global batch of optimizer step ``step``: a function of the seed, the task and the step alone.

    Returns:
        tokens ``(b, l)``, targets ``(b, l)`` (-100 off the answer) and, with randomized
        positions, the positions ``(b, l)`` drawn from ``range(max_position)``, one draw per
        sequence (else None).
    """
    generator = _generator("train", spec.seed, spec.task, step)
    draws = config.batch_size if config.mixed_lengths else 1
    lengths = torch.randint(1, config.train_len + 1, (draws,), generator=generator).tolist()
    tokens, targets, _ = make_batch(task, lengths * (config.batch_size // draws), generator)
    rows, length = tokens.shape
    positions = _random_positions(rows, length, max_position, generator) if spec.randomized_positions else None
    return tokens, targets, positions


def _learning_rate(step: int, steps: int, config: StudyConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def decay_without_gradient(config: StudyConfig, steps_taken: int, scheduled: int) -> float:
    """The factor left on a weight whose gradient is zero at every step of a run (e.g. an untrained T5 bucket).

    Adam's update of such a weight is zero (its moments stay zero), but AdamW's decoupled weight
    decay still multiplies it by ``1 - lr_t * weight_decay`` at every step ``t``: an untrained
    bucket does not keep its initial value, it shrinks toward zero by this product.

    Args:
        config: the schedule (``lr``, ``warmup``) and ``weight_decay``.
        steps_taken: optimizer steps the run took.
        scheduled: the schedule's length (:meth:`StudyConfig.steps_for`).
    """
    factor = 1.0
    for step in range(steps_taken):
        factor *= 1.0 - _learning_rate(step, scheduled, config) * config.weight_decay
    return factor


def parameter_count(spec: RunSpec, config: StudyConfig) -> int:
    """Trainable parameters of the run's model (:func:`build_model`): the model's size, stated in the docs."""
    return sum(p.numel() for p in build_model(spec, config).parameters())


def _answer_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax right, scored)``, both bool ``(b, l)``; scored marks the answer positions."""
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must share (batch, length)")
    scored = targets != -100
    return (logits.argmax(dim=-1) == targets) & scored, scored


def exact_match(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, 1.0 if the argmax is right at every answer position (targets != -100), else 0.0.

    Teacher-forced exact match equals greedy decoding's: if every answer token is the argmax
    given the right prefix, greedy decoding produces exactly that prefix.

    Args:
        logits: ``(b, l, v)``.
        targets: ``(b, l)``, -100 where the position is not part of the answer.

    Returns:
        ``(b,)`` float.
    """
    right, scored = _answer_hits(logits, targets)
    return ((right | ~scored).all(dim=-1) & scored.any(dim=-1)).float()


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the fraction of answer positions whose argmax is right (arguments as :func:`exact_match`).

    Beside :func:`exact_match` it tells a model that gets most of a long answer right (and
    loses exact match to a few wrong tokens) from one that has not learned the task.
    """
    right, scored = _answer_hits(logits, targets)
    return right.sum(dim=-1).float() / scored.sum(dim=-1).clamp(min=1).float()


@torch.no_grad()
def _score_lengths(
    model: nn.Module,
    task: Task,
    spec: RunSpec,
    lengths: Sequence[int],
    samples: int,
    stream: str,
    chunk_tokens: int = 16384,
) -> tuple[dict[str, float], dict[str, float]]:
    """Exact match and token accuracy at each length, on ``samples`` samples drawn from ``stream``.

    With randomized positions each sample draws its own positions (a ``(b, l)`` row each), so a
    length's accuracy does not hang on one draw shared by all its samples.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    accuracy: dict[str, float] = {}
    tokens_right: dict[str, float] = {}
    for n in lengths:
        generator = _generator(stream, spec.seed, spec.task, n)
        tokens, targets, _ = make_batch(task, [n] * samples, generator)
        tokens, targets = tokens.to(device), targets.to(device)
        positions: torch.Tensor | None = None
        if spec.randomized_positions:
            assert isinstance(model, TransformerLM)
            positions = _random_positions(samples, tokens.shape[1], model.max_len, generator).to(device)
        per_chunk = max(1, chunk_tokens // tokens.shape[1])
        batches = [
            (
                tokens[i : i + per_chunk],
                targets[i : i + per_chunk],
                None if positions is None else positions[i : i + per_chunk],
            )
            for i in range(0, tokens.shape[0], per_chunk)
        ]
        hits, fractions = [], []
        for inputs, answers, rows in batches:
            logits = model(inputs, positions=rows)
            hits.append(exact_match(logits, answers))
            fractions.append(token_accuracy(logits, answers))
        accuracy[str(n)] = float(torch.cat(hits).mean())
        tokens_right[str(n)] = float(torch.cat(fractions).mean())
    model.train(was_training)
    return accuracy, tokens_right


def evaluate_lengths(
    model: nn.Module, task: Task, spec: RunSpec, config: StudyConfig, *, chunk_tokens: int = 16384
) -> tuple[dict[str, float], dict[str, float]]:
    """Exact match and token accuracy at every input length 1 .. ``config.eval_len``, each ``{"1": acc, ...}``."""
    lengths = range(1, config.eval_len + 1)
    return _score_lengths(model, task, spec, lengths, config.eval_samples, "eval", chunk_tokens)


def check_accuracy(model: nn.Module, task: Task, spec: RunSpec, config: StudyConfig) -> float:
    """Mean exact match over the training lengths 1 .. ``config.train_len``: what decides an early stop.

    Its samples come from their own stream, apart from training and evaluation, and are the
    same at every check of a run.
    """
    lengths = range(1, config.train_len + 1)
    accuracy, _ = _score_lengths(model, task, spec, lengths, config.check_samples, "check")
    return sum(accuracy.values()) / len(accuracy)


def check_lengths_beyond(config: StudyConfig) -> list[int]:
    """The lengths past ``train_len`` a check measures: ``check_beyond_lengths`` of them, evenly spread to ``eval_len``."""
    beyond = list(range(config.train_len + 1, config.eval_len + 1))
    if len(beyond) <= config.check_beyond_lengths:
        return beyond
    last = len(beyond) - 1
    picks = sorted({round(i * last / (config.check_beyond_lengths - 1)) for i in range(config.check_beyond_lengths)})
    return [beyond[i] for i in picks]


def check_beyond(model: nn.Module, task: Task, spec: RunSpec, config: StudyConfig) -> float | None:
    """Mean exact match over :func:`check_lengths_beyond` on the check's samples (None if ``eval_len == train_len``)."""
    lengths = check_lengths_beyond(config)
    if not lengths:
        return None
    accuracy, _ = _score_lengths(model, task, spec, lengths, config.check_samples, "check")
    return sum(accuracy.values()) / len(accuracy)


def evaluate(
    model: nn.Module, task: Task, spec: RunSpec, config: StudyConfig, *, chunk_tokens: int = 16384
) -> dict[str, float]:
    """Exact-match accuracy at every input length 1 .. ``config.eval_len``, ``{"1": acc, ...}``."""
    return evaluate_lengths(model, task, spec, config, chunk_tokens=chunk_tokens)[0]


def answer_readings(model: nn.Module, task: Task, spec: RunSpec, config: StudyConfig) -> dict[str, Any] | None:
    """:func:`~selfattn.study.answer_use.answer_use` on the run's own sample stream, or None where it does not apply.

    None with randomized positions (the window reading would need positions of its own) and
    when nothing past the training lengths is evaluated.
    """
    if spec.randomized_positions or config.eval_len <= config.train_len:
        return None
    return answer_use(
        model, task, train_len=config.train_len, eval_len=config.eval_len, samples=ANSWER_SAMPLES,
        generator=_generator("answer", spec.seed, spec.task),
    )  # fmt: skip


@dataclass
class _State:
    step: int = 0
    train_seconds: float = 0.0
    cpu_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    checks: list[list[float | None]] = field(default_factory=list)  # [step, in range, beyond] of each check
    stopped: bool = False  # a check reached stop_at


def _save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: _State, average: AveragedModel | None
) -> None:
    payload = {
        "step": state.step,
        "train_seconds": state.train_seconds,
        "cpu_seconds": state.cpu_seconds,
        "losses": state.losses,
        "checks": state.checks,
        "stopped": state.stopped,
        "model": model.state_dict(),
        "average": None if average is None else average.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    with atomic_write_path(path) as tmp:  # a kill leaves the old checkpoint or the new one, never half of one
        torch.save(payload, tmp)


def _load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, average: AveragedModel | None
) -> _State:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:  # a file damaged outside the study
        raise ValueError(f"checkpoint {path} cannot be read ({error}); remove it to start that run over") from None
    if (average is None) != (payload.get("average") is None):
        raise ValueError(f"checkpoint {path} was written with another ema_decay setting; remove it to start over")
    model.load_state_dict(payload["model"])
    if average is not None:
        average.load_state_dict(payload["average"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    return _State(
        int(payload["step"]),
        float(payload["train_seconds"]),
        float(payload["cpu_seconds"]),
        list(payload["losses"]),
        [list(check) for check in payload.get("checks", [])],
        bool(payload.get("stopped", False)),
    )


def evaluated_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The state dict of the model a run evaluates: the weight average if the run kept one."""
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if payload.get("average") is None:
        return dict(payload["model"])
    prefix = "module."  # AveragedModel keeps the averaged copy as its submodule `module`
    return {key[len(prefix) :]: value for key, value in payload["average"].items() if key.startswith(prefix)}


def make_optimizer(
    model: nn.Module, config: StudyConfig, device: torch.device | str
) -> tuple[torch.optim.AdamW, AveragedModel | None]:
    """A run's AdamW and, with ``config.ema_decay``, the average of the weights it evaluates."""
    # The fused step (one kernel over all parameters) took about 8% off a CPU training step.
    fused = torch.device(device).type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=fused)
    if config.ema_decay is None:
        return optimizer, None
    return optimizer, AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay))  # type: ignore[no-untyped-call]


def _loss_by_tenth(losses: list[float]) -> list[float]:
    """Mean training loss over each tenth of the steps (fewer parts for fewer than ten steps)."""
    if not losses:
        return []
    parts = min(10, len(losses))
    bounds = [round(i * len(losses) / parts) for i in range(parts + 1)]
    return [sum(losses[a:b]) / (b - a) for a, b in itertools.pairwise(bounds)]


def data_parallel_ranks(data_parallel: bool, batch_size: int) -> tuple[int, int]:
    """``(rank, world)`` of the process group a data-parallel run splits each batch over; ``(0, 1)`` otherwise."""
    import torch.distributed as dist

    if not (data_parallel and dist.is_available() and dist.is_initialized()):
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must be divisible by the {world} data-parallel ranks")
    return rank, world


def over_ranks(model: nn.Module, world: int) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` when ``world > 1`` ranks train it together."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _run_check(
    evaluated: nn.Module,
    task: Task,
    spec: RunSpec,
    config: StudyConfig,
    state: _State,
    *,
    rank: int,
    world: int,
    device: torch.device | str,
) -> None:
    """Append ``[step, in range, beyond]`` to ``state.checks``; stop the run if ``config.stop_at`` is reached."""
    import torch.distributed as dist

    checked = torch.full((2,), float("nan"), dtype=torch.float64, device=device)
    if rank == 0:
        beyond = check_beyond(evaluated, task, spec, config)
        checked[0] = check_accuracy(evaluated, task, spec, config)
        checked[1] = float("nan") if beyond is None else beyond
    if world > 1:
        dist.broadcast(checked, 0)  # one decision for every rank, or DDP would wait forever
    inside, past = float(checked[0]), float(checked[1])
    state.checks.append([state.step, inside, None if math.isnan(past) else past])
    state.stopped = config.stop_at is not None and inside >= config.stop_at


def steps_to_learn(checks: Sequence[Sequence[float | None]], learned_at: float) -> int | None:
    """The step of the first check whose exact match at the training lengths reaches ``learned_at`` (None: none did)."""
    for check in checks:
        step, inside = check[0], check[1]
        if step is not None and inside is not None and inside >= learned_at:
            return int(step)
    return None


def train_run(
    spec: RunSpec,
    config: StudyConfig,
    *,
    checkpoint: Path | None = None,
    checkpoint_seconds: float = 5.0,
    on_step: Callable[[int, float], None] | None = None,
    device: torch.device | str = "cpu",
    data_parallel: bool = False,
    position_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``spec`` under ``config`` and measure accuracy by length.

    Args:
        spec: task, encoding, seed and whether positions are randomized.
        config: the training and evaluation settings.
        checkpoint: file to resume from if it exists and to save to every
            ``checkpoint_seconds`` of work and at the end.
        checkpoint_seconds: how much work a kill may lose at most.
        on_step: called with ``(step, loss)`` after every step (progress bars).
        device: where to train.
        data_parallel: split each batch over the ranks of the initialised process group with
            ``DistributedDataParallel`` (every rank calls this with the same arguments).
        position_options: options of the encoding that replace the study's (:func:`build_model`).

    Returns:
        The run's entry of ``results.json["runs"]`` plus its loss curve.
    """
    task = get_task(spec.task)
    if spec.encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {spec.encoding!r}")
    if spec.randomized_positions and spec.encoding not in ABSOLUTE_OR_ROTARY:
        raise ValueError(f"randomized positions apply to {', '.join(ABSOLUTE_OR_ROTARY)}, not {spec.encoding!r}")
    import torch.distributed as dist

    rank, world = data_parallel_ranks(data_parallel, config.batch_size)

    model = build_model(spec, config, position_options).to(device)
    optimizer, average = make_optimizer(model, config, device)
    evaluated = model if average is None else average.module
    state = _State()
    if checkpoint is not None and checkpoint.exists():
        state = _load_checkpoint(checkpoint, model, optimizer, average)
    trained = over_ranks(model, world)
    share = config.batch_size // world

    steps = config.steps_for(spec.task)
    last_save = time.perf_counter()
    while state.step < steps and not state.stopped:
        started, cpu_started = time.perf_counter(), time.process_time()
        tokens, targets, positions = training_batch(task, spec, config, state.step, model.max_len)
        count = int((targets != -100).sum())  # answer tokens in the global batch
        tokens, targets = tokens[rank * share : (rank + 1) * share], targets[rank * share : (rank + 1) * share]
        positions = None if positions is None else positions[rank * share : (rank + 1) * share]
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(state.step, steps, config)
        logits = trained(tokens.to(device), positions=None if positions is None else positions.to(device))
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1), ignore_index=-100, reduction="sum"
        )
        # DDP averages gradients over ranks, so scale each rank's sum to make the mean over the global batch.
        (loss_sum * world / count).backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if average is not None:
            average.update_parameters(model)
        total = loss_sum.detach()
        if world > 1:
            dist.all_reduce(total)
        loss = float(total) / count
        state.losses.append(loss)
        state.step += 1
        if state.step % config.check_every == 0 and state.step < steps:
            _run_check(evaluated, task, spec, config, state, rank=rank, world=world, device=device)
        state.train_seconds += time.perf_counter() - started
        state.cpu_seconds += time.process_time() - cpu_started
        if on_step is not None:
            on_step(state.step, loss)
        if (
            checkpoint is not None
            and rank == 0
            and (time.perf_counter() - last_save >= checkpoint_seconds or state.step == steps or state.stopped)
        ):
            _save_checkpoint(checkpoint, model, optimizer, state, average)
            last_save = time.perf_counter()

    eval_started = time.process_time()
    accuracy, tokens_right = evaluate_lengths(evaluated, task, spec, config)
    answers = answer_readings(evaluated, task, spec, config)
    return {
        **spec.as_dict(),
        "steps": state.step,
        "scheduled_steps": steps,
        # [step, exact match in range, beyond] every check_every steps: accuracy past L over training.
        "checks": state.checks,
        # The early-stopping reading, without stopping: when the run first reached learned_at in range.
        "steps_to_learn": steps_to_learn(state.checks, config.learned_at),
        "train_max_len": config.train_len,
        "accuracy_by_length": accuracy,
        "token_accuracy_by_length": tokens_right,
        # Answer tokens right by position past L, with the whole sample and with a window of L's length.
        "answer_use": answers,
        "train_seconds": state.train_seconds,
        # CPU time of this process: on a shared machine, what the run costs a quiet core.
        "train_cpu_seconds": state.cpu_seconds,
        "eval_cpu_seconds": time.process_time() - eval_started,
        "final_loss": state.losses[-1] if state.losses else None,
        "loss_by_tenth": _loss_by_tenth(state.losses),
        "loss_curve": state.losses,
    }
