"""Cost of each positional encoding inside selfattn's MultiHeadAttention, as a ratio to no encoding.

Run from the repository root::

    .venv/bin/python benchmarks/positional.py            # full run, writes its section of BENCHMARKS.md
    .venv/bin/python benchmarks/positional.py --quick    # smoke run: small n, prints only

Every encoding comes from ``selfattn.positional.build(name, num_hiddens=512, num_heads=8)``.
Input encodings (sinusoidal, learned, N-D sinusoidal) are added to the input before the same
attention (the N-D ones see the sequence as a square / cubic grid); rotary and score terms are
given to ``MultiHeadAttention(position=...)``; the ``dropout 0.1`` row is attention with no
encoding and ``dropout=0.1`` in training mode. All of them, and the plain attention they are
compared with, are timed round-robin in one run. Peak memory is measured in one child process
per case, each capped (``--memory-cap-gib``) so that no case can exhaust the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
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
    verdict,
)

import selfattn
from selfattn.positional import NAMES, InputEncoding, build

BATCH, NUM_HIDDENS, NUM_HEADS = 2, 512, 8
# Extra rows beyond the registry's defaults: (label, name, options); name None is no encoding.
VARIANTS = [
    ("shaw (keys only)", "shaw", {"values": False}),
    ("dropout 0.1", None, {}),
    ("(no encoding, causal)", None, {}),
    ("alibi (causal)", "alibi", {}),
    ("t5 (causal)", "t5", {}),
]
# MultiHeadAttention options of a row (the others use the defaults: no dropout).
ATTENTION_OPTIONS = {"dropout 0.1": {"dropout": 0.1}}
# Rows called with causal=True (the language-model case); their ratios are to the causal baseline.
CAUSAL_ROWS = {"(no encoding, causal)", "alibi (causal)", "t5 (causal)"}
CAUSAL_BASELINE = "(no encoding, causal)"
# Goals of the blockwise path (issue 8): forward+backward time at the largest n, as a ratio to no encoding.
SPEED_GOALS = [
    ("alibi", 1.15),
    ("t5", 2.0),
    ("shaw", 3.0),
    ("kerple", 2.5),
    ("fire", 2.5),
    ("dropout 0.1", 1.6),
    ("alibi (causal)", 1.15),
    ("t5 (causal)", 2.0),
]
# (label, n, mode, goal in GiB or None): peak memory at b=1; "fwd" is eval + no_grad, "train" forward+backward.
MEMORY_CASES = [
    ("(no encoding)", 4096, "fwd", None),
    ("shaw", 4096, "fwd", 0.3),
    ("shaw (keys only)", 4096, "fwd", None),
    ("dropout 0.1", 16384, "train", 1.0),
    ("alibi", 32768, "train", 2.0),
    ("t5", 32768, "train", 2.0),
    ("(no encoding)", 16384, "train", None),
    ("(no encoding)", 32768, "train", None),
]


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


def contender(
    encoding: nn.Module | None, device: torch.device, seed: int = 0, options: dict | None = None, causal: bool = False
):
    """(modules, call(x)) for attention with ``encoding`` in its place (and ``options`` for the attention)."""
    torch.manual_seed(seed)
    options = options or {}
    if encoding is None or isinstance(encoding, InputEncoding):
        mha = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, **options).to(device)
    else:
        mha = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, position=encoding, **options).to(device)
    if not isinstance(encoding, InputEncoding):
        return [mha], lambda x: mha(x, x, x, causal=causal)
    encoding = encoding.to(device)
    axes = spatial_axes(encoding)

    def call(x):
        b, n, d = x.shape
        y = encoding(x.reshape(b, *grid(n, axes), d)).reshape(b, n, d)  # (b, n1, ..., nk, d) -> (b, n, d)
        return mha(y, y, y, causal=causal)

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
    if "selfattn::flex_attention" in keys:
        return "FlexAttention"
    if "selfattn::blockwise_attention" in keys:
        return "blockwise, fused" if any(k.startswith(fused) for k in keys) else "blockwise, explicit"
    if any(k.startswith(fused) for k in keys):
        return "fused SDPA"
    if "aten::_scaled_dot_product_attention_math" in keys:
        return "SDPA math"
    return "explicit"


def specs() -> list[tuple[str, str | None, dict]]:
    """(label, registry name, options) of every row; name None is attention with no encoding at all."""
    rows: list[tuple[str, str | None, dict]] = [("(no encoding)", None, {})]
    rows += [(name, name, {}) for name in NAMES]
    rows += [variant for variant in VARIANTS if variant[1] is None or variant[1] in NAMES]
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


def baseline(label: str) -> str:
    """The row a row's ratio is taken to: the causal baseline for causal rows."""
    return CAUSAL_BASELINE if label in CAUSAL_ROWS else "(no encoding)"


