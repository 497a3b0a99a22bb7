"""``selfattn study --exercises``: the trained experiments behind the chapter's claims about learning.

Two experiments, each made of short runs:

* ``long_range`` (:mod:`selfattn.study.long_range`): a CNN, an RNN and self-attention trained on
  an answer at distance n, for several n and seeds;
* ``deep_stack_by_depth`` (:func:`selfattn.study.deep_stack.trained_by_depth`): stacks of
  depth 1..8 of each encoding, with and without residual connections, trained until their
  accuracy levels off, then probed.

Output, beside the grid's files of the same study folder::

    DIR/exercises/config.json        the settings (checked on --resume)
    DIR/exercises/long_range/*.json  one finished run each (model, distance, seed), with its code_version
    DIR/exercises/by_depth/*.json    one trained and probed stack each (encoding, variant, depth), the same
    DIR/exercises.json               the merged results (see :func:`run_exercises`)

Every file is written atomically. A killed call continues with ``--resume``: finished runs
are kept and the rest are trained (a run lasts seconds to a few minutes and restarts from
its beginning). The runs are trained in one process, one after another.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from selfattn._atomic import check_folder, write_json
from selfattn.study.deep_stack import ENCODINGS as DEPTH_ENCODINGS
from selfattn.study.deep_stack import trained_by_depth
from selfattn.study.long_range import MODELS, summarize_by_distance, train_at_distance
from selfattn.study.provenance import code_version, code_versions, mixed_versions_warning
from selfattn.study.runner import refuse_other_settings

__all__ = ["QUICK_EXERCISES", "ExerciseConfig", "exercise_lines", "load_exercises", "run_exercises"]


@dataclass(frozen=True)
class ExerciseConfig:
    """The sizes of both experiments.

    Attributes:
        distances: the distances n of the long-range task.
        seeds: runs per (model, distance): 5, so that "learns sooner" is claimed only outside
            the 95% interval of the steps over seeds (2 seeds left one pair deciding the ordering).
        long_range: keyword arguments of :func:`selfattn.study.long_range.train_at_distance`
            (checks every 25 steps: at 50, two models 50 steps apart fell on adjacent checks).
        depth_encodings: encodings of the stacks trained by depth.
        depth_variants: their kinds of block (keys of :data:`selfattn.study.deep_stack.VARIANTS`).
        depths: the depths.
        by_depth: keyword arguments of :func:`selfattn.study.deep_stack.trained_by_depth`; no
            patience stop by default: "did not train" is judged after the whole ``max_steps``,
            not on a plateau that more steps might have left.
        depth_seeds: seeds per stack (each stack of each seed is its own run).
    """

    distances: tuple[int, ...] = (2, 4, 6, 8, 12, 16, 32)
    seeds: int = 5
    long_range: dict[str, Any] = field(default_factory=lambda: {"budget": 1000, "max_steps": 3000, "check_every": 25})
    depth_encodings: tuple[str, ...] = DEPTH_ENCODINGS
    depth_variants: tuple[str, ...] = ("residual", "no_residual")
    depths: tuple[int, ...] = tuple(range(1, 9))
    by_depth: dict[str, Any] = field(default_factory=lambda: {"max_steps": 3000, "patience": None})
    depth_seeds: int = 3

    def as_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))  # type: ignore[no-any-return]  # tuples as lists, as saved


QUICK_EXERCISES = ExerciseConfig(
    distances=(2, 16),
    seeds=1,
    long_range={"budget": 100, "max_steps": 200, "num_hiddens": 16},
    depth_encodings=("none", "sinusoidal"),
    depth_variants=("residual",),
    depths=(1, 2),
    by_depth={"max_steps": 200, "check_every": 50, "num_hiddens": 16, "num_heads": 2, "ffn_hiddens": 32},
    depth_seeds=1,
)
"""A smoke test of both experiments (seconds): too short to decide anything."""


_LONG_RANGE_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(train_at_distance).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("seed", "cnn_layers")
}


def _long_range_jobs(config: ExerciseConfig) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    for distance in config.distances:
        for kind in MODELS:
            for seed in range(config.seeds):
                job = functools.partial(train_at_distance, kind, distance, seed=seed, **config.long_range)
                yield f"long_range/{kind}-n{distance}-s{seed}", job


def _by_depth_jobs(config: ExerciseConfig) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    for encoding in config.depth_encodings:
        for variant in config.depth_variants:
            for depth in config.depths:
                for seed in range(config.depth_seeds):
                    job = functools.partial(
                        trained_by_depth, encodings=(encoding,), variants=(variant,), depths=(depth,), seed=seed,
                        **config.by_depth,
                    )  # fmt: skip
                    yield f"by_depth/{encoding}-{variant}-d{depth}-s{seed}", job


def _merge_by_depth(config: ExerciseConfig, found: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One :func:`trained_by_depth` result from the single-stack results, in the config's order."""
    stacks: dict[str, dict[str, list[Any]]] = {}
    for one in found:
        for encoding, by_variant in one["stacks"].items():
            for variant, entries in by_variant.items():
                stacks.setdefault(encoding, {}).setdefault(variant, []).extend(entries)
    merged_config = {
        **found[0]["config"],
        "encodings": list(config.depth_encodings),
        "variants": list(config.depth_variants),
        "depths": list(config.depths),
        "seeds": config.depth_seeds,
    }
    seconds = sum(one["seconds"] for one in found)
    return {"config": merged_config, "chance": found[0]["chance"], "stacks": stacks, "seconds": seconds}


