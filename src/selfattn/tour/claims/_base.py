"""What a claim row holds and how its label fixes its verdict (see :mod:`selfattn.tour.claims`); shared helpers."""

from __future__ import annotations

from typing import Any

from selfattn.tour.parallel import UNDECIDED

__all__ = ["EVIDENCE", "PAGES", "VERDICTS", "count_evidence", "count_verdicts"]

PAGES = {
    "chapter": "the chapter's PyTorch notebook",
    "note": "the study note",
    "slides": "the slides",
    "summary": "the English summary page with MXNet code",
    "frameworks": "the d2l-zh page with MXNet / PyTorch / TensorFlow / Paddle tabs",
}
EVIDENCE = ("measured", "derived", "identity", "not shown")
VERDICTS = ("holds", "does not hold", "undecided (noise)", "not shown")


def _claim(
    id_: str,
    page: str,
    quote: str,
    statement: str,
    evidence: str,
    number: object,
    expected: str,
    holds: bool | None,
    *,
    basis: str | None = None,
    also_on: tuple[str, ...] = (),
) -> dict[str, object]:
    for where in (page, *also_on):
        if where not in PAGES:
            raise ValueError(f"page must be one of {', '.join(PAGES)}, got {where!r}")
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence must be one of {', '.join(EVIDENCE)}, got {evidence!r}")
    if evidence != "measured" and not basis:
        raise ValueError(f"a {evidence} claim needs a basis (from what it follows, or what would show it): {id_}")
    if evidence == "not shown" and holds is not None:
        raise ValueError(f"holds must be None when evidence is 'not shown', got {holds!r} for {id_}")
    if holds is None and evidence in ("derived", "identity"):
        raise ValueError(f"a {evidence} claim is decided: holds must be True or False, got None for {id_}")
    if holds is None and evidence == "measured" and not basis:
        raise ValueError(f"an undecided measured claim needs a basis (the spread that straddles the cut): {id_}")
    if evidence == "not shown":
        verdict = "not shown"
    else:
        verdict = "undecided (noise)" if holds is None else ("holds" if holds else "does not hold")
    return {
        "id": id_,
        "page": page,
        "also_on": list(also_on),
        "quote": quote,
        "statement": statement,
        "evidence": evidence,
        "basis": basis,
        "number": number,
        "expected": expected,
        "holds": None if holds is None else bool(holds),
        "verdict": verdict,
    }


def _near(value: float, want: float, tolerance: float = 0.1) -> bool:
    return abs(value - want) <= tolerance


def count_evidence(found: list[dict[str, Any]]) -> dict[str, int]:
    """How many claims are measured, derived, identities checked numerically and not shown."""
    return {kind: sum(c["evidence"] == kind for c in found) for kind in EVIDENCE}


def count_verdicts(found: list[dict[str, Any]]) -> dict[str, int]:
    """How many claims hold, do not hold, are undecided by noise and are not shown."""
    return {kind: sum(c["verdict"] == kind for c in found) for kind in VERDICTS}


def _tri(decision: str, yes: str) -> bool | None:
    """A timing decision (``above``, ``below``, undecided) as True (it is ``yes``), False, or None (noise)."""
    return None if decision == UNDECIDED else decision == yes


def _all(*conditions: bool | None) -> bool | None:
    """False if any condition fails, None (undecided) if none fails but one is undecided, else True."""
    if any(c is False for c in conditions):
        return False
    return None if any(c is None for c in conditions) else True
