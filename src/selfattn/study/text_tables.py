"""The text study's tables: perplexity by length, by position, and the gain from context past ``L``.

Each function reads the runs of :func:`selfattn.study.text.train_text_run` (or the merged
``results.json``) and writes the mean over seeds ± the half-width of its 95% interval
(:func:`~selfattn.study.spread.interval95`); one seed shows the mean alone. Under the
perplexity table, the best row at each length and the rows whose intervals overlap its: no
difference among those is claimed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from selfattn.study.provenance import mixed_versions_warning
from selfattn.study.spread import best_and_ties, interval95

__all__ = [
    "attention_table",
    "by_position_table",
    "context_gain_table",
    "summarize_attention",
    "summarize_context_gain",
    "summarize_scaling_gains",
    "summarize_text",
    "summarize_text_runs",
    "text_figures",
    "text_table",
]


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sd, the 95% interval's half-width (None for one seed) and the per-seed values."""
    interval = interval95(values)
    return {"mean": interval["mean"], "sd": interval["sd"], "half_width": interval["half_width"],
            "per_seed": list(values)}  # fmt: skip


def _plus_minus(cell: dict[str, Any], digits: int) -> str:
    """`` ± h`` with the 95% interval's half-width; `` ± sd`` for results written before intervals; empty for one seed."""
    half = cell.get("half_width", cell.get("sd") or None)
    return "" if half is None else f" ± {half:.{digits}f}"


