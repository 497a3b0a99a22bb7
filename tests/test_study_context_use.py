"""The context-use readings: by position, truncated context, context gain and token-by-token decoding.

Two models built here fix what the readings must find: one whose prediction depends on the last
``WIDTH`` bytes only (truncating to ``context >= WIDTH`` changes nothing), and one that averages
every byte before it (truncating changes every prediction past ``context``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfattn.models import TransformerLM
from selfattn.study.context_use import (
    context_gain,
    nll_by_position,
    nll_token_by_token,
    position_bands,
    truncated_context_nll,
)

VOCAB = 11
WIDTH = 3


class LocalWindowModel(nn.Module):
    """Logits at ``t`` from bytes ``t - width + 1 .. t`` only: a causal convolution, position-free."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.width = width
        self.embedding = nn.Embedding(VOCAB, 8)
        self.conv = nn.Conv1d(8, 8, width)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens).transpose(1, 2)  # (w, 8, l)
        x = nn.functional.pad(x, (self.width - 1, 0))  # causal: position t sees t - width + 1 .. t
        return self.out(torch.tanh(self.conv(x)).transpose(1, 2))  # (w, l, v)


class RunningMeanModel(nn.Module):
    """Logits at ``t`` from the mean of the embeddings of bytes ``0 .. t``: every earlier byte counts."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (w, l, 8)
        counts = torch.arange(1, tokens.shape[1] + 1, dtype=x.dtype)[:, None]
        return self.out(x.cumsum(dim=1) / counts)


@pytest.fixture
def data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (4 * 24 + 1,), generator=generator)


def _reference_truncated(model: nn.Module, data: torch.Tensor, length: int, context: int, t: int) -> torch.Tensor:
    """The loss of position ``t`` of each window, from a window of its last ``context`` bytes: a plain loop."""
    losses = []
    for start in range(0, len(data) - 1, length):
        first = max(start, start + t - context + 1)
        window = data[first : start + t + 1].long()[None]
        logits = model(window)[0, -1].double()
        losses.append(-torch.log_softmax(logits, dim=-1)[data[start + t + 1]])
    return torch.stack(losses)


@torch.no_grad()
@pytest.mark.parametrize("stride", [1, 2])
def test_truncated_equals_full_for_a_model_that_ignores_distant_bytes(data: torch.Tensor, stride: int) -> None:
    torch.manual_seed(1)
    model = LocalWindowModel()
    full = nll_by_position(model, data, 24, 96)
    short = truncated_context_nll(model, data, 24, 96, context=WIDTH + stride - 1, scored_from=4, stride=stride)
    assert short[:, :4].isnan().all()
    torch.testing.assert_close(short[:, 4:], full[:, 4:], rtol=0, atol=1e-12)
    rows = context_gain(full, short, position_bands(24, 8))
    assert rows and all(abs(row["gain"]) < 1e-12 for row in rows)


@torch.no_grad()
def test_truncated_differs_for_a_model_that_uses_every_byte(data: torch.Tensor) -> None:
    torch.manual_seed(1)
    model = RunningMeanModel().double()  # float32 matrix products differ with the batch's layout on some CPUs
    full = nll_by_position(model, data, 24, 96)
    short = truncated_context_nll(model, data, 24, 96, context=6, scored_from=6)
    # Positions up to 5 have at most 6 bytes of context: truncation to 6 removes nothing there.
    assert short[:, :6].isnan().all()
    assert (short[:, 6:] - full[:, 6:]).abs().amin(dim=0).gt(1e-6).all()
    for t in (6, 13, 23):
        torch.testing.assert_close(short[:, t], _reference_truncated(model, data, 24, 6, t), rtol=0, atol=1e-10)
    bands = context_gain(full, short, [(6, 16), (16, 24)])
    assert [row["windows"] for row in bands] == [4, 4]
    assert all(row["gain"] != 0.0 for row in bands)


@torch.no_grad()
def test_a_sample_of_windows_and_of_positions_scores_the_same_bytes(data: torch.Tensor) -> None:
    """``starts`` picks windows anywhere in the data; ``every`` scores every k-th position, each from its last bytes."""
    torch.manual_seed(1)
    model = RunningMeanModel()
    full = nll_by_position(model, data, 24, 96)  # windows at 0, 24, 48, 72
    picked = nll_by_position(model, data, 24, 48, starts=[72, 24])
    torch.testing.assert_close(picked, full[[3, 1]], rtol=0, atol=1e-12)
    inside = nll_by_position(model, data, 24, 24, starts=[10])  # a window not on the grid: data[10:34]
    torch.testing.assert_close(inside, nll_by_position(model, data[10:], 24, 24), rtol=0, atol=1e-12)
    every = truncated_context_nll(model, data, 24, 96, context=6, scored_from=6, every=5)
    short = truncated_context_nll(model, data, 24, 96, context=6, scored_from=6)
    columns = [6, 11, 16, 21]
    torch.testing.assert_close(every[:, columns], short[:, columns], rtol=0, atol=1e-12)
    others = [t for t in range(24) if t not in columns]
    assert every[:, others].isnan().all()
    sampled = truncated_context_nll(model, data, 24, 48, context=6, scored_from=6, every=5, starts=[72, 24])
    torch.testing.assert_close(sampled[:, columns], short[[3, 1]][:, columns], rtol=0, atol=1e-12)
    bands = context_gain(full, every, [(6, 16), (16, 24)])
    assert [row["windows"] for row in bands] == [4, 4]


def test_position_bands_cut_at_the_training_length() -> None:
    assert position_bands(1024, 64) == [(0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512), (512, 1024)]
    assert position_bands(100, 48) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 100)]
    assert position_bands(8, 8) == [(0, 8)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": 0}, "context must be a positive int"),
        ({"context": 4, "stride": 5}, "stride=5 must be at most context=4"),
        ({"context": 4, "scored_from": 24}, r"scored_from must lie in \[0, length=24\), got 24"),
        ({"context": 4, "stride": 2, "every": 3}, "give stride=2 or every=3, not both"),
        ({"context": 4, "every": 0}, "every must be a positive int"),
    ],
)
def test_truncated_context_refuses_bad_settings(data: torch.Tensor, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        truncated_context_nll(LocalWindowModel(), data, 24, 96, **kwargs)


def test_windows_refuse_bad_lengths(data: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="tokens=90 must be a multiple of length=24"):
        nll_by_position(LocalWindowModel(), data, 24, 90)
    with pytest.raises(ValueError, match="data holds 97 bytes; 193 are needed"):
        nll_by_position(LocalWindowModel(), data, 24, 192)
    with pytest.raises(ValueError, match=r"starts must give tokens // length = 2 windows, got 1"):
        nll_by_position(LocalWindowModel(), data, 24, 48, starts=[0])
    with pytest.raises(ValueError, match=r"every window of 24 bytes .* must lie in the 97 bytes of data"):
        nll_by_position(LocalWindowModel(), data, 24, 48, starts=[0, 73])
    with pytest.raises(ValueError, match="every window of 24 bytes"):
        nll_by_position(LocalWindowModel(), data, 24, 48, starts=[-1, 0])
    with pytest.raises(ValueError, match="model must have make_caches"):
        nll_token_by_token(LocalWindowModel(), data, 24, 96)
    with pytest.raises(ValueError, match="full and truncated must have one shape"):
        context_gain(torch.zeros(2, 3), torch.zeros(2, 4), [(0, 3)])


def _rotary_lm(scaling: dict[str, object] | None) -> TransformerLM:
    torch.manual_seed(3)
    options = {} if scaling is None else {"scaling": scaling}
    return TransformerLM(VOCAB, 16, 2, 1, position="rotary", max_len=8, ffn_hiddens=32, position_options=options)


@torch.no_grad()
def test_token_by_token_equals_one_pass_without_length_dependent_scaling(data: torch.Tensor) -> None:
    model = _rotary_lm(None).double()
    torch.testing.assert_close(
        nll_token_by_token(model, data, 24, 96), nll_by_position(model, data, 24, 96), rtol=0, atol=1e-10
    )


@torch.no_grad()
def test_dynamic_scaling_token_by_token_follows_the_current_length(data: torch.Tensor) -> None:
    """Position ``t`` scored one byte at a time equals a one-pass window of ``t + 1`` bytes, not of 24."""
    model = _rotary_lm({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}).double()
    step = nll_token_by_token(model, data, 24, 96)
    whole = nll_by_position(model, data, 24, 96)
    for t in (3, 7, 8, 15, 23):
        prefix = truncated_context_nll(model, data, 24, 96, context=24, scored_from=t, stride=1)[:, t]
        torch.testing.assert_close(step[:, t], prefix, rtol=0, atol=1e-10)
    # One pass gives every position the factor of length 24; only the last position has that length
    # token by token (position 0 sees itself alone, where no rotation matters).
    assert (step[:, 1:23] - whole[:, 1:23]).abs().amax(dim=0).gt(1e-8).all()
    torch.testing.assert_close(step[:, [0, 23]], whole[:, [0, 23]], rtol=0, atol=1e-10)


@torch.no_grad()
def test_the_sliding_window_reading_sees_from_half_of_l_to_all_of_it(data: torch.Tensor) -> None:
    """The study's third reading: windows of L moved L / 2 at a time, each byte past L predicted from between
    L / 2 + 1 and L bytes. A model that reads the last WIDTH = L / 2 + 1 bytes gains nothing from the whole
    window; one that reads every byte does."""
    from dataclasses import replace

    from selfattn.study.text import QUICK_TEXT, evaluate_context_gain

    config = replace(QUICK_TEXT, train_len=4, eval_factors=(1, 2, 4), eval_tokens=64)
    assert config.sliding_stride == 2 and config.train_len - config.sliding_stride + 1 == WIDTH
    torch.manual_seed(1)
    local = evaluate_context_gain(LocalWindowModel(), data, config, sliding=True)
    assert [(row["start"], row["stop"]) for row in local] == [(4, 16)]  # the band past L
    assert all(abs(row["gain"]) < 1e-12 for row in local)
    torch.manual_seed(1)
    every_byte = evaluate_context_gain(RunningMeanModel(), data, config, sliding=True)
    assert len(every_byte) == 1 and abs(every_byte[0]["gain"]) > 1e-6
    # A model that reads exactly L bytes: the last-L reading finds no gain, the sliding one (some bytes see L / 2 + 1)
    torch.manual_seed(1)
    whole_l = LocalWindowModel(width=config.train_len)
    assert abs(evaluate_context_gain(whole_l, data, config)[0]["gain"]) < 1e-12
    assert abs(evaluate_context_gain(whole_l, data, config, sliding=True)[0]["gain"]) > 1e-6
