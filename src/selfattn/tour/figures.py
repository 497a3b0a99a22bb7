"""The tour's figures: each function draws numbers computed elsewhere and returns a Figure.

Figures are built on :class:`matplotlib.figure.Figure` with the Agg canvas, never through
``pyplot``, so nothing here touches a global backend or needs a display. matplotlib is an
optional dependency (``pip install selfattn[plot]``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("the figures need matplotlib: pip install 'selfattn[plot]'") from error

__all__ = [
    "absolute_figure",
    "absolute_figures",
    "attention_weights_figure",
    "attention_weights_figures",
    "comparison_figure",
    "deep_stack_figure",
    "deep_stack_figures",
    "encoding_panel_figure",
    "encoding_panel_figures",
    "heatmap_figure",
    "note_figure",
    "note_figures",
    "pe_columns_figure",
    "pe_heatmap_figure",
    "pe_heatmap_figures",
    "permutation_figure",
    "profile_figure",
    "relative_figure",
    "save_figure",
]

_LAYER_STYLE = {
    "cnn": ("CNN", "tab:blue", "o"),
    "rnn": ("RNN", "tab:orange", "s"),
    "self_attention": ("Self-attention", "tab:green", "^"),
}


def _figure(width: float, height: float, columns: int = 1, rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False)
    return fig, list(axes.ravel())


def _apart(width: float, height: float, count: int) -> tuple[list[Figure], list[Axes]]:
    """``count`` figures of one panel each, ``width`` x ``height`` inches apiece, and their axes."""
    drawn = [_figure(width, height) for _ in range(count)]
    return [fig for fig, _ in drawn], [axes[0] for _, axes in drawn]


def save_figure(fig: Figure, directory: Path | str, name: str) -> list[Path]:
    """Write ``name.png`` and ``name.svg`` into ``directory``; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.png", directory / f"{name}.svg"]
    fig.savefig(paths[0], dpi=110)
    fig.savefig(paths[1])
    return paths


def _heatmap(
    fig: Figure,
    ax: Axes,
    values: np.ndarray,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    cmap: str = "Blues",
    colorbar: str | None = None,
    symmetric: bool = False,
    **imshow_options: Any,
) -> None:
    values = np.asarray(values, dtype=float)
    if symmetric:
        bound = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
        bound = bound or 1.0
        imshow_options.update(vmin=-bound, vmax=bound)
    image = ax.imshow(values, cmap=cmap, aspect="auto", interpolation="nearest", **imshow_options)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colorbar, shrink=0.9)


def _draw_attention_weights(
    figs: list[Figure], axes: list[Axes], weights: np.ndarray, valid_lens: Sequence[int], head: int
) -> None:
    for fig, ax, sequence, valid_len in zip(figs, axes, weights, valid_lens, strict=True):
        _heatmap(
            fig,
            ax,
            sequence[head],
            xlabel="Key position",
            ylabel="Query position",
            title=f"valid_len = {valid_len} (head {head})",
            colorbar="attention weight",
            vmin=0.0,
            vmax=1.0,
        )
        ax.axvline(valid_len - 0.5, color="tab:red", linestyle="--", linewidth=1.2, label="masked keys start")
        ax.legend(loc="lower left", fontsize=8)


def attention_weights_figure(weights: np.ndarray, valid_lens: Sequence[int], head: int = 0) -> Figure:
    """Section 1: one heat map per sequence of the batch, masked keys at exactly 0."""
    fig, axes = _figure(4.2 * len(valid_lens), 3.6, columns=len(valid_lens))
    _draw_attention_weights([fig] * len(axes), axes, weights, valid_lens, head)
    return fig


def attention_weights_figures(weights: np.ndarray, valid_lens: Sequence[int], head: int = 0) -> dict[str, Figure]:
    """The panels of :func:`attention_weights_figure`, each its own figure (the report wraps them when narrow)."""
    figs, axes = _apart(4.2, 3.6, len(valid_lens))
    _draw_attention_weights(figs, axes, weights, valid_lens, head)
    return {f"valid_len_{valid_len}": fig for fig, valid_len in zip(figs, valid_lens, strict=True)}


