"""Section 8, exercise 1: what happens to position in a deep stack of self-attention layers.

The measurement itself is :func:`selfattn.study.deep_stack.measure_deep_stack` (probes of
absolute position and of order, rank collapse, position share, after every layer). The tour
runs it on *untrained* stacks only; stacks trained by ``selfattn study`` are shown when its
output is given (:func:`study_deep_stack`). This module also writes the section's HTML from
the measured numbers (:func:`section_html`), so every sentence follows the data.

Shape legend: b sequences, n positions, d model size.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfattn.study.deep_stack import ENCODINGS, VARIANTS, measure_deep_stack
from selfattn.tour._html import figure_html

__all__ = [
    "COLLAPSED",
    "CONVERGING",
    "by_depth_html",
    "measure",
    "progress_count",
    "section_html",
    "study_by_depth",
    "study_deep_stack",
    "summary_line",
    "verdict_numbers",
]

COLLAPSED = 1e-6
"""A mean-row residual below this counts as collapsed: every row the same to 6 digits."""

CONVERGING = 1e-3
"""Rows whose mean-row residual fell below this fraction of the input's are described as collapsing."""

_VARIANT_LABELS = {
    "residual": "residual + MLP",
    "residual_no_mlp": "residual, no MLP",
    "no_residual": "no residual + MLP",
    "no_residual_no_mlp": "no residual, no MLP",
}


_QUICK_VARIANTS = ("residual", "no_residual")


