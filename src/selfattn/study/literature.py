"""The synthetic study in Kazemnejad et al.'s setting, and the measured causes of its disagreements.

Kazemnejad et al. (2023) trained decoder-only models on lengths 1..20 and tested to 40 (2L) by
exact match, finding NoPE and T5 best and ALiBi in the middle. The study's default grid
evaluates to 4L. This module trains copy and reverse (the tasks of theirs the study trains to
>= 95%; their ranking aggregates several tasks), 3 seeds each, with the study's settings except
``eval_factor=2``, every run for the whole schedule (compute-matched), and variants that each
change one suspected cause:

* ``t5`` vs ``t5-trained-buckets``: with causal T5 buckets up to distance 128, training (lengths
  1..20, distances up to 41) reaches buckets 0-23, and the distances 46..81 of lengths up to 40
  fall in buckets 24-28 (:func:`t5_bucket_starts`), which get no gradient: their N(0, 1) initial
  biases only shrink under AdamW's weight decay
  (:func:`~selfattn.study.training.decay_without_gradient`); ``max_distance=40`` sends every
  distance past 38 to the last bucket, which training reaches (as T5's 128 did in Press et
  al.'s training at 512).
* ``shaw-clip-40`` (the study's) vs ``shaw-clip-16`` (Shaw et al.'s): the distance past which
  one vector serves every offset.
* ``rotary+rand``: randomized positions (Ruoss et al. 2023) beside plain ``rotary``.
* ``rotary-partial-25``: their rotary (25% of each head rotates), beside full ``rotary`` and
  ``p-rope-scaled`` (the fastest pairs rotate, :mod:`selfattn.study.encodings`).
* ``t5-init``: their T5 initialisation (std ``d ** -0.5``) beside ``nn.Embedding``'s N(0, 1).

The papers' depth, each beside the study's 3 layers of width 64 (:data:`MODEL_SIZES`):

* **Kazemnejad et al.** trained a decoder-only T5 built from Hugging Face's ``t5-base``
  configuration (their repository's ``configs/models/custom_t5_base_dec_only.jsonnet`` with
  ``hf_model_name: 't5-base'``, ``from_pretrained: false``): 12 layers, ``d_model`` 768, 12 heads
  of 64, ``d_ff`` 3072 (7.1M parameters per layer without cross-attention, 85M in the layers;
  trained from scratch). The ``*-12-layers`` variants take their depth, 12 layers, at the
  study's width (64, 4 heads of 16, MLP 128): width 768 is 12 times the width and about 144
  times the multiply-adds per layer, beyond 2 cores in any budget of hours.
  Their four main encodings (NoPE, T5 with its initialisation, ALiBi, partial rotary) are
  trained at that depth.
* **Ruoss et al.**: their repository (``google-deepmind/randomized_positional_encodings``)
  builds its transformer from ``models/transformer.py``'s ``TransformerConfig`` defaults, 8 heads
  and MLP 4 x the embedding, with ``experiments/example.py``'s 5 layers of embedding 64 (an
  encoder; that script trains 10,000 steps at batch 128, lr 1e-3, on lengths 1..40, drawing
  positions from ``range(2048)``): 5 layers, d = 64, 8 heads of 8, MLP 256.
  ``rotary-5x64-8-heads`` and ``rotary+rand-5x64-8-heads`` are that size exactly, causal as the
  rest of the study.

Budget (CPU time of one thread per run of copy, 7,500 steps, measured on the shared 2-core
machine at load about 5 on 2026-11-26): 6.7 min at the study's 3 layers, 19.8 min at 12 layers,
13.6 min at 5 layers of 8 heads (reverse runs take about 0.7 times as long). The 11 shallow
variants x 2 tasks x 3 seeds are about 6 h of CPU, the 4 deep ones about 7 h, Ruoss et al.'s
size about 2.5 h; ``--variants`` and ``--tasks`` run any subset, resumably, into the same folder
(two processes with different ``--tasks`` use both cores; a last call with every variant merges).

Run ``python -m selfattn.study.literature --out DIR``; it resumes (one file per run, written
atomically; checkpoints as the study's) and writes ``DIR/literature.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json
from selfattn.functional import t5_relative_bucket
from selfattn.study.provenance import code_version, code_versions, mixed_versions_warning
from selfattn.study.spread import best_and_ties, interval95
from selfattn.study.tasks import get_task
from selfattn.study.training import RunSpec, StudyConfig, shaw_max_distance, train_run

__all__ = [
    "CAUSE_VARIANTS",
    "KAZEMNEJAD",
    "LITERATURE_SEEDS",
    "LITERATURE_TASKS",
    "MODEL_SIZES",
    "literature_lines",
    "run_literature",
    "t5_bucket_starts",
    "t5_buckets_reached",
    "variant_config",
]

#: The study's settings, evaluated to 2L as Kazemnejad et al. did (compute-matched: no early stop).
KAZEMNEJAD = StudyConfig(eval_factor=2)
_HEAD_DIM = KAZEMNEJAD.num_hiddens // KAZEMNEJAD.num_heads

#: name: (encoding, randomized positions, options replacing the study's). The faithful ones:
#: ``rotary-partial-25`` is their "rotary" (GPT-NeoX style, ``rotary_dim = int(0.25 * d_head)``:
#: the first quarter of each head rotates, with frequencies over that quarter), ``t5-init`` their
#: T5 (bias table drawn from N(0, d^-1), as Hugging Face's T5 initialises it, instead of N(0, 1)).
CAUSE_VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "t5": ("t5", False, {}),
    "t5-init": ("t5", False, {"bias_init_std": KAZEMNEJAD.num_hiddens**-0.5}),
    "t5-trained-buckets": ("t5", False, {"max_distance": 40}),
    "none": ("none", False, {}),
    "alibi": ("alibi", False, {}),
    "shaw-clip-40": ("shaw", False, {}),
    "shaw-clip-16": ("shaw", False, {"max_distance": 16}),
    "rotary": ("rotary", False, {}),
    "rotary-partial-25": ("rotary", False, {"rotary_dim": int(0.25 * _HEAD_DIM)}),
    "p-rope-scaled": ("p-rope-scaled", False, {}),
    "rotary+rand": ("rotary", True, {}),
    # The papers' depth (MODEL_SIZES): Kazemnejad et al.'s 12 layers, Ruoss et al.'s 5 x 64 with 8 heads.
    "none-12-layers": ("none", False, {}),
    "t5-init-12-layers": ("t5", False, {"bias_init_std": KAZEMNEJAD.num_hiddens**-0.5}),
    "alibi-12-layers": ("alibi", False, {}),
    "rotary-partial-25-12-layers": ("rotary", False, {"rotary_dim": int(0.25 * _HEAD_DIM)}),
    "rotary-5x64-8-heads": ("rotary", False, {}),
    "rotary+rand-5x64-8-heads": ("rotary", True, {}),
}
_KAZEMNEJAD_DEPTH = {"num_layers": 12}
_RUOSS_SIZE = {"num_layers": 5, "num_heads": 8, "ffn_hiddens": 256}
#: Variants trained at another model size than the study's (fields of StudyConfig they replace).
MODEL_SIZES: dict[str, dict[str, int]] = {
    **{name: _KAZEMNEJAD_DEPTH for name in CAUSE_VARIANTS if name.endswith("-12-layers")},
    **{name: _RUOSS_SIZE for name in CAUSE_VARIANTS if name.endswith("-5x64-8-heads")},
}
#: More than one task, as their ranking aggregates several (the two the study's budget trains).
LITERATURE_TASKS = ("copy", "reverse")
LITERATURE_SEEDS = 3


def t5_bucket_starts(num_buckets: int = 32, max_distance: int = 128, farthest: int = 4096) -> list[int]:
    """The first distance of each causal T5 bucket (index: the bucket), as the study's models assign them.

    Read off :func:`~selfattn.functional.t5_relative_bucket` for the distances ``0 .. farthest``
    (a bucket no distance up to ``farthest`` reaches is left out). The log-spaced buckets do
    not start at round numbers: with 32 buckets to 128, bucket 24 starts at 46 and the last at
    113, so ``max_distance`` is not where the last bucket begins.
    """
    distances = torch.arange(farthest + 1)
    buckets = t5_relative_bucket(-distances, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance)
    starts: dict[int, int] = {}
    for distance, bucket in zip(distances.tolist(), buckets.tolist(), strict=True):
        starts.setdefault(int(bucket), int(distance))
    return [starts[bucket] for bucket in sorted(starts)]


def t5_buckets_reached(task: str, config: StudyConfig, max_distance: int = 128) -> dict[str, list[int]]:
    """Causal T5 buckets (32) that training's distances reach, and those only evaluation reaches."""
    trained = get_task(task).sequence_len(config.train_len)
    tested = get_task(task).sequence_len(config.eval_len)

    def buckets(length: int) -> set[int]:
        distances = -torch.arange(length)  # key before query: negative relative position
        found = t5_relative_bucket(distances, bidirectional=False, num_buckets=32, max_distance=max_distance)
        return set(found.tolist())

    seen = buckets(trained)
    return {"trained": sorted(seen), "only_in_evaluation": sorted(buckets(tested) - seen)}


