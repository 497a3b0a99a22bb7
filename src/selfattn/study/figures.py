"""The study's figures, each saved as PNG and SVG (atomically).

Shape legend: n positions, d model size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from selfattn._atomic import atomic_write_path
from selfattn.study.training import encoding_label

__all__ = [
    "accuracy_figure",
    "answer_use_figure",
    "context_gain_figure",
    "cosine_similarity",
    "learned_table_figure",
    "perplexity_by_position_figure",
    "save_figure",
    "training_checks_figure",
]


def save_figure(fig: Any, folder: Path, stem: str) -> list[str]:
    """Write ``folder/stem.png`` and ``.svg``; return their names."""
    import matplotlib.pyplot as plt

    names = []
    for suffix in (".png", ".svg"):
        path = folder / f"{stem}{suffix}"
        with atomic_write_path(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
        names.append(path.name)
    plt.close(fig)
    return names


def _by_label(runs: list[dict[str, Any]], task: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run["task"] == task:
            groups.setdefault(encoding_label(run), []).append(run)
    return groups


def accuracy_figure(results: dict[str, Any], task: str, folder: Path) -> list[str]:
    """Exact match against input length, one curve per encoding, shaded min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    groups = _by_label(results["runs"], task)
    for index, (label, members) in enumerate(groups.items()):
        lengths = sorted(int(n) for n in members[0]["accuracy_by_length"])
        table = np.array([[run["accuracy_by_length"][str(n)] for n in lengths] for run in members])  # (seeds, n)
        style = "--" if label.endswith("+rand") else "-"
        color = f"C{index % 10}"
        ax.plot(
            lengths,
            table.mean(axis=0),
            style,
            color=color,
            label=f"{label} ({len(members)} seed{'s' if len(members) > 1 else ''})",
        )
        ax.fill_between(lengths, table.min(axis=0), table.max(axis=0), color=color, alpha=0.15, linewidth=0)
    limit = int(results["config"]["train_len"])
    ax.axvline(limit, color="black", linewidth=0.8)
    ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
    ax.text(limit, 1.02, " longest training input", fontsize=8, va="bottom")
    ax.set(xlabel="input length n", ylabel="exact match of the answer", ylim=(-0.02, 1.08), title=f"{task}")
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    return save_figure(fig, folder, f"accuracy_{task}")


def training_checks_figure(results: dict[str, Any], task: str, folder: Path) -> list[str]:
    """Exact match past the training lengths at each check during training, one curve per encoding (mean over
    seeds); empty when the runs hold no checks with a reading past ``L`` (runs made before it was recorded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tracked(run: dict[str, Any]) -> bool:  # checks of the form [step, in range, beyond]
        checks = run.get("checks") or []
        return bool(checks) and all(len(check) > 2 and check[2] is not None for check in checks)

    groups = {
        label: members
        for label, members in _by_label(results["runs"], task).items()
        if all(tracked(run) for run in members)
    }
    if not groups:
        return []
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for index, (label, members) in enumerate(groups.items()):
        shortest = min(len(run["checks"]) for run in members)  # early-stopped runs have fewer checks
        steps = [check[0] for check in members[0]["checks"][:shortest]]
        past = np.array([[c[2] for c in run["checks"][:shortest]] for run in members])  # (seeds, checks)
        ax.plot(steps, past.mean(axis=0), color=f"C{index % 10}", label=f"{label} ({len(members)} seeds)")
    ax.set(xlabel="training step", ylabel="exact match past the training lengths", ylim=(-0.02, 1.02),
           title=f"{task}: accuracy past L during training (mean over seeds)")  # fmt: skip
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    return save_figure(fig, folder, f"training_{task}")


def cosine_similarity(table: np.ndarray) -> np.ndarray:
    """``(n, n)`` cosine similarity of the rows of an ``(n, d)`` table."""
    rows = table / np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-12)
    similarity: np.ndarray = rows @ rows.T
    return similarity


def learned_table_figure(
    learned: np.ndarray, initial: np.ndarray, sinusoid: np.ndarray, trained_rows: int, folder: Path
) -> list[str]:
    """The trained learned table's similarity matrix beside the sinusoid's, and how far each row moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), layout="constrained", gridspec_kw={"width_ratios": [1, 1, 1.3]})
    for ax, table, title in (
        (axes[0], learned, "learned P after training"),
        (axes[1], sinusoid, "sinusoidal P"),
    ):
        image = ax.imshow(cosine_similarity(table), cmap="RdBu_r", vmin=-1, vmax=1)
        ax.axvline(trained_rows - 0.5, color="black", linewidth=0.8)
        ax.axhline(trained_rows - 0.5, color="black", linewidth=0.8)
        ax.set(title=f"{title}: cosine similarity of rows", xlabel="position", ylabel="position")
    fig.colorbar(image, ax=axes[1], fraction=0.046, pad=0.02)
    moved = np.linalg.norm(learned - initial, axis=1) / np.maximum(np.linalg.norm(initial, axis=1), 1e-12)
    axes[2].plot(np.arange(len(moved)), moved)
    axes[2].axvline(trained_rows - 0.5, color="black", linewidth=0.8)
    axes[2].set(
        title="learned rows: distance moved in training",
        xlabel="position (line: longest training sequence)",
        ylabel="|P_trained - P_init| / |P_init|",
    )
    return save_figure(fig, folder, "learned_vs_sinusoidal")


