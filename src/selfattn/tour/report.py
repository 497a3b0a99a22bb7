"""The tour's HTML report: one self-contained page, figures beside it in ``figures/``.

The page is rendered with jinja2 from ``templates/`` (one partial per section); this module
turns ``results`` into the rows and numbers the templates show. Nothing is fetched from the
network; the page opens offline from the file system. Every number shown here is in
``results.json``.

The deep-stack section and the study's section are slots: their HTML comes from
:func:`_section_depth` (:mod:`selfattn.tour.depth`) and
:func:`selfattn.study.summary.study_section_html` (the study's results, when there are any).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from selfattn import __version__
from selfattn.study.summary import study_section_html
from selfattn.tour import depth
from selfattn.tour._html import figure_html
from selfattn.tour.claims import count_evidence, count_verdicts
from selfattn.tour.comparison import CHAPTER, KINDS

__all__ = ["format_number", "format_ratio", "page_text", "render_report"]

_TEMPLATES = Path(__file__).parent / "templates"


def format_number(value: object, digits: int | None = None) -> str:
    """A number as a reader wants it: thousands separators, small values in scientific notation.

    ``digits`` fixes the decimals of a value that is not in scientific notation.
    """
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        if value.is_integer() and abs(value) >= 1 and digits is None:
            return f"{int(value):,}"
        magnitude = abs(value)
        if magnitude < 1e-3 or magnitude >= 1e9:
            return f"{value:.2e}"
        if digits is not None:
            return f"{value:,.{digits}f}"
        if magnitude >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


def format_ratio(value: object) -> str:
    """A ratio, labelled as one: ``4.00x (ratio)``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    return f"{format_number(float(value), 2 if abs(value) < 1000 else 0)}\u00d7 (ratio)"


def _show(value: object) -> str:
    """Any value of ``results``: numbers formatted, lists and dicts element by element."""
    if isinstance(value, (list, tuple)):
        shown = [_show(v) for v in value[:12]]
        return "[" + ", ".join(shown) + (", ..." if len(value) > 12 else "") + "]"
    if isinstance(value, dict):
        return "; ".join(f"{key}: {_show(item)}" for key, item in value.items())
    if value is None:
        return "n/a"
    return format_number(value)


def _environment() -> Any:
    try:
        import jinja2
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the report needs jinja2: pip install 'selfattn[cli]'") from error
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        autoescape=jinja2.select_autoescape(["html", "j2"], default_for_string=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        show=_show,
        num=format_number,
        ratio=format_ratio,
        fixed=lambda value, digits=2: f"{value:.{digits}f}",
        pct=lambda value: f"{100 * value:.1f}\u2009%" if value >= 0.001 else f"{100 * value:.2g}\u2009%",
        tuple=lambda value: str(tuple(value)),
        join_nums=lambda values, digits=None: ", ".join(format_number(v, digits) for v in values),
        page_text=page_text,
    )
    env.globals["figure_html"] = figure_html
    # A Chinese quote is marked as such, so the browser picks a CJK face from the page's font stack.
    env.tests["chinese"] = lambda text: bool(re.search(r"[\u4e00-\u9fff]", str(text)))
    return env