def _variant_row(members: list[dict[str, Any]], config: StudyConfig) -> dict[str, Any]:
    """A variant's row over seeds: mean and 95% interval of exact match in range and to 2L, tokens to 2L, steps."""
    lengths = range(1, config.eval_len + 1)
    inside = [n for n in lengths if n <= config.train_len]
    beyond = [n for n in lengths if n > config.train_len]

    def per_seed(key: str, which: list[int]) -> list[float]:
        return [statistics.fmean(m[key][str(n)] for n in which) for m in members]

    return {
        "steps": [m["steps"] for m in members],
        "steps_to_learn": [m.get("steps_to_learn") for m in members],
        "exact_match_in_range": interval95(per_seed("accuracy_by_length", inside)),
        "exact_match_to_2L": interval95(per_seed("accuracy_by_length", beyond)),
        "exact_match_to_2L_per_seed": per_seed("accuracy_by_length", beyond),
        "token_accuracy_to_2L": interval95(per_seed("token_accuracy_by_length", beyond)),
        "exact_match_by_length": {
            str(n): statistics.fmean(m["accuracy_by_length"][str(n)] for m in members) for n in lengths
        },
    }


def variant_config(name: str, config: StudyConfig = KAZEMNEJAD) -> StudyConfig:
    """``config`` at the variant's model size (:data:`MODEL_SIZES`; the study's for the others)."""
    if name not in CAUSE_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(CAUSE_VARIANTS)}; got {name!r}")
    size = MODEL_SIZES.get(name, {})
    return replace(
        config,
        num_layers=size.get("num_layers", config.num_layers),
        num_heads=size.get("num_heads", config.num_heads),
        ffn_hiddens=size.get("ffn_hiddens", config.ffn_hiddens),
    )


