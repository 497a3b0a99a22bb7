"""The task readings of context use: answer tokens right by position, with the whole sample and with a window.

Two models built here fix what the readings must find: one that predicts from the last token
alone (a window changes nothing), and a copy oracle that counts from the sample's start (right
on every answer token with the whole sample, wrong wherever a window cuts the start off). A
plain loop over every answer token and its window is the reference for the batched windows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfattn.study.answer_use import (
    answer_accuracy_by_position,
    answer_bands,
    answer_use,
    summarize_answer_use,
)
from selfattn.study.tasks import BOS, SEP, VOCAB_SIZE, get_task, make_batch


class _OneHot(nn.Module):
    """Logits that put all their mass on ``choose(tokens)``: ``(b, l) -> (b, l, v)``."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # the readings ask a parameter for the device

    def choose(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(self.choose(tokens), VOCAB_SIZE).float() + self.anchor


class EchoModel(_OneHot):
    """Predicts the token it reads: position-free, it looks at nothing before the last token."""

    def choose(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


class CopyOracle(_OneHot):
    """Copy solved by counting from the start: at column ``t >= s`` (``s`` the first SEP) it predicts ``tokens[t - s + 1]``."""

    def choose(self, tokens: torch.Tensor) -> torch.Tensor:
        l = tokens.shape[1]
        sep = (tokens == SEP).int().argmax(dim=1)  # (b,): the first SEP's column (0 where there is none)
        columns = torch.arange(l)[None, :]  # (1, l)
        source = (columns - sep[:, None] + 1).clamp(0, l - 1)  # (b, l)
        return torch.where(columns >= sep[:, None], tokens.gather(1, source), tokens)


def _loop_window(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, window: int) -> torch.Tensor:
    """Per answer token, right or wrong from BOS + its last window - 1 tokens: one forward per token and sample."""
    scored = (targets[0] != -100).nonzero().flatten().tolist()
    right = torch.zeros(len(scored))
    for i, t in enumerate(scored):
        for row in range(tokens.shape[0]):
            context = tokens[row, : t + 1] if t < window else tokens[row, t - window + 2 : t + 1]
            if t >= window:
                context = torch.cat([torch.tensor([BOS]), context])
            right[i] += float(model(context[None])[0, -1].argmax() == targets[row, t])
    return right / tokens.shape[0]


def _batch(task: str, n: int, samples: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets, _ = make_batch(get_task(task), [n] * samples, torch.Generator().manual_seed(n))
    return tokens, targets


@pytest.mark.parametrize(("task", "n", "window"), [("copy", 9, 10), ("reverse", 13, 10), ("copy", 4, 10)])
def test_batched_windows_equal_a_loop_over_each_answer_token(task: str, n: int, window: int) -> None:
    tokens, targets = _batch(task, n)
    for model in (EchoModel(), CopyOracle()):
        batched = answer_accuracy_by_position(model, tokens, targets, window=window)
        torch.testing.assert_close(batched, _loop_window(model, tokens, targets, window), rtol=0, atol=0)


def test_a_model_that_reads_only_the_last_token_reads_the_same_through_a_window() -> None:
    use = answer_use(EchoModel(), get_task("copy"), train_len=4, eval_len=16, samples=8,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert use["window"] == 10  # BOS, 4 inputs, SEP, 4 answer tokens
    assert use["bands"] == [[1, 2], [3, 4], [5, 8], [9, 16]]
    assert use["far_full"] == use["far_window"] and None not in use["far_full"][:3]
    assert use["far_full"][3] is None  # answer positions 9-16 exist only past 2L, where a window cuts off the source


def test_a_model_that_counts_from_the_start_loses_its_answers_to_a_window() -> None:
    use = answer_use(CopyOracle(), get_task("copy"), train_len=4, eval_len=16, samples=8,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert use["in_range"][:2] == [1.0, 1.0] and use["full"] == [1.0, 1.0, 1.0, 1.0]
    assert use["far_full"] == [1.0, 1.0, 1.0, None]
    assert all(window < 0.5 for window in use["far_window"][:3])  # chance is 1 in 10 symbols


def test_the_same_samples_feed_both_readings() -> None:
    """Two calls on one seed give one result; a window no shorter than every sample gives the whole-sample reading."""
    tokens, targets = _batch("reverse", 7)
    whole = answer_accuracy_by_position(CopyOracle(), tokens, targets)
    wide = answer_accuracy_by_position(CopyOracle(), tokens, targets, window=tokens.shape[1])
    assert torch.equal(whole, wide)
    first = answer_use(CopyOracle(), get_task("copy"), train_len=3, eval_len=9, samples=4,
                       generator=torch.Generator().manual_seed(5))  # fmt: skip
    second = answer_use(CopyOracle(), get_task("copy"), train_len=3, eval_len=9, samples=4,
                        generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert first == second


def test_answer_bands_halve_l_then_double_it() -> None:
    assert answer_bands(20, 80) == [(1, 10), (11, 20), (21, 40), (41, 80)]
    assert answer_bands(4, 8) == [(1, 2), (3, 4), (5, 8)]
    assert answer_bands(1, 3) == [(1, 1), (2, 2), (3, 3)]


def test_the_summary_gives_each_band_an_interval_over_seeds() -> None:
    runs = [
        {"answer_use": {"window": 10, "bands": [[1, 2], [3, 4]], "in_range": [1.0, None],
                        "full": [0.5, 0.25], "far_full": [0.5, None], "far_window": [0.75, None]}},
        {"answer_use": {"window": 10, "bands": [[1, 2], [3, 4]], "in_range": [1.0, None],
                        "full": [0.7, 0.35], "far_full": [0.7, None], "far_window": [0.65, None]}},
        {"answer_use": None},
    ]  # fmt: skip
    summary = summarize_answer_use(runs)
    assert summary is not None and summary["seeds"] == 2 and summary["window"] == 10
    assert summary["full"][0]["mean"] == pytest.approx(0.6) and summary["full"][1]["mean"] == pytest.approx(0.3)
    assert summary["far_window"][1] is None and summary["in_range"][1] is None and summary["far_gain"][1] is None
    assert summary["full"][0]["half_width"] == pytest.approx(12.706 * 0.1)  # t(1) * sd / sqrt(2), sd = 0.1 * sqrt(2)
    gain = summary["far_gain"][0]  # per seed -0.25 and +0.05: paired, not the difference of two means' intervals
    assert gain["mean"] == pytest.approx(-0.1) and gain["sd"] == pytest.approx(0.3 / 2**0.5)
    assert summarize_answer_use([{"answer_use": None}, {}]) is None


def test_bad_arguments_are_refused() -> None:
    tokens, targets = _batch("copy", 5)
    with pytest.raises(ValueError, match="window must hold BOS and at least one token, got 1"):
        answer_accuracy_by_position(EchoModel(), tokens, targets, window=1)
    with pytest.raises(ValueError, match="window must be a positive integer"):
        answer_accuracy_by_position(EchoModel(), tokens, targets, window=0)
    mixed_tokens, mixed_targets, _ = make_batch(get_task("copy"), [3, 5], torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one answer span"):
        answer_accuracy_by_position(EchoModel(), mixed_tokens, mixed_targets)
    with pytest.raises(ValueError, match="one answer span"):
        answer_accuracy_by_position(EchoModel(), tokens, targets[:, :-1])
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="eval_len=4 must exceed train_len=4"):
        answer_use(EchoModel(), get_task("copy"), train_len=4, eval_len=4, samples=2, generator=generator)
    with pytest.raises(ValueError, match="samples must be a positive integer"):
        answer_use(EchoModel(), get_task("copy"), train_len=4, eval_len=8, samples=0, generator=generator)
