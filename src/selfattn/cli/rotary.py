"""``selfattn rotary``: every frequency pair of a rotary setup, scaled and not, and its precision per dtype."""

from __future__ import annotations

import argparse
import decimal
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from selfattn._atomic import atomic_write_path
from selfattn.cli._args import ExamplesFormatter, base_number, positive_int, require_output

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "angle_errors", "frequency_rows", "parse_scaling", "run"]

_ERROR_DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name: torch is imported only when the command runs
_MEASURED_POSITIONS = 4096  # the last positions of the context, where angles are largest


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rotary",
        help="show every rotary frequency pair (scaled vs not) and the angle error of each dtype",
        description=(
            "For a rotary setup (a Hugging Face config.json, or --head-dim/--base/--scaling), print one row per "
            "rotated pair: its wavelength in tokens before and after scaling, how much the scaling stretched it, how "
            "many turns it makes within the context, and whether it completes a turn at all. A second table measures, "
            "over the last positions of the context, the angle error when the angle is formed in each dtype (as most "
            "implementations do) and of selfattn's float64 angles rounded once to that dtype, both against the exact "
            "angle of the float64 frequency (60-digit decimals). --plot draws the "
            "wavelengths."
        ),
        epilog="examples:\n  selfattn rotary --config config.json\n"
        "  selfattn rotary --head-dim 128 --base 500000 --context 131072 --scaling "
        "'llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192'\n"
        '  selfattn rotary --head-dim 64 --scaling \'{"rope_type": "yarn", "factor": 4, '
        '"original_max_position_embeddings": 4096}\' --plot yarn.png',
        formatter_class=ExamplesFormatter,
    )
    parser.add_argument("--config", type=Path, default=None, metavar="FILE", help="a Hugging Face config.json")
    parser.add_argument("--head-dim", type=positive_int, default=None, help="size of each head (default 128)")
    parser.add_argument("--base", type=base_number, default=None, help="rope_theta (default 10000)")
    parser.add_argument("--rotary-dim", type=positive_int, default=None, help="rotated features (default: all)")
    parser.add_argument(
        "--scaling",
        default=None,
        metavar="SPEC",
        help="a rope_scaling JSON object, or TYPE:KEY=VALUE,... (e.g. linear:factor=4)",
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="context length (default: max_position_embeddings, else original * factor, else 4096)",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="also draw FILE.png or FILE.svg")
    parser.set_defaults(handler=run)