def _fmt(value: object) -> str:
    """Numbers as a reader wants them: small ones in scientific notation, lists element by element."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.2e}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        shown = [_fmt(v) for v in value[:12]]
        return "[" + ", ".join(shown) + (", ..." if len(value) > 12 else "") + "]"
    return str(value)


def _e(text: object) -> str:
    return html.escape(str(text))


_LATEX_SYMBOLS = {
    r"\times": "\u00d7", r"\in": "\u2208", r"\ne": "\u2260", r"\cdot": "\u00b7", r"\delta": "\u03b4",
    r"\omega": "\u03c9", r"\ldots": "\u2026", r"\,": "\u2009",
}  # fmt: skip


def page_text(text: object) -> str:
    """A page's words as HTML: its inline LaTeX as plain text with sub- and superscripts, its markdown as markup.

    The quotes keep the pages' own characters in ``results.json``; only the report renders them, so a
    reader sees O(knd<sup>2</sup>) and <i>a priori</i>, not ``$\\mathcal{O}(knd^2)$`` and ``*a priori*``.
    """
    parts = re.split(r"\$([^$]*)\$", html.escape(str(text), quote=False))
    # Odd parts were inside $...$: LaTeX. Even parts are prose: markdown.
    out = "".join(_latex_as_text(part) if index % 2 else part for index, part in enumerate(parts))
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    out = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<i>\1</i>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def _latex_as_text(math_text: str) -> str:
    """Inline LaTeX as plain text: commands unwrapped or turned into symbols, sub- and superscripts as markup."""
    out = re.sub(r"\\(?:mathcal|mathbf|mathbb|textrm|mathrm|text)\{([^{}]*)\}", r"\1", math_text)
    for command, symbol in _LATEX_SYMBOLS.items():
        out = re.sub(re.escape(command) + r"(?![A-Za-z])", symbol, out)
    out = re.sub(r"\^\{([^{}]*)\}|\^(\w)", lambda m: f"<sup>{m.group(1) or m.group(2)}</sup>", out)
    return re.sub(r"_\{([^{}]*)\}|_(\w)", lambda m: f"<sub>{m.group(1) or m.group(2)}</sub>", out)


def _comparison_context(comp: dict[str, Any]) -> dict[str, Any]:
    sweep = comp["sweep"]
    slides = {"cnn": "O(n)", "rnn": "O(1)", "self_attention": "O(n)"}
    rows, timing = [], []
    for kind in KINDS:
        entry, claim = comp[kind], CHAPTER[kind]
        low, high = entry["time_exponent_spread"]
        rows.append(
            [
                claim["label"],
                claim["complexity"],
                f"{entry['flops_exponent_n']:.3f}",
                f"{entry['flops_exponent_d']:.3f}",
                claim["sequential_ops"],
                format_number(entry["sequential_ops"]),
                slides[kind],
                f"{entry['parallelism_exponent_n']:.2f}",
                claim["max_path_length"],
                format_number(entry["max_path_length"]) + (f" (k={entry['k']})" if entry["k"] else ""),
                format_number(entry["path_layers"]),
                f"{entry['time_exponent_n']:.2f} [{low:.2f}, {high:.2f}]",
            ]
        )
        timing.append(
            {
                "label": claim["label"],
                "median": entry["time_exponent_n"],
                "low": low,
                "high": high,
                "share": entry["fixed_cost_share"],
                "dominated": entry["fixed_costs_dominate"],
            }
        )
    sa, cnn, rnn = comp["self_attention"], comp["cnn"], comp["rnn"]
    series = [
        [
            n,
            cnn["flops_by_n"][i],
            rnn["flops_by_n"][i],
            sa["flops_by_n"][i],
            sa["layer_flops_by_n"][i],
            cnn["sequential_ops_by_n"][i],
            rnn["sequential_ops_by_n"][i],
            sa["sequential_ops_by_n"][i],
            cnn["path_length_by_n"][i],
            rnn["path_length_by_n"][i],
            sa["path_length_by_n"][i],
        ]
        for i, n in enumerate(sweep["n"])
    ]
    by_k = [
        list(row)
        for row in zip(
            sweep["k"], cnn["flops_by_k"], cnn["path_length_by_k"], cnn["expected_path_length_by_k"], strict=True
        )
    ]
    cross = comp["crossings"]
    places = []
    if cross["core_equals_rnn_at_n"] is not None:
        places.append(
            f"at n = d = {round(cross['core_equals_rnn_at_n']):,} tokens (the formulas n^2 d and n d^2 meet at n = d)"
        )
    if cross["core_equals_rnn_at_d"] is not None:
        places.append(f"at d = n = {round(cross['core_equals_rnn_at_d']):,} features")
    core_meets = " and ".join(places) if places else "nowhere in these sweeps"
    return {
        "comparison_rows": rows,
        "timing": timing,
        "series_rows": series,
        "by_k_rows": by_k,
        "core_meets": html.escape(core_meets),
    }


def _positional_context(results: dict[str, Any]) -> dict[str, Any]:
    pe = results["positional_encoding"]
    measured = pe["period_measurements"]
    periods = [
        [column, zero, fft, formula]
        for column, zero, fft, formula in zip(
            pe["columns"], measured["zero_crossings"], measured["fft"], measured["formula"], strict=True
        )
    ]
    return {"period_rows": periods, "binary_rows": [[i, bits] for i, bits in enumerate(pe["binary"])]}


def _absolute_context(results: dict[str, Any]) -> dict[str, Any]:
    q = results["absolute"]["qualities"]
    precision = results["absolute"]["precision"]
    rows: list[list[object]] = [
        [
            "a unique row per position",
            f"smallest distance between two rows among {q['num_positions']:,} positions",
            q["min_row_distance"],
        ],
        ["bounded values", "largest |P[i, j]|", q["max_abs_value"]],
        ["bounded values", "row norms (min, max); sqrt(d/2) for even d", [q["row_norm_min"], q["row_norm_max"]]],
        [
            "same distance across sentence lengths",
            "largest change of |P[i] - P[j]| across lengths "
            + ", ".join(map(str, results["absolute"]["across_lengths"]["lengths"])),
            results["absolute"]["across_lengths"]["spread"],
        ],
        [
            "same distance wherever the positions sit",
            "max over delta of (max_i - min_i) |P[i] - P[i+delta]|",
            q["offset_distance_spread_max"],
        ],
        [
            f"past the longest position seen ({q['num_seen']})",
            (
                "smallest distance from a new row to a seen row (rows "
                f"{q['unseen_nearest_pair'][0]} and {q['unseen_nearest_pair'][1]}: neighbours)"
            ),
            q["unseen_nearest_distance"],
        ],
        [f"past the longest position seen ({q['num_seen']})", "largest |P| of the new rows", q["unseen_max_abs_value"]],
    ]
    rows += [
        [
            f"precision at {length:,} positions",
            "error of the textbook's float32 angles / of selfattn's float64 angles",
            [textbook, ours],
        ]
        for length, textbook, ours in zip(
            precision["lengths"], precision["textbook_error"], precision["selfattn_error"], strict=True
        )
    ]
    return {"absolute_rows": rows}


def _note_context(results: dict[str, Any]) -> dict[str, Any]:
    terms, survival, fw = results["note"]["taylor"], results["note"]["embedding"], results["frameworks"]
    taylor_rows = [
        [
            f"N(0, {entry['scale']:g}\u00b2)",
            *(f"{100 * entry[k]:.1f}\u2009%" for k in ("content_content", "content_position", "position_position")),
        ]
        for entry in terms["scales"]
    ]
    survival_rows = [
        [d, f"{100 * a:.1f}\u2009%", b, f"{100 * c:.1f}\u2009%", e]
        for d, a, b, c, e in zip(
            survival["sizes"],
            survival["recovered"],
            survival["cosine"],
            survival["recovered_unit"],
            survival["cosine_unit"],
            strict=True,
        )
    ]
    survive_from = next(
        (d for d, a in zip(survival["sizes"], survival["recovered"], strict=True) if a > 0.99), survival["sizes"][-1]
    )
    precision = fw["precision"]
    names = list(precision["errors"])
    precision_rows = [
        [length, *(precision["errors"][name][i] for name in names), precision["selfattn"][i]]
        for i, length in enumerate(precision["lengths"])
    ]
    odd_rows = [
        [
            name,
            "yes" if entry["builds"] else "no",
            f"largest error {format_number(entry['max_error'])} against selfattn's odd-d table"
            if entry["builds"]
            else entry["error"],
        ]
        for name, entry in fw["odd_width"].items()
    ]
    return {
        "taylor_rows": taylor_rows,
        "survival_rows": survival_rows,
        "survive_from": survive_from,
        "framework_names": names,
        "precision_rows": precision_rows,
        "odd_rows": odd_rows,
        "odd_d": results["positional_encoding"]["num_hiddens"] + 1,
    }


def _learning_context(results: dict[str, Any]) -> dict[str, Any]:
    learning = results["learning"]
    off, hm, par = learning["offset"], learning["harmless"], learning["parallel"]
    runs, target = off["variants"], off["config"]["target"]
    labels = {"sinusoidal": "sinusoidal P", "none": "no P", "shuffled": "P's rows shuffled"}
    offset_rows = [
        [
            labels[name],
            f"{100 * run['accuracy']:.1f}\u2009%",
            run["steps_to_target"] or "never",
            run["weight_on_offset"],
            run["position_r2"],
        ]
        for name, run in runs.items()
    ]
    learned = [labels[name] for name, run in runs.items() if run["steps_to_target"] is not None]
    missed = [labels[name] for name, run in runs.items() if run["steps_to_target"] is None]
    offset_sentence = (
        f"Reached {100 * target:.0f}\u2009%: {', '.join(learned) or 'none'}; not within the budget: "
        f"{', '.join(missed) or 'none'}."
    )
    steps = [step for step, _ in hm["with_p"]["curve"]]
    harmless_rows = [
        [label, *(f"{100 * acc:.1f}\u2009%" for _, acc in hm[key]["curve"])]
        for key, label in (("without_p", "without P"), ("with_p", "with P"))
    ]
    lag, lag_step = max(
        (b - a, step) for (step, a), (_, b) in zip(hm["with_p"]["curve"], hm["without_p"]["curve"], strict=True)
    )
    harmless_sentence = (
        f"After {hm['config']['train_steps']} steps: {100 * hm['with_p']['accuracy']:.1f}\u2009% with P, "
        f"{100 * hm['without_p']['accuracy']:.1f}\u2009% without. Along the way, the model with P trails the one "
        f"without by at most {100 * lag:.1f} points (step {lag_step}): "
        + ("within 2 points at every check, so the claim counts as holding" if lag <= 0.02 else "more than 2 points, "
           "so the claim does not hold here, even where both end at the ceiling")
        + ", for this task, model and budget."
    )  # fmt: skip
    thread_headers = [f"{t} thread{'s' if t > 1 else ''} (ms)" for t in par["threads"]] + [
        f"speed-up at {t} threads" for t in par["threads"][1:]
    ]
    thread_rows = [
        [
            CHAPTER[kind]["label"],
            *(1e3 * value for value in par["times"][kind]),
            *(format_ratio(value) for value in par["speedup"][kind][1:]),
        ]
        for kind in KINDS
    ]
    if len(par["threads"]) == 1:
        thread_sentence = "This machine has one core: no speed-up can be measured here."
    elif not par["quiet"]:
        thread_sentence = (
            f"The load average (up to {max(par['load']):.1f} on {par['cores']} cores) shows other work on the cores, "
            "so the extra threads had no idle core to run on: these timings do not measure parallelism, and the "
            "claims that rest on them are marked not shown. Rerun the tour on an idle machine to decide them."
        )
    else:
        words = {"above": "parallel", "below": "not parallel", "undecided (noise)": "undecided (noise)"}
        thread_sentence = (
            f"At {par['threads'][-1]} threads, median over {par['rounds']} rounds [lowest, highest]: "
            + "; ".join(
                f"{CHAPTER[kind]['label']} {format_ratio(par['speedup'][kind][-1])} "
                f"[{par['speedup_spread'][kind][0]:.2f}, {par['speedup_spread'][kind][1]:.2f}]: "
                f"{words[par['parallel'][kind]]}"
                for kind in KINDS
            )
            + "."
        )
    return {
        "offset_rows": offset_rows,
        "offset_sentence": offset_sentence,
        "harmless_steps": [f"step {step:,}" for step in steps],
        "harmless_rows": harmless_rows,
        "harmless_sentence": harmless_sentence,
        "thread_headers": thread_headers,
        "thread_rows": thread_rows,
        "thread_sentence": thread_sentence,
    }


_LONG_RANGE_LABELS = {"cnn": "CNN", "rnn": "RNN", "self_attention": "self-attention"}


def _long_range_context(results: dict[str, Any]) -> dict[str, Any]:
    """The long-range table and its sentences, from ``selfattn study --exercises``; empty when absent."""
    long_range = results.get("long_range")
    if not long_range:
        return {"long_range": None}
    settings, by_distance = long_range["settings"], long_range["by_distance"]
    distances = sorted({int(n) for cells in by_distance.values() for n in cells})
    target, budget = settings["target"], settings["budget"]
    rows, sentences = [], []
    for kind, cells in by_distance.items():
        label = _LONG_RANGE_LABELS.get(kind, kind)
        row: list[object] = [label]
        for n in distances:
            cell = cells.get(str(n))
            if cell is None:
                row.append("")
                continue
            steps = "never" if cell["steps_to_target"] is None else f"{cell['steps_to_target']:,.0f}"
            row.append(f"{100 * cell['accuracy_at_budget']:.0f}\u2009% / {steps}")
        rows.append(row)
        reached = [n for n in distances if str(n) in cells and cells[str(n)]["reached"] == cells[str(n)]["seeds"]]
        missed = [n for n in distances if str(n) in cells and cells[str(n)]["reached"] == 0]
        params = sorted({cells[str(n)]["parameters"] for n in distances if str(n) in cells})
        sentences.append(
            f"{label} ({params[0]:,} parameters"
            + (f" at n = {distances[0]} to {params[-1]:,} at n = {distances[-1]}" if len(params) > 1 else "")
            + f"): every seed reached {100 * target:.0f}\u2009% at "
            + (f"n = {', '.join(map(str, reached))}" if reached else "no distance")
            + (
                f"; no seed within {settings['max_steps']:,} steps at n = {', '.join(map(str, missed))}."
                if missed
                else f"; at no distance did every seed miss it within {settings['max_steps']:,} steps."
            )
        )
    seeds = max(cell["seeds"] for cells in by_distance.values() for cell in cells.values())
    return {
        "long_range": long_range,
        "long_range_headers": ["model"] + [f"n = {n}" for n in distances],
        "long_range_rows": rows,
        "long_range_sentences": sentences,
        "long_range_seeds": seeds,
        "long_range_budget": budget,
    }


def _fit_context(results: dict[str, Any]) -> dict[str, Any]:
    fit = results["relative"]["fitted_rotation"]
    return {"fit_rows": [[int(d), fit["rotation_error"][d], fit["window_spread"][d]] for d in fit["rotation_error"]]}


def _family_context(results: dict[str, Any]) -> dict[str, Any]:
    fam = results["family"]
    encodings = fam["encodings"]
    rows: list[list[object]] = []
    relative: list[str] = []
    absolute: list[str] = []
    nothing: list[str] = []
    for name, d in encodings.items():
        aware = d.get("position_aware", True)
        measured = "no position" if not aware else ("relative" if d["measured_relative"] else "absolute")
        (nothing if not aware else relative if d["measured_relative"] else absolute).append(name)
        declared = (
            "no position" if d["class"] == "NoPositionalEncoding" else ("relative" if d["is_relative"] else "absolute")
        )
        rows.append(
            [
                name + (f" ({d['form']})" if d.get("form") else ""),
                d["class"],
                d["acts_on"],
                declared,
                measured,
                d["shift_spread"],
                d["shift_change"],
                d.get("permutation_change"),
                d["far_positions"],
            ]
        )
    return {"family_rows": rows, "relative_names": relative, "absolute_names": absolute, "no_position_names": nothing}


def _unseen_sentence(unseen: dict[str, Any] | None) -> str:
    """Which rows of the learned table, Shaw's and T5's training reaches, against those a longer sequence reads."""
    if not unseen:
        return ""
    found = unseen["encodings"]
    parts = []
    for name in ("learned", "shaw", "t5"):
        if name not in found:
            continue
        entry = found[name]
        parts.append(
            f"<code>{name}</code> reads {entry['rows_read']} rows for {entry['positions']} positions or offsets, "
            f"{entry['never_trained']} of them rows no training sequence reaches (training reaches "
            f"{entry['rows_trained']})"
        )
    return (
        " Which rows of each table training can reach, read off untrained models of the shape <code>selfattn "
        "study</code> trains (which rows a sequence reaches depends on its length, not on the weights; "
        f"{_e(unseen['task'])}: a training sequence has at most "
        f"{unseen['train_tokens']} tokens, one of the longest evaluated length {unseen['eval_tokens']}): which rows of "
        "each table get a nonzero gradient from a sequence of the longest training length, against those a sequence "
        f"of the longest evaluated length reads. {'; '.join(parts)}. A row no training sequence reaches keeps its "
        "random initial value (weight decay aside); fewer rows than positions means offsets past Shaw's clip, or "
        "inside one of T5's buckets, share a row and look the same to the model."
    )


_BY_LENGTH_LABELS = {
    "sinusoidal": "sinusoidal P (the chapter's)",
    "learned": "learned table of positions (exercise 2)",
    "shaw": "Shaw's embeddings by offset (exercise 3)",
    "t5": "T5's bias by offset (exercise 3)",
}


def _by_length_html(by_length: dict[str, Any] | None) -> str:
    """Exercises 2 and 3, trained by the tour: each encoding's accuracy at and past its training length."""
    if not by_length:
        return (
            "<p><b>Exercises 2 and 3</b> are not shown in this run: <code>selfattn.tour.exercises."
            "encodings_by_length</code> trains them.</p>"
        )
    config, runs = by_length["config"], by_length["encodings"]
    train_len, longest = config["train_len"], max(config["eval_lens"])
    rows = "".join(
        f"<tr><td>{_e(_BY_LENGTH_LABELS.get(name, name))}</td>"
        f'<td class="num">{100 * run["by_length"][str(train_len)]["all"]:.1f}\u2009%</td>'
        f'<td class="num">{100 * run["by_length"][str(longest)]["past_train_len"]:.1f}\u2009%</td></tr>'
        for name, run in runs.items()
    )
    return (
        f"<p><b>Exercises 2 and 3, trained by this tour</b> (one seed, {config['train_steps']:,} steps of Adam, "
        f"learning rate {config['lr']}, batches of {config['batch_size']}): one attention layer (d = "
        f"{config['num_hiddens']}, one head) must output at every position i &ge; {config['delta']} the token "
        f"{config['delta']} back, out of {config['vocab_size']} (chance {100 * by_length['chance']:.1f}\u2009%), "
        f"trained on sequences of {train_len} tokens, then evaluated on {config['eval_samples']:,} fresh sequences "
        f"of {train_len} and of {longest} tokens. The learned table has rows up to {longest}, but no training "
        f"step reaches rows {train_len} to {longest - 1}; the encodings by offset read the row of the offset "
        f"the task needs ({config['delta']} back) at every length, a row training did reach.</p>"
        f'<div class="table-scroll"><table><thead><tr><th>encoding</th><th>accuracy at length {train_len}</th>'
        f"<th>accuracy at positions {train_len}..{longest - 1} of length {longest}</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></div>"
    )