def _train_variant(out: Path, task: str, name: str, seed: int, config: StudyConfig, version: str) -> dict[str, Any]:
    """One run of a variant, trained unless ``out`` holds it (a run file per run, written atomically)."""
    encoding, randomized, options = CAUSE_VARIANTS[name]
    path = out / "runs" / f"{task}-{name}-s{seed}.json"
    if not path.exists():
        run = train_run(
            RunSpec(task, encoding, seed, randomized),
            variant_config(name, config),
            checkpoint=out / "checkpoints" / f"{task}-{name}-s{seed}.pt",
            position_options=options,
        )
        write_json(path, {**{k: v for k, v in run.items() if k != "loss_curve"}, "code_version": version})
    return dict(json.loads(path.read_text()))


def _further_seeds(out: Path, task: str, name: str, seeds: int) -> list[Path]:
    """Run files of ``task`` and variant ``name`` in ``out`` with a seed of ``seeds`` or more, by seed."""
    pattern = re.compile(rf"{re.escape(task)}-{re.escape(name)}-s(\d+)")
    found = {int(m.group(1)): p for p in (out / "runs").glob("*.json") if (m := pattern.fullmatch(p.stem))}
    return [found[seed] for seed in sorted(found) if seed >= seeds]


def run_literature(
    out: Path,
    *,
    tasks: tuple[str, ...] = LITERATURE_TASKS,
    seeds: int = LITERATURE_SEEDS,
    variants: list[str] | None = None,
    config: StudyConfig = KAZEMNEJAD,
) -> dict[str, Any]:
    """Train the variants on ``tasks`` x ``seeds`` (resuming what ``out`` holds); write and return ``literature.json``.

    Each variant's cells are the mean over seeds with a 95% interval
    (:func:`~selfattn.study.spread.interval95`) over seeds ``0 .. seeds - 1`` and any further seeds whose run
    files ``out`` holds (seeds added to some variants later; ``seeds_by_variant`` then names them);
    ``code_versions`` lists the code the runs came from.
    """
    for name in variants or ():
        if name not in CAUSE_VARIANTS:
            raise ValueError(f"variants must be among {', '.join(CAUSE_VARIANTS)}; got {name!r}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints").mkdir(exist_ok=True)
    version = code_version()
    rows: dict[str, dict[str, Any]] = {}
    every: list[dict[str, Any]] = []
    for task in tasks:
        for name in variants or list(CAUSE_VARIANTS):
            encoding, randomized, options = CAUSE_VARIANTS[name]
            members = [_train_variant(out, task, name, seed, config, version) for seed in range(seeds)]
            members += [json.loads(path.read_text()) for path in _further_seeds(out, task, name, seeds)]
            every += members
            rows.setdefault(task, {})[name] = {
                "encoding": encoding, "randomized_positions": randomized, "options": options,
                "model": MODEL_SIZES.get(name, {}),
                **_variant_row(members, config),
            }  # fmt: skip
    counts = {
        f"{task}/{name}": row["exact_match_to_2L"]["seeds"] for task, by in rows.items() for name, row in by.items()
    }
    results = {
        "tasks": list(tasks),
        "seeds": seeds,
        **(
            {"seeds_by_variant": {k: n for k, n in counts.items() if n != seeds}}
            if set(counts.values()) != {seeds}
            else {}
        ),
        "config": config.as_dict(),
        "code_versions": code_versions(every),
        "shaw_clip_in_study": {task: shaw_max_distance(task, config) for task in tasks},
        "t5_buckets": {
            task: {
                "max_distance_128": t5_buckets_reached(task, config),
                "max_distance_40": t5_buckets_reached(task, config, 40),
            }
            for task in tasks
        },
        "variants": rows,
    }
    write_json(out / "literature.json", results)
    return results


