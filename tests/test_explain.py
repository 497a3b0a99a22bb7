"""``explain`` for a person: the route in words, why, its cost, and the declined routes only on request."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from selfattn import MultiHeadAttention
from selfattn.core import dispatch
from selfattn.core.explanation import ROUTE_NOTES, ROUTES_PAGE, Explanation, route_anchor
from selfattn.functional import explain
from selfattn.functional._attention import describe_attention
from selfattn.positional import build

ROOT = Path(__file__).resolve().parents[1]


def test_a_plain_call_is_a_few_lines_without_the_declined_routes() -> None:
    q = torch.randn(1, 2, 64, 16)
    explanation = explain(q, q, q, causal=True)
    text = str(explanation)
    assert explanation.route == "fused"
    assert text.splitlines()[0] == "route: fused: PyTorch's fused kernel, scaled_dot_product_attention"
    assert "why: " in text and f"more: {ROUTES_PAGE}#fused" in text
    before = len(dispatch.ROUTES) - 1  # fused is the last route
    assert len(text.splitlines()) <= 6 and "\n  " not in text  # no list of the routes that declined
    assert f"{before} routes before it declined: .describe(verbose=True) says why" in text


def test_verbose_lists_every_declined_route_with_its_reason() -> None:
    q = torch.randn(1, 2, 64, 16)
    explanation = explain(q, q, q, verbose=True)
    listed = [line.strip().split(": ", 1) for line in str(explanation).splitlines() if line.startswith("  ")]
    assert [tuple(pair) for pair in listed] == list(explanation.declined)
    assert explanation.describe(verbose=True) == str(explanation)
    assert explain(q, q, q).describe(verbose=True) == str(explanation)


def test_functional_explain_takes_attentions_arguments_and_agrees_with_the_dispatcher() -> None:
    q = torch.randn(1, 2, 8, 4)
    for options in ({}, {"return_weights": True}, {"dropout_p": 0.1}, {"causal": True, "softcap": 5.0}):
        assert explain(q, q, q, **options).route == dispatch.explain(describe_attention(q, q, q, **options)).route
    with pytest.raises(TypeError, match="unexpected keyword arguments window"):
        explain(q, q, q, window=4)


def test_the_cost_of_the_explicit_route_counts_the_weights() -> None:
    q = torch.randn(2, 4, 128, 8)
    explanation = explain(q, q, q, return_weights=True)
    assert explanation.route == "explicit"
    assert "holds the (2, 4, 128, 128) weights, 512.0 KiB" in explanation.cost  # 2*4*128*128 floats of 4 bytes


def test_reasons_say_which_condition_applied() -> None:
    # Sinks, a window and rotary: no score term at all, so "blockwise band" declines for that,
    # not because "the term does not declare itself relative".
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, position=build("rotary", num_hiddens=64, num_heads=4), sinks=True, window=16)
    x = torch.randn(1, 300, 64)
    declined = dict(mha.explain(x, x, x, causal=True).declined)
    assert declined["blockwise band"] == "no score term"
    assert declined["flex"] == "sinks: this route does not apply them"
    q = torch.randn(1, 2, 8, 4)
    declined = dict(explain(q, q, q, return_weights=True, verbose=True).declined)
    assert declined["blockwise"].startswith("the weights were asked for")
    small = dict(explain(q, q, q, dropout_p=0.1, softcap=3.0).declined)
    assert small["ragged"] == "a softcap: this route does not apply it"


def test_every_route_has_a_note_and_a_section_on_the_routes_page() -> None:
    names = {route.name for route in (*dispatch.ROUTES, *dispatch.BLOCKWISE_ROUTES)}
    assert names == set(ROUTE_NOTES)
    page = (ROOT / ROUTES_PAGE).read_text(encoding="utf-8")
    headings = {route_anchor(title) for title in re.findall(r"^## (.+)$", page, re.M)}
    assert {route_anchor(name) for name in names} <= headings


def test_an_explanation_keeps_its_route_and_declined_fields() -> None:
    made = Explanation("fused", (("explicit", "the weights were not asked for"),))
    assert made.route == "fused" and made.declined == (("explicit", "the weights were not asked for"),)
    assert "explicit: the weights were not asked for" in made.describe(verbose=True)
    assert "explicit" not in str(made).split("\n", 1)[1]
