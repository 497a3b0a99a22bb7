"""``selfattn plot``: one of the tour's figures for any encoding and size."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from selfattn._atomic import atomic_write_path
from selfattn.cli._args import (
    ExamplesFormatter,
    OneLineErrorParser,
    add_kind_argument,
    check_heads,
    positive_int,
    require_memory,
    require_output,
)
from selfattn.cli._names import PLOT_ENCODINGS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURES = ("panel", "scores", "similarity", "attention", "table", "columns")


def add_parser(subparsers: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw a figure of the tour for any encoding and size",
        description=(
            "Draw one figure for the encoding KIND on N positions with model size D and HEADS heads. "
            "Figures: panel (the tour's section 7 row: the three below side by side); scores (the attention score "
            "positions alone contribute); similarity (that score against the offset between key and query); "
            "attention (a self-attention layer's weights on one random input); table (what the encoding adds: "
            "the rows of P, rotated heads or each head's bias); columns (chosen columns of P against the position, "
            "the chapter's plot; encodings added to the input only). The format follows the extension: .png or .svg. "
            "M-RoPE is not offered: on the one line of text positions drawn here (time = height = width = the index) it is "
            "half-split rotary, with rotary's scores."
        ),
        epilog="examples:\n  selfattn plot --kind sinusoidal --figure columns -n 60 -d 32 --columns 6 7 8 9 -o cols.png\n"
        "  selfattn plot --kind sinusoidal --figure table -n 60 -d 32 -o P.svg\n"
        "  selfattn plot --kind alibi --figure panel -n 32 -d 64 --heads 8 -o alibi.png\n"
        "  selfattn plot --kind alibi --figure panel --causal -o alibi-causal.png",
        formatter_class=ExamplesFormatter,
    )
    add_kind_argument(parser, PLOT_ENCODINGS)
    parser.add_argument("--figure", choices=FIGURES, default="panel", help="which figure (default: panel)")
    parser.add_argument("-n", "--num-steps", type=positive_int, default=32, metavar="N", help="positions (default 32)")
    parser.add_argument(
        "-d", "--num-hiddens", type=positive_int, default=32, metavar="D", help="model size (default 32)"
    )
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument(
        "--causal",
        action="store_true",
        help="causal attention; encodings with two forms (ALiBi) take the causal one (default: bidirectional)",
    )
    parser.add_argument(
        "--columns",
        type=int,
        nargs="+",
        default=[6, 7, 8, 9],
        metavar="C",
        help="columns for --figure columns (default 6 7 8 9)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="FILE.png or FILE.svg (default: KIND-FIGURE.png)",
    )
    parser.set_defaults(handler=run)


def _draw(args: argparse.Namespace) -> Figure:
    from selfattn.tour import figures
    from selfattn.tour.family import encoding_diagnostics, encoding_table, has_causal_form

    n, d, heads = args.num_steps, args.num_hiddens, args.heads
    if args.figure in ("table", "columns"):
        options = {"causal": args.causal} if has_causal_form(args.kind) else {}
        table = encoding_table(args.kind, num_steps=n, num_hiddens=d, num_heads=heads, **options).numpy()
        if args.figure == "columns":
            if table.ndim != 2 or table.shape[1] != d:
                raise ValueError(f"--figure columns needs an encoding added to the input; {args.kind} is not")
            bad = [c for c in args.columns if not 0 <= c < d]
            if bad:
                raise ValueError(f"--columns must lie in [0, {d - 1}] for -d {d}, got {bad}")
            return figures.pe_columns_figure(table[:, args.columns], args.columns)
        if table.ndim == 3:  # one bias per head: show the first
            return figures.heatmap_figure(
                table[0],
                title=f"{args.kind}: bias of head 0" + (" (causal form)" if options else ""),
                xlabel="Key position",
                ylabel="Query position",
                colorbar="bias",
            )
        xlabel = "Column (encoding dimension)" if table.shape[1] == d else "Feature of a rotated head"
        return figures.heatmap_figure(
            table, title=f"{args.kind}: n={n}, d={d}", xlabel=xlabel, ylabel="Row (position)", colorbar="value"
        )
    diagnostics = encoding_diagnostics(args.kind, num_hiddens=d, num_heads=heads, num_steps=n, causal=args.causal)
    if args.figure == "panel":
        return figures.encoding_panel_figure(diagnostics)
    if args.figure == "similarity":
        return figures.profile_figure(diagnostics)
    if args.figure == "scores":
        return figures.heatmap_figure(
            diagnostics["position_scores"],
            title=f"{args.kind}: score from positions alone",
            xlabel="Key position",
            ylabel="Query position",
            colorbar="score",
        )
    return figures.heatmap_figure(
        diagnostics["attention"],
        title=f"{args.kind}: attention on one input (head 0)",
        xlabel="Key position",
        ylabel="Query position",
        colorbar="attention weight",
        cmap="Blues",
        symmetric=False,
    )


def _check_size(args: argparse.Namespace) -> None:
    """Refuse sizes whose figure data cannot fit in memory, before computing any of it."""
    from selfattn.cli.encode import check_size

    n, d, heads = args.num_steps, args.num_hiddens, args.heads
    check_size(args.kind, n, d, heads)
    if args.figure not in ("table", "columns"):
        # The diagnostics hold (n, n) float64 matrices per head and a few more: measured peaks
        # (ru_maxrss, n = 1000..1500) stay under (heads + 4) * n^2 * 72 bytes for every encoding.
        require_memory(f"--figure {args.figure} with -n {n} and --heads {heads}", (heads + 4) * n * n * 72)


def run(args: argparse.Namespace) -> int:
    output = require_output("--output", args.output or Path(f"{args.kind}-{args.figure}.png"), (".png", ".svg"))
    check_heads(args.kind, args.num_hiddens, args.heads)
    _check_size(args)
    figure = _draw(args)
    with atomic_write_path(output) as tmp:  # the figure is the old one or the complete new one
        figure.savefig(tmp, dpi=110)
    print(
        f"wrote {args.figure} of {args.kind} (n={args.num_steps}, d={args.num_hiddens}, heads={args.heads}) to {output}"
    )
    return 0
