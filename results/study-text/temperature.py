"""One cause at a time: does rotary read worse than sinusoidal far past L because its attention there is sharp?

    .venv/bin/python results/study-text/temperature.py GRID CHECKPOINTS [OUT.json]

GRID is a folder of the text study (``L256``: ``config.json``, ``runs/``); CHECKPOINTS its final checkpoints
(``text-ENCODING-sSEED.pt``). Past 2L the study measured rotary attending sharply (low entropy) and sinusoidal
diffusely, with sinusoidal the lower perplexity from 8L on. This changes one thing, the sharpness: every layer's
query projection ``W_q`` of the trained rotary and sinusoidal models is multiplied by ``c`` (each score times
``c``: a softmax temperature ``1 / c``, the same at every position; rotary's rotation is linear, so it commutes),
and the models are read again at the longest length, on the sample of windows the context gain reads
(:meth:`selfattn.study.text.TextConfig.sample_starts`): perplexity and attention entropy by band of positions,
mean over the seeds (every seed GRID/runs holds) ± the half-width of the 95% interval. ``c = 1`` is the trained model. Beside them, the same
bytes' perplexity from the training bytes' frequencies alone (no context at all): the level a model that ignores
its context would read.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from selfattn._atomic import write_json
from selfattn.models.block import TransformerBlock
from selfattn.study.attention_use import attention_bands, attention_by_position
from selfattn.study.context_use import nll_by_position, position_bands
from selfattn.study.corpus import load_corpus, split_corpus
from selfattn.study.spread import interval95
from selfattn.study.text import TextConfig, build_text_model

FACTORS = (1.0, 0.5, 0.25)
ENCODINGS = ("rotary", "sinusoidal")


def _config(grid: Path) -> TextConfig:
    saved = json.loads((grid / "config.json").read_text())["text"]
    names = {f.name for f in fields(TextConfig)}
    return TextConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names})


def _softened(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    """A copy of ``model`` whose every attention score is ``factor`` times the trained one."""
    soft = copy.deepcopy(model)
    with torch.no_grad():
        for block in soft.blocks:
            if isinstance(block, TransformerBlock):
                block.attention.W_q.weight.mul_(factor)
                if block.attention.W_q.bias is not None:
                    block.attention.W_q.bias.mul_(factor)
    return soft


def read(model: torch.nn.Module, held_out: torch.Tensor, config: TextConfig) -> dict[str, list[float]]:
    """Perplexity and mean attention entropy (nats, over layers and heads) by band, at the longest length."""
    length = config.longest
    starts = config.sample_starts(config.scored_tokens(len(held_out)))
    bands = position_bands(length, config.train_len)
    nll = nll_by_position(model, held_out, length, len(starts) * length, starts=starts)  # (w, l)
    perplexity = [math.exp(float(nll[:, a:b].mean())) for a, b in bands]
    tokens = torch.stack([held_out[s : s + length].long() for s in starts[:2]])  # (2, l): two windows, as the study
    rows = attention_bands(attention_by_position(model, tokens), bands)
    entropy = [sum(row["entropy"]) / len(row["entropy"]) for row in rows]  # mean over layers
    return {"perplexity": perplexity, "entropy": entropy}


def byte_frequencies(train: torch.Tensor, held_out: torch.Tensor, config: TextConfig) -> list[float]:
    """By band, the perplexity of :func:`read`'s bytes predicted from the training bytes' frequencies alone."""
    counts = torch.bincount(train.long(), minlength=256).double()
    log_p = torch.log(counts / counts.sum())
    length = config.longest
    starts = config.sample_starts(config.scored_tokens(len(held_out)))
    targets = torch.stack([held_out[s + 1 : s + length + 1].long() for s in starts])  # (w, l): the bytes read scores
    return [math.exp(-float(log_p[targets[:, a:b]].mean())) for a, b in position_bands(length, config.train_len)]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    grid, checkpoints = Path(argv[0]), Path(argv[1])
    torch.set_num_threads(1)
    config = _config(grid)
    train, held_out = split_corpus(load_corpus(), config.held_out_fraction)
    bands = position_bands(config.longest, config.train_len)
    frequencies = byte_frequencies(train, held_out, config)
    print(
        "byte frequencies alone: "
        + " ".join(f"{a}-{b - 1}: {p:.1f}" for (a, b), p in zip(bands, frequencies, strict=True))
    )
    found: dict[str, Any] = {
        "bands": [list(b) for b in bands],
        "factors": list(FACTORS),
        "byte_frequencies": frequencies,
        "readings": {},
    }
    for encoding in ENCODINGS:
        per_seed: dict[float, list[dict[str, list[float]]]] = {factor: [] for factor in FACTORS}
        seeds = sorted(
            json.loads(path.read_text())["seed"] for path in (grid / "runs").glob(f"text-{encoding}-s*.json")
        )
        for seed in seeds:
            model = build_text_model(encoding, config)
            model.load_state_dict(torch.load(checkpoints / f"text-{encoding}-s{seed}.pt", map_location="cpu")["model"])
            for factor in FACTORS:
                per_seed[factor].append(read(_softened(model, factor).eval(), held_out, config))
        for factor, seeds in per_seed.items():
            cells = {key: [interval95([s[key][i] for s in seeds]) for i in range(len(bands))] for key in seeds[0]}
            found["readings"].setdefault(encoding, {})[str(factor)] = cells
            text = " ".join(
                f"{a}-{b - 1}: {p['mean']:.1f}±{p['half_width']:.1f} ({e['mean']:.2f})"
                for (a, b), p, e in zip(bands, cells["perplexity"], cells["entropy"], strict=True)
            )
            print(f"{encoding:11s} c={factor:<5} {text}", flush=True)
    if len(argv) == 3:
        write_json(Path(argv[2]), found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
