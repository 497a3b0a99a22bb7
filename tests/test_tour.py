"""`selfattn tour --quick`: files written, the measured numbers, and each section's pure functions."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re

import numpy as np
import pytest
import torch
from reference import naive_attention, sinusoidal_numpy

from selfattn.cli.main import main
from selfattn.tour import checks, claims, family, qualities, runner
from selfattn.tour.report import render_report

SECTION_FIGURES = (
    "attention_weights-valid_len_3",
    "attention_weights-valid_len_5",
    "permutation",
    "comparison",
    "comparison_stacked",
    "pe_columns",
    "pe_heatmap-table",
    "pe_heatmap-bits",
    "absolute-distance",
    "absolute-precision",
    "relative",
    "note-score_terms",
    "note-tokens",
)
FAMILY_PANELS = ("scores", "profile", "attention")


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    out = tmp_path_factory.mktemp("tour") / "report"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["tour", "--quick", "--out", str(out), "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    return {"status": status, "stdout": stdout.getvalue(), "out": out, "results": results}


def test_tour_passes_and_prints_a_summary(tour):
    assert tour["status"] == 0
    text = tour["stdout"]
    passed, total = map(int, re.search(r"(\d+)/(\d+) checks pass", text).groups())
    assert passed == total == len(tour["results"]["checks"])
    assert "report.html" in text and "FAILED" not in text


def test_every_figure_is_written_as_png_and_svg(tour):
    folder = tour["out"] / "figures"
    # Figures of several panels are drawn panel by panel (name-part), so the report can stack them when narrow.
    names = [
        *SECTION_FIGURES,
        *(f"family_{name}-{panel}" for name in family.family_names() for panel in FAMILY_PANELS),
        *(f"depth-{variant}" for variant in tour["results"]["depth"]["variants"]),
    ]
    for name in names:
        png, svg = folder / f"{name}.png", folder / f"{name}.svg"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5000, name
        assert "<svg" in svg.read_text()[:2000], name
    assert len(list(folder.glob("*.png"))) == len(names)


def test_results_hold_the_measured_comparison(tour):
    comparison = tour["results"]["comparison"]
    largest_n = comparison["sweep"]["n"][-1]
    chapter = {"cnn": (1, 2), "rnn": (1, 2), "self_attention": (2, 1)}
    for kind, (want_n, want_d) in chapter.items():
        entry = comparison[kind]
        assert abs(entry["flops_exponent_n"] - want_n) <= 0.1
        assert abs(entry["flops_exponent_d"] - want_d) <= 0.1
        assert entry["n"] == largest_n
        assert isinstance(entry["sequential_ops"], int)
    k = comparison["cnn"]["k"]
    assert comparison["cnn"]["max_path_length"] == math.ceil((largest_n - 1) / (k - 1))
    assert comparison["rnn"]["max_path_length"] == largest_n
    assert comparison["self_attention"]["max_path_length"] == 3
    assert comparison["rnn"]["sequential_ops"] == largest_n
    assert comparison["cnn"]["sequential_ops"] == 1


def test_results_hold_rotation_and_permutation(tour):
    results = tour["results"]
    assert 0 <= results["rotation_max_error"] < 1e-12
    assert results["permutation"]["without_pe_error"] < 1e-12
    assert results["permutation"]["with_pe_change"] > 1e-2
    assert results["family"]["encodings"]
    assert all(check["ok"] for check in results["checks"])


def test_report_shows_every_figure_and_needs_no_network(tour):
    page = (tour["out"] / "report.html").read_text()
    shown = set(re.findall(r'<img src="([^"]+)"', page)) | set(re.findall(r'srcset="([^"]+)"', page))
    written = {f"figures/{p.name}" for p in (tour["out"] / "figures").glob("*.png")}
    assert shown == written
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert f"{len(tour['results']['checks'])} checks pass" in page
    for section in range(1, 9):
        assert f'id="s{section}"' in page


def test_verdicts_fail_when_a_claim_is_broken(tour):
    broken = copy.deepcopy(tour["results"])
    broken["rotation_max_error"] = 1e-3
    broken["comparison"]["self_attention"]["flops_exponent_n"] = 1.8
    broken["comparison"]["rnn"]["path_length_by_n"][-1] += 1
    failed = {c["name"] for c in runner.verdicts(broken) if not c["ok"]}
    assert failed == {
        "6. M_delta P[i] = P[i+delta]",
        "3. Self-attention: FLOPs grow as n^2",
        "3. RNN: maximum path length O(n)",
    }
    broken["checks"] = runner.verdicts(broken)
    assert any(line.startswith("  FAILED: 6.") for line in runner.summary_lines(broken))


def test_an_import_error_in_the_family_is_not_hidden(monkeypatch):
    def missing():
        raise ImportError("cannot import name 'NAMES'")

    monkeypatch.setattr(family, "family_names", missing)
    with pytest.raises(ImportError, match="cannot import name 'NAMES'"):
        runner._family(runner.QUICK, lambda description: None)


def test_unwritable_output_fails_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot write the report"):
        runner.run_tour(blocker / "report", quick=True, progress=False)
    # The command line writes into a hidden folder beside the user's: the error names the user's.
    with pytest.raises(ValueError, match=r"cannot write the report to '[^']*chosen'"):
        runner.run_tour(blocker / ".hidden-tmp", quick=True, progress=False, shown_as=tmp_path / "chosen")


def test_progress_bar_reports_on_stderr(capsys):
    with runner.progress_bar(3, True) as advance:
        for step in range(3):
            advance(f"step {step}")
    assert "3/3" in capsys.readouterr().err
    with runner.progress_bar(3, False) as advance:
        advance("silent")
    assert capsys.readouterr().err == ""


# Section 1 ------------------------------------------------------------------------------------


def test_attention_weights_match_a_naive_masked_softmax():
    from selfattn.attention import MultiHeadAttention
    from selfattn.tour._common import seeded

    data = checks.masked_attention_weights(num_hiddens=8, num_heads=2, num_steps=5, valid_lens=(4, 2), seed=3)
    with seeded(3):  # the same draws as the function: the layer, then the input
        mha = MultiHeadAttention(8, 2)
        X = torch.randn(2, 5, 8)
    with torch.no_grad():
        q = mha.W_q(X).view(2, 5, 2, 4).transpose(1, 2).numpy()
        k = mha.W_k(X).view(2, 5, 2, 4).transpose(1, 2).numpy()
    visible = np.zeros((2, 2, 5, 5), dtype=bool)
    visible[0, ..., :4] = True
    visible[1, ..., :2] = True
    _, expected = naive_attention(q, k, k, visible)
    np.testing.assert_allclose(data["weights"], expected, atol=1e-6)
    assert data["masked_weight_max"] == 0.0
    assert data["row_sum_error"] < 1e-6


def test_self_attention_keeps_the_chapter_shape():
    projections = {key: [100, 100, False] for key in ("W_q", "W_k", "W_v", "W_o")}  # the page's printed module
    assert checks.self_attention_shape() == {
        "shape": [2, 4, 100], "expected": [2, 4, 100], "ok": True, "projections": projections
    }  # fmt: skip


# Section 2 ------------------------------------------------------------------------------------


def test_permutation_check_separates_with_and_without_p():
    data = checks.permutation_check(num_hiddens=16, num_heads=2, num_steps=7, seed=1)
    assert sorted(data["permutation"]) == list(range(7))
    assert data["without_pe_error"] < 1e-13
    assert data["with_pe_change"] > 1e-3


# Sections 4 and 6 -----------------------------------------------------------------------------


def test_columns_and_periods_follow_the_formula():
    columns = checks.table_columns(60, 32, (6, 7, 8, 9)).numpy()
    np.testing.assert_allclose(columns, sinusoidal_numpy(np.arange(60), 32)[:, 6:10], atol=1e-6)
    periods = checks.column_periods(32, (6, 7, 8, 9))
    assert periods == pytest.approx([2 * math.pi * 10000 ** (6 / 32)] * 2 + [2 * math.pi * 10000 ** (8 / 32)] * 2)
    measured = checks.measured_periods(60, 32, (6, 7, 8, 9))
    assert measured["zero_crossings"] == pytest.approx(periods, rel=1e-3)
    assert measured["fft"] == pytest.approx(periods, rel=1e-3)


def test_binary_representations_of_0_to_7():
    assert checks.binary_representations(8) == ["000", "001", "010", "011", "100", "101", "110", "111"]
    assert checks.bit_matrix(8)[5].tolist() == [1, 0, 1]


def test_offset_similarity_is_a_sum_of_cosines():
    data = checks.offset_similarity(num_hiddens=16, starts=(0, 9), max_delta=20)
    table = sinusoidal_numpy(np.arange(40), 16)
    for row, start in enumerate((0, 9)):
        expected = [table[start] @ table[start + delta] for delta in range(21)]
        np.testing.assert_allclose(data["similarity"][row], expected, atol=1e-12)
    assert data["spread"] < 1e-12 and data["closed_form_error"] < 1e-12


def test_rotation_error_is_rounding_only():
    assert checks.rotation_max_error(20, 16, 20) < 1e-12


# Section 5 ------------------------------------------------------------------------------------


def test_absolute_qualities_against_a_naive_loop():
    data = qualities.absolute_position_qualities(num_hiddens=8, num_seen=10, num_positions=40, deltas=(1, 3))
    table = sinusoidal_numpy(np.arange(40), 8)
    naive_min = min(np.linalg.norm(table[i] - table[j]) for i in range(40) for j in range(40) if i != j)
    assert data["min_row_distance"] == pytest.approx(naive_min, abs=1e-12)
    unseen = min(np.linalg.norm(table[i] - table[j]) for i in range(10, 40) for j in range(10))
    assert data["unseen_nearest_distance"] == pytest.approx(unseen, abs=1e-12)
    assert data["max_abs_value"] <= 1.0
    assert data["row_norm_min"] == pytest.approx(2.0) and data["row_norm_max"] == pytest.approx(2.0)  # sqrt(d / 2)
    assert data["offset_distance_spread_max"] < 1e-12
    with pytest.raises(ValueError, match="num_seen"):
        qualities.absolute_position_qualities(num_seen=50, num_positions=50)


def test_textbook_float32_angles_drift_and_ours_do_not():
    data = qualities.table_precision(32, lengths=(60, 10000))
    assert data["textbook_error"][1] > 1e-4
    assert max(data["selfattn_error"]) < 1e-7
    with pytest.raises(ValueError, match="even"):
        qualities.table_precision(33)


# Section 7 ------------------------------------------------------------------------------------


def test_family_measurements_agree_with_each_declared_kind():
    for name in family.family_names():
        data = family.encoding_diagnostics(name, num_steps=10)
        assert data["measured_relative"] == data["is_relative"], name
        assert data["position_scores"].shape == (10, 10)
        np.testing.assert_allclose(data["attention"].sum(-1), 1.0, atol=1e-12)
        if data["is_relative"]:
            assert data["shift_spread"] < 1e-9, name


def test_sinusoidal_position_scores_are_scaled_dot_products():
    data = family.encoding_diagnostics("sinusoidal", num_hiddens=16, num_heads=2, num_steps=12)
    table = sinusoidal_numpy(np.arange(12), 16)
    np.testing.assert_allclose(data["position_scores"], table @ table.T / 4.0, atol=1e-5)


def test_learned_encoding_refuses_positions_past_its_table():
    assert family.encoding_diagnostics("learned", num_steps=8)["far_positions"].startswith("positions 5000")


def test_encoding_table_of_sinusoidal_honours_base_and_offset():
    table = family.encoding_table("sinusoidal", num_steps=5, num_hiddens=6, offset=100, base=50.0, dtype=torch.float64)
    np.testing.assert_allclose(table.numpy(), sinusoidal_numpy(np.arange(100, 105), 6, base=50.0), atol=1e-12)
    assert family.encoding_table("alibi", num_steps=4, num_hiddens=8, num_heads=2).shape == (2, 4, 4)
    with pytest.raises(ValueError, match="offset"):
        family.encoding_table("sinusoidal", num_steps=3, num_hiddens=4, offset=-1)


def test_deep_stack_section_is_measured_for_every_encoding(tour):
    page = (tour["out"] / "report.html").read_text()
    section = page[page.index('id="s8"') :]
    assert "re-inject" not in page and "untrained" in section
    deep = tour["results"]["depth"]
    assert set(deep["untrained"]) == {"none", "sinusoidal", "rotary", "alibi", "t5", "shaw"}
    results = copy.deepcopy(tour["results"])
    results["depth_study"] = {**deep, "trained": deep["untrained"], "config": {**deep["config"], "train_seeds": 2}}
    assert "Trained stacks" in render_report(results, {})


# Claims of the source pages and the report built from them -----------------------------------------


def test_claims_cover_the_five_pages_with_every_field(tour):
    from selfattn.tour.claims import EVIDENCE, PAGES

    found = tour["results"]["claims"]
    assert len(found) >= 40
    assert len({c["id"] for c in found}) == len(found)
    keys = {
        "id",
        "page",
        "also_on",
        "quote",
        "statement",
        "evidence",
        "basis",
        "number",
        "expected",
        "holds",
        "verdict",
    }
    for claim in found:
        assert set(claim) == keys
        assert claim["page"] in PAGES and set(claim["also_on"]) <= set(PAGES) - {claim["page"]}
        assert claim["evidence"] in EVIDENCE and claim["quote"] and claim["statement"]
        if claim["evidence"] == "not shown":
            assert claim["holds"] is None and claim["verdict"] == "not shown"
        elif claim["holds"] is None:  # a timing whose rounds straddle its cut
            assert claim["evidence"] == "measured" and claim["verdict"] == "undecided (noise)", claim["id"]
        if claim["evidence"] != "measured":
            assert claim["basis"], claim["id"]  # derived: from what; not shown: what would show it
    assert {c["page"] for c in found} == set(PAGES)
    assert {c["evidence"] for c in found} >= set(EVIDENCE) - {"not shown"}


def test_the_named_claims_carry_the_corrected_verdict_kind_and_page(tour):
    by_id = {c["id"]: c for c in tour["results"]["claims"]}
    # The note's equality, read as its Taylor term reads f (one value per sentence), holds.
    assert by_id["symmetry"]["holds"] is True and by_id["symmetry"]["evidence"] == "identity"
    # With the layer's own A the cross term is mostly absolute; purely relative only for A = I.
    assert by_id["taylor-relative-term"]["holds"] is False
    # The X[:, :num_hiddens // 2] slice is the summary page's; the tour's own findings are no page's claims.
    assert by_id["odd-width-summary"]["page"] == "summary" and by_id["odd-width-summary"]["holds"] is True
    assert "odd-width-mxnet" not in by_id and "float32-angles" not in by_id and "same-distance-anywhere" not in by_id
    for name in ("cnn-compute", "rnn-compute", "self-attention-compute", "parallelism", "same-distance-across-lengths",
                 "space-efficient"):  # fmt: skip
        assert by_id[name]["evidence"] == "derived", name
    for name in ("attend-by-relative", "shift-by-five", "remember-position", "not-harmful"):
        assert by_id[name]["evidence"] == "measured", name
    # No study in this run: the tour trains its own answers and says so.
    assert by_id["long-range"]["evidence"] == "measured"
    assert tour["results"]["long_range"]["source"] == runner.TOUR_TRAINED
    assert by_id["longer-sentences"]["evidence"] in ("measured", "not shown")  # measured once its model learned
    # Timed on a busy machine, the parallel claims say so instead of reporting the load as a slowdown.
    quiet = tour["results"]["learning"]["parallel"]["quiet"]
    assert (by_id["sequential-prevents-parallel"]["evidence"] == "measured") == quiet


def test_longer_sentences_is_decided_by_a_study(tour):
    results = copy.deepcopy(tour["results"])
    results["study_generalization"] = {
        "folder": "study",
        "train_len": 20,
        "cells": {"copy": {"in": 0.99, "beyond": 0.0}, "reverse": {"in": 0.99, "beyond": 0.02},
                  "addition": {"in": 0.0, "beyond": 0.0}},
    }  # fmt: skip
    longer = next(c for c in claims.claims(results) if c["id"] == "longer-sentences")
    assert longer["evidence"] == "measured" and longer["holds"] is False
    assert set(longer["number"]) == {"copy", "reverse"}  # a task not learned says nothing past its lengths
    results["study_generalization"]["cells"]["copy"]["beyond"] = 0.98
    results["study_generalization"]["cells"]["reverse"]["beyond"] = 0.9
    assert next(c for c in claims.claims(results) if c["id"] == "longer-sentences")["holds"] is True


def test_study_generalization_reads_the_sinusoidal_cells(tmp_path):
    (tmp_path / "results.json").write_text(
        json.dumps(
            {
                "config": {"train_len": 20},
                "runs": [{}, {}],
                "summary": {
                    "copy": {
                        "sinusoidal": {"in_distribution": 0.99, "beyond": 0.01, "below_half_at": 22},
                        "alibi": {"in_distribution": 0.99, "beyond": 0.48, "below_half_at": 47},
                    }
                },
            }
        )
    )
    found = runner.study_generalization(tmp_path)
    assert found["cells"] == {"copy": {"in": 0.99, "beyond": 0.01}} and found["train_len"] == 20
    assert found["by_encoding"]["alibi"] == {"copy": {"in": 0.99, "beyond": 0.48}}
    assert runner.study_generalization(None) is None
    assert runner.study_generalization(tmp_path / "absent") is None


def test_exercises_show_the_studys_learned_and_offset_encodings_past_the_training_lengths(tour):
    results = copy.deepcopy(tour["results"])
    page = render_report(results, {})
    assert "past the training lengths on the tasks each learnt" not in page  # no study, no sentence
    results["study_generalization"] = {
        "folder": "study", "train_len": 20, "cells": {},
        "by_encoding": {"learned": {"copy": {"in": 0.99, "beyond": 0.0}, "sort": {"in": 0.7, "beyond": 0.08}},
                        "shaw": {"copy": {"in": 0.99, "beyond": 0.01}}},
    }  # fmt: skip
    page = render_report(results, {})
    assert "<code>learned</code> on copy 0\u2009%, <code>shaw</code> on copy 1\u2009%" in page
    assert "on sort" not in page  # a task it did not learn says nothing past its lengths


def test_every_quote_is_the_pages_own_words(tour):
    """Each quote occurs in its page (the chapter's folder, when this machine has it)."""
    import pathlib

    folder = pathlib.Path("/work/shared/seeds")
    files = {"chapter": "000_*.md", "note": "001_*.txt", "summary": "002_*.txt", "frameworks": "003_*.txt",
             "slides": "004_*.txt"}  # fmt: skip
    if not all(list(folder.glob(pattern)) for pattern in files.values()):
        pytest.skip("the chapter's source pages are not on this machine")

    def squash(text):
        return re.sub(r"\s+", " ", text)

    pages = {page: squash(next(folder.glob(pattern)).read_text()) for page, pattern in files.items()}
    for claim in tour["results"]["claims"]:
        assert squash(claim["quote"]) in pages[claim["page"]], claim["id"]


def test_claims_do_not_set_the_exit_status_checks_do(tour):
    assert any(c["holds"] is False for c in tour["results"]["claims"])  # the note's "because" of distinct rows
    assert tour["status"] == 0 and all(c["ok"] for c in tour["results"]["checks"])
    assert "monotone-makes-distinct" in tour["stdout"]  # the summary names the claims that do not hold


def test_quick_report_says_it_is_a_smoke_test(tour):
    page = (tour["out"] / "report.html").read_text()
    assert "<h1>Smoke test" in page and "This is a smoke test" in page
    results = copy.deepcopy(tour["results"])
    results["quick"] = False
    assert "Smoke test" not in render_report(results, {})


def test_report_closes_with_one_row_per_claim(tour):
    page = (tour["out"] / "report.html").read_text()
    rows = re.findall(r'<tr id="claim-([^"]+)">', page)
    assert rows == [c["id"] for c in tour["results"]["claims"]]
    assert page.index('id="claims"') > page.index('id="s8"')


def test_report_says_only_what_it_measured(tour):
    page = (tour["out"] / "report.html").read_text()
    assert "lags column 6" not in page and "leads column 6" in page  # the cosine comes first
    assert "the work, not fixed per-call costs" not in page
    offset_only = re.search(r"section 7 measured (.*?) as depending on the offset only", page)
    assert offset_only and "fire" not in offset_only.group(1)  # FIRE is measured as absolute
    assert "keep working past the longest" not in page
    assert "selfattn study" in page  # where generalization is measured instead
    assert "period from zero crossings" in page
    assert "8nd<sup>2</sup>" in page and "(ratio)" in page
    assert re.search(r"\d,\d{3}", page)  # thousands separators


def test_summary_lists_no_position_apart_from_relative(tour):
    text = " ".join(runner.summary_lines(tour["results"]))
    assert "no position: none" in text
    relative = re.search(r"relative \(shift-invariant, position-aware\): ([^;]+);", text)
    assert relative and "none" not in relative.group(1).split(", ")


def test_rich_summary_shows_failed_checks_verbatim(tour):
    from rich.console import Console

    from selfattn.tour.summary import print_summary

    broken = copy.deepcopy(tour["results"])
    broken["rotation_max_error"] = 1e-3
    broken["checks"] = runner.verdicts(broken)
    console = Console(file=io.StringIO(), width=200)
    print_summary(broken, "out/report.html", console=console)
    text = console.file.getvalue()
    assert "FAILED checks" in text and "6. M_delta P[i] = P[i+delta]" in text
    assert f"{len(broken['checks']) - 1}/{len(broken['checks'])} checks pass" in text
