"""Each claim the tour labels ``measured`` changes its verdict when the experiment changes (issue 34).

A claim is ``measured`` when the run could have found otherwise without a bug in the code: its data, its model or its
setting decides the outcome. For each, the experiment runs at a tiny size as the tour runs it, then once changed (P
scaled down, embeddings smaller than P, a convolution of width 1, an offset past the encodings' reach, ...), and the
claim is built from both runs by the tour's own claim functions: the verdict differs. The offset claims, the timed
claims, quadratic-slow, not-harmful and symmetry-broken are shown the same way in other files (``COVERED_ELSEWHERE``);
test_tour_labels.py checks that every measured claim of a run is in ``COVERED``.
"""

from __future__ import annotations

import pytest
import torch

from selfattn.functional import sinusoidal_table
from selfattn.study.long_range import summarize_by_distance
from selfattn.tour import checks, embedding, exercises, taylor
from selfattn.tour.claims import code, comparison, note, positions

COVERED_ELSEWHERE = {
    **dict.fromkeys(
        ("attend-by-relative", "shift-by-five", "remember-position", "inject-position"),
        "test_tour_learning.py::test_the_offset_claims_fail_when_p_is_scaled_down_to_a_twentieth",
    ),
    "sequential-prevents-parallel": "test_tour_labels.py::test_a_timing_whose_rounds_straddle_the_cut_decides_nothing",
    "both-parallel": "test_tour_labels.py::test_a_timing_whose_rounds_straddle_the_cut_decides_nothing",
    "fully-parallel": "test_tour_labels.py::test_one_number_gets_one_decision_in_every_claim",
    "quadratic-slow": "test_tour_labels.py::test_quadratic_slow_is_undecided_when_the_rounds_disagree",
    "not-harmful": "test_tour_learning.py::test_adding_p_costs_nothing_on_a_task_without_position_unless_p_drowns_"
    "the_tokens",
    "symmetry-broken": "test_tour_labels.py::test_symmetry_is_broken_by_different_rows_only",
}
COVERED_HERE = (
    "embeddings-survive", "absolute-term", "taylor-relative-term", "no-position-unlike-cnn-rnn", "longer-sentences", "exercise-learnable",
    "exercise-offsets", "exercise-deep-stack", "long-range",
)  # fmt: skip
COVERED = set(COVERED_HERE) | set(COVERED_ELSEWHERE)


def _by_id(found):
    return {c["id"]: c for c in found}


def test_embeddings_survive_fails_for_embeddings_smaller_than_p():
    sizes = {"sizes": (64,), "vocabulary": 64, "num_positions": 16}
    before = note._embeddings_survive(embedding.embedding_survival(**sizes))
    after = note._embeddings_survive(embedding.embedding_survival(**sizes, scale=0.1))  # N(0, 0.1^2) entries
    assert before["holds"] is True and after["holds"] is False, after["number"]


def test_the_absolute_term_carries_no_position_when_every_row_of_p_is_the_same():
    before = _by_id(note._score_claims(taylor.score_terms(16, num_steps=20)))
    same_rows = taylor.score_terms(16, num_steps=20, encoding=lambda n, d: torch.ones(n, d))
    after = _by_id(note._score_claims(same_rows))
    assert before["absolute-term"]["holds"] is True and after["absolute-term"]["holds"] is False
    assert same_rows["content_position_shift_change"] == 0.0


def test_the_relative_term_is_mostly_relative_only_for_a_model_whose_a_is_the_identity():
    terms = taylor.score_terms(16, num_steps=20)
    before = _by_id(note._score_claims(terms))["taylor-relative-term"]
    # The model changed: W_q' W_k = I, so the cross term is P P' (what the note's argument assumes).
    P = sinusoidal_table(20, 16, dtype=torch.float64)
    changed = dict(terms, position_position_relative_share=taylor._offset_share(P @ P.T))
    after = _by_id(note._score_claims(changed))["taylor-relative-term"]
    assert before["holds"] is False and after["holds"] is True


