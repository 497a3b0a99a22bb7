"""Section 5: the qualities an absolute positional encoding needs, each measured on P.

From the chapter's discussion: a unique row per position, bounded values, a distance between
positions i and i + delta that does not depend on i, and sensible rows past the longest
position seen in training. Plus the precision of the rows far out, where the textbook's
float32 angles drift.

Shape legend: n positions, d columns of P.
"""

from __future__ import annotations

import torch

from selfattn.functional import sinusoidal_table

__all__ = [
    "absolute_position_qualities",
    "distance_across_lengths",
    "fraction_encoding",
    "offset_distance_curves",
    "table_precision",
    "textbook_table",
]


def absolute_position_qualities(
    num_hiddens: int = 32,
    num_seen: int = 60,
    num_positions: int = 2000,
    deltas: tuple[int, ...] = (1, 2, 5, 10, 30),
) -> dict[str, object]:
    """Measure the desiderata on the float64 table.

    Args:
        num_hiddens: d.
        num_seen: the longest sequence "seen in training"; rows past it are new.
        num_positions: how many positions to examine in all.
        deltas: offsets for the distance-consistency check.

    Returns:
        ``min_row_distance`` (smallest distance between two different rows, unique if > 0),
        ``max_abs_value`` and ``row_norm`` range (bounded), ``offset_distance_spread`` per
        delta (``max_i - min_i`` of ``|P[i] - P[i + delta]|``, 0 when it depends on delta
        only), ``unseen_nearest_distance`` (smallest distance from a row past ``num_seen`` to
        any row before it: new positions still look new) and ``unseen_max_abs_value``.
    """
    if num_seen >= num_positions:
        raise ValueError(f"num_seen must be smaller than num_positions, got {num_seen} and {num_positions}")
    table = sinusoidal_table(num_positions, num_hiddens, dtype=torch.float64)  # (n, d)
    distances = torch.cdist(table, table)  # (n, n)
    distances.fill_diagonal_(float("inf"))
    norms = table.norm(dim=-1)  # (n,)
    spreads = {}
    for delta in deltas:
        gaps = (table[delta:] - table[:-delta]).norm(dim=-1)  # (n - delta,)
        spreads[str(delta)] = float(gaps.max() - gaps.min())
    seen, unseen = table[:num_seen], table[num_seen:]
    gaps = torch.cdist(unseen, seen)  # (n - seen, seen)
    new_row, seen_row = divmod(int(gaps.argmin()), num_seen)
    return {
        "num_hiddens": num_hiddens,
        "num_seen": num_seen,
        "num_positions": num_positions,
        "min_row_distance": float(distances.min()),
        "min_row_distance_seen": float(distances[:num_seen, :num_seen].min()),
        "max_abs_value": float(table.abs().max()),
        "row_norm_min": float(norms.min()),
        "row_norm_max": float(norms.max()),
        "offset_distance_spread": spreads,
        "offset_distance_spread_max": max(spreads.values()),
        "unseen_nearest_distance": float(gaps.min()),
        # Which pair attains it: the first new row and the last seen one are neighbours.
        "unseen_nearest_pair": [num_seen + new_row, seen_row],
        "unseen_max_abs_value": float(unseen.abs().max()),
    }


def offset_distance_curves(
    num_hiddens: int = 32, num_positions: int = 240, deltas: tuple[int, ...] = (1, 2, 5, 10, 30)
) -> dict[str, object]:
    """``|P[i] - P[i + delta]|`` for ``i < num_positions``, one row per delta: flat when it ignores i."""
    table = sinusoidal_table(num_positions + max(deltas), num_hiddens, dtype=torch.float64)  # (n + D, d)
    curves = torch.stack(
        [(table[delta : delta + num_positions] - table[:num_positions]).norm(dim=-1) for delta in deltas]
    )
    return {"deltas": list(deltas), "distances": curves.numpy()}  # (len(deltas), n)


def textbook_table(num_positions: int, num_hiddens: int) -> torch.Tensor:
    """The textbook's recipe, angles formed in float32 (even d only), for comparison."""
    positions = torch.arange(num_positions, dtype=torch.float32).reshape(-1, 1)  # (n, 1)
    angles = positions / torch.pow(10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens)
    table = torch.zeros(num_positions, num_hiddens)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table  # (n, d)


def table_precision(num_hiddens: int = 32, lengths: tuple[int, ...] = (60, 1000, 10000)) -> dict[str, list[float]]:
    """Largest error against the float64 formula of the textbook's table and of ours (float32)."""
    if num_hiddens % 2:
        raise ValueError(f"the textbook's table needs an even num_hiddens, got {num_hiddens}")
    textbook, ours = [], []
    for length in lengths:
        exact = sinusoidal_table(length, num_hiddens, dtype=torch.float64)
        textbook.append(float((textbook_table(length, num_hiddens).double() - exact).abs().max()))
        ours.append(float((sinusoidal_table(length, num_hiddens).double() - exact).abs().max()))
    return {"lengths": list(lengths), "textbook_error": textbook, "selfattn_error": ours}


def fraction_encoding(num_steps: int, num_hiddens: int) -> torch.Tensor:
    """A foil for the note's second quality: sinusoids of the position as a fraction of the length.

    Row i is the sinusoidal row of angle ``pi * i / n`` scaled per column: the encoding
    depends on the sentence length n, which the chapter's P does not. ``(n, d)``, float64.
    """
    fractions = torch.arange(num_steps, dtype=torch.float64) / num_steps  # (n,)
    table = sinusoidal_table(num_steps, num_hiddens, dtype=torch.float64)  # only for its shape
    columns = torch.arange(1, (num_hiddens + 1) // 2 + 1, dtype=torch.float64)  # (ceil(d/2),)
    angles = torch.pi * torch.outer(fractions, columns)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : num_hiddens // 2])
    return table


def distance_across_lengths(
    num_hiddens: int = 32,
    lengths: tuple[int, ...] = (10, 30, 60, 200),
    pairs: tuple[tuple[int, int], ...] = ((0, 1), (2, 7), (3, 9)),
) -> dict[str, object]:
    """The note's "same distance between two time steps across sentence lengths", measured.

    For each pair of positions ``(i, j)``, ``|P[i] - P[j]|`` in sentences of each length, with
    P taken from :class:`~selfattn.positional.SinusoidalPositionalEncoding` applied to a
    zero input of that length; ``spread`` is the largest difference across lengths (0 when
    the length does not matter). The same for :func:`fraction_encoding`, which fails it.
    """
    from selfattn.positional import SinusoidalPositionalEncoding

    encoding = SinusoidalPositionalEncoding(num_hiddens, dropout=0.0).double().eval()
    usable = [length for length in lengths if length > max(max(p) for p in pairs)]
    if len(usable) < 2:
        raise ValueError(f"need two lengths longer than every pair's positions, got lengths {lengths} for {pairs}")
    chapter, foil = {}, {}
    with torch.no_grad():
        for i, j in pairs:
            key = f"{i}-{j}"
            rows = [encoding(torch.zeros(1, n, num_hiddens, dtype=torch.float64))[0] for n in usable]
            chapter[key] = [float((p[i] - p[j]).norm()) for p in rows]
            foil_rows = [fraction_encoding(n, num_hiddens) for n in usable]
            foil[key] = [float((p[i] - p[j]).norm()) for p in foil_rows]
    return {
        "lengths": usable,
        "pairs": [list(p) for p in pairs],
        "distances": chapter,
        "spread": max(max(v) - min(v) for v in chapter.values()),
        "fraction_distances": foil,
        "fraction_spread": max(max(v) - min(v) for v in foil.values()),
    }
