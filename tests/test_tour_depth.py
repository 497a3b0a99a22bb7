"""Section 8 of the tour (deep stacks): the text follows the measurement, the figure, the study link."""

from __future__ import annotations

import json
import math

import pytest

from selfattn.study.deep_stack import measure_deep_stack
from selfattn.tour import depth

SMALL = {
    "depth": 3,
    "seeds": 2,
    "num_hiddens": 8,
    "num_heads": 2,
    "ffn_hiddens": 8,
    "num_steps": 8,
    "num_sequences": 12,
    "test_sequences": 4,
    "vocab_size": 5,
    "variants": ("residual", "no_residual"),
}


@pytest.fixture(scope="module")
def measured():
    return json.loads(json.dumps(measure_deep_stack(**SMALL, train_steps=2, train_seeds=1)))


def test_section_shows_every_encoding_labelled_untrained_and_never_says_re_inject(measured):
    page = depth.section_html(measured, {"depth": "figures/depth.png"})
    assert "re-inject" not in page and "survives" not in page
    assert "<i>untrained</i>" in page and "selfattn tour --study DIR" in page
    for encoding in measured["untrained"]:
        assert f"<code>{encoding}</code>" in page
    assert 'src="figures/depth.png"' in page and "figures/depth.svg" in page
    share = measured["untrained"]["sinusoidal"]["residual"]["position_share"]
    assert f"falls from {share['mean'][0]:.2f}" in page  # the number comes from the measurement
    assert "Trained stacks" not in page


def test_section_shows_trained_stacks_from_a_study(measured):
    page = depth.section_html(measured, {}, trained=measured)
    assert "Trained stacks" in page and "task accuracy" in page
    assert "selfattn tour --study DIR" not in page


def test_section_sentences_follow_the_numbers(measured):
    fake = json.loads(json.dumps(measured))
    fake["untrained"]["shaw"]["no_residual"]["mean_row_residual"]["max"][-1] = 1e-9
    fake["untrained"]["shaw"]["no_residual"]["mean_row_residual"]["mean"][-1] = 1e-9
    assert "shaw" in depth._collapsed(fake, "no_residual")
    fake["untrained"]["sinusoidal"]["no_residual"]["mean_row_residual"]["max"] = [0.8, 0.5, 0.5, 0.5]
    assert "sinusoidal" not in depth._collapsed(fake, "no_residual")
    page = depth.section_html(fake, {})
    assert "With <code>sinusoidal</code> the rows do not collapse without residuals" in page


def test_verdict_numbers_and_summary_line(measured):
    numbers = depth.verdict_numbers(measured)
    rows = measured["untrained"]["sinusoidal"]["no_residual"]["mean_row_residual"]
    assert numbers["collapse_ratio"] == pytest.approx(rows["max"][-1] / rows["min"][0])
    assert numbers["residual_share_min"] == measured["untrained"]["sinusoidal"]["residual"]["position_share"]["min"][-1]
    line = depth.summary_line(measured)
    assert line.startswith("  8. deep stacks (3 untrained layers, 2 seeds)")
    missing = {**measured, "untrained": {"none": measured["untrained"]["none"]}}
    assert all(math.isnan(v) for v in depth.verdict_numbers(missing).values())  # the check then fails


def test_study_deep_stack_reads_a_study_folder(tmp_path, measured):
    assert depth.study_deep_stack(None) is None
    with pytest.raises(ValueError, match="study_dir="):
        depth.study_deep_stack(tmp_path)
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="study_dir="):
        depth.study_deep_stack(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"runs": [], "deep_stack": None}))
    assert depth.study_deep_stack(tmp_path) is None
    (tmp_path / "results.json").write_text(json.dumps({"deep_stack": measured}))
    assert depth.study_deep_stack(tmp_path) == measured


