"""``selfattn encode``: write a positional encoding's table to .npy, .csv or .pt."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from selfattn._atomic import atomic_write_path
from selfattn.cli._args import (
    ExamplesFormatter,
    OneLineErrorParser,
    add_kind_argument,
    base_number,
    check_heads,
    non_negative_int,
    positive_int,
    require_memory,
    require_output,
)

_DTYPES = ("float32", "float64")  # torch dtypes by name: torch is imported only when the command runs
_FORMATS = (".npy", ".csv", ".pt")


def add_parser(subparsers: argparse._SubParsersAction[OneLineErrorParser]) -> None:
    parser = subparsers.add_parser(
        "encode",
        help="write an encoding's table (P, rotated heads or biases) to a file",
        description=(
            "Write what an encoding contributes at positions OFFSET .. OFFSET+N-1: for encodings added to the input "
            "the rows of P (N, D); for rotary an all-ones head after rotation (N, D/HEADS); for score encodings "
            "(alibi, t5, shaw) the bias of every head (HEADS, N, N). The format follows the extension of -o: "
            ".npy (numpy.save), .csv (2-D tables only) or .pt (torch.save)."
        ),
        epilog="examples:\n  selfattn encode --kind sinusoidal -n 60 -d 32 -o P.npy\n"
        "  selfattn encode --kind sinusoidal -n 8 -d 6 --offset 1000 --base 100 --dtype float64 -o P.csv\n"
        "  selfattn encode --kind alibi -n 16 -d 32 --heads 8 -o alibi.pt",
        formatter_class=ExamplesFormatter,
    )
    add_kind_argument(parser)
    parser.add_argument("-n", "--num-steps", type=positive_int, default=60, metavar="N", help="positions (default 60)")
    parser.add_argument(
        "-d", "--num-hiddens", type=positive_int, default=32, metavar="D", help="model size (default 32)"
    )
    parser.add_argument("--heads", type=positive_int, default=1, help="attention heads (default 1)")
    parser.add_argument("--offset", type=non_negative_int, default=0, help="position of the first row (default 0)")
    parser.add_argument("--base", type=base_number, default=None, help="the 10000 of sinusoidal and rotary")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="default float32")
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="FILE.npy, FILE.csv or FILE.pt"
    )
    parser.set_defaults(handler=run)


def table_shape(kind: str, num_steps: int, num_hiddens: int, num_heads: int) -> tuple[int, ...]:
    """The shape :func:`~selfattn.tour.family.encoding_table` gives, known before building anything."""
    from selfattn.positional.registry import acts_on

    where = acts_on(kind)
    if where == "scores":
        return (num_heads, num_steps, num_steps)
    if where == "query_key":
        return (num_steps, num_hiddens // num_heads)
    return (num_steps, num_hiddens)


# Peak bytes per element of the result, measured with ru_maxrss at n, d in the thousands: the
# tables of input and rotary encodings are built in float64 beside their angles (up to 57),
# score encodings build one float bias per head and copy it once (up to 19).
_PEAK_BYTES_PER_ELEMENT = {"input": 64, "query_key": 64, "scores": 24}


def check_size(kind: str, num_steps: int, num_hiddens: int, num_heads: int) -> None:
    """Refuse a table that cannot fit in memory, before allocating it."""
    from selfattn.positional.registry import acts_on

    shape = table_shape(kind, num_steps, num_hiddens, num_heads)
    require_memory(
        f"the table of --kind {kind}, of shape {shape},", math.prod(shape) * _PEAK_BYTES_PER_ELEMENT[acts_on(kind)]
    )


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from selfattn._validation import require_position
    from selfattn.tour.family import encoding_table

    suffix = require_output("--output", args.output, _FORMATS).suffix.lower()
    check_heads(args.kind, args.num_hiddens, args.heads)
    check_size(args.kind, args.num_steps, args.num_hiddens, args.heads)  # first: an -n this large is its size
    require_position("--offset", args.offset, args.num_steps)
    options = {} if args.base is None else {"base": args.base}
    table = encoding_table(
        args.kind,
        num_steps=args.num_steps,
        num_hiddens=args.num_hiddens,
        num_heads=args.heads,
        offset=args.offset,
        dtype=getattr(torch, args.dtype),
        **options,
    )
    if suffix == ".csv" and table.dim() != 2:
        raise ValueError(f"CSV holds 2-D tables; {args.kind} gives a {tuple(table.shape)} array: use .npy or .pt")
    with atomic_write_path(args.output) as tmp:  # the file is the old one or the complete new one
        if suffix == ".npy":
            np.save(tmp, table.numpy())
        elif suffix == ".csv":
            np.savetxt(tmp, table.numpy(), delimiter=",", fmt="%.17g" if args.dtype == "float64" else "%.9g")
        else:
            with open(tmp, "wb") as file:  # an unwritable path raises OSError here, not deep in torch.save
                torch.save(table, file)
    print(f"wrote {args.kind} {tuple(table.shape)} {args.dtype} to {args.output}")
    return 0