def literature_lines(results: dict[str, Any]) -> list[str]:
    """Per task and variant: exact match in range and to 2L, tokens to 2L (mean ± 95% half-width), and the
    variants not told apart from the best to 2L (:func:`~selfattn.study.spread.best_and_ties`)."""
    from selfattn.study.summary import _percent

    lines = []
    for task, by in results["variants"].items():
        more = [f"{key.split('/', 1)[1]} {n}" for key, n in results.get("seeds_by_variant", {}).items()
                if key.startswith(f"{task}/")]  # fmt: skip
        extra = f"; {', '.join(more)}" if more else ""
        lines.append(f"{task} (mean ± half-width of the 95% interval over {results['seeds']} seeds{extra}):")
        for name, row in by.items():
            lines.append(
                f"  {name:20s} in range {_percent(row['exact_match_in_range'])}  21..40 exact "
                f"{_percent(row['exact_match_to_2L'])}  tokens {_percent(row['token_accuracy_to_2L'])}"
            )
        best, ties = best_and_ties({name: row["exact_match_to_2L_per_seed"] for name, row in by.items()},
                                   higher_is_better=True)  # fmt: skip
        lines.append(
            f"  best to 2L: {best}" + (f"; not told apart from it by the seeds: {', '.join(ties)}" if ties else "")
        )
    warning = mixed_versions_warning(list(results.get("code_versions", [])))
    return lines + ([warning] if warning else [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("selfattn-literature"))
    parser.add_argument("--tasks", nargs="+", default=list(LITERATURE_TASKS))
    parser.add_argument("--seeds", type=int, default=LITERATURE_SEEDS)
    parser.add_argument("--variants", nargs="+", choices=list(CAUSE_VARIANTS), default=None)
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be a positive integer, got {args.seeds}")
    torch.set_num_threads(1)
    results = run_literature(args.out, tasks=tuple(args.tasks), seeds=args.seeds, variants=args.variants)
    print("\n".join(literature_lines(results)))


if __name__ == "__main__":
    main()
