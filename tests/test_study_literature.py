"""The literature setting's facts, measured from the code: T5's buckets, untrained weights under weight decay, sizes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from study_settings import TINY

from selfattn._atomic import write_json
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


def test_p_rope_scaled_rotates_exactly_the_pairs_that_turn_within_the_training_sequence() -> None:
    from selfattn.study.encodings import p_rope_for_length
    from selfattn.study.tasks import get_task
    from selfattn.study.training import build_model

    wavelengths = [2 * math.pi * 10000 ** (2 * i / 16) for i in range(8)]  # 6.3, 19.9, 62.8, ...
    assert p_rope_for_length(16, 42) == sum(w <= 42 for w in wavelengths) / 8 == 0.25
    assert p_rope_for_length(16, 64) == 0.375  # the text study's L: p <= 0.375, as the audit asked
    config = StudyConfig()
    model = build_model(RunSpec("copy", "p-rope-scaled", 0), config)
    frequencies, _ = model.encoding.frequencies_at()  # type: ignore[operator]
    trained = get_task("copy").sequence_len(config.train_len)
    turning = [2 * math.pi / float(f) for f in frequencies if float(f) > 0]
    assert turning and max(turning) <= trained < min(w for w in wavelengths if w not in turning)


def test_scaled_settings_beside_the_papers() -> None:
    from selfattn.study.text import TextConfig, build_text_model
    from selfattn.study.training import build_model

    config = StudyConfig()
    assert build_model(RunSpec("copy", "xpos", 0), config).encoding.scale_base == 512  # type: ignore[union-attr]
    assert build_model(RunSpec("copy", "xpos-scaled", 0), config).encoding.scale_base == 21  # type: ignore[union-attr]
    assert build_model(RunSpec("copy", "p-rope", 0), config).encoding.p == 0.75  # type: ignore[union-attr]
    text = TextConfig()
    assert build_text_model("xpos-scaled", text).encoding.scale_base == 32  # type: ignore[union-attr]
    alibi = build_text_model("alibi-8-heads", text)
    slopes = alibi.encoding.slopes  # type: ignore[union-attr]
    torch.testing.assert_close(slopes, torch.tensor([2.0**-k for k in range(1, 9)], dtype=torch.float64))
    assert build_text_model("alibi", text).encoding.slopes.tolist() == [2.0**-k for k in (2, 4, 6, 8)]  # type: ignore[union-attr]


def test_literature_variants_are_faithful() -> None:
    from selfattn.study.literature import CAUSE_VARIANTS, KAZEMNEJAD
    from selfattn.study.training import build_model

    encoding, _, options = CAUSE_VARIANTS["rotary-partial-25"]
    partial = build_model(RunSpec("copy", encoding, 0), KAZEMNEJAD, options)
    assert partial.encoding.rotary_dim == int(0.25 * 16) == 4  # type: ignore[union-attr]
    encoding, _, options = CAUSE_VARIANTS["t5-init"]
    table = build_model(RunSpec("copy", encoding, 0), KAZEMNEJAD, options).encoding.relative_attention_bias.weight
    default = build_model(RunSpec("copy", "t5", 0), KAZEMNEJAD).encoding.relative_attention_bias.weight
    assert (
        0.09 < float(table.detach().std()) < 0.16 < 0.7 < float(default.detach().std())
    )  # d^-0.5 = 0.125 against N(0, 1)
    with pytest.raises(ValueError, match="bias_init_std applies to T5's bias table, not to 'alibi'"):
        build_model(RunSpec("copy", "alibi", 0), KAZEMNEJAD, {"bias_init_std": 0.1})


def test_literature_runs_two_tasks_with_seeds_and_intervals(tmp_path: Path) -> None:
    from selfattn.study.literature import LITERATURE_SEEDS, LITERATURE_TASKS, literature_lines, run_literature

    assert (LITERATURE_TASKS, LITERATURE_SEEDS) == (("copy", "reverse"), 3)
    config = replace(TINY, steps=6, check_every=3)
    results = run_literature(tmp_path, tasks=("copy", "reverse"), seeds=2, variants=["none", "t5-init"], config=config)
    assert set(results["variants"]) == {"copy", "reverse"} and len(results["code_versions"]) == 1
    row = results["variants"]["copy"]["t5-init"]
    assert row["exact_match_to_2L"]["seeds"] == 2 and len(row["exact_match_to_2L_per_seed"]) == 2
    lines = "\n".join(literature_lines(results))
    assert "copy (mean ± half-width of the 95% interval over 2 seeds):" in lines and "best to 2L:" in lines
    assert "seeds_by_variant" not in results
    # A seed added to one variant later is read with the others; a deeper variant's file is not taken for it.
    kept = json.loads((tmp_path / "runs" / "copy-none-s0.json").read_text())
    write_json(tmp_path / "runs" / "copy-none-s4.json", {**kept, "seed": 4})
    write_json(tmp_path / "runs" / "copy-none-12-layers-s5.json", {**kept, "seed": 5})
    again = run_literature(tmp_path, tasks=("copy", "reverse"), seeds=2, variants=["none", "t5-init"], config=config)
    assert again["variants"]["copy"]["none"]["exact_match_to_2L"]["seeds"] == 3
    assert again["variants"]["reverse"]["none"]["exact_match_to_2L"]["seeds"] == 2
    assert again["seeds_by_variant"] == {"copy/none": 3}
    assert "copy (mean ± half-width of the 95% interval over 2 seeds; none 3):" in literature_lines(again)


def test_depth_variants_train_the_papers_model_sizes(tmp_path: Path) -> None:
    """Kazemnejad et al.'s 12 layers at the study's width; Ruoss et al.'s 5 layers of 64 with 8 heads and MLP 256."""
    from selfattn.study.literature import CAUSE_VARIANTS, KAZEMNEJAD, MODEL_SIZES, run_literature, variant_config
    from selfattn.study.training import build_model

    deep = ["none-12-layers", "t5-init-12-layers", "alibi-12-layers", "rotary-partial-25-12-layers"]
    ruoss = ["rotary-5x64-8-heads", "rotary+rand-5x64-8-heads"]
    assert set(MODEL_SIZES) == {*deep, *ruoss}
    for name in deep:
        encoding, randomized, options = CAUSE_VARIANTS[name]
        model = build_model(RunSpec("copy", encoding, 0, randomized), variant_config(name), options)
        assert (len(model.blocks), model.num_hiddens, model.blocks[0].attention.num_heads) == (12, 64, 4)
    for name in ruoss:
        encoding, randomized, options = CAUSE_VARIANTS[name]
        model = build_model(RunSpec("copy", encoding, 0, randomized), variant_config(name), options)
        block = model.blocks[0]
        assert (len(model.blocks), model.num_hiddens, block.attention.num_heads) == (5, 64, 8)
        assert block.mlp is not None and block.mlp[0].out_features == 256
    assert variant_config("rotary") == KAZEMNEJAD  # the others keep the study's 3 layers
    with pytest.raises(ValueError, match=r"variant must be one of .*; got 'bogus'"):
        variant_config("bogus")
    with pytest.raises(ValueError, match=r"variants must be among .*; got 'bogus'"):
        run_literature(tmp_path, variants=["bogus"])
