"""``selfattn tour``: the chapter's cells, run and checked."""

from __future__ import annotations

import argparse

from selfattn.tour import checks


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tour",
        help="walk through the chapter, checking each claim",
        description="Run the chapter's code cells and check each claim on real numbers.",
        epilog="example: selfattn tour",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    shape = checks.self_attention_shape()
    print("1. Self-attention keeps the shape (batch, queries, num_hiddens)")
    print(f"   output shape {tuple(shape['shape'])}, expected {tuple(shape['expected'])}: {'ok' if shape['ok'] else 'MISMATCH'}")
    print("\n2. Columns 6-9 of P (d=32, 60 positions), every 10th row")
    columns = checks.table_columns()
    print("   row   " + "  ".join(f"col {c:>2}" for c in (6, 7, 8, 9)))
    for row in range(0, columns.shape[0], 10):
        print(f"   {row:>3}  " + "  ".join(f"{float(x):+.3f}" for x in columns[row]))
    print("\n3. Binary representations of 0..7 (low bits flip fastest, like P's first columns)")
    for i, bits in enumerate(checks.binary_representations(8)):
        print(f"   {i} in binary is {bits}")
    error = checks.rotation_max_error()
    print("\n4. Relative positions: M_delta P[i] = P[i + delta]")
    print(f"   largest error over i, delta < 60 and all pairs j: {error:.2e}")
    return 0 if shape["ok"] and error < 1e-9 else 1