def _section_depth(results: dict[str, Any], figures: dict[str, str]) -> str:
    available = results["family"]["encodings"]
    learned = (
        ", ".join(
            f"<code>{_e(n)}</code>" for n, d in available.items() if not d["is_relative"] and d["far_positions"] != "ok"
        )
        or "a learned table"
    )
    inside = {n: d for n, d in available.items() if d["acts_on"] != "input"}
    offset_only = ", ".join(
        f"<code>{_e(n)}</code>" for n, d in inside.items() if d["measured_relative"] and d.get("position_aware", True)
    )
    not_offset_only = ", ".join(f"<code>{_e(n)}</code>" for n, d in inside.items() if not d["measured_relative"])
    relative = (
        (f"of them, section 7 measured {offset_only} as depending on the offset only" if offset_only else "")
        + ("; " if offset_only and not_offset_only else "")
        + (f"{not_offset_only} as absolute" if not_offset_only else "")
    ) or "none measured in section 7"
    study = results.get("study_generalization")
    beyond = ""
    if study:
        learnt = [
            f"<code>{_e(name)}</code> on {_e(task)} {100 * cell['beyond']:.0f}\u2009%"
            for name in ("learned", "shaw", "t5")
            for task, cell in study["by_encoding"].get(name, {}).items()
            if cell["in"] >= 0.9 and cell["beyond"] is not None
        ]
        if learnt:
            beyond = (
                f" In the study (<code>{_e(study['folder'])}</code>, trained on inputs of 1 to {study['train_len']} "
                "tokens), exact match past the training lengths on the tasks each learnt (90\u2009% or more within "
                f"them): {', '.join(learnt)}."
            )
    beyond += _unseen_sentence(results.get("unseen_rows"))
    return f"""
<h2 id="s8">8. The exercises</h2>
{depth.section_html(results["depth"], figures, results.get("depth_study"), results.get("depth_by_depth"))}
{_by_length_html((results.get("exercises") or {}).get("by_length"))}
<p><b>A learnable encoding</b>: {learned} (<code>selfattn.positional.LearnedPositionalEncoding</code>) learns one row
per position; it has no row past its <code>max_len</code>, which is why it refuses positions far out in
section 7. <b>Embeddings by offset</b> (Shaw et al. 2018; Huang et al. 2018) and their successors act inside
attention: {", ".join(f"<code>{_e(n)}</code>" for n in inside) or "none here"}; {relative}.{beyond}</p>
"""


