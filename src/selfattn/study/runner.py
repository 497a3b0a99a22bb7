"""The grid of runs: which to do, who does them (torch.distributed ranks), and merging.

Output folder::

    DIR/config.json          the settings every run of this folder shares (checked on --resume)
    DIR/runs/KEY.json        one finished run (accuracy by length, loss curve)
    DIR/checkpoints/KEY.pt   model, optimizer, RNG state and step: where a run resumes; the
                             final model once the run is finished
    DIR/claims/KEY           which runs a rank of the current call has taken
    DIR/results.json         the merged results (see :func:`merge_results`)
    DIR/study.html, DIR/figures/*.png|svg

Under ``torchrun`` the ranks share out the unfinished runs (gloo on CPU, nccl on CUDA): each
takes the next unclaimed run, longest first, so they finish together however long each run
takes, and the last rank measures the deep stack while the others train. With
``data_parallel=True`` all ranks train every run together instead (``DistributedDataParallel``).
Rank 0 merges and writes the report.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import check_folder, write_json
from selfattn.study.answer_use import summarize_answer_use
from selfattn.study.provenance import code_version, code_versions
from selfattn.study.spread import interval95
from selfattn.study.tasks import get_task
from selfattn.study.training import (
    ABSOLUTE_OR_ROTARY,
    ENCODINGS,
    RunSpec,
    StudyConfig,
    encoding_label,
    train_run,
)

__all__ = ["Grid", "merge_results", "run_study", "summarize"]

#: ``progress(my_specs, steps_of)``: a context manager whose value has ``start_run(spec, done_steps)``,
#: ``step(step, loss)`` and ``end_run(finished_steps)``.
ProgressFactory = Callable[[Sequence[RunSpec], Callable[[RunSpec], int]], AbstractContextManager[Any]]


@dataclass(frozen=True)
class Grid:
    """Tasks x encodings x seeds, plus randomized-position variants of the absolute and rotary ones."""

    tasks: tuple[str, ...]
    encodings: tuple[str, ...]
    seeds: int
    randomized_positions: bool = False

    def __post_init__(self) -> None:
        for task in self.tasks:
            get_task(task)
        for encoding in self.encodings:
            if encoding not in ENCODINGS:
                raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
        if not self.tasks or not self.encodings:
            raise ValueError("the grid needs at least one task and one encoding")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"seeds must be a positive integer, got {self.seeds!r}")
        if self.randomized_positions and not set(self.encodings) & set(ABSOLUTE_OR_ROTARY):
            raise ValueError(f"randomized positions need one of the encodings {', '.join(ABSOLUTE_OR_ROTARY)}")

    def specs(self) -> list[RunSpec]:
        specs: list[RunSpec] = []
        for task in self.tasks:
            for encoding in self.encodings:
                variants = [False, True] if self.randomized_positions and encoding in ABSOLUTE_OR_ROTARY else [False]
                for randomized in variants:
                    specs.extend(RunSpec(task, encoding, seed, randomized) for seed in range(self.seeds))
        return specs


def _sd(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{task: {encoding: {...}}}``: means over seeds and their spread.

    ``in_distribution`` is the mean accuracy over lengths 1..L (the training lengths),
    ``beyond`` over lengths > L; ``spread`` holds the standard deviations of those two over
    seeds, ``interval`` their 95% intervals (:func:`~selfattn.study.spread.interval95`) and
    ``per_seed`` the values themselves (for :func:`~selfattn.study.spread.differs`); ``below_half_at`` is the first length where the mean over seeds falls below 50%
    (None if it never does); ``steps`` the mean steps the runs took (None if a run does not say).
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["task"], encoding_label(run)), []).append(run)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for (task, label), members in groups.items():
        limit = int(members[0]["train_max_len"])
        lengths = sorted(int(n) for n in members[0]["accuracy_by_length"])
        inside = [statistics.fmean(r["accuracy_by_length"][str(n)] for n in lengths if n <= limit) for r in members]
        outside = [
            statistics.fmean(r["accuracy_by_length"][str(n)] for n in lengths if n > limit)
            for r in members
            if lengths[-1] > limit
        ]
        mean_by_length = {n: statistics.fmean(r["accuracy_by_length"][str(n)] for r in members) for n in lengths}
        below = next((n for n in lengths if mean_by_length[n] < 0.5), None)
        summary.setdefault(task, {})[label] = {
            "in_distribution": statistics.fmean(inside),
            "beyond": statistics.fmean(outside) if outside else None,
            "spread": {"in_distribution": _sd(inside), "beyond": _sd(outside) if outside else None},
            "interval": {"in_distribution": interval95(inside), "beyond": interval95(outside) if outside else None},
            "per_seed": {"in_distribution": inside, "beyond": outside or None},
            "below_half_at": below,
            "seeds": len(members),
            # Steps taken, mean over seeds: with early stops, how fast the encoding learns the task.
            "steps": statistics.fmean(int(r["steps"]) for r in members) if all("steps" in r for r in members) else None,
            # The early-stopping reading, per seed: the first check at learned_at in range (None: never reached).
            "steps_to_learn": [r.get("steps_to_learn") for r in members],
            # Answer tokens right by position past L, whole sample against a window (None for older runs).
            "answer_use": summarize_answer_use(members),
        }
    return summary


def merge_results(
    specs: Sequence[RunSpec], runs_dir: Path, config: dict[str, Any], deep_stack: dict[str, Any] | None
) -> dict[str, Any]:
    """``results.json``: ``{"config", "runs", "summary", "deep_stack"}`` from the finished run files."""
    runs = []
    for spec in specs:
        run = json.loads((runs_dir / f"{spec.key}.json").read_text())
        runs.append({k: v for k, v in run.items() if k != "loss_curve"})
    config = {**config, "code_versions": code_versions(runs)}
    return {"config": config, "runs": runs, "summary": summarize(runs), "deep_stack": deep_stack}


class _Distributed:
    """Rank, world size and device; starts (and later ends) a process group under torchrun."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.owns_group = False
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not dist.is_initialized():
            # Long timeout: a rank that finished its share waits at the barrier for the others.
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=24))
            self.owns_group = True
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()

    def close(self) -> None:
        if self.owns_group:
            self.dist.destroy_process_group()


