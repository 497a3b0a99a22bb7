"""Every claim of the chapter's five source pages, how the tour knows it, and whether it holds.

The pages: the PyTorch notebook (``chapter``), the d2l-zh page with MXNet, PyTorch,
TensorFlow and Paddle tabs (``frameworks``), a short English summary with MXNet code
(``summary``), the study note (``note``) and the slides (``slides``). Each claim appears once,
under the page that states it first in that order of reading (chapter, note, slides, summary,
frameworks); ``also_on`` names the other pages that make the same claim.

Each entry: ``{"id", "page", "also_on", "quote", "statement", "evidence", "basis", "number",
"expected", "holds", "verdict"}``.

* ``quote``: the page's own words (whitespace collapsed); ``statement``: what is tested, in
  English.
* ``evidence``: ``measured`` (``number`` is a result of this run that could have come out
  otherwise without a bug in the code: a trained model, a timing, an experiment whose data,
  model or setting decides the outcome), ``derived`` (it follows from how the code is written:
  a count of operations fixed by how each layer is written, integer arithmetic, a definition;
  ``basis`` says from what, and ``number`` only restates it), ``identity`` (an identity of the
  formula, checked numerically to rounding; ``basis`` names the identity) or ``not shown``
  (this run has no measurement that decides it; ``basis`` says what would).
* ``holds``: True or False; None for ``not shown`` and for a ``measured`` timing whose spread
  over repeated rounds straddles its cut (``basis`` gives the spread).
* ``verdict``: the same in words: ``holds``, ``does not hold``, ``undecided (noise)`` or
  ``not shown``.

A claim that does not hold is kept: the point is to report what was found. Claims do not set
``selfattn tour``'s exit status; its checks do (see :func:`selfattn.tour.runner.verdicts`).

The claims are written by concept, one module each: :mod:`.code` (the layer, the pages' code, the
exercises), :mod:`.comparison` (section 3: costs, timings, long range), :mod:`.positions` (order,
the columns of P, attention by offset, rotation) and :mod:`.note` (the study note's qualities,
symmetry, Taylor terms and harm); :mod:`._base` checks each row's label against its verdict.
"""

from __future__ import annotations

import math
from typing import Any

from selfattn.tour.claims._base import EVIDENCE, PAGES, VERDICTS, count_evidence, count_verdicts
from selfattn.tour.claims.code import code_claims, exercise_claims
from selfattn.tour.claims.comparison import comparison_claims, long_range_claim
from selfattn.tour.claims.note import note_claims, quality_claims
from selfattn.tour.claims.positions import position_claims

__all__ = ["EVIDENCE", "PAGES", "VERDICTS", "claims", "count_evidence", "count_verdicts", "long_range_claim"]


def claims(results: dict[str, Any]) -> list[dict[str, object]]:
    """The claims of the source pages against ``results`` (as :func:`selfattn.tour.runner.compute` returns)."""
    out = [
        *code_claims(results),
        *comparison_claims(results),
        *position_claims(results),
        *quality_claims(results),
        *note_claims(results),
        *exercise_claims(results),
    ]
    order = list(PAGES)
    out.sort(key=lambda claim: order.index(str(claim["page"])))  # stable: page by page, in reading order
    for entry in out:
        number = entry["number"]
        if isinstance(number, float) and not math.isfinite(number):
            entry["number"] = None
    return out