def _no_study_html() -> str:
    """The study's slot when no study folder was found: what the tour trained itself, and how to train longer."""
    return (
        '<h2 id="study">Longer trained runs: the study</h2><p>No <code>selfattn study</code> folder was found '
        "(<code>./selfattn-study</code> or <code>$SELFATTN_STUDY</code>): the trained answers above are the tour's "
        "own small models, trained in this run for the steps each paragraph states. <code>selfattn study</code> "
        "trains full-size models on several tasks and <code>selfattn study --exercises</code> the exercises with "
        "more seeds and steps (an hour and more on 2 CPU cores); rerun the tour afterwards, or pass "
        "<code>--study DIR</code>, and the report reads them instead, with their folder and date.</p>"
    )


def render_report(results: dict[str, Any], figures: dict[str, str]) -> str:
    """The report page for JSON-ready ``results`` and ``{figure name: relative png path}``."""
    checks: Sequence[dict[str, Any]] = results["checks"]
    claims: Sequence[dict[str, Any]] = results.get("claims", [])
    context: dict[str, Any] = {
        "r": results,
        "figures": figures,
        "version": __version__,
        "mode": "quick sizes (<code>--quick</code>)" if results.get("quick") else "full sizes",
        "checks": checks,
        "claims": claims,
        "passed": sum(c["ok"] for c in checks),
        "claims_held": sum(c["holds"] is True for c in claims),
        "claims_failed": sum(c["holds"] is False for c in claims),
        "evidence_counts": count_evidence(list(claims)),
        "verdict_counts": count_verdicts(list(claims)),
        "depth_section": _section_depth(results, figures),
        # The study's own loader fills the slot, from the folder the tour read (its default without one).
        "study_section": study_section_html(Path(results["study_folder"]))
        if results.get("study_folder")
        else _no_study_html(),
    }
    context.update(_comparison_context(results["comparison"]))
    context.update(_positional_context(results))
    context.update(_absolute_context(results))
    context.update(_fit_context(results))
    context.update(_learning_context(results))
    context.update(_long_range_context(results))
    context.update(_note_context(results))
    context.update(_family_context(results))
    page: str = _environment().get_template("report.html.j2").render(**context)
    return page
