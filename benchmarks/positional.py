"""Cost of each positional encoding inside selfattn's MultiHeadAttention, as a ratio to no encoding.

Run from the repository root::

    .venv/bin/python benchmarks/positional.py            # full run, writes its section of BENCHMARKS.md
    .venv/bin/python benchmarks/positional.py --quick    # smoke run: small n, prints only

Every encoding comes from ``selfattn.positional.build(name, num_hiddens=512, num_heads=8)``.
Input encodings (sinusoidal, learned, N-D sinusoidal) are added to the input before the same
attention (the N-D ones see the sequence as a square / cubic grid); rotary and score terms are
given to ``MultiHeadAttention(position=...)``. All of them, and the plain attention they are
compared with, are timed round-robin in one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    BENCHMARKS_MD,
    GIB,
    emit,
    load_average,
    log,
    machine_lines,
    measure,
    memory_headroom,
    ms,
    resolve_device,
    run_memory_child,
    size,
    spread_note,
    table,
)

import selfattn  # noqa: E402
from selfattn.positional import NAMES, InputEncoding, build  # noqa: E402

BATCH, NUM_HIDDENS, NUM_HEADS = 2, 512, 8
# Extra rows beyond the registry's defaults: (label, name, options).
VARIANTS = [("shaw (keys only)", "shaw", {"values": False})]


def grid(n: int, axes: int) -> tuple[int, ...]:
    """Split ``n`` positions into ``axes`` sizes as equal as possible (exact for powers of two)."""
    sizes = []
    for remaining_axes in range(axes, 0, -1):
        side = round(n ** (1 / remaining_axes))
        while n % side:
            side -= 1
        sizes.append(side)
        n //= side
    return tuple(sizes)


def spatial_axes(encoding: nn.Module) -> int:
    """How many grid axes an input encoding expects before the features (1 for sequences)."""
    return getattr(encoding, "num_axes", 1)


def make_encoding(name: str, options: dict, max_len: int) -> nn.Module | None:
    """``build(name, ...)``; the learned table is given room for the longest sequence measured."""
    if name == "learned":
        options = {"max_len": max_len, **options}
    return build(name, num_hiddens=NUM_HIDDENS, num_heads=NUM_HEADS, **options)


def contender(encoding: nn.Module | None, device: torch.device, seed: int = 0):
    """(modules, call(x)) for attention with ``encoding`` in its place."""
    torch.manual_seed(seed)
    if encoding is None or isinstance(encoding, InputEncoding):
        mha = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS).to(device)
    else:
        mha = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, position=encoding).to(device)
    if not isinstance(encoding, InputEncoding):
        return [mha], lambda x: mha(x, x, x)
    encoding = encoding.to(device)
    axes = spatial_axes(encoding)

    def call(x):
        b, n, d = x.shape
        y = encoding(x.reshape(b, *grid(n, axes), d)).reshape(b, n, d)  # (b, n1, ..., nk, d) -> (b, n, d)
        return mha(y, y, y)

    return [mha, encoding], call


def attention_kernel(call, device: torch.device, *, training: bool) -> str:
    """Which attention kernel a call runs, read from ``torch.profiler`` at a small n.

    With ``training``, autograd is on: a bias that needs a gradient (T5, Shaw's key term) can
    send ``scaled_dot_product_attention`` to its O(n^2)-memory math path there.
    """
    x = torch.randn(1, 64, NUM_HIDDENS, device=device, requires_grad=training)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.set_grad_enabled(training), torch.profiler.profile(activities=activities) as prof:
        call(x)
    keys = {event.key for event in prof.key_averages()}
    fused = tuple(f"aten::_scaled_dot_product_{kind}" for kind in ("flash", "efficient", "cudnn"))
    if any(k.startswith(fused) for k in keys):
        return "fused SDPA"
    if "aten::_scaled_dot_product_attention_math" in keys:
        return "SDPA math"
    return "explicit"


def specs() -> list[tuple[str, str | None, dict]]:
    """(label, registry name, options) of every row; name None is attention with no encoding at all."""
    rows: list[tuple[str, str | None, dict]] = [("(no encoding)", None, {})]
    rows += [(name, name, {}) for name in NAMES]
    rows += [variant for variant in VARIANTS if variant[1] in NAMES]
    return rows


def entries(max_len: int, only: str | None = None) -> list[tuple[str, nn.Module | None]]:
    """(label, encoding) for every row of :func:`specs` (or just the one labelled ``only``)."""
    out: list[tuple[str, nn.Module | None]] = []
    for label, name, options in specs():
        if only is not None and label != only:
            continue
        try:
            out.append((label, None if name is None else make_encoding(name, options, max_len)))
        except (TypeError, ValueError) as error:  # an option this build does not offer: leave the row out
            log(f"{label}: not built ({error})")
    return out


def run_speed(args, device: torch.device) -> tuple[str, dict]:
    built = entries(max(args.sizes))
    calls, kernels = {}, {}
    for label, encoding in built:
        modules, call = contender(encoding, device)
        params = [p for m in modules for p in m.parameters()]
        calls[label] = (call, params)
        kernels[label] = " / ".join(attention_kernel(call, device, training=t) for t in (True, False))
    kinds = {label: ("-" if e is None else type(e).__name__ + f" ({e.acts_on})") for label, e in built}

    results, spread = {}, {}
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device).requires_grad_(True)
        grad = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device)
        forward, forward_backward = {}, {}
        for label, (call, params) in calls.items():

            def fwd_bwd(call=call, params=params):
                x.grad = None
                for p in params:
                    p.grad = None
                call(x).backward(grad)

            forward[label] = lambda call=call: call(x)
            forward_backward[label] = fwd_bwd
        for kind, cases in (("fwd", forward), ("fwd+bwd", forward_backward)):
            log(f"positional n={n}: {kind}")
            noise = {}
            results[(kind, n)] = measure(cases, device=device, spread=noise, **args.timing)
            spread.update({(label, kind, f"n={n}"): value for label, value in noise.items()})

    header = ["encoding", "kind", "attention kernel (train / eval)"]
    for n in args.sizes:
        header += [f"fwd n={n}", f"fwd+bwd n={n}"]
    rows = []
    for label in calls:
        row = [label, kinds[label], kernels[label]]
        for n in args.sizes:
            for kind in ("fwd", "fwd+bwd"):
                r = results[(kind, n)]
                cell = f"{r[label] / r['(no encoding)']:.2f}"
                row.append(cell + (f" ({ms(r[label])} ms)" if label == "(no encoding)" else ""))
        rows.append(row)
    text = "\n".join(
        [
            f"**Time relative to the same attention with no encoding** (1.00 = no extra cost; b={BATCH}, "
            f"d={NUM_HIDDENS}, {NUM_HEADS} heads, fp32, self-attention, training mode; the no-encoding row "
            "gives its absolute time):",
            "",
            table(header, rows),
            "",
            spread_note(spread),
            "",
            "`attention kernel`, with autograd on / off: `fused SDPA` is the flash kernel of "
            "`scaled_dot_product_attention` (a score term goes in as its float mask); `SDPA math` is its "
            "fallback that materializes the scores (taken when the bias needs a gradient); `explicit` is "
            "selfattn's matmul-softmax-matmul (Shaw's value term needs the weights).",
            "",
        ]
    )
    return text, {"results": results}


def memory_child(label: str, n: int, allowed_bytes: int) -> dict:
    """One forward at b=1 (eval, no_grad) of attention with the encoding called ``label``."""
    from _common import measure_peak_rss

    torch.set_grad_enabled(False)
    encoding = dict(entries(n, only=label))[label]
    modules, call = contender(encoding, torch.device("cpu"))
    for m in modules:
        m.eval()
    call(torch.randn(1, 64, NUM_HIDDENS))  # load kernels outside the measurement
    x = torch.randn(1, n, NUM_HIDDENS, generator=torch.Generator().manual_seed(n))
    return measure_peak_rss(lambda: call(x), allowed_bytes)


def run_memory(args) -> tuple[str, dict]:
    n = args.memory_n
    labels = ["(no encoding)", "shaw"] + [label for label, name, _ in VARIANTS if name == "shaw"]
    measured = {}
    for label in labels:
        allowed, available = memory_headroom(args.memory_margin_gib)
        log(f"memory {label} n={n} (allowed {allowed / GIB:.1f} GiB)")
        measured[label] = run_memory_child(Path(__file__), [label, str(n)], allowed)
        log(f"  {measured[label]}")
    scores = NUM_HEADS * n * n * 4
    materialized = n * n * (NUM_HIDDENS // NUM_HEADS) * 4
    rows = [
        [label, size(r["peak_bytes"]) if "peak_bytes" in r else f"failed: {r.get('error')}"]
        for label, r in measured.items()
    ]
    text = "\n".join(
        [
            f"**Peak memory of one forward at n={n}**, b=1, eval + `torch.no_grad()`, one process each "
            "(growth of the resident set during the call):",
            "",
            table(["encoding", "peak"], rows),
            "",
            f"For scale: one fp32 `(h, n, n)` score tensor is {size(scores)}; materializing Shaw's "
            f"`(n, n, dh)` embeddings would take {size(materialized)} on its own.",
            "",
        ]
    )
    return text, {"measured": measured}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small n, few repeats; prints only, unless --output")
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (memory is measured on CPU only)")
    parser.add_argument("--skip-memory", action="store_true", help="leave out Shaw's peak-memory subprocess")
    parser.add_argument("--memory-margin-gib", type=float, default=4.0, help="RAM left free for others (GiB)")
    parser.add_argument("--memory-child", nargs=3, metavar=("LABEL", "N", "ALLOWED_BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.memory_n = [128, 256], 512
        args.timing = {"min_repeats": 2, "max_repeats": 3, "budget_s": 0.5}
    else:
        args.sizes, args.memory_n = [1024, 4096], 4096
        args.timing = {"min_repeats": 4, "max_repeats": 10, "budget_s": 5.0}
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        import json

        label, n, allowed = args.memory_child
        print(json.dumps(memory_child(label, int(n), int(allowed))))
        return 0
    device = resolve_device(args.device)
    started = time.perf_counter()
    header = machine_lines(device)
    speed_text, _ = run_speed(args, device)
    if args.skip_memory or device.type != "cpu":
        memory_text = "*Peak memory not measured in this run.*\n"
    else:
        memory_text, _ = run_memory(args)
    parts = [f"## Positional encodings inside attention ({device.type}{', quick smoke run' if args.quick else ''})", ""]
    parts += [*header, f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s", ""]
    parts += [speed_text, memory_text]
    emit("\n".join(parts), output=args.output, section=f"positional-{device.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