def _bands_over_seeds(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Perplexity by band of positions, mean and sd over the seeds' cells (empty for runs without it)."""
    if any("by_position" not in cell for cell in cells):
        return []
    return [
        {"start": band[0]["start"], "stop": band[0]["stop"], "perplexity": _mean_sd([b["perplexity"] for b in band])}
        for band in zip(*(cell["by_position"] for cell in cells), strict=True)
    ]


def by_position_table(summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Markdown lines: perplexity by band of positions at each row's longest evaluated length."""
    rows = []
    for row, by_length in summary.items():
        longest = max((n for n, cell in by_length.items() if cell.get("by_position")), key=int, default=None)
        if longest is not None:
            rows.append((row, longest, by_length[longest]["by_position"]))
    if not rows:
        return []
    bands = [(band["start"], band["stop"]) for band in max((r[2] for r in rows), key=len)]
    lines = [
        "Perplexity by position (windows of the longest evaluated length):",
        "",
        f"| row | window | {' | '.join(f'{a}-{b}' for a, b in bands)} |",
        f"|---|---|{'---|' * len(bands)}",
    ]
    for row, longest, cells in rows:
        texts = [f"{c['perplexity']['mean']:.2f}{_plus_minus(c['perplexity'], 2)}" for c in cells]
        lines.append(f"| {row} | {longest} | {' | '.join(texts + [''] * (len(bands) - len(texts)))} |")
    return lines


def summarize_text(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{row: {length: {"perplexity": {"mean", "sd"}, "beyond": ... | None}}}`` over seeds.

    Rows are the encodings, and ``rotary+SCALING`` for each scaling; a length that a row
    skipped holds ``{"skipped": why}``.
    """
    rows: dict[str, list[dict[str, dict[str, Any]]]] = {}
    for run in runs:
        by_length: dict[str, dict[str, Any]] = {
            **{n: {"skipped": why} for n, why in run["skipped"].items()},
            **run["perplexity_by_length"],
        }
        rows.setdefault(run["encoding"], []).append(by_length)
        for kind, scores in run["scalings"].items():
            rows.setdefault(f"rotary+{kind}", []).append(scores)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for row, members in rows.items():
        for length in sorted(members[0], key=int):
            cells = [member[length] for member in members]
            if "skipped" in cells[0]:
                summary.setdefault(row, {})[length] = {"skipped": cells[0]["skipped"]}
                continue
            beyond = [cell["beyond"] for cell in cells]
            summary.setdefault(row, {})[length] = {
                "perplexity": _mean_sd([cell["perplexity"] for cell in cells]),
                "beyond": None if None in beyond else _mean_sd(beyond),
                "seeds": len(cells),
                "by_position": _bands_over_seeds(cells),
            }
    return summary


def summarize_context_gain(
    runs: Sequence[dict[str, Any]], *, key: str = "context_gain"
) -> dict[str, list[dict[str, Any]]]:
    """``{encoding: [{"start", "stop", "gain": {"mean", "sd"}, "seeds"}]}``: the gain from context past ``L`` over
    seeds, as each run's ``key`` holds it (``"sliding_gain"``: the sliding-window reading's)."""
    by_encoding: dict[str, list[list[dict[str, Any]]]] = {}
    for run in runs:
        if run.get(key):  # absent in runs from before this reading, and for learned
            by_encoding.setdefault(run["encoding"], []).append(run[key])
    return {
        encoding: [
            {"start": band[0]["start"], "stop": band[0]["stop"], "gain": _mean_sd([row["gain"] for row in band]),
             "seeds": len(band)}
            for band in zip(*members, strict=True)
        ]
        for encoding, members in by_encoding.items()
    }  # fmt: skip


def summarize_scaling_gains(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """As :func:`summarize_context_gain`, per scaling of the rotary runs (rows ``rotary+KIND``)."""
    scaled = [
        {"encoding": f"{run['encoding']}+{kind}", "context_gain": gain}
        for run in runs
        for kind, gain in (run.get("scaling_context_gain") or {}).items()
    ]
    return summarize_context_gain(scaled)


def context_gain_table(
    gains: dict[str, list[dict[str, Any]]], train_len: int, *, short: str | None = None
) -> list[str]:
    """Markdown lines: per row and band of positions past ``L``, the loss from the shorter context (``short``:
    by default the last ``L`` bytes only) minus the loss with the whole window (nats per byte; > 0 where the bytes
    past ``L`` helped)."""
    if not gains:
        return []
    short = short or f"the last {train_len} bytes only"
    bands = [(row["start"], row["stop"]) for row in next(iter(gains.values()))]
    lines = [
        f"Context gain (nats per byte, {short} minus the whole window; > 0: the model used the bytes past L):",
        "",
        f"| row | {' | '.join(f'{a}-{b}' for a, b in bands)} |",
        f"|---|{'---|' * len(bands)}",
    ]
    for encoding, rows in gains.items():
        cells = [f"{row['gain']['mean']:+.4f}{_plus_minus(row['gain'], 4)}" for row in rows]
        lines.append(f"| {encoding} | {' | '.join(cells)} |")
    return lines


def _best_lines(summary: dict[str, dict[str, dict[str, Any]]], lengths: Sequence[str]) -> list[str]:
    """Per length, the row of lowest mean perplexity and the rows not told apart from it by the seeds."""
    lines = []
    for n in lengths:
        seeds = {row: by[n]["perplexity"]["per_seed"] for row, by in summary.items()
                 if "per_seed" in by.get(n, {}).get("perplexity", {})}  # fmt: skip
        if len(seeds) > 1:
            best, ties = best_and_ties(seeds, higher_is_better=False)
            tied = f"; its 95% interval overlaps {', '.join(ties)} (no difference claimed)" if ties else ""
            lines.append(f"Lowest at {n}: {best}{tied}.")
    return ["", *lines] if lines else []


def summarize_attention(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{encoding: [{"start", "stop", "distance", "entropy", "uniform_entropy"}]}``: per band of query positions,
    the mean attended distance and attention entropy (mean over layers, then over seeds; :mod:`~selfattn.study.attention_use`)."""
    by_encoding: dict[str, list[list[dict[str, Any]]]] = {}
    for run in runs:
        if run.get("attention"):  # absent in runs from before this reading
            by_encoding.setdefault(run["encoding"], []).append(run["attention"])
    summary: dict[str, list[dict[str, Any]]] = {}
    for encoding, members in by_encoding.items():
        summary[encoding] = [
            {"start": band[0]["start"], "stop": band[0]["stop"], "uniform_entropy": band[0]["uniform_entropy"],
             "distance": _mean_sd([sum(b["distance"]) / len(b["distance"]) for b in band]),
             "entropy": _mean_sd([sum(b["entropy"]) / len(b["entropy"]) for b in band])}
            for band in zip(*members, strict=True)
        ]  # fmt: skip
    return summary


def attention_table(attention: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown lines: per encoding and band of query positions, mean attended distance / entropy (uniform's in the header)."""
    if not attention:
        return []
    widest = max(attention.values(), key=len)
    lines = [
        "Attention by query position (mean over layers, heads and seeds ± the half-width of the 95% interval over the "
        "seeds): mean distance back / entropy in nats; uniform attention over every earlier key has the entropy in "
        "the header:",
        "",
        "| encoding | " + " | ".join(f"{b['start']}-{b['stop']} ({b['uniform_entropy']:.2f})" for b in widest) + " |",
        f"|---|{'---|' * len(widest)}",
    ]
    for encoding, bands in attention.items():
        cells = [
            f"{b['distance']['mean']:.1f}{_plus_minus(b['distance'], 1)} / {b['entropy']['mean']:.2f}"
            f"{_plus_minus(b['entropy'], 2)}"
            for b in bands
        ]
        lines.append(f"| {encoding} | {' | '.join(cells + [''] * (len(widest) - len(cells)))} |")
    return lines


def scored_lines(config: dict[str, Any]) -> list[str]:
    """Which held-out bytes the numbers read, by book, chapter and verse (nothing for results that do not say)."""
    corpus = config.get("corpus", {})
    if "scored" not in corpus:
        return []
    sample, every = corpus["sample_windows"], corpus["gain_every"]
    longest = max(config["eval_factors"]) * config["train_len"]
    return [
        f"Scored: {corpus['scored_bytes']:,} of the {corpus['held_out_bytes']:,} held-out bytes, {corpus['scored']} "
        f"(the held-out tail: {corpus['held_out']}). The context gain and rotary+dynamic-cached (beside it "
        f"rotary+dynamic-sample, one pass on the same bytes) read a sample: {len(sample)} windows of {longest:,} "
        f"bytes spread evenly over them ({sample[0]}; ...; {sample[-1]}), the gain at "
        + ("every position past L." if every == 1 else f"one position in {every} past L (L, L + {every}, ...).")
    ]


def summarize_text_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every summary ``results.json`` holds beside its config and runs: perplexity, both context gains, each
    scaling's gain and attention, over the seeds of each encoding."""
    return {
        "summary": summarize_text(runs),
        "context_gain": summarize_context_gain(runs),
        "sliding_gain": summarize_context_gain(runs, key="sliding_gain"),
        "scaling_context_gain": summarize_scaling_gains(runs),
        "attention": summarize_attention(runs),
    }


def _seeds_lines(seeds_by_encoding: dict[str, int] | None) -> list[str]:
    """One line when encodings have different numbers of seeds (seeds added to some after the grid), else none."""
    if not seeds_by_encoding or len(set(seeds_by_encoding.values())) == 1:
        return []
    usual = Counter(seeds_by_encoding.values()).most_common(1)[0][0]
    others = ", ".join(f"{encoding} {n}" for encoding, n in seeds_by_encoding.items() if n != usual)
    return ["", f"Seeds: {usual} per encoding, except {others}."]


def text_table(results: dict[str, Any]) -> list[str]:
    """The perplexity table as Markdown lines: mean ± the 95% interval's half-width over seeds, the mean alone with one seed (beyond-L perplexity in brackets, with its half-width)."""
    config, summary = results["config"], results["summary"]
    lengths = [str(f * config["train_len"]) for f in config["eval_factors"]]
    lines = [
        f"| encoding | {' | '.join(f'L={n}' if n == lengths[0] else n for n in lengths)} |",
        f"|---|{'---|' * len(lengths)}",
    ]
    for row, by_length in summary.items():
        cells = []
        for n in lengths:
            cell = by_length.get(n)
            if cell is None:
                cells.append("")
            elif "skipped" in cell:
                cells.append("n/a")
            else:
                text = f"{cell['perplexity']['mean']:.3f}{_plus_minus(cell['perplexity'], 3)}"
                if cell["beyond"] is not None:
                    text += f" ({cell['beyond']['mean']:.2f}{_plus_minus(cell['beyond'], 2)})"
                cells.append(text)
        lines.append(f"| {row} | {' | '.join(cells)} |")
    notes = {cell["skipped"] for by_length in summary.values() for cell in by_length.values() if "skipped" in cell}
    lines += [""] + [f"n/a: {note}." for note in sorted(notes)]
    lines += scored_lines(config)
    lines += _seeds_lines(config.get("seeds_by_encoding"))
    lines += _best_lines(summary, lengths)
    warning = mixed_versions_warning(list(config.get("code_versions", [])))
    lines += [warning] if warning else []
    for extra in (
        by_position_table(summary),
        context_gain_table(results.get("context_gain", {}), config["train_len"]),
        context_gain_table(
            results.get("sliding_gain", {}),
            config["train_len"],
            short=f"sliding windows of {config['train_len']} bytes moved {config.get('sliding_stride')} at a time",
        ),
        context_gain_table(
            results.get("scaling_context_gain", {}),
            config["train_len"],
            short=f"the last {config['train_len']} bytes only, rotary scaled for the longest length,",
        ),
        attention_table(results.get("attention", {})),
    ):
        lines += ["", *extra] if extra else []
    return lines


def text_figures(results: dict[str, Any], folder: Path) -> list[str]:
    """Draw the text study's figures into ``folder`` (perplexity by position, context gain by position) and
    return the Markdown lines that show them in ``text.md`` (paths relative to the study folder)."""
    from selfattn.study.figures import context_gain_figure, perplexity_by_position_figure

    folder.mkdir(parents=True, exist_ok=True)
    train_len = int(results["config"]["train_len"])
    drawn = [
        ("Perplexity by position, log scales", perplexity_by_position_figure(results["summary"], train_len, folder)),
        (
            "Gain from context past L, by position",
            context_gain_figure(results.get("context_gain", {}), train_len, folder),
        ),
    ]
    return [line for title, names in drawn if names for line in ("", f"![{title}]({folder.name}/{names[0]})")]