def run_exercises(
    out: Path,
    config: ExerciseConfig,
    *,
    resume: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train (or finish) both experiments in ``out``; write and return ``out/exercises.json``.

    Returns:
        ``{"config": config.as_dict(), "code_versions" (of the runs), "quick" (the settings are QUICK_EXERCISES'), "long_range": {"settings" (every keyword of
        train_at_distance but the seed), "runs": [...], "by_distance":
        summarize_by_distance(runs), "chance": 1 / vocab_size, "seconds"}, "deep_stack_by_depth":
        trained_by_depth's result for every stack, "seconds": wall time of this call}``.

    Raises:
        ValueError: ``out`` is a file or lies under one; ``resume`` with other settings than
            the folder's.
    """
    check_folder(out, f"cannot write the exercises to {str(out)!r}")
    folder = out / "exercises"
    saved = config.as_dict()
    config_file = folder / "config.json"
    if resume:
        refuse_other_settings(config_file, saved, folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    for sub in ("long_range", "by_depth"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    write_json(config_file, saved)
    start = time.perf_counter()
    tick = progress or (lambda description: None)
    found: dict[str, list[dict[str, Any]]] = {"long_range": [], "by_depth": []}
    jobs = [*_long_range_jobs(config), *_by_depth_jobs(config)]
    version = code_version()
    for index, (key, job) in enumerate(jobs, 1):
        path = folder / f"{key}.json"
        if path.exists():
            result = json.loads(path.read_text())
        else:
            result = {**job(), "code_version": version}
            write_json(path, result)
        found[key.split("/")[0]].append(result)
        tick(f"{index}/{len(jobs)} {key}")
    runs = found["long_range"]
    settings = _LONG_RANGE_DEFAULTS | config.long_range
    results = {
        "config": saved,
        "code_versions": code_versions([*found["long_range"], *found["by_depth"]]),
        "quick": config == QUICK_EXERCISES,
        "long_range": {
            "settings": settings,
            "runs": runs,
            "by_distance": summarize_by_distance(runs),
            "chance": 1 / settings["vocab_size"],
            "seconds": sum(run["seconds"] for run in runs),
        },
        "deep_stack_by_depth": _merge_by_depth(config, found["by_depth"]) if found["by_depth"] else None,
        "seconds": time.perf_counter() - start,
    }
    write_json(out / "exercises.json", results)
    return results


def load_exercises(folder: Path | str | None) -> dict[str, Any] | None:
    """``folder/exercises.json`` of a study folder, or None when there is none (or it cannot be read)."""
    if folder is None:
        return None
    try:
        data = json.loads((Path(folder) / "exercises.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and "long_range" in data else None


def exercise_lines(results: dict[str, Any]) -> list[str]:
    """The terminal summary: the long-range table and which stacks did not train."""
    long_range = results["long_range"]
    settings = long_range["settings"]
    lines = [
        f"long-range dependency (answer at distance n; chance {long_range['chance']:.0%}): "
        f"accuracy after {settings['budget']} steps / steps to {settings['target']:.0%} "
        "(mean over the seeds that reached it, ± the 95% interval's half-width when every seed did; '-' none did)"
    ]
    for kind, by_distance in long_range["by_distance"].items():
        cells = [
            f"n={n} {cell['accuracy_at_budget']:.0%}/"
            + ("-" if cell["steps_to_target"] is None else f"{cell['steps_to_target']:.0f}")
            + (
                f"±{cell['steps_interval']['half_width']:.0f}"
                if (cell.get("steps_interval") or {}).get("half_width") is not None
                else ""
            )
            for n, cell in by_distance.items()
        ]
        lines.append(f"  {kind:<15}" + "  ".join(cells))
    stacks = results.get("deep_stack_by_depth")
    if stacks:
        config_seeds = int(stacks["config"].get("seeds", 1))
        not_trained = [
            f"{encoding} {variant} d{entry['depth']}" + (f" s{entry['seed']}" if config_seeds > 1 else "")
            for encoding, by_variant in stacks["stacks"].items()
            for variant, entries in by_variant.items()
            for entry in entries
            if not entry["trains"]
        ]
        count = sum(len(entries) for by_variant in stacks["stacks"].values() for entries in by_variant.values())
        patience = stacks["config"].get("patience")
        stop = f"{stacks['config']['max_steps']} steps" + (f", patience {patience}" if patience is not None else "")
        lines.append(
            f"deep stacks ({stop}): {count - len(not_trained)} of {count} train (above chance + 0.05); "
            f"did not train: {', '.join(not_trained) or 'none'}"
        )
    warning = mixed_versions_warning(list(results.get("code_versions", [])))
    return lines + ([warning] if warning else [])