def measure(
    *, depth: int, seeds: int, quick: bool = False, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The untrained measurement the tour shows: every encoding; all four variants unless ``quick``.

    ``progress`` is called once per encoding and variant (:func:`progress_count` times), so a
    progress bar moves during the minute this takes.
    """
    if quick:
        return measure_deep_stack(
            depth=depth, seeds=seeds, variants=_QUICK_VARIANTS, num_hiddens=16, num_heads=2,
            ffn_hiddens=32, num_steps=16, num_sequences=32, test_sequences=8, train_steps=0, progress=progress,
        )  # fmt: skip
    return measure_deep_stack(depth=depth, seeds=seeds, train_steps=0, progress=progress)


def progress_count(*, depth: int, seeds: int, quick: bool = False) -> int:
    """How many times :func:`measure` calls ``progress``: once per encoding and variant."""
    return len(ENCODINGS) * (len(_QUICK_VARIANTS) if quick else len(VARIANTS))


def study_deep_stack(study_dir: Path | str | None) -> dict[str, Any] | None:
    """``results.json["deep_stack"]`` of a ``selfattn study`` output folder, or None when there is none.

    Raises:
        ValueError: the folder is given but holds no readable ``results.json``.
    """
    if study_dir is None:
        return None
    path = Path(study_dir) / "results.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        if (Path(study_dir) / "exercises.json").is_file():
            return None  # a folder of `selfattn study --exercises` alone
        raise ValueError(
            f"study_dir={str(study_dir)!r} holds no readable results.json ({error}) and no exercises.json"
        ) from None
    stack = data.get("deep_stack") if isinstance(data, dict) else None
    return stack if isinstance(stack, dict) else None


def study_by_depth(study_dir: Path | str | None) -> dict[str, Any] | None:
    """``deep_stack_by_depth`` of a study folder (:func:`selfattn.study.deep_stack.trained_by_depth`).

    Read from ``exercises.json`` (``selfattn study --exercises``), else from ``results.json``.
    None when there is no study or it holds no such entry (a folder that cannot be read is
    reported by :func:`study_deep_stack`, which the tour calls first).
    """
    if study_dir is None:
        return None
    for name in ("exercises.json", "results.json"):
        try:
            data = json.loads((Path(study_dir) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found = data.get("deep_stack_by_depth") if isinstance(data, dict) else None
        if isinstance(found, dict) and "stacks" in found:
            return found
    return None


def by_depth_html(by_depth: dict[str, Any]) -> str:
    """Stacks of each depth trained until their accuracy levelled off: a table and which did not train."""
    config, chance = by_depth["config"], by_depth["chance"]
    rows, not_trained, not_learnt = [], [], []
    for encoding, by_variant in by_depth["stacks"].items():
        for variant, entries in by_variant.items():
            label = _VARIANT_LABELS.get(variant, variant)
            for entry in entries:
                name = f"<code>{_e(encoding)}</code>, {_e(label)}, depth {entry['depth']}"
                if not entry["trains"]:
                    not_trained.append(name)
                elif not entry["learnt"]:
                    not_learnt.append(name)
                rows.append(
                    f'<tr><td><code>{_e(encoding)}</code></td><td>{_e(label)}</td><td class="num">{entry["depth"]}</td>'
                    f'<td class="num">{entry["steps"]:,}</td><td class="num">{_num(entry["task_accuracy"])}</td>'
                    f"<td>{'yes' if entry['levelled_off'] else 'no (step limit)'}</td>"
                    f'<td class="num">{_num(entry["position_r2"])}</td>'
                    f'<td class="num">{_num(entry["order_accuracy"])}</td></tr>'
                )
    head = (
        "<tr><th>encoding</th><th>block</th><th>depth</th><th>steps</th><th>task accuracy</th><th>levelled off</th>"
        "<th>position R&sup2;, last layer</th><th>order accuracy, last layer</th></tr>"
    )
    return (
        f"<p><b>Trained until the accuracy levels off</b> ({_e(by_depth.get('source', 'from selfattn study --exercises'))}"
        f"; d = {config['num_hiddens']}): for each depth "
        f"{', '.join(map(str, config['depths']))}, a stack trained on the previous-token task, its held-out accuracy "
        f"checked every {config['check_every']} steps, stopped at 0.99 or once it rose less than 0.01 in "
        f"{config['patience']} checks (at most {config['max_steps']:,} steps), then probed. Chance is {_num(chance)}. "
        f"<b>Did not train</b> (within 0.05 of chance): {'; '.join(not_trained) or 'none'}. Trained but did not learn "
        f"the task (below 0.9): {'; '.join(not_learnt) or 'none'}.</p>"
        f'<div class="table-scroll"><table><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table></div>'
    )


# Reading the numbers ------------------------------------------------------------------------------


def _metric(deep: dict[str, Any], which: str, encoding: str, variant: str, metric: str) -> dict[str, Any] | None:
    try:
        return deep[which][encoding][variant][metric]  # type: ignore[no-any-return]
    except (KeyError, TypeError):
        return None


def _last(deep: dict[str, Any], which: str, encoding: str, variant: str, metric: str, stat: str = "mean") -> float:
    entry = _metric(deep, which, encoding, variant, metric)
    return float("nan") if entry is None else float(entry[stat][-1])


def verdict_numbers(deep: dict[str, Any]) -> dict[str, float]:
    """The numbers the tour's checks of section 8 test (sinusoidal input, untrained, over seeds).

    ``collapse_ratio``: largest final mean-row residual without residuals over its value at the
    input; ``residual_rows_min``: smallest final mean-row residual with residuals;
    ``residual_share_min``: smallest final position share with residuals.
    """
    rows = _metric(deep, "untrained", "sinusoidal", "no_residual", "mean_row_residual")
    kept = _metric(deep, "untrained", "sinusoidal", "residual", "mean_row_residual")
    share = _metric(deep, "untrained", "sinusoidal", "residual", "position_share")
    nan = float("nan")
    return {
        "collapse_ratio": nan if rows is None else float(rows["max"][-1] / rows["min"][0]),
        "residual_rows_min": nan if kept is None else float(kept["min"][-1]),
        "residual_share_min": nan if share is None else float(share["min"][-1]),
    }


def summary_line(deep: dict[str, Any]) -> str:
    """One line for the terminal summary."""
    depth, seeds = deep["layers"][-1], deep["config"]["seeds"]
    share = _metric(deep, "untrained", "sinusoidal", "residual", "position_share")
    collapsed = _collapsed(deep, "no_residual")
    text = f"  8. deep stacks ({depth} untrained layers, {seeds} seeds): without residuals rows collapse with "
    text += (", ".join(collapsed) or "no encoding") + "; "
    if share is not None:
        text += (
            f"with residuals the sinusoidal position share goes {share['mean'][0]:.2f} -> {share['mean'][-1]:.2f} "
            f"(seeds {share['min'][-1]:.2f}-{share['max'][-1]:.2f})"
        )
    return text


def _shrink_factor(entry: dict[str, Any]) -> float:
    """Per-layer factor of the largest (over seeds) curve over the last quarter of the layers."""
    high = entry["max"]
    span = max(1, len(high) // 4)
    if high[-1 - span] <= 0:
        return float("nan")
    return float((max(high[-1], 0.0) / high[-1 - span]) ** (1 / span))


def _collapsed(deep: dict[str, Any], variant: str) -> list[str]:
    """Encodings whose rows collapse: in every seed the last layer's mean-row residual is below
    :data:`CONVERGING` of the input's, or the largest one still halves (or faster) per layer."""
    out = []
    for encoding in deep["untrained"]:
        entry = _metric(deep, "untrained", encoding, variant, "mean_row_residual")
        if entry is not None and (entry["max"][-1] < CONVERGING * entry["min"][0] or _shrink_factor(entry) < 0.5):
            out.append(encoding)
    return out


# HTML ---------------------------------------------------------------------------------------------


def _e(text: object) -> str:
    return html.escape(str(text))


def _num(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "0"
    return f"{value:.1e}" if abs(value) < 1e-2 else f"{value:.2f}"


def _spread(entry: dict[str, Any] | None, layer: int = -1) -> str:
    if entry is None:
        return "n/a"
    low, mean, high = entry["min"][layer], entry["mean"][layer], entry["max"][layer]
    if len(entry["by_seed"]) == 1:
        return _num(mean)
    return f"{_num(mean)} ({_num(low)} to {_num(high)})"


def _figure(figures: dict[str, str], name: str, caption: str) -> str:
    return figure_html(figures, name, caption, panel_width=250)


def _spread_cell(text: str) -> str:
    """A table cell for ``mean (low to high)``: the range may go to a second line, so the table fits its box."""
    mean, _, rest = text.partition(" (")
    spread = f' <span class="range">({_e(rest)}</span>' if rest else ""
    return f'<td class="num spread">{_e(mean)}{spread}</td>'


def _table(deep: dict[str, Any], which: str) -> str:
    layer_label = f"layer {deep['layers'][-1]}"
    head = (
        "<tr><th>encoding</th><th>block</th>"
        + ("<th>task accuracy</th>" if which == "trained" else "")
        + f"<th>position R&sup2;, {layer_label}</th><th>order accuracy, {layer_label}</th>"
        f"<th>mean-row residual, {layer_label}</th><th>position share, layer 1</th>"
        f"<th>position share, {layer_label}</th></tr>"
    )
    rows = []
    for encoding, by_variant in deep[which].items():
        for variant in by_variant:
            cells = [
                f'<td class="name"><code>{_e(encoding)}</code></td><td>{_e(_VARIANT_LABELS.get(variant, variant))}</td>'
            ]
            if which == "trained":
                accuracy = by_variant[variant].get("task_accuracy")
                cells.append(_spread_cell(_spread(_scalar_as_layers(accuracy))))
            for metric, layer in (
                ("position_r2", -1),
                ("order_accuracy", -1),
                ("mean_row_residual", -1),
                ("position_share", 1),
                ("position_share", -1),
            ):
                cells.append(_spread_cell(_spread(_metric(deep, which, encoding, variant, metric), layer)))
            rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="table-scroll"><table><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table></div>'


def _scalar_as_layers(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {key: ([value] if key != "by_seed" else [[v] for v in value]) for key, value in entry.items()}


def _falling(entry: dict[str, Any]) -> str:
    """What the last quarter of the layers does to the mean curve, measured."""
    mean = entry["mean"]
    span = max(1, len(mean) // 4)
    change = (mean[-1] - mean[-1 - span]) / span
    if change < 0:
        return f"and is still falling (by {_num(-change)} per layer over the last {span} layers)"
    return f"and no longer falls (it changes by {_num(change)} per layer over the last {span} layers)"


def _sentences(deep: dict[str, Any]) -> list[str]:
    depth = deep["layers"][-1]
    seeds = deep["config"]["seeds"]
    out = []
    collapsed = _collapsed(deep, "no_residual")
    kept = [e for e in deep["untrained"] if e not in collapsed and "no_residual" in deep["untrained"][e]]
    if collapsed:
        r2_max = max(_last(deep, "untrained", e, "no_residual", "position_r2", "max") for e in collapsed)
        order_max = max(_last(deep, "untrained", e, "no_residual", "order_accuracy", "max") for e in collapsed)
        inside = [e for e in collapsed if e not in ("none", "sinusoidal", "learned")]
        finals = []
        for e in collapsed:
            entry = _metric(deep, "untrained", e, "no_residual", "mean_row_residual")
            assert entry is not None
            factor = _shrink_factor(entry)
            shrinking = f", still x{_num(factor)} per layer" if entry["max"][-1] >= COLLAPSED else ""
            finals.append(f"<code>{_e(e)}</code> {_num(entry['max'][-1])}{shrinking}")
        out.append(
            f"<b>Without residual connections</b> the rows collapse towards one vector: after {depth} layers the "
            f"largest mean-row residual over the seeds is {'; '.join(finals)}. Over these encodings and seeds the "
            f"last layer gives position R&sup2; at most {_num(r2_max)} and order accuracy at most {_num(order_max)} "
            "(0.5 is chance)."
            + (
                f" Encodings inside attention ({', '.join(f'<code>{_e(e)}</code>' for e in inside)}) are given to "
                "every layer and collapse all the same."
                if inside
                else ""
            )
        )
    for encoding in kept:
        share = _metric(deep, "untrained", encoding, "no_residual", "position_share")
        r2 = _metric(deep, "untrained", encoding, "no_residual", "position_r2")
        rows = _metric(deep, "untrained", encoding, "no_residual", "mean_row_residual")
        out.append(
            f"With <code>{_e(encoding)}</code> the rows do not collapse without residuals (mean-row residual "
            f"{_spread(rows)}): the position share after "
            f"{depth} layers is {_spread(share)} and position R&sup2; is {_spread(r2)}."
            + (
                " (Shaw's encoding adds a learned vector per clipped offset to the values in every layer, and the "
                "offsets a token sees depend on where it sits in the sequence.)"
                if encoding == "shaw"
                else ""
            )
        )
    share = _metric(deep, "untrained", "sinusoidal", "residual", "position_share")
    if share is not None:
        out.append(
            f"<b>With residual connections</b> nothing collapses (mean-row residual {_spread(_metric(deep, 'untrained', 'sinusoidal', 'residual', 'mean_row_residual'))} "
            f"for <code>sinusoidal</code> after {depth} layers), but position does not simply survive either: its share "
            f"of the rows of a repeated token falls from {_num(share['mean'][0])} at the input to {_spread(share)} "
            f"after {depth} layers ({seeds} seeds: mean, then the smallest to the largest) {_falling(share)}."
        )
        r2 = _metric(deep, "untrained", "sinusoidal", "residual", "position_r2")
        if r2 is not None:
            reads = "still reads" if min(r2["mean"]) > 0.5 else "reads less and less of"
            out.append(
                f"A linear probe {reads} the absolute position from those rows: held-out R&sup2; "
                f"{_num(r2['mean'][0])} at the input, {_spread(r2)} after {depth} layers."
            )
    relative = [e for e in deep["untrained"] if e not in ("none", "sinusoidal")]
    if relative and "residual" in deep["untrained"][relative[0]]:
        best = max(relative, key=lambda e: _last(deep, "untrained", e, "residual", "order_accuracy"))
        at_input = _metric(deep, "untrained", relative[0], "residual", "position_r2")
        out.append(
            "Encodings inside attention add nothing to the input rows (position R&sup2; at the input "
            f"{_num(float('nan') if at_input is None else at_input['mean'][0])}). With residuals, "
            f"after {depth} layers: position R&sup2; "
            + ", ".join(
                f"<code>{_e(e)}</code> {_num(_last(deep, 'untrained', e, 'residual', 'position_r2'))}" for e in relative
            )
            + "; order accuracy "
            + ", ".join(
                f"<code>{_e(e)}</code> {_num(_last(deep, 'untrained', e, 'residual', 'order_accuracy'))}"
                for e in relative
            )
            + f" (0.5 is chance; highest: <code>{_e(best)}</code>)."
        )
    blind = []
    for encoding in relative:
        share = _metric(deep, "untrained", encoding, "residual", "position_share")
        if share is not None and max(share["max"]) < 1e-9:
            blind.append((encoding, max(share["max"])))
    if blind:
        out.append(
            "On a sequence of one repeated token, "
            + ", ".join(f"<code>{_e(e)}</code>" for e, _ in blind)
            + f" leave every row the same at every layer (position share at most {_num(max(v for _, v in blind))}): "
            "they change only the attention weights, and here every value is the same vector."
        )
    if "none" in deep["untrained"]:
        nope = _metric(deep, "untrained", "none", "residual", "position_r2") or _metric(
            deep, "untrained", "none", "no_residual", "position_r2"
        )
        if nope is not None:
            verdict = "no better than guessing the mean position" if max(nope["max"]) < 0.05 else "measured, not zero"
            causal = "causal" if deep["config"]["causal"] else "bidirectional"
            out.append(
                f"Without any encoding (<code>none</code>), {causal} attention: position R&sup2; after {depth} layers "
                f"is {_spread(nope)} ({verdict}; at most {_num(max(nope['max']))} at any layer)."
            )
    return out


def _trained_sentences(trained: dict[str, Any]) -> list[str]:
    """What the study's trained stacks measured: task accuracy, then what the probes read after training."""
    data = trained["trained"]
    depth = trained["layers"][-1]
    out = []
    variants = list(next(iter(data.values())))
    config = trained["config"]
    chance = 1 / config["vocab_size"]  # the previous token, uniform over the vocabulary
    steps = config["train_steps"]
    for variant in variants:
        accuracies = []
        untrained: list[str] = []
        partly: list[str] = []
        learnt: list[str] = []
        for encoding, by_variant in data.items():
            entry = by_variant.get(variant, {}).get("task_accuracy")
            if entry is not None:
                mean = float(entry["mean"])
                accuracies.append(f"<code>{_e(encoding)}</code> {_num(mean)}")
                (untrained if mean < chance + 0.05 else partly if mean < 0.5 else learnt).append(
                    f"<code>{_e(encoding)}</code>"
                )
        out.append(f"Held-out task accuracy, {_e(_VARIANT_LABELS.get(variant, variant))}: {', '.join(accuracies)}.")
        out.append(
            f"{_e(_VARIANT_LABELS.get(variant, variant))}: <b>did not train</b> in {steps} steps (within 5 points of "
            f"chance, {_num(chance)}): {', '.join(untrained) or 'none'}; trained partly (below 0.5): "
            f"{', '.join(partly) or 'none'}; learnt the task (0.5 or more): {', '.join(learnt) or 'none'}. The budget "
            "is fixed, not run until the accuracy levels off, so a stack that did not train here may train with more "
            "steps; its probes describe a stack that has not learnt the task."
        )
    for variant in variants:
        parts = []
        for encoding in data:
            r2 = _last(trained, "trained", encoding, variant, "position_r2")
            order = _last(trained, "trained", encoding, variant, "order_accuracy")
            rows = _last(trained, "trained", encoding, variant, "mean_row_residual", "max")
            parts.append(f"<code>{_e(encoding)}</code> {_num(r2)} / {_num(order)} / {_num(rows)}")
        out.append(
            f"After training, {_e(_VARIANT_LABELS.get(variant, variant))}, layer {depth}: position R&sup2; / order "
            f"accuracy / largest mean-row residual: {'; '.join(parts)}."
        )
    return out


def section_html(
    deep: dict[str, Any],
    figures: dict[str, str],
    trained: dict[str, Any] | None = None,
    by_depth: dict[str, Any] | None = None,
) -> str:
    """The deep-stack part of section 8, written from the measured numbers.

    Args:
        deep: the tour's untrained measurement (:func:`measure`), JSON-ready.
        figures: ``{figure name: png path}``; ``depth`` (and ``depth_trained``) are shown if present.
        trained: ``results.json["deep_stack"]`` of a study (:func:`study_deep_stack`), or None.
        by_depth: ``results.json["deep_stack_by_depth"]`` of a study (:func:`study_by_depth`), or None.
    """
    config = deep["config"]
    variants = "; ".join(_VARIANT_LABELS.get(v, v) for v in deep["variants"])
    intro = (
        f"<p><b>Deep stacks of self-attention with positional encoding</b> (measured on <i>untrained</i>, randomly "
        f"initialized stacks). Each stack is {deep['layers'][-1]} pre-LN blocks of "
        f"<code>selfattn.models.TransformerBlock</code> (d = {config['num_hiddens']}, {config['num_heads']} heads, "
        f"{'causal' if config['causal'] else 'bidirectional'} attention), {len(deep['variants'])} kinds "
        f"({_e(variants)}); an input "
        "encoding is added to the token embeddings once, an encoding inside attention is given to every block. "
        f"Each reads {config['num_sequences']} random sequences of {config['num_steps']} tokens in float64, "
        f"{config['seeds']} seeds per stack. After every layer: a linear probe of absolute position (ridge regression, "
        f"fitted on {config['num_sequences'] - config['test_sequences']} sequences, R&sup2; on the other "
        f"{config['test_sequences']}; 0 is no better than the mean position), a linear probe of order (is token i "
        "before token j, from the pair of rows; 0.5 is chance), the <i>mean-row residual</i> "
        "|H - mean row| / |H| (0 when every row is the same vector: rank collapse), and the <i>position share</i>, "
        "the same residual on a sequence of one repeated token, where only position can tell the rows apart.</p>"
    )
    sentences = "".join(f"<p>{s}</p>" for s in _sentences(deep))
    table = _table(deep, "untrained")
    caption = "Untrained random stacks: position probe, order probe, position share and mean-row residual against depth"
    parts = [intro, sentences, _figure(figures, "depth", caption), table]
    if trained and trained.get("trained"):
        tconf = trained["config"]
        parts.append(
            f"<p><b>Trained stacks</b> (from the <code>selfattn study</code> output): the same stacks trained for "
            f"{tconf['train_steps']} steps of {tconf.get('train_batch_size', 16)} sequences to predict the previous "
            f"token ({tconf['train_seeds']} seeds), then probed the same way. The task accuracy (held-out "
            "sequences) tells which stacks learnt the task.</p>"
        )
        parts.append("".join(f"<p>{sentence}</p>" for sentence in _trained_sentences(trained)))
        parts.append(_figure(figures, "depth_trained", "Trained stacks: the same measurements after training"))
        parts.append(_table(trained, "trained"))
    else:
        parts.append(
            '<p class="note">These are untrained stacks: they show what stacking does to position before any '
            "learning, not what a trained model keeps"
            + ("; stacks trained by depth follow below" if by_depth else "")
            + ". <code>selfattn study</code> trains the full-size stacks on a task that needs positions and probes "
            "them again; <code>selfattn tour --study DIR</code> shows those results here.</p>"
        )
    if by_depth:
        parts.append(by_depth_html(by_depth))
    return "\n".join(p for p in parts if p)
