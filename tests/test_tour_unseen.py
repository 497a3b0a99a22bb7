"""The rows of a position table that training never reaches: counted from gradients, and the count can be zero."""

from __future__ import annotations

from selfattn.study.training import StudyConfig
from selfattn.tour import unseen


def test_rows_past_the_training_lengths_get_no_gradient():
    found = unseen.unseen_rows(config=StudyConfig(train_len=4, num_hiddens=16, num_heads=2, num_layers=1))
    assert (found["train_tokens"], found["eval_tokens"]) == (10, 34)  # BOS, 4 (16) tokens, SEP, 4 (16) tokens
    learned, shaw, t5 = (found["encodings"][name] for name in ("learned", "shaw", "t5"))
    # One row per position: the 24 positions past the longest training sequence are never trained.
    assert learned == {"rows_trained": 10, "rows_read": 34, "never_trained": 24, "positions": 34}
    # Shaw clips at the farthest training offset (8 back): every row is trained, but 34 offsets share 9 rows.
    assert shaw == {"rows_trained": 9, "rows_read": 9, "never_trained": 0, "positions": 34}
    assert t5["never_trained"] > 0 and t5["rows_read"] < t5["positions"]


def test_nothing_is_unseen_when_evaluation_stays_within_the_training_lengths():
    found = unseen.unseen_rows(
        config=StudyConfig(train_len=4, eval_factor=1, num_hiddens=16, num_heads=2, num_layers=1)
    )
    assert all(entry["never_trained"] == 0 for entry in found["encodings"].values())
    assert found["encodings"]["learned"]["rows_read"] == found["train_tokens"]