def test_a_convolution_of_width_one_ignores_order_like_self_attention():
    results = {"permutation": {"without_pe_error": 0.0}, "learning": {"order": checks.order_sensitivity()}}
    before = _by_id(positions._order_claims(results))["no-position-unlike-cnn-rnn"]
    results["learning"]["order"] = checks.order_sensitivity(kernel_size=1)  # reads no neighbour
    after = _by_id(positions._order_claims(results))["no-position-unlike-cnn-rnn"]
    assert before["holds"] is True and after["holds"] is False


@pytest.fixture(scope="module")
def by_length():
    return exercises.encodings_by_length(train_steps=150, eval_samples=64)


def test_trained_encodings_beat_chance_and_only_the_offsets_carry_past_the_training_length(by_length):
    chance = by_length["chance"]
    for name in exercises.ENCODINGS:
        assert by_length["encodings"][name]["by_length"]["16"]["all"] > chance + 0.5, name  # it trained
    assert by_length["encodings"]["learned"]["by_length"]["32"]["past_train_len"] < chance + 0.15  # untrained rows
    assert by_length["encodings"]["shaw"]["by_length"]["32"]["past_train_len"] > 0.8
    with pytest.raises(ValueError, match="delta must be in"):
        exercises.encodings_by_length(delta=16)
    with pytest.raises(ValueError, match="eval_lens must be at least train_len"):
        exercises.encodings_by_length(eval_lens=(8,))
    with pytest.raises(ValueError, match="encodings must be among"):
        exercises.encodings_by_length(encodings=("alibi",))


def test_the_learnable_encoding_claim_needs_the_table_trained(by_length):
    before = _by_id(code._encoding_exercises(by_length))["exercise-learnable"]
    short = exercises.encodings_by_length(train_steps=10, eval_samples=64, encodings=("learned",))
    after = _by_id(
        code._encoding_exercises(dict(by_length, encodings={**by_length["encodings"], **short["encodings"]}))
    )
    assert before["holds"] is True and after["exercise-learnable"]["holds"] is False


def test_embeddings_by_offset_fail_for_an_offset_past_their_reach(by_length):
    before = _by_id(code._encoding_exercises(by_length))["exercise-offsets"]
    # Copy 10 back: past Shaw's clip (8), and inside one of T5's log buckets with its neighbours.
    far = exercises.encodings_by_length(train_steps=150, eval_samples=64, delta=10, encodings=("shaw", "t5"))
    changed = dict(by_length, encodings={**by_length["encodings"], **far["encodings"]})
    after = _by_id(code._encoding_exercises(changed))["exercise-offsets"]
    assert before["holds"] is True and after["holds"] is False, after["number"]


def test_longer_sentences_is_decided_only_by_a_model_that_learned_its_task(by_length):
    before = note._longer_sentences({}, {"by_length": by_length})
    short = exercises.encodings_by_length(train_steps=5, eval_samples=64, encodings=("sinusoidal",))
    after = note._longer_sentences({}, {"by_length": short})
    assert before["evidence"] == "measured" and before["holds"] is False  # P learned the task, yet fails past it
    assert after["evidence"] == "not shown" and after["holds"] is None


def test_the_long_range_claim_is_undecided_when_every_answer_is_near():
    found = exercises.long_range(distances=(2, 8), budget=100, max_steps=100)
    before = comparison.long_range_claim(found)
    # The same runs at distance 2 only: every model reaches the target within a check of the others.
    near = [run for run in found["runs"] if run["distance"] == 2]
    after = comparison.long_range_claim(dict(found, runs=near, by_distance=summarize_by_distance(near)))
    assert before["holds"] is True and after["holds"] is False, after["number"]


def test_the_deep_stack_answer_does_not_hold_for_a_stack_of_one_layer():
    deep = exercises.deep_stacks(depths=(4,), max_steps=60, check_every=20)
    before = code._deep_stack_exercise(deep)
    shallow = exercises.deep_stacks(depths=(1,), max_steps=60, check_every=20)  # one block: no depth to suffer
    after = code._deep_stack_exercise(shallow)
    assert before["holds"] is True and after["holds"] is False, after["number"]