def _band_centres(bands: list[dict[str, Any]]) -> np.ndarray:
    """Geometric centre of each band ``[a, b)`` of positions (``a = 0`` counts as 1): where it sits on a log axis."""
    return np.array([np.sqrt(max(band["start"], 1) * band["stop"]) for band in bands])


#: Markers of the lines past the colour cycle's ten: a line is told by its colour and marker together.
_MARKERS = ("o", "s", "^", "D", "v", "P")


def _line_look(index: int) -> dict[str, Any]:
    """The ``index``-th line's colour and marker: no two of the first 60 lines look the same (the text study draws
    about 20, more than one colour cycle)."""
    return {"color": f"C{index % 10}", "marker": _MARKERS[index // 10 % len(_MARKERS)]}


def perplexity_by_position_figure(
    summary: dict[str, dict[str, dict[str, Any]]], train_len: int, folder: Path
) -> list[str]:
    """Text study: perplexity against position at each row's longest evaluated length, log scales, one line per row
    (mean over seeds; bars: the 95% interval where there are seeds to give one). Empty when no row has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    for row, by_length in summary.items():
        longest = max((n for n, cell in by_length.items() if cell.get("by_position")), key=int, default=None)
        if longest is not None:
            curves.append((row, by_length[longest]["by_position"]))
    if not curves:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for index, (row, bands) in enumerate(curves):
        means = np.array([band["perplexity"]["mean"] for band in bands])
        halves = np.array([band["perplexity"].get("half_width") or 0.0 for band in bands])
        style = "--" if row.startswith("rotary+") else "-"
        ax.errorbar(_band_centres(bands), means, yerr=halves, fmt=style, markersize=4, capsize=2, label=row,
                    **_line_look(index))  # fmt: skip
    ax.axvline(train_len, color="black", linewidth=0.8)
    ax.text(train_len, ax.get_ylim()[1], " L", va="top", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="position in the window (band centre)", ylabel="perplexity per byte",
           title="Perplexity by position (longest window of each row; mean over seeds)")  # fmt: skip
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: the curves fill the axes
    return save_figure(fig, folder, "perplexity_by_position")


def context_gain_figure(gains: dict[str, list[dict[str, Any]]], train_len: int, folder: Path) -> list[str]:
    """Text study: the gain from the bytes past ``L`` (last-``L``-bytes loss minus whole-window loss, nats per byte)
    against position, one line per encoding, bars the 95% interval over seeds. Empty without gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not gains:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for index, (encoding, bands) in enumerate(gains.items()):
        means = np.array([band["gain"]["mean"] for band in bands])
        halves = np.array([band["gain"].get("half_width") or 0.0 for band in bands])
        ax.errorbar(_band_centres(bands), means, yerr=halves, markersize=4, capsize=2, label=encoding,
                    **_line_look(index))  # fmt: skip
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel=f"position in the window (band centre; context past L = {train_len} bytes)",
           ylabel="gain from context past L (nats per byte)",
           title="Does the model use the bytes past L? (> 0: yes)")  # fmt: skip
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, folder, "context_gain")


def answer_use_figure(cells: dict[str, dict[str, Any]], task: str, folder: Path) -> list[str]:
    """Past L: answer tokens right by position in the answer (left), and what the tokens beyond a window of L's
    length add (right: whole sample minus ``BOS`` + window, on the answer tokens a window shortens).

    ``cells`` is one task's summary (``{encoding: {"answer_use": ...}}``); one line per encoding over the bands
    of answer positions, the mean over seeds with bars for the 95% interval. Empty when no encoding has the
    readings.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {label: s["answer_use"] for label, s in cells.items() if s.get("answer_use")}
    if not rows:
        return []
    first = next(iter(rows.values()))
    names = [f"{a}-{b}" for a, b in first["bands"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (label, use) in enumerate(rows.items()):
        for ax, cells_of in ((left, use["full"]), (right, use["far_gain"])):
            shown = [(i, cell) for i, cell in enumerate(cells_of) if cell]
            ax.errorbar([i for i, _ in shown], [100 * c["mean"] for _, c in shown], markersize=4, capsize=2,
                        yerr=[100 * (c.get("half_width") or 0.0) for _, c in shown], label=label,
                        **_line_look(index))  # fmt: skip
    for ax in (left, right):
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("position in the answer")
    left.set(ylabel="answer tokens right (%)", title=f"{task}, lengths past L: whole sample")
    right.axhline(0.0, color="grey", linewidth=0.8)
    right.set(ylabel="whole sample minus window (points)",
              title=f"gain from the tokens beyond BOS + the last {first['window'] - 1}\n"
                    "(> 0: used; where the source lies beyond the window, trivially)")  # fmt: skip
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, folder, f"answer_use_{task}")