def test_deep_stack_figure_has_a_panel_per_metric_and_variant(tmp_path, measured):
    from selfattn.tour import figures

    fig = figures.deep_stack_figure(measured)
    assert len(fig.axes) == 4 * 2
    assert [line.get_label() for line in fig.axes[0].lines] == list(measured["untrained"])
    png, svg = figures.save_figure(figures.deep_stack_figure(measured, "trained"), tmp_path, "depth_trained")
    assert png.stat().st_size > 5000 and "<svg" in svg.read_text()[:2000]
    # The report's version: one figure per block kind, its four metrics stacked, so narrow windows stack them.
    panels = figures.deep_stack_figures(measured)
    assert list(panels) == list(next(iter(measured["untrained"].values())))
    for variant, panel in panels.items():
        assert len(panel.axes) == 4 and panel.axes[0].get_title() == variant.replace("_", " ")
        assert [line.get_label() for line in panel.axes[0].lines] == list(measured["untrained"])
    assert panels[next(iter(panels))].axes[0].get_legend() is not None


def test_tour_with_a_missing_study_fails_at_once_with_one_line(tmp_path, capsys):
    from selfattn.cli.main import main

    status = main(
        ["tour", "--quick", "--out", str(tmp_path / "report"), "--study", str(tmp_path / "nowhere"), "--no-progress"]
    )
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfattn tour: error: --study ") and "no such folder" in err and "\n" not in err
    assert not (tmp_path / "report" / "results.json").exists()


def test_trained_sentences_quote_the_study_numbers(measured):
    page = depth.section_html(measured, {}, trained=measured)
    accuracy = measured["trained"]["rotary"]["residual"]["task_accuracy"]["mean"]
    assert f"<code>rotary</code> {depth._num(accuracy)}" in page
    assert "Held-out task accuracy, residual + MLP" in page and "After training, no residual + MLP" in page


def test_trained_stacks_that_stay_at_chance_are_named_as_not_trained(measured):
    fake = json.loads(json.dumps(measured))
    for encoding, by_variant in fake["trained"].items():
        for variant, entry in by_variant.items():
            entry["task_accuracy"]["mean"] = 0.9 if (encoding, variant) == ("sinusoidal", "residual") else 0.21
    fake["trained"]["rotary"]["residual"]["task_accuracy"]["mean"] = 0.3
    page = depth.section_html(fake, {}, trained=fake)
    chance = 1 / fake["config"]["vocab_size"]  # 0.2 for this small run
    assert f"within 5 points of chance, {chance:.2f}" in page or f"within 5 points of chance, {chance}" in page
    residual = page[page.index("residual + MLP: <b>did not train</b>") :]
    residual = residual[: residual.index("</p>")]
    assert "learnt the task (0.5 or more): <code>sinusoidal</code>" in residual
    assert "trained partly (below 0.5): <code>rotary</code>" in residual
    assert "<code>alibi</code>" in residual.split("trained partly")[0]  # at chance: did not train


def test_stacks_trained_to_level_off_are_read_from_a_study_and_named_when_they_do_not_train(tmp_path, measured):
    from selfattn.study.deep_stack import trained_by_depth

    by_depth = trained_by_depth(encodings=("none", "sinusoidal"), variants=("residual",), depths=(1,), max_steps=400,
                                check_every=50, patience=3, num_hiddens=16, num_heads=2, ffn_hiddens=16, num_steps=8,
                                num_sequences=24, test_sequences=8, vocab_size=5)  # fmt: skip
    by_depth = json.loads(json.dumps(by_depth))
    (tmp_path / "results.json").write_text(json.dumps({"deep_stack_by_depth": by_depth}))
    assert depth.study_by_depth(tmp_path) == by_depth
    assert depth.study_by_depth(tmp_path / "absent") is None and depth.study_by_depth(None) is None
    page = depth.section_html(measured, {}, by_depth=by_depth)
    assert "Trained until the accuracy levels off" in page
    assert "did not learn the task (below 0.9): <code>none</code>, residual + MLP, depth 1" in page
    by_depth["stacks"]["none"]["residual"][0].update(trains=False, learnt=False)
    page = depth.section_html(measured, {}, by_depth=by_depth)
    assert "<b>Did not train</b> (within 0.05 of chance): <code>none</code>, residual + MLP, depth 1." in page
    assert "Trained until" not in depth.section_html(measured, {})