def permutation_figure(without_pe_error: float, with_pe_change: float) -> Figure:
    """Section 2: how far f(X[perm]) is from f(X)[perm], without and with P (log scale)."""
    fig, (ax,) = _figure(6.4, 2.8)
    labels = ["f = self-attention", "f = self-attention of X + P"]
    values = [max(without_pe_error, 1e-18), with_pe_change]
    bars = ax.barh(labels, values, color=["tab:green", "tab:orange"])
    ax.set_xscale("log")
    ax.set_xlabel("max |f(X)[perm] - f(X[perm])|")
    ax.set_title("Permuting tokens permutes outputs, until P is added")
    ax.bar_label(bars, labels=[f"{v:.1e}" for v in values], padding=3)
    ax.set_xlim(1e-18, 10)
    return fig


def comparison_figure(results: dict[str, Any], *, stacked: bool = False) -> Figure:
    """Section 3: counted FLOPs against n and d, path lengths, parallelism and timed wall-clock seconds.

    ``stacked``: the six panels in one column, for a narrow window (the report picks it below
    600 px), instead of two.
    """
    sweep = results["sweep"]
    ns, ds = sweep["n"], sweep["d"]
    fig, axes = _figure(5.2, 26.0, columns=1, rows=6) if stacked else _figure(10.5, 11.0, columns=2, rows=3)
    panels = [
        (axes[0], ns, "flops_by_n", "flops_exponent_n", f"n (tokens), d = {sweep['fixed_d']}", "FLOPs (counted)"),
        (axes[1], ds, "flops_by_d", "flops_exponent_d", f"d (features), n = {sweep['fixed_n']}", "FLOPs (counted)"),
        (axes[2], ns, "path_length_by_n", "path_length_exponent_n", "n (tokens)", "matrix products on the path"),
        (axes[3], ns, "parallelism_by_n", "parallelism_exponent_n", "n (tokens)", "positions per sequential step"),
        (axes[4], ns, "seconds_by_n", "time_exponent_n", f"n (tokens), d = {sweep['fixed_d']}", "forward time (s)"),
    ]
    for ax, xs, key, exponent_key, xlabel, ylabel in panels:
        for kind, (label, colour, marker) in _LAYER_STYLE.items():
            entry = results[kind]
            ax.plot(
                xs,
                entry[key],
                marker=marker,
                color=colour,
                label=f"{label}: slope {round(entry[exponent_key], 2) + 0.0:.2f}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    sa = results["self_attention"]
    crossings = results.get("crossings", {})
    for ax, xs, key in ((axes[0], ns, "layer_flops_by_n"), (axes[1], ds, "layer_flops_by_d")):
        ax.plot(xs, sa[key], linestyle="--", color="tab:green", label="Self-attention layer (8nd² + 4n²d)")
    for ax, key in ((axes[0], "core_equals_rnn_at_n"), (axes[1], "core_equals_rnn_at_d")):
        if crossings.get(key):
            ax.axvline(crossings[key], color="grey", linestyle=":", label=f"core = RNN at {crossings[key]:,.0f}")
    for kind, (_label, colour, _marker) in _LAYER_STYLE.items():
        rounds = np.asarray(results[kind]["seconds_by_n_rounds"])  # (rounds, len(ns))
        axes[4].fill_between(ns, rounds.min(0), rounds.max(0), color=colour, alpha=0.2)
    for ax in axes[:5]:
        ax.legend(fontsize=7)
    if crossings:
        axes[5].plot(ns, crossings["core_over_rnn_by_n"], marker="^", color="tab:green", label="attention core / RNN")
        axes[5].plot(
            ns, crossings["layer_over_rnn_by_n"], linestyle="--", color="tab:green", label="attention layer / RNN"
        )
        axes[5].axhline(1.0, color="grey", linewidth=0.8)
        axes[5].set_xscale("log", base=2)
        axes[5].set_yscale("log")
        axes[5].set_xlabel(f"n (tokens), d = {sweep['fixed_d']}")
        axes[5].set_ylabel("FLOPs ratio")
        axes[5].set_title("Attention against the RNN (ratio of counted FLOPs)")
        axes[5].grid(True, which="both", alpha=0.3)
        axes[5].legend(fontsize=7)
    else:
        axes[5].set_axis_off()
    axes[0].set_title("Compute against n (solid: score and value matmuls)")
    axes[1].set_title("Compute against d (dashed: whole attention layer)")
    axes[2].set_title(f"Shortest path from input 1 to output n (CNN k = {sweep['fixed_k']})")
    axes[3].set_title("Parallelism: n / sequential operations")
    axes[4].set_title(
        f"Wall-clock, 1 thread, {sweep.get('rounds', 1)} rounds (band: spread; slopes from n = "
        f"{results['cnn']['time_fit_from_n']:,})"
    )
    if stacked:  # one narrow column: titles wrap instead of running past the panel
        for ax in axes:
            ax.set_title(textwrap.fill(ax.get_title(), 48), fontsize=9)
    return fig


def pe_columns_figure(columns: np.ndarray, column_ids: Sequence[int], periods: Sequence[float] | None = None) -> Figure:
    """Section 4: the chapter's plot of columns of P against the position."""
    fig, (ax,) = _figure(7.0, 3.0)
    positions = np.arange(columns.shape[0])
    for index, column in enumerate(column_ids):
        label = f"Col {column}" + ("" if periods is None else f" (period {periods[index]:.1f})")
        ax.plot(positions, columns[:, index], label=label)
    ax.set_xlabel("Row (position)")
    ax.set_ylabel("P[row, col]")
    ax.set_title("Columns of P: lower columns oscillate faster")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    return fig


def pe_heatmap_figure(table: np.ndarray, bits: np.ndarray | None = None) -> Figure:
    """Section 4: the heat map of P, and the binary representations of 0..7 beside it."""
    if bits is None:
        fig, axes = _figure(4.6, 4.4)
    else:
        fig, axes = _figure(8.2, 4.4, columns=2)
    _draw_pe_heatmap([fig] * len(axes), axes, table, bits)
    return fig


def pe_heatmap_figures(table: np.ndarray, bits: np.ndarray) -> dict[str, Figure]:
    """The two panels of :func:`pe_heatmap_figure`, each its own figure (the report wraps them when narrow)."""
    figs, axes = _apart(4.6, 4.4, 2)
    _draw_pe_heatmap(figs, axes, table, bits)
    return dict(zip(("table", "bits"), figs, strict=True))


def _draw_pe_heatmap(figs: list[Figure], axes: list[Axes], table: np.ndarray, bits: np.ndarray | None) -> None:
    _heatmap(
        figs[0],
        axes[0],
        table,
        xlabel="Column (encoding dimension)",
        ylabel="Row (position)",
        title="P: frequency falls along the columns",
        colorbar="value",
        cmap="RdBu_r",
        symmetric=True,
    )
    if bits is not None:
        width = bits.shape[1]
        _heatmap(
            figs[1],
            axes[1],
            bits,
            xlabel="Bit",
            ylabel="Number",
            title="0..7 in binary: higher bits flip slower",
            colorbar="bit value",
            vmin=0,
            vmax=1,
        )
        axes[1].set_xticks(range(width), [f"2^{width - 1 - b}" for b in range(width)])
        for row in range(bits.shape[0]):
            for col in range(width):
                axes[1].text(
                    col,
                    row,
                    str(bits[row, col]),
                    ha="center",
                    va="center",
                    color="white" if bits[row, col] else "black",
                )


def absolute_figure(curves: dict[str, Any], precision: dict[str, Any]) -> Figure:
    """Section 5: distance between positions i and i + delta along i, and float32 drift far out."""
    fig, axes = _figure(10.5, 3.6, columns=2)
    _draw_absolute(axes, curves, precision)
    return fig


def absolute_figures(curves: dict[str, Any], precision: dict[str, Any]) -> dict[str, Figure]:
    """The two panels of :func:`absolute_figure`, each its own figure (the report wraps them when narrow)."""
    figs, axes = _apart(5.25, 3.6, 2)
    _draw_absolute(axes, curves, precision)
    return dict(zip(("distance", "precision"), figs, strict=True))


def _draw_absolute(axes: list[Axes], curves: dict[str, Any], precision: dict[str, Any]) -> None:
    for delta, gaps in zip(curves["deltas"], curves["distances"], strict=True):
        axes[0].plot(np.arange(len(gaps)), gaps, label=f"delta = {delta}")
    axes[0].set_xlabel("position i")
    axes[0].set_ylabel("|P[i] - P[i + delta]|")
    axes[0].set_title("The distance depends on delta, not on i")
    axes[0].legend(fontsize=8, ncol=2)
    axes[1].plot(precision["lengths"], precision["textbook_error"], marker="o", label="textbook (float32 angles)")
    axes[1].plot(precision["lengths"], precision["selfattn_error"], marker="s", label="selfattn (float64 angles)")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("sequence length")
    axes[1].set_ylabel("max error against float64 formula")
    axes[1].set_title("Far positions: float32 angles drift")
    axes[1].legend(fontsize=8)
    axes[1].grid(True, which="both", alpha=0.3)


def relative_figure(similarity: dict[str, Any]) -> Figure:
    """Section 6: ``P[i] . P[i + delta]`` against delta, one curve per starting position i."""
    fig, (ax,) = _figure(7.0, 3.2)
    styles = ["-", "--", "-.", ":"]
    for index, (start, curve) in enumerate(zip(similarity["starts"], similarity["similarity"], strict=True)):
        ax.plot(
            similarity["deltas"],
            curve,
            linestyle=styles[index % len(styles)],
            linewidth=2.2 - 0.4 * index,
            label=f"i = {start}",
        )
    ax.set_xlabel("offset delta")
    ax.set_ylabel("P[i] . P[i + delta]")
    ax.set_title(f"The similarity depends on delta only (spread over i: {similarity['spread']:.1e})")
    ax.legend(fontsize=8)
    return fig


def heatmap_figure(
    values: np.ndarray,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar: str,
    cmap: str = "RdBu_r",
    symmetric: bool = True,
) -> Figure:
    """One labelled heat map with a colour bar (used by ``selfattn plot``)."""
    fig, (ax,) = _figure(5.0, 4.2)
    _heatmap(
        fig, ax, values, xlabel=xlabel, ylabel=ylabel, title=title, colorbar=colorbar, cmap=cmap, symmetric=symmetric
    )
    return fig


def _draw_profile(ax: Axes, deltas: Sequence[int], scores: Sequence[float], spread: float, name: str) -> None:
    ax.plot(deltas, scores, color="tab:purple", label=f"mean over i (spread {spread:.1e})")
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("delta = key position - query position")
    ax.set_ylabel("position score")
    ax.set_title(f"{name}: score against offset")
    ax.legend(fontsize=8)


def profile_figure(diagnostics: dict[str, Any]) -> Figure:
    """The position score against the offset delta (used by ``selfattn plot``)."""
    fig, (ax,) = _figure(6.0, 3.2)
    _draw_profile(
        ax, diagnostics["deltas"], diagnostics["score_by_delta"], diagnostics["shift_spread"], diagnostics["name"]
    )
    return fig


def _draw_position_scores(fig: Figure, ax: Axes, diagnostics: dict[str, Any], name: str) -> None:
    _heatmap(
        fig,
        ax,
        diagnostics["position_scores"],
        xlabel="Key position",
        ylabel="Query position",
        title=f"{name}: score from positions alone",
        colorbar="score",
        cmap="RdBu_r",
        symmetric=True,
    )


def _draw_attention(fig: Figure, ax: Axes, diagnostics: dict[str, Any], name: str) -> None:
    _heatmap(
        fig,
        ax,
        diagnostics["attention"],
        xlabel="Key position",
        ylabel="Query position",
        title=f"{name}: attention on one input (head 0)",
        colorbar="attention weight",
        vmin=0.0,
    )


def _panel_names(diagnostics: dict[str, Any]) -> tuple[str, str]:
    """The encoding's name with its form (for the first panel's title) and without."""
    short = str(diagnostics["name"])
    return (f"{short} ({diagnostics['form']})" if diagnostics.get("form") else short), short


def encoding_panel_figure(diagnostics: dict[str, Any]) -> Figure:
    """One encoding's position scores, offset profile and attention pattern side by side (``selfattn plot``)."""
    name, short = _panel_names(diagnostics)
    fig, axes = _figure(13.0, 3.7, columns=3)
    _draw_position_scores(fig, axes[0], diagnostics, name)
    _draw_profile(axes[1], diagnostics["deltas"], diagnostics["score_by_delta"], diagnostics["shift_spread"], short)
    _draw_attention(fig, axes[2], diagnostics, short)
    return fig


def encoding_panel_figures(diagnostics: dict[str, Any]) -> dict[str, Figure]:
    """Section 7: the three panels of :func:`encoding_panel_figure`, each its own figure.

    The report lays them side by side where there is room and one under the other where there is
    not, so each keeps a readable size in a narrow window.
    """
    name, short = _panel_names(diagnostics)
    scores, (scores_ax,) = _figure(4.4, 3.7)
    _draw_position_scores(scores, scores_ax, diagnostics, name)
    profile, (profile_ax,) = _figure(4.4, 3.7)
    _draw_profile(profile_ax, diagnostics["deltas"], diagnostics["score_by_delta"], diagnostics["shift_spread"], short)
    attention, (attention_ax,) = _figure(4.4, 3.7)
    _draw_attention(attention, attention_ax, diagnostics, short)
    return {"scores": scores, "profile": profile, "attention": attention}


_ENCODING_COLORS = {
    "none": "tab:gray",
    "sinusoidal": "tab:blue",
    "learned": "tab:cyan",
    "rotary": "tab:orange",
    "alibi": "tab:green",
    "t5": "tab:red",
    "shaw": "tab:purple",
}
_DEEP_ROWS = (
    ("position_r2", "position R$^2$ (held out)", "linear"),
    ("order_accuracy", "order probe accuracy", "linear"),
    ("position_share", "position share", "log"),
    ("mean_row_residual", "mean-row residual", "log"),
)


def _draw_deep_panel(ax: Axes, deep: dict[str, Any], which: str, metric: str, scale: str, variant: str) -> None:
    """One metric against depth for one block kind: a line per encoding (mean over seeds), the range shaded."""
    layers = np.asarray(deep["layers"])
    floor = 1e-17
    for encoding, by_variant in deep[which].items():
        if variant not in by_variant:
            continue
        entry = by_variant[variant][metric]
        mean, low, high = (np.asarray(entry[k], dtype=float) for k in ("mean", "min", "max"))
        if scale == "log":
            mean, low, high = (np.maximum(v, floor) for v in (mean, low, high))
        else:
            mean, low, high = (np.maximum(v, -0.2) for v in (mean, low, high))
        color = _ENCODING_COLORS.get(encoding)
        ax.plot(layers, mean, marker=".", color=color, label=encoding, linewidth=1.2)
        ax.fill_between(layers, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_yscale(scale)
    if metric == "position_r2":
        ax.set_ylim(-0.22, 1.05)
    elif metric == "order_accuracy":
        ax.axhline(0.5, color="black", linewidth=0.6, linestyle=":")
        ax.set_ylim(0.3, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="major", alpha=0.3)


def _deep_variants(deep: dict[str, Any], which: str) -> list[str]:
    return list(next(iter(deep[which].values())))


def deep_stack_figure(deep: dict[str, Any], which: str = "untrained") -> Figure:
    """Section 8: each metric of the deep-stack measurement against depth, one panel per block kind.

    Rows: position R^2, order accuracy, position share, mean-row residual; columns: the block
    kinds (with / without residuals and MLP); one line per encoding (the mean over seeds) with
    the range over seeds shaded. R^2 is drawn from -0.2 (lower values sit on the edge); the
    log panels from 1e-17.
    """
    variants = _deep_variants(deep, which)
    fig, axes = _figure(3.3 * len(variants), 2.3 * len(_DEEP_ROWS), columns=len(variants), rows=len(_DEEP_ROWS))
    for row, (metric, label, scale) in enumerate(_DEEP_ROWS):
        for column, variant in enumerate(variants):
            ax = axes[row * len(variants) + column]
            _draw_deep_panel(ax, deep, which, metric, scale, variant)
            if row == 0:
                ax.set_title(variant.replace("_", " "), fontsize=10)
            if row == len(_DEEP_ROWS) - 1:
                ax.set_xlabel("layer (0 = input)")
            if column == 0:
                ax.set_ylabel(label)
    axes[0].legend(fontsize=7, ncol=2)
    seeds = deep["config"]["train_seeds" if which == "trained" else "seeds"]
    fig.suptitle(f"{which.capitalize()} deep stacks: mean over {seeds} seeds, range shaded", fontsize=11)
    return fig


def deep_stack_figures(deep: dict[str, Any], which: str = "untrained") -> dict[str, Figure]:
    """Section 8: the columns of :func:`deep_stack_figure`, one figure per block kind (the four metrics stacked).

    The report lays them side by side where there is room and one under the other where there is
    not, so each keeps a readable size in a narrow window. Each panel has its own y label; the
    first figure carries the legend of the encodings.
    """
    figures: dict[str, Figure] = {}
    for index, variant in enumerate(_deep_variants(deep, which)):
        fig, axes = _figure(3.5, 2.4 * len(_DEEP_ROWS), rows=len(_DEEP_ROWS))
        for ax, (metric, label, scale) in zip(axes, _DEEP_ROWS, strict=True):
            _draw_deep_panel(ax, deep, which, metric, scale, variant)
            ax.set_ylabel(label)
        axes[0].set_title(variant.replace("_", " "), fontsize=11)
        axes[-1].set_xlabel("layer (0 = input)")
        if index == 0:
            axes[0].legend(fontsize=7, ncol=2)
        figures[variant] = fig
    return figures


def note_figure(terms: dict[str, Any], survival: dict[str, Any]) -> Figure:
    """The study note's two questions: what each term contributes to the scores, what survives of a token."""
    fig, axes = _figure(10.5, 3.6, columns=2)
    _draw_note(axes, terms, survival)
    return fig


def note_figures(terms: dict[str, Any], survival: dict[str, Any]) -> dict[str, Figure]:
    """The two panels of :func:`note_figure`, each its own figure (the report wraps them when narrow)."""
    figs, axes = _apart(5.25, 3.6, 2)
    _draw_note(axes, terms, survival)
    return dict(zip(("score_terms", "tokens"), figs, strict=True))


def _draw_note(axes: list[Axes], terms: dict[str, Any], survival: dict[str, Any]) -> None:
    labels = ["content-content", "content-position", "position-position"]
    keys = ["content_content", "content_position", "position_position"]
    width = 0.8 / len(terms["scales"])
    for index, entry in enumerate(terms["scales"]):
        offsets = np.arange(3) + index * width
        bars = axes[0].bar(offsets, [entry[k] for k in keys], width, label=f"content scale {entry['scale']:g}")
        axes[0].bar_label(bars, labels=[f"{entry[k]:.0%}" for k in keys], fontsize=7)
    axes[0].set_xticks(np.arange(3) + width * (len(terms["scales"]) - 1) / 2, labels)
    axes[0].set_ylabel("share of the scores (squared norm)")
    axes[0].set_ylim(0, 1.1)
    axes[0].set_title("Scores of x + P split into three terms")
    axes[0].legend(fontsize=8)
    sizes = survival["sizes"]
    axes[1].plot(sizes, survival["recovered"], marker="o", label="N(0, 1) embeddings (nn.Embedding)")
    axes[1].plot(sizes, survival["recovered_unit"], marker="s", label="unit-norm embeddings")
    axes[1].set_xscale("log", base=2)
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_xlabel("model size d")
    axes[1].set_ylabel("tokens recovered after adding P")
    axes[1].set_title(f"Nearest of {survival['vocabulary']:,} tokens to E[t] + P[i]")
    axes[1].legend(fontsize=8)
    axes[1].grid(True, alpha=0.3)