def parse_scaling(spec: str) -> dict[str, Any]:
    """``--scaling``: a JSON object, or ``TYPE:KEY=VALUE,...`` with JSON values."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--scaling is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--scaling must be a JSON object, got {text!r}")
        return value
    kind, _, rest = text.partition(":")
    scaling: dict[str, Any] = {"rope_type": kind}
    for item in filter(None, rest.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--scaling entries must be KEY=VALUE, got {item!r}")
        try:
            scaling[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(
                f"--scaling value of {key} must be a number, true/false or a JSON list, got {raw!r}"
            ) from None
    return scaling


def _encoding(args: argparse.Namespace) -> tuple[Any, int | None]:
    """The encoding and ``max_position_embeddings`` (if the config has one)."""
    from selfattn.positional import RotaryPositionalEncoding

    scaling = None if args.scaling is None else parse_scaling(args.scaling)
    if args.config is not None:
        if args.head_dim is not None or args.rotary_dim is not None:
            raise ValueError("--config gives the sizes; drop --head-dim / --rotary-dim")
        try:
            config = json.loads(args.config.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"--config {str(args.config)!r} is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {str(args.config)!r} must hold a JSON object")
        if args.base is not None:
            config["rope_theta"] = args.base
        if scaling is not None:
            config["rope_scaling"], config["rope_parameters"] = scaling, None
        return RotaryPositionalEncoding.from_config(config), config.get("max_position_embeddings")
    head_dim = args.head_dim or 128
    encoding = RotaryPositionalEncoding(
        head_dim, 10000.0 if args.base is None else args.base, False, rotary_dim=args.rotary_dim, scaling=scaling
    )
    return encoding, None


def _context(args: argparse.Namespace, encoding: Any, max_positions: int | None) -> int:
    if args.context is not None:
        return int(args.context)
    if max_positions:
        return int(max_positions)
    config = encoding.scaling_config
    if config is not None and config.original_max_position_embeddings and config.factor:
        return int(config.original_max_position_embeddings * config.factor)
    return 4096


def frequency_rows(encoding: Any, context: int) -> list[dict[str, Any]]:
    """One dict per rotated pair: wavelengths, stretch, turns within ``context``, rotation status."""
    from selfattn.functional import rotary_frequencies

    unscaled = rotary_frequencies(encoding.rotary_dim, encoding.base)
    scaled, _ = encoding.frequencies_at(context)
    rows = []
    for j, (w0, w) in enumerate(zip(unscaled.tolist(), scaled.tolist(), strict=True)):
        wavelength = math.inf if w == 0 else 2 * math.pi / w
        turns = 0.0 if w == 0 else (context - 1) * w / (2 * math.pi)
        if w == 0:
            rotates = "no (p-RoPE)"
        elif turns >= 1:
            rotates = "yes"
        else:
            rotates = f"part: {360 * turns:.0f} deg"
        stretch = math.inf if w == 0 else w0 / w
        rows.append(
            {
                "pair": j,
                "wavelength": 2 * math.pi / w0,
                "scaled_wavelength": wavelength,
                "stretch": stretch,
                "scaled": w == 0 or abs(stretch - 1) > 1e-12,
                "turns": turns,
                "rotates": rotates,
            }
        )
    return rows


def _wrapped(diff: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.remainder(diff + math.pi, 2 * math.pi) - math.pi


#: pi to 80 digits: angles are reduced modulo 2 pi exactly enough at any position a float64 holds (2**63 rad and more).
_PI = "3.1415926535897932384626433832795028841971693993751058209749445923078164062862089986"


def _reduced(angles: list[list[decimal.Decimal]]) -> torch.Tensor:
    """float64 ``(l, r/2)``: each angle reduced to ``[-pi, pi]`` in 60-digit decimals, then rounded once. A float64
    product or remainder of an angle near 2**53 rad is off by up to a radian itself: no reference for a float32."""
    import torch

    context = decimal.Context(prec=60, traps=[])  # an infinite angle (float16 past 65,504) becomes NaN
    two_pi = context.multiply(2, decimal.Decimal(_PI))
    return torch.tensor(
        [[float(context.remainder_near(a, two_pi)) for a in row] for row in angles], dtype=torch.float64
    )


def angle_errors(encoding: Any, context: int) -> list[dict[str, Any]]:
    """Measured largest angle error over the last positions of the context, per dtype.

    ``in_dtype``: the angle ``position * frequency`` formed in that dtype (positions and
    frequencies cast to it first); ``selfattn``: each pair of a unit vector rotated by
    :meth:`RotaryPositionalEncoding.forward` in that dtype, its angle read back with atan2.
    Both against the exact angle of the float64 frequency (:func:`_reduced`); NaN where the dtype cannot hold the
    positions.
    """
    import torch

    from selfattn.functional._rotary import _rotate_by_positions

    frequencies, _ = encoding.frequencies_at(context)
    positions = torch.arange(max(context - _MEASURED_POSITIONS, 0), context)  # (l,)
    # The exact angle of the float64 frequency at each integer position (Decimal of a float is exact): (l, r/2)
    exact_frequencies = [decimal.Decimal(f) for f in frequencies.tolist()]
    product = decimal.Context(prec=60).multiply
    exact = _reduced([[product(decimal.Decimal(p), f) for f in exact_frequencies] for p in positions.tolist()])
    pairs = frequencies.shape[0]
    unit = torch.zeros(positions.shape[0], encoding.rotary_dim, dtype=torch.float64)
    unit[:, :pairs] = 1.0  # half-split: first feature of every pair
    results = []
    for name in _ERROR_DTYPES:
        dtype = getattr(torch, name)
        formed = (positions.to(dtype)[:, None] * frequencies.to(dtype)[None, :]).double()
        formed = _reduced([[decimal.Decimal(a) for a in row] for row in formed.tolist()])  # inf stays inf: NaN below
        in_dtype = float(_wrapped(formed - exact).abs().max())
        rotated = _rotate_by_positions(
            unit.to(dtype), positions, frequencies, interleaved=False, rotary_dim=encoding.rotary_dim
        ).double()
        read_back = torch.atan2(rotated[:, pairs:], rotated[:, :pairs])
        ours = float(_wrapped(read_back - exact).abs().max())
        results.append({"dtype": name, "in_dtype": in_dtype, "selfattn": ours})
    return results


def _print_tables(encoding: Any, context: int, rows: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
    config = encoding.scaling_config
    title = (
        f"rotary: head_dim={encoding.head_dim}, rotary_dim={encoding.rotary_dim}, base={encoding.base:g}, "
        f"scaling={'none' if config is None else config.as_dict()}, attention_factor={encoding.attention_factor:.6g}, "
        f"context={context}"
    )
    headers = ["pair", "wavelength", "scaled wavelength", "stretch", "scaled", "turns in context", "rotates"]
    body = [
        [
            str(row["pair"]),
            f"{row['wavelength']:.4g}",
            f"{row['scaled_wavelength']:.4g}",
            f"{row['stretch']:.4g}",
            "yes" if row["scaled"] else "no",
            f"{row['turns']:.4g}",
            row["rotates"],
        ]
        for row in rows
    ]
    error_headers = ["dtype", "angle formed in dtype (rad)", "selfattn, float64 angle (rad)"]
    error_body = [
        [e["dtype"], "overflow" if math.isnan(e["in_dtype"]) else f"{e['in_dtype']:.3g}", f"{e['selfattn']:.3g}"]
        for e in errors
    ]
    note = (
        f"angle errors: largest over positions {max(context - _MEASURED_POSITIONS, 0)}..{context - 1}, "
        "measured against the exact angle of each float64 frequency"
    )
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without the optional extra
        print(title)
        for line in [headers, *body, [], error_headers, *error_body]:
            print("  ".join(line))
        print(note)
        return
    console = Console(width=None if Console().is_terminal else 140)
    table = Table(title=title, box=box.SIMPLE)
    for header in headers:
        table.add_column(header, justify="left" if header == "rotates" else "right")
    for line in body:
        table.add_row(*line, style=None if line[4] == "no" else "bold")
    console.print(table)
    errors_table = Table(title=note, box=box.SIMPLE)
    for header in error_headers:
        errors_table.add_column(header, justify="right")
    for line in error_body:
        errors_table.add_row(*line)
    console.print(errors_table)


def _plot(path: Path, rows: list[dict[str, Any]], context: int, trained: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [row["pair"] for row in rows]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(pairs, [row["wavelength"] for row in rows], "o-", ms=3, label="unscaled")
    axis.plot(pairs, [row["scaled_wavelength"] for row in rows], "s-", ms=3, label="scaled")
    axis.axhline(context, color="k", ls="--", lw=1, label=f"context {context}")
    if trained:
        axis.axhline(trained, color="gray", ls=":", lw=1, label=f"trained length {trained}")
    axis.set_yscale("log")
    axis.set_xlabel("pair j (fastest first)")
    axis.set_ylabel("wavelength (tokens)")
    axis.legend()
    figure.tight_layout()
    with atomic_write_path(path) as tmp:  # the figure is the old one or the complete new one
        figure.savefig(tmp, dpi=110)
    plt.close(figure)


def _check_sizes(args: argparse.Namespace) -> None:
    """``--head-dim`` and ``--rotary-dim``, checked here so that the message names the flags."""
    for flag, value in (("--head-dim", args.head_dim), ("--rotary-dim", args.rotary_dim)):
        if value is not None and value % 2:
            raise ValueError(f"{flag} must be even (rotary turns features in pairs), got {value}")
    head_dim = 128 if args.head_dim is None else args.head_dim
    if args.config is None and args.rotary_dim is not None and args.rotary_dim > head_dim:
        raise ValueError(f"--rotary-dim {args.rotary_dim} must be at most --head-dim {head_dim}")


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        require_output("--plot", args.plot, (".png", ".svg"))
    _check_sizes(args)
    encoding, max_positions = _encoding(args)
    context = _context(args, encoding, max_positions)
    rows = frequency_rows(encoding, context)
    errors = angle_errors(encoding, context)
    _print_tables(encoding, context, rows, errors)
    if args.plot is not None:
        config = encoding.scaling_config
        _plot(args.plot, rows, context, None if config is None else config.original_max_position_embeddings)
        print(f"wrote the wavelength plot to {args.plot}")
    return 0