def _deep_stack(out: Path, quick: bool, reuse: bool) -> dict[str, Any]:
    """The deep-stack measurements (:mod:`selfattn.study.deep_stack`), cached in DIR.

    ``reuse``: return DIR's cached measurements where there are some (``--resume``, or another
    rank measured them during this call).
    """
    from selfattn.study.deep_stack import measure_deep_stack

    cached = out / "deep_stack.json"
    if reuse and cached.exists():
        try:
            return dict(json.loads(cached.read_text()))
        except (TypeError, ValueError):  # a JSONDecodeError or UnicodeDecodeError is a ValueError
            pass  # a damaged cache (written whole, so damaged outside the study): measured again below
    options: dict[str, Any] = {"depth": 4, "seeds": 1, "train_steps": 0} if quick else {}
    result = dict(measure_deep_stack(**options))
    write_json(cached, result)
    return result


def run_study(
    out: Path,
    grid: Grid,
    config: StudyConfig,
    *,
    resume: bool = False,
    quick: bool = False,
    data_parallel: bool = False,
    checkpoint_seconds: float = 5.0,
    deep_stack: bool = True,
    report: bool = True,
    progress: ProgressFactory | None = None,
) -> dict[str, Any] | None:
    """Run (or finish) the grid in ``out``; return the merged results on rank 0, None elsewhere.

    Args:
        out: output folder (created).
        grid: which runs.
        config: how each run trains and is measured.
        resume: keep finished runs and checkpoints of an earlier call with the same ``config``;
            without it the folder's runs and checkpoints are cleared first.
        quick: a smaller deep-stack measurement (``--quick``).
        data_parallel: every rank trains every run together (DistributedDataParallel).
        checkpoint_seconds: the most work a kill loses.
        deep_stack: include the deep-stack measurements (exercise 1).
        report: write ``study.html`` and the figures.
        progress: ``progress(my_specs, steps_of)`` (``steps_of(spec)``: the run's steps) returns
            a context manager whose value has ``start_run(spec, done_steps)``, ``step(step,
            loss)`` and ``end_run(finished_steps)`` (the steps of every finished run of
            ``my_specs``, whichever rank trained it).

    Raises:
        ValueError: ``out`` is a file or lies under one; ``resume`` with other settings than
            the folder's.
    """
    check_folder(out, f"cannot write the study to {str(out)!r}")
    env = _Distributed()
    try:
        runs_dir, checkpoints, claims = prepare_runs_folder(out, {"study": config.as_dict()}, env, resume=resume)
        specs = grid.specs()
        pending = pending_runs(specs, runs_dir)
        env.barrier()  # every rank has listed the pending runs before any new one is written
        # Longest first: the runs left at the end are short, so the ranks finish close together.
        pending.sort(key=lambda spec: -_estimated_cost(spec, config))
        shared = data_parallel or env.world == 1
        if deep_stack and not shared and env.rank == env.world - 1:
            _deep_stack(out, quick, resume)  # cached in DIR for rank 0, while the other ranks train
        mine = iter(pending) if shared else (spec for spec in pending if _claim(claims, spec))

        train_pending(
            pending, mine, functools.partial(train_run, config=config), lambda spec: config.steps_for(spec.task),
            env=env, runs_dir=runs_dir, checkpoints=checkpoints, checkpoint_seconds=checkpoint_seconds,
            data_parallel=data_parallel, progress=progress,
        )  # fmt: skip
        env.barrier()
        if env.rank != 0:
            return None
        stack = _deep_stack(out, quick, resume or not shared) if deep_stack else None
        full_config = {
            **config.as_dict(),
            "tasks": list(grid.tasks),
            "encodings": list(grid.encodings),
            "seeds": grid.seeds,
            "randomized_positions": grid.randomized_positions,
            "world_size": env.world,
            "data_parallel": data_parallel,
        }
        results = merge_results(specs, runs_dir, full_config, stack)
        write_json(out / "results.json", results)
        if report:
            from selfattn.study.report import write_report

            write_report(out, results)
        return results
    finally:
        env.close()


