"""The literature setting's facts, measured from the code: T5's buckets, untrained weights under weight decay, sizes."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from study_settings import TINY

from selfattn.study.literature import t5_bucket_starts
from selfattn.study.training import (
    RunSpec,
    StudyConfig,
    _learning_rate,
    decay_without_gradient,
    make_optimizer,
    parameter_count,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tour-and-study.md"


def _t5_causal_bucket(distance: int, num_buckets: int, max_distance: int) -> int:
    """T5's causal bucket of a key ``distance`` before the query, from the paper's formula in float64."""
    exact = num_buckets // 2
    if distance < exact:
        return distance
    logarithmic = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(logarithmic, num_buckets - 1)


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (32, 40), (16, 32)])
def test_t5_bucket_starts_follow_the_formula(num_buckets: int, max_distance: int) -> None:
    starts: dict[int, int] = {}
    for distance in range(4097):
        starts.setdefault(_t5_causal_bucket(distance, num_buckets, max_distance), distance)
    assert t5_bucket_starts(num_buckets, max_distance) == [starts[b] for b in sorted(starts)]


def test_t5_bucket_starts_as_the_docs_state_them() -> None:
    starts = t5_bucket_starts()
    # The audit's reading: distances 64-66 are still in bucket 26, bucket 24 starts at 46.
    assert (starts[24], starts[26], starts[27], starts[31]) == (46, 59, 67, 113)
    assert t5_bucket_starts(16, 32)[-1] == 27  # t5-short at L = 64: the last bucket starts at 27, not 32
    text = " ".join(DOCS.read_text().split())
    assert "distances 67..1023 fall in buckets 27-31" in text
    assert "distances 46..81 fall in buckets 24-28" in text


def test_an_untouched_weight_shrinks_by_the_decay_factor() -> None:
    """A row whose gradient is zero at every step (an untrained T5 bucket) under the study's AdamW and schedule."""
    config, steps = replace(TINY, lr=0.05, weight_decay=0.3, warmup=3), 40
    table = torch.nn.Embedding(4, 2)
    start = table.weight.detach().clone()
    optimizer, _ = make_optimizer(table, config, "cpu")
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps, config)
        table(torch.tensor([0, 1])).sum().backward()  # rows 2 and 3 get a zero gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    factor = decay_without_gradient(config, steps, steps)
    assert factor < 0.9  # it shrinks: the row does not keep its initial value
    torch.testing.assert_close(table.weight[2:], start[2:] * factor, rtol=1e-5, atol=0)


def test_docs_state_the_synthetic_models_size() -> None:
    nope = parameter_count(RunSpec("copy", "none", 0), StudyConfig())
    config = StudyConfig()
    text = " ".join(DOCS.read_text().split())
    assert f"{config.num_layers} layers, d = {config.num_hiddens}, {config.num_heads} heads" in text
    assert f"{nope:,} parameters" in text
