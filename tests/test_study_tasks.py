"""Task generators against hand-written examples, the batch layout, and the exact-match metric."""

from __future__ import annotations

import pytest
import torch

from selfattn.study.tasks import (
    ALPHABET,
    BOS,
    DIGIT0,
    PAD,
    PLUS,
    SEP,
    TASKS,
    VOCAB_SIZE,
    WRITE0,
    decode,
    get_task,
    make_batch,
)
from selfattn.study.training import exact_match, token_accuracy


def _digits(*values: int) -> torch.Tensor:
    return torch.tensor([values]) + DIGIT0


def test_tasks_on_hand_written_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([[3, 1, 4, 1, 5]])
    y = torch.tensor([[9, 2, 6, 5, 3]])
    draws = iter([x, y])
    monkeypatch.setattr("selfattn.study.tasks._digits", lambda b, n, g: next(draws))
    monkeypatch.setattr("selfattn.study.tasks._symbols", lambda b, n, g: next(draws))
    g = torch.Generator()
    inputs, answer = TASKS["copy"].draw(1, 5, g)
    assert decode(torch.cat([inputs[0], torch.tensor([SEP]), answer[0]])) == "3 1 4 1 5 | 3 1 4 1 5"
    draws = iter([x])
    assert torch.equal(TASKS["reverse"].draw(1, 5, g)[1], _digits(5, 1, 4, 1, 3))
    draws = iter([x])
    assert torch.equal(TASKS["sort"].draw(1, 5, g)[1], _digits(1, 1, 3, 4, 5))
    # 51413 + 35629 = 87042, digits least significant first: 3 1 4 1 5 + 9 2 6 5 3 -> 2 4 0 7 8 0
    draws = iter([x, y])
    inputs, answer = TASKS["addition"].draw(1, 5, g)
    assert torch.equal(inputs, torch.cat([_digits(3, 1, 4, 1, 5), torch.tensor([[PLUS]]), _digits(9, 2, 6, 5, 3)], 1))
    assert torch.equal(answer, _digits(2, 4, 0, 7, 8, 0))
    assert decode(inputs[0]) == "3 1 4 1 5 + 9 2 6 5 3"


def test_addition_and_sort_agree_with_python_on_random_draws() -> None:
    g = torch.Generator().manual_seed(0)
    inputs, answer = TASKS["addition"].draw(50, 7, g)
    for row, out in zip(inputs - DIGIT0, answer - DIGIT0, strict=True):
        a = int("".join(map(str, row[:7].flip(0).tolist())))
        b = int("".join(map(str, row[8:].flip(0).tolist())))
        assert int("".join(map(str, out.flip(0).tolist()))) == a + b
    inputs, answer = TASKS["sort"].draw(20, 9, g)
    assert all(sorted(i.tolist()) == a.tolist() for i, a in zip(inputs, answer, strict=True))
    assert int(inputs.max()) == DIGIT0 + ALPHABET - 1  # the whole alphabet
    inputs, _ = TASKS["addition"].draw(20, 9, g)
    assert int(inputs[:, :9].max()) <= DIGIT0 + 9


def test_flip_flop_hand_written_and_random() -> None:
    g = torch.Generator().manual_seed(0)
    inputs, answer = TASKS["flipflop"].draw(200, 6, g)
    ops = inputs - WRITE0
    assert bool((ops[:, 0] < 2).all())
    for row, a in zip(ops.tolist(), answer[:, 0].tolist(), strict=True):
        last = [op for op in row if op < 2][-1]
        assert a - DIGIT0 == last


def test_make_batch_layout_and_targets() -> None:
    task = get_task("copy")
    tokens, targets, valid = make_batch(task, [2, 3], torch.Generator().manual_seed(0))
    assert tokens.shape == (2, 8) and valid.tolist() == [6, 8]
    assert tokens[:, 0].tolist() == [BOS, BOS]
    assert tokens[0, 3] == SEP and tokens[1, 4] == SEP and tokens[0, 6:].tolist() == [PAD, PAD]
    # Position t predicts token t + 1, only over the answer.
    assert targets[1].tolist() == [-100, -100, -100, -100, *tokens[1, 5:8].tolist(), -100]
    assert targets[0].tolist() == [-100, -100, -100, *tokens[0, 4:6].tolist(), -100, -100, -100]
    assert torch.equal(tokens[1, 1:4], tokens[1, 5:8])
    assert decode(tokens[0, :6]).startswith("^ ")


def test_generators_are_seeded() -> None:
    first = make_batch(get_task("sort"), [5] * 4, torch.Generator().manual_seed(7))[0]
    again = make_batch(get_task("sort"), [5] * 4, torch.Generator().manual_seed(7))[0]
    other = make_batch(get_task("sort"), [5] * 4, torch.Generator().manual_seed(8))[0]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_exact_match_always_right_and_always_wrong() -> None:
    _, targets, _ = make_batch(get_task("reverse"), [1, 4, 6], torch.Generator().manual_seed(1))
    answer_only = targets.clamp(min=0)
    right = torch.nn.functional.one_hot(answer_only, VOCAB_SIZE).float()  # (b, l, v): argmax is the target everywhere
    assert exact_match(right, targets).tolist() == [1.0, 1.0, 1.0]
    wrong = torch.nn.functional.one_hot((answer_only + 1) % VOCAB_SIZE, VOCAB_SIZE).float()
    assert exact_match(wrong, targets).tolist() == [0.0, 0.0, 0.0]
    # One wrong token spoils its sample only; positions outside the answer do not count.
    one_off = right.clone()
    one_off[1, 6] = wrong[1, 6]
    one_off[2, 0] = wrong[2, 0]
    assert exact_match(one_off, targets).tolist() == [1.0, 0.0, 1.0]
    # Token accuracy: the same cases, counted per answer token (lengths 1, 4 and 6 here).
    assert token_accuracy(right, targets).tolist() == [1.0, 1.0, 1.0]
    assert token_accuracy(wrong, targets).tolist() == [0.0, 0.0, 0.0]
    assert token_accuracy(one_off, targets).tolist() == pytest.approx([1.0, 3 / 4, 1.0])
    with pytest.raises(ValueError, match="must share"):
        token_accuracy(right[:, :-1], targets)


def test_errors() -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        get_task("parity")
    with pytest.raises(ValueError, match="lengths must not be empty"):
        make_batch(get_task("copy"), [], torch.Generator())
    with pytest.raises(ValueError, match="length must be a positive integer, got 0"):
        make_batch(get_task("copy"), [0], torch.Generator())
    with pytest.raises(ValueError, match="must share"):
        exact_match(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