def _estimated_cost(spec: RunSpec, config: StudyConfig) -> int:
    """Steps times the training sequence length: enough to order runs from long to short."""
    return config.steps_for(spec.task) * get_task(spec.task).sequence_len(config.train_len)


def refuse_other_settings(config_file: Path, saved: dict[str, Any], folder: Path) -> None:
    """Raise when ``config_file`` (an earlier call's) holds other settings than ``saved``, naming those that differ."""
    if not config_file.exists():
        return
    try:
        before = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--resume: {config_file} cannot be read ({error}); remove it to start over") from None
    if before == saved:
        return
    changed = _differing(before, saved)
    raise ValueError(
        f"--resume: {folder} was made with other settings ({', '.join(changed)} differ); "
        "use the same options or another --out"
    )


def _differing(before: Any, now: dict[str, Any]) -> list[str]:
    """The keys of ``now`` whose values differ in ``before``, looking inside a value that is a dict on both sides."""
    changed: list[str] = []
    for key, value in now.items():
        old = before.get(key) if isinstance(before, dict) else None
        if isinstance(value, dict) and isinstance(old, dict):
            changed += _differing(old, value)
        elif old != value:
            changed.append(key)
    return sorted(changed)


def pending_runs(specs: Sequence[RunSpec], runs_dir: Path) -> list[RunSpec]:
    """The runs of ``specs`` with no record in ``runs_dir``. A record is written whole (atomically), so one that does
    not read as its run's (damaged, or another file put there) is refused, naming it, rather than merged."""
    pending = []
    for spec in specs:
        path = runs_dir / f"{spec.key}.json"
        if not path.exists():
            pending.append(spec)
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{path} is not a finished run's record ({error}); remove it to run that run again"
            ) from None
        expected = spec.as_dict()
        if not isinstance(record, dict) or {key: record.get(key) for key in expected} != expected:
            raise ValueError(
                f"{path} is not a finished run's record (not the record of run {spec.key}); remove it to run that "
                "run again"
            )
    return pending