def run_speed(args, device: torch.device) -> tuple[str, dict]:
    built = entries(max(args.sizes))
    if args.only:
        wanted = {"(no encoding)", *args.only.split(",")}
        wanted |= {baseline(label) for label in wanted}
        built = [(label, encoding) for label, encoding in built if label in wanted]
    calls, kernels = {}, {}
    for label, encoding in built:
        modules, call = contender(encoding, device, options=ATTENTION_OPTIONS.get(label), causal=label in CAUSAL_ROWS)
        params = [p for m in modules for p in m.parameters()]
        calls[label] = (call, params)
        kernels[label] = " / ".join(attention_kernel(call, device, training=t) for t in (True, False))
    kinds = {label: ("-" if e is None else type(e).__name__ + f" ({e.acts_on})") for label, e in built}
    kinds.update({label: "attention dropout" for label in ATTENTION_OPTIONS if label in kinds})
    kinds.update({label: kinds[label] + ", causal" for label in CAUSAL_ROWS if label in kinds})

    results, spread = {}, {}
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device).requires_grad_(True)
        grad = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device)
        forward, forward_backward = {}, {}
        for label, (call, params) in calls.items():

            def fwd_bwd(call=call, params=params, x=x, grad=grad):
                x.grad = None
                for p in params:
                    p.grad = None
                call(x).backward(grad)

            forward[label] = lambda call=call, x=x: call(x)
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
                cell = f"{r[label] / r[baseline(label)]:.2f}"
                row.append(cell + (f" ({ms(r[label])} ms)" if baseline(label) == label else ""))
        rows.append(row)
    largest = max(args.sizes)
    final = results[("fwd+bwd", largest)]
    goal_rows = [
        [
            label,
            f"{final[label] / final[baseline(label)]:.2f}",
            f"<= {goal:.2f}",
            verdict(final[label] / final[baseline(label)] <= goal),
        ]
        for label, goal in SPEED_GOALS
        if label in final
    ]
    text = "\n".join(
        [
            f"**Goals of the blockwise path**: forward+backward at n={largest}, ratio to no encoding in this run:",
            "",
            table(["row", "ratio", "goal", "verdict"], goal_rows),
            "",
            f"**Time relative to the same attention with no encoding** (1.00 = no extra cost; b={BATCH}, "
            f"d={NUM_HIDDENS}, {NUM_HEADS} heads, fp32, self-attention, training mode; the no-encoding row "
            "gives its absolute time; the `(causal)` rows are `mha(x, x, x, causal=True)`, timed against "
            "`(no encoding, causal)`, the same causal attention with no encoding, in the same run):",
            "",
            table(header, rows),
            "",
            spread_note(spread),
            "",
            "`attention kernel`, with autograd on / off, read from the profiler in the forward pass: `fused SDPA` "
            "is one call of the flash kernel of `scaled_dot_product_attention`; `blockwise, fused` is "
            "`selfattn.functional.blockwise_attention` handing each block of queries and its bias (a float mask) "
            "to that kernel; `FlexAttention` is a score term's `score_mod` in PyTorch's compiled FlexAttention kernel (CUDA); `blockwise, explicit` computes each block's scores itself (Shaw's value term and "
            "dropout need the weights). A learnable bias (T5, Kerple, FIRE, Shaw's keys) runs a fused forward "
            "and an explicit blockwise backward that reduces the score gradient into its parameters.",
            "",
        ]
    )
    return text, {"results": results}


def memory_child(label: str, n: int, mode: str, allowed_bytes: int) -> dict:
    """At b=1, one forward (``fwd``: eval, no_grad) or forward+backward (``train``) of the row ``label``."""
    from _common import measure_peak_rss

    train = mode == "train"
    torch.set_grad_enabled(train)
    encoding = dict(entries(n, only=label))[label]
    modules, call = contender(
        encoding, torch.device("cpu"), options=ATTENTION_OPTIONS.get(label), causal=label in CAUSAL_ROWS
    )
    for m in modules:
        m.train(train)
    gen = torch.Generator().manual_seed(n)
    warm = torch.randn(1, 64, NUM_HIDDENS, requires_grad=train)
    x = torch.randn(1, n, NUM_HIDDENS, generator=gen).requires_grad_(train)
    grad = torch.randn(1, n, NUM_HIDDENS, generator=gen)
    if train:  # load kernels outside the measurement
        call(warm).sum().backward()
        return measure_peak_rss(lambda: call(x).backward(grad), allowed_bytes)
    call(warm)
    return measure_peak_rss(lambda: call(x), allowed_bytes)


