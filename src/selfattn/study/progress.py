"""Rich progress bars for a study: one for the grid, one for the run in hand, with ETAs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from selfattn.study.training import RunSpec

__all__ = ["GridProgress", "grid_progress"]


class GridProgress:
    """Callbacks :func:`selfattn.study.runner.run_study` drives."""

    def __init__(self, progress: Any, specs: Sequence[RunSpec], steps_of: Callable[[RunSpec], int]):
        self.progress, self.steps_of = progress, steps_of
        self.grid = progress.add_task(f"grid ({len(specs)} runs)", total=sum(steps_of(spec) for spec in specs))
        self.run: Any = None
        self.key = ""
        self.done_steps = 0  # steps of the finished runs, by every rank
        self.steps = 0  # of the run in hand

    def start_run(self, spec: RunSpec, done_steps: int) -> None:
        self.key, self.steps = spec.key, self.steps_of(spec)
        self.run = self.progress.add_task(spec.key, total=self.steps, completed=done_steps)
        self.progress.update(self.grid, completed=self.done_steps + done_steps)

    def step(self, step: int, loss: float) -> None:
        self.progress.update(self.run, completed=step, description=f"{self.key} loss {loss:.3f}")
        self.progress.update(self.grid, completed=self.done_steps + step)

    def end_run(self, finished_steps: int) -> None:
        self.done_steps = finished_steps
        self.progress.remove_task(self.run)
        self.progress.update(self.grid, completed=self.done_steps)


@contextmanager
def grid_progress(specs: Sequence[RunSpec], steps_of: Callable[[RunSpec], int]) -> Iterator[GridProgress]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as progress:
        yield GridProgress(progress, specs, steps_of)