def prepare_runs_folder(
    out: Path, saved: dict[str, Any], env: _Distributed, *, resume: bool
) -> tuple[Path, Path, Path]:
    """``out/runs``, ``out/checkpoints`` and a fresh ``out/claims``, made by rank 0 with ``saved`` in ``out/config.json``.

    Without ``resume`` earlier runs and checkpoints are cleared, and the results and report made from them (an
    interrupted call would leave an earlier study's beside its own settings); with it, other settings than
    ``saved`` are refused (:func:`refuse_other_settings`). Every rank waits for rank 0.
    """
    runs_dir, checkpoints, claims = out / "runs", out / "checkpoints", out / "claims"
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config_file = out / "config.json"
        if resume:
            refuse_other_settings(config_file, saved, out)
        else:
            for folder in (runs_dir, checkpoints, out / "figures"):
                shutil.rmtree(folder, ignore_errors=True)
            for made in ("results.json", "study.html", "text.md"):
                (out / made).unlink(missing_ok=True)
        runs_dir.mkdir(exist_ok=True)
        checkpoints.mkdir(exist_ok=True)
        shutil.rmtree(claims, ignore_errors=True)  # an earlier call's claims: no rank of it runs now
        claims.mkdir()
        write_json(config_file, saved)
    env.barrier()
    return runs_dir, checkpoints, claims


def train_pending(
    pending: Sequence[RunSpec],
    mine: Iterable[RunSpec],
    train: Callable[..., dict[str, Any]],
    steps_of: Callable[[RunSpec], int],
    *,
    env: _Distributed,
    runs_dir: Path,
    checkpoints: Path,
    checkpoint_seconds: float,
    data_parallel: bool,
    progress: ProgressFactory | None,
) -> None:
    """Train this rank's runs (``mine``, of ``pending``) into ``runs_dir/KEY.json``, each resuming its checkpoint.

    ``train(spec, checkpoint=, checkpoint_seconds=, on_step=, device=, data_parallel=)`` trains
    one run and returns its record (:func:`~selfattn.study.training.train_run` with its
    config bound, or the text study's). Rank 0 shows
    ``progress`` over ``pending``: after each run, the steps of every finished one, whichever
    rank trained it.
    """
    context = progress(pending, steps_of) if env.rank == 0 and progress is not None else nullcontext(None)
    version = code_version()  # recorded with every run: a folder's runs compare only if they share it
    with context as bars:
        for spec in mine:
            checkpoint = checkpoints / f"{spec.key}.pt"
            if bars is not None:
                bars.start_run(spec, _checkpoint_step(checkpoint))
            run = train(
                spec,
                checkpoint=checkpoint,
                checkpoint_seconds=checkpoint_seconds,
                on_step=None if bars is None else bars.step,
                device=env.device,
                data_parallel=data_parallel,
            )
            run["code_version"] = version
            if env.rank == 0 or not data_parallel:
                write_json(runs_dir / f"{spec.key}.json", run)
            if bars is not None:
                finished = [done for done in pending if (runs_dir / f"{done.key}.json").exists()]
                bars.end_run(sum(steps_of(done) for done in finished))


def _claim(claims: Path, spec: RunSpec) -> bool:
    """Take ``spec`` for this rank unless another rank has (an exclusive create is atomic)."""
    try:
        os.close(os.open(claims / spec.key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _checkpoint_step(path: Path) -> int:
    if not path.exists():
        return 0
    return int(torch.load(path, map_location="cpu", weights_only=True)["step"])