def run_memory(args) -> tuple[str, dict]:
    measured, rows = {}, []
    cases = args.memory_cases
    if args.only:
        wanted = set(args.only.split(","))
        cases = [case for case in cases if case[0] in wanted]
    for label, n, mode, goal in cases:
        allowed, _ = memory_headroom(args.memory_margin_gib)
        allowed = min(allowed, int(args.memory_cap_gib * GIB))  # never near what the machine has
        log(f"memory {label} n={n} {mode} (allowed {allowed / GIB:.1f} GiB)")
        r = run_memory_child(Path(__file__), [label, str(n), mode], allowed, timeout_s=args.memory_timeout_s)
        log(f"  {r}")
        measured[(label, n, mode)] = r
        peak = size(r["peak_bytes"]) if "peak_bytes" in r else f"failed: {r.get('error')}"
        seconds = f"{r['seconds']:.1f}" if "seconds" in r else "-"
        met = (
            "-"
            if goal is None
            else (verdict("peak_bytes" in r and r["peak_bytes"] <= goal * GIB) + f" (<= {goal} GiB)")
        )
        rows.append([label, str(n), "forward+backward" if mode == "train" else "forward", peak, seconds, met])
    n = 4096
    scores = NUM_HEADS * n * n * 4
    materialized = n * n * (NUM_HIDDENS // NUM_HEADS) * 4
    text = "\n".join(
        [
            "**Peak memory**, b=1, one process each (growth of the resident set during the call, over the "
            "inputs and their gradient); `forward` is eval + `torch.no_grad()`, `forward+backward` is training "
            f"mode. Each process may use at most {args.memory_cap_gib:.0f} GiB; past that it fails instead:",
            "",
            table(["row", "n", "pass", "peak", "seconds", "goal"], rows),
            "",
            f"For scale: at n={n} one fp32 `(h, n, n)` score tensor is {size(scores)} (at n=32768, "
            f"{size(NUM_HEADS * 32768**2 * 4)}); materializing Shaw's `(n, n, dh)` embeddings at n={n} would take "
            f"{size(materialized)} on its own.",
            "",
        ]
    )
    return text, {"measured": measured}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small n, few repeats; prints only, unless --output")
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (memory is measured on CPU only)")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the peak-memory subprocesses")
    parser.add_argument("--memory-margin-gib", type=float, default=4.0, help="RAM left free for others (GiB)")
    parser.add_argument("--memory-cap-gib", type=float, default=6.0, help="most RAM one memory case may use (GiB)")
    parser.add_argument(
        "--memory-timeout-s", type=float, default=1800.0, help="give up on a memory case after this long"
    )
    parser.add_argument("--skip-speed", action="store_true", help="measure peak memory only (its own section)")
    parser.add_argument(
        "--only", help="comma-separated row labels to time and measure (default: all; speed keeps the baseline)"
    )
    parser.add_argument("--min-repeats", type=int, help="timed rounds at least (default 4; 2 with --quick)")
    parser.add_argument(
        "--sizes", dest="sizes_arg", help="comma-separated sequence lengths to time (default 1024,4096)"
    )
    parser.add_argument(
        "--memory-child", nargs=4, metavar=("LABEL", "N", "MODE", "ALLOWED_BYTES"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [128, 256]
        args.memory_cases = [(label, n // 64, mode, goal) for label, n, mode, goal in MEMORY_CASES]
        args.timing = {"min_repeats": 2, "max_repeats": 3, "budget_s": 0.5}
    else:
        args.sizes = [1024, 4096]
        args.memory_cases = MEMORY_CASES
        args.timing = {"min_repeats": 4, "max_repeats": 10, "budget_s": 5.0}
    if args.min_repeats:
        args.timing["min_repeats"] = args.min_repeats
        args.timing["max_repeats"] = max(args.timing["max_repeats"], args.min_repeats)
    if args.sizes_arg:
        args.sizes = [int(n) for n in args.sizes_arg.split(",")]
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        import json

        label, n, mode, allowed = args.memory_child
        print(json.dumps(memory_child(label, int(n), mode, int(allowed))))
        return 0
    device = resolve_device(args.device)
    started = time.perf_counter()
    header = machine_lines(device)
    speed_text = "" if args.skip_speed else run_speed(args, device)[0]
    if args.skip_memory or device.type != "cpu":
        memory_text = "*Peak memory not measured in this run.*\n"
    else:
        memory_text, _ = run_memory(args)
    title = (
        "Peak memory of positional encodings inside attention"
        if args.skip_speed
        else "Positional encodings inside attention"
    )
    parts = [f"## {title} ({device.type}{', quick smoke run' if args.quick else ''})", ""]
    parts += [*header, f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s", ""]
    parts += [speed_text, memory_text]
    section = f"positional-memory-{device.type}" if args.skip_speed else f"positional-{device.type}"
    emit("\n".join(parts), output=args.output, section=section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
