"""Attention distance and entropy by position, checked on models whose attention is known in closed form."""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.models import TransformerLM
from selfattn.study.attention_use import attention_bands, attention_by_position


def _blind(position: str, heads: int = 2) -> TransformerLM:
    """A model whose queries and keys are zero: its scores are the encoding's bias alone."""
    torch.manual_seed(0)
    model = TransformerLM(16, 8, heads, 2, position=position, max_len=32)
    for block in model.blocks:
        torch.nn.init.zeros_(block.attention.W_q.weight)
        torch.nn.init.zeros_(block.attention.W_k.weight)
    return model


def test_uniform_attention_without_position() -> None:
    length = 12
    measured = attention_by_position(_blind("none"), torch.randint(0, 16, (3, length)))
    assert measured["distance"].shape == (2, 2, length)
    for i in range(length):  # uniform over keys 0..i: mean distance i / 2, entropy log(i + 1)
        torch.testing.assert_close(measured["distance"][:, :, i], torch.full((2, 2), i / 2, dtype=torch.float64))
        torch.testing.assert_close(
            measured["entropy"][:, :, i], torch.full((2, 2), math.log(i + 1), dtype=torch.float64)
        )


def test_alibi_attention_follows_its_slopes() -> None:
    length, heads = 10, 2
    measured = attention_by_position(_blind("alibi", heads), torch.randint(0, 16, (2, length)))
    for h, slope in enumerate([2.0**-4, 2.0**-8]):  # ALiBi's slopes for 2 heads
        for i in range(length):
            weights = [math.exp(-slope * (i - j)) for j in range(i + 1)]
            total = sum(weights)
            p = [w / total for w in weights]
            distance = sum(pj * (i - j) for j, pj in enumerate(p))
            entropy = -sum(pj * math.log(pj) for pj in p)
            assert measured["distance"][0, h, i].item() == pytest.approx(distance, rel=1e-5)
            assert measured["entropy"][1, h, i].item() == pytest.approx(entropy, rel=1e-5)


def test_bands_average_over_heads_and_positions() -> None:
    measured = attention_by_position(_blind("none"), torch.randint(0, 16, (1, 8)))
    rows = attention_bands(measured, [(0, 4), (4, 8)])
    assert rows[1]["distance"] == pytest.approx([sum(i / 2 for i in range(4, 8)) / 4] * 2)
    assert rows[1]["uniform_entropy"] == pytest.approx(sum(math.log(i + 1) for i in range(4, 8)) / 4)
    assert rows[1]["entropy"] == pytest.approx([rows[1]["uniform_entropy"]] * 2)
    with pytest.raises(ValueError, match=r"band \[4, 9\) must lie in \[0, 8\]"):
        attention_bands(measured, [(4, 9)])
    with pytest.raises(ValueError, match="model must be a TransformerLM, got Linear"):
        attention_by_position(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))  # type: ignore[arg-type]


def test_text_runs_record_attention_past_l_and_the_table_shows_it() -> None:
    from selfattn.study.attention_use import attention_on_text
    from selfattn.study.text_tables import attention_table, summarize_attention

    model, data = _blind("none"), torch.randint(0, 16, (64,))
    bands = attention_on_text(model, data, 32, 8, windows=2)
    assert [(b["start"], b["stop"]) for b in bands] == [(0, 8), (8, 16), (16, 32)]
    # Uniform attention: the entropy equals the uniform ceiling in every band, past L included.
    assert bands[2]["entropy"] == pytest.approx([bands[2]["uniform_entropy"]] * 2)
    runs = [{"encoding": "none", "attention": bands}, {"encoding": "none", "attention": bands}]
    table = "\n".join(attention_table(summarize_attention(runs)))
    assert f"16-32 ({bands[2]['uniform_entropy']:.2f})" in table
    assert f"| none | 1.8 ± 0.0 / {bands[0]['entropy'][0]:.2f} ± 0.00 |" in table  # two equal seeds: no spread
    with pytest.raises(ValueError, match="data holds 64 bytes; 3 windows of 32 need 96"):
        attention_on_text(model, data, 32, 8, windows=3)
