"""Speed and memory of selfattn's MultiHeadAttention vs the textbook algorithm and nn.MultiheadAttention.

Run from the repository root::

    .venv/bin/python benchmarks/attention.py            # full run, writes its section of BENCHMARKS.md
    .venv/bin/python benchmarks/attention.py --quick    # smoke run: small n, prints only

Every contender gets the same weights (selfattn's, copied into the textbook baseline and into
``nn.MultiheadAttention``) and the same inputs; every figure is reported as a ratio to another
contender timed in the same run, round-robin. Peak memory is measured in one subprocess per
(contender, n) as the growth of the resident set during one forward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    BENCHMARKS_MD,
    GIB,
    MIB,
    emit,
    gemm_case,
    gemm_peak_gflops,
    load_average,
    log,
    machine_lines,
    measure,
    measure_peak_rss,
    memory_headroom,
    ms,
    ratio,
    resolve_device,
    run_memory_child,
    size,
    spread_note,
    table,
    verdict,
)
from textbook import TextbookMultiHeadAttention

import selfattn

BATCH, NUM_HIDDENS, NUM_HEADS = 2, 512, 8


# --------------------------------------------------------------------------- contenders


def make_selfattn(*, bias: bool = False, device: torch.device, seed: int = 0) -> selfattn.MultiHeadAttention:
    torch.manual_seed(seed)
    return selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=bias).to(device)


def make_textbook(reference: nn.Module) -> TextbookMultiHeadAttention:
    bias = reference.W_q.bias is not None
    textbook = TextbookMultiHeadAttention(NUM_HIDDENS, NUM_HEADS, bias=bias)
    textbook.load_state_dict(reference.state_dict())
    return textbook.to(reference.W_q.weight.device)


def make_torch(reference: nn.Module, *, bias: bool) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` holding ``reference``'s projection weights (biases zero, as torch inits them)."""
    device = reference.W_q.weight.device
    mha = nn.MultiheadAttention(NUM_HIDDENS, NUM_HEADS, bias=bias, batch_first=True).to(device)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([reference.W_q.weight, reference.W_k.weight, reference.W_v.weight]))
        mha.out_proj.weight.copy_(reference.W_o.weight)
    return mha


def torch_fast_path_used(mha: nn.MultiheadAttention, *, need_weights: bool, device: torch.device) -> bool:
    """Whether an eval/no_grad self-attention call goes through torch's fused inference kernel."""
    x = torch.randn(1, 8, NUM_HIDDENS, device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        mha(x, x, x, need_weights=need_weights)
    return any(event.key == "aten::_native_multi_head_attention" for event in prof.key_averages())


def forward_flops(batch: int, n: int) -> float:
    """Matmul FLOPs of one self-attention forward: four projections plus q k^T and weights @ v."""
    return 8 * batch * n * NUM_HIDDENS**2 + 4 * batch * n * n * NUM_HIDDENS


def training_steps(modules: dict, x: torch.Tensor, grad: torch.Tensor, valid_lens=None):
    """Forward and forward+backward callables for each contender, on the same input."""
    forward, forward_backward = {}, {}
    for name, (module, call) in modules.items():
        params = list(module.parameters())

        def fwd(call=call):
            return call(x, valid_lens)

        def fwd_bwd(call=call, params=params):
            x.grad = None
            for p in params:
                p.grad = None
            call(x, valid_lens).backward(grad)

        forward[name], forward_backward[name] = fwd, fwd_bwd
    return forward, forward_backward


def torch_call(mha: nn.MultiheadAttention, *, need_weights: bool):
    def call(x, valid_lens):
        padding = None
        if valid_lens is not None:
            padding = torch.arange(x.shape[1], device=x.device)[None, :] >= valid_lens[:, None]  # True = ignore
        return mha(x, x, x, key_padding_mask=padding, need_weights=need_weights)[0]

    return call


def mha_call(mha: nn.Module):
    return lambda x, valid_lens: mha(x, x, x, valid_lens)


def training_contenders(device: torch.device) -> dict:
    """name -> (module, call(x, valid_lens)) for selfattn, the textbook and nn.MultiheadAttention."""
    mha = make_selfattn(device=device)
    textbook = make_textbook(mha)
    torch_mha = make_torch(mha, bias=False)
    return {
        "selfattn": (mha, mha_call(mha)),
        "textbook": (textbook, mha_call(textbook)),
        "nn.MHA": (torch_mha, torch_call(torch_mha, need_weights=False)),
    }


# --------------------------------------------------------------------------- sections


GEMM = "GEMM"  # the torch.mm timed in the same rounds as the forward passes, for "% of peak"


def percent_of_peak(r: dict, name: str, n: int, gemm_flops: float) -> float:
    """Achieved matmul GFLOP/s of ``name`` over the GEMM's, both from the same rounds."""
    return (forward_flops(BATCH, n) / r[name]) / (gemm_flops / r[GEMM])


def run_speed(args, device: torch.device) -> tuple[str, dict]:
    """Forward and forward+backward at b=2 for every n, plus GFLOP/s against the GEMM peak."""
    contenders = training_contenders(device)
    names = list(contenders)
    log(f"GEMM peak: torch.mm {args.gemm_size}^2 fp32")
    peak = gemm_peak_gflops(device, size=args.gemm_size, repeats=args.gemm_repeats)
    log(f"  {peak:.1f} GFLOP/s")
    gemm, gemm_flops = gemm_case(device, args.gemm_size)

    results, spread = {}, {"fwd": {}, "fwd+bwd": {}}
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device).requires_grad_(True)
        grad = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device)
        fwd, fwd_bwd = training_steps(contenders, x, grad)
        for kind, cases in (("fwd", {**fwd, GEMM: gemm}), ("fwd+bwd", fwd_bwd)):
            log(f"speed n={n}: {kind}")
            noise = {}
            results[(kind, n)] = measure(cases, device=device, spread=noise, **args.timing)
            spread[kind].update({(name, f"n={n}"): value for name, value in noise.items()})
            log(f"  {results[(kind, n)]}")

    lines = [
        f"fp32 GEMM peak: `torch.mm` of two {args.gemm_size}x{args.gemm_size} matrices, **{peak:.0f} GFLOP/s** "
        "at the start of the run; `% peak` below divides by the same GEMM timed in the same rounds as the "
        "forward passes (column `GEMM GFLOP/s`), so a busy machine slows both.",
        "",
    ]
    for kind, title in (("fwd", "Forward (training mode, autograd on)"), ("fwd+bwd", "Forward + backward")):
        rows = []
        for n in args.sizes:
            r = results[(kind, n)]
            row = [str(n)] + [ms(r[name]) for name in names]
            row += [ratio(r["textbook"] / r["selfattn"]), ratio(r["selfattn"] / r["nn.MHA"])]
            if kind == "fwd":
                row += [f"{percent_of_peak(r, name, n, gemm_flops):.0%}" for name in names]
                row.append(f"{gemm_flops / r[GEMM] / 1e9:.0f}")
            rows.append(row)
        header = ["n"] + [f"{name} ms" for name in names] + ["textbook / selfattn", "selfattn / nn.MHA"]
        if kind == "fwd":
            header += [f"{name} % peak" for name in names] + ["GEMM GFLOP/s"]
        lines += [f"**{title}**, b={BATCH}, d={NUM_HIDDENS}, {NUM_HEADS} heads, fp32:", "", table(header, rows), ""]
        lines += [spread_note(spread[kind]), ""]
    lines += [
        "`textbook / selfattn` above 1 means selfattn is faster than the textbook algorithm; "
        "`selfattn / nn.MHA` below 1 means selfattn is faster than `nn.MultiheadAttention` "
        "(bias=False, need_weights=False, batch_first=True, the same weights). "
        "`% peak` counts only matmul FLOPs (8·b·n·d² + 4·b·n²·d; softmax and masking are free).",
        "",
    ]
    return "\n".join(lines), {"peak": peak, "gemm_flops": gemm_flops, "results": results}


def run_inference(args, device: torch.device) -> tuple[str, dict]:
    """eval + no_grad: selfattn vs nn.MultiheadAttention in each of its modes."""
    plain = make_selfattn(device=device).eval()
    with_bias = make_selfattn(bias=True, device=device).eval()
    textbook = make_textbook(plain).eval()
    torch_bias, torch_plain = make_torch(with_bias, bias=True).eval(), make_torch(plain, bias=False).eval()
    modes = {
        "nn.MHA defaults (bias=True, need_weights=True)": (torch_bias, True),
        "nn.MHA bias=True, need_weights=False": (torch_bias, False),
        "nn.MHA bias=False, need_weights=False": (torch_plain, False),
    }
    fast = {name: torch_fast_path_used(m, need_weights=w, device=device) for name, (m, w) in modes.items()}
    gemm, gemm_flops = gemm_case(device, args.gemm_size)
    results, spread = {}, {}
    for n in args.inference_sizes:
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=torch.Generator().manual_seed(n)).to(device)
        cases = {
            "selfattn (bias=False, its default)": lambda x=x: plain(x, x, x),
            "selfattn bias=True": lambda x=x: with_bias(x, x, x),
            "textbook": lambda x=x: textbook(x, x, x),
        }
        for name, (m, w) in modes.items():
            cases[name] = lambda m=m, w=w, x=x: m(x, x, x, need_weights=w)
        cases[GEMM] = gemm
        log(f"inference n={n}")
        noise = {}
        with torch.no_grad():
            results[n] = measure(cases, device=device, spread=noise, **args.timing)
        spread.update({(name, f"n={n}"): value for name, value in noise.items()})
        log(f"  {results[n]}")

    defaults = "nn.MHA defaults (bias=True, need_weights=True)"
    names = [name for name in results[args.inference_sizes[0]] if name != GEMM]
    header = ["contender", "torch fast path"] + [f"n={n} ms" for n in args.inference_sizes]
    header += [f"n={n}: nn.MHA defaults / it" for n in args.inference_sizes]
    header += [f"n={n} % peak" for n in args.inference_sizes]
    rows = []
    for name in names:
        row = [name, ("yes" if fast[name] else "no") if name in fast else "-"]
        row += [ms(results[n][name]) for n in args.inference_sizes]
        row += [ratio(results[n][defaults] / results[n][name]) for n in args.inference_sizes]
        row += [f"{percent_of_peak(results[n], name, n, gemm_flops):.0%}" for n in args.inference_sizes]
        rows.append(row)
    text = "\n".join(
        [
            f"**Inference** (eval, `torch.no_grad()`), b={BATCH}, d={NUM_HIDDENS}, {NUM_HEADS} heads, "
            "self-attention (`x, x, x`):",
            "",
            table(header, rows),
            "",
            spread_note(spread),
            "",
            "`nn.MHA defaults / it` above 1 means that contender is faster than `nn.MultiheadAttention` called "
            "with its defaults. `torch fast path`: whether the call ran torch's fused inference kernel "
            "(`aten::_native_multi_head_attention`, seen with `torch.profiler`). `% peak` as above (the same "
            "nominal FLOPs for every contender; returning weights costs extra work that is not counted).",
            "",
        ]
    )
    return text, {"results": results, "defaults": defaults, "selfattn": names[0], "gemm_flops": gemm_flops}


def run_padding(args, device: torch.device) -> tuple[str, dict]:
    """Forward+backward with valid lengths at most n/2 vs the same batch at full length."""
    contenders = training_contenders(device)
    results, spread = {}, {}
    for n in args.padding_sizes:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device).requires_grad_(True)
        grad = torch.randn(BATCH, n, NUM_HIDDENS, generator=gen).to(device)
        full = torch.tensor([n, n], device=device)
        half = torch.tensor([n // 2, n // 4], device=device)
        cases = {}
        for label, lens in (("full", full), ("half", half)):
            _, steps = training_steps(contenders, x, grad, valid_lens=lens)
            cases.update({(name, label): step for name, step in steps.items()})
        log(f"padding n={n}")
        noise = {}
        results[n] = measure(cases, device=device, spread=noise, **args.timing)
        spread.update({(*name, f"n={n}"): value for name, value in noise.items()})
        log(f"  {results[n]}")

    rows = []
    for n in args.padding_sizes:
        r = results[n]
        for name in contenders:
            full, half = r[(name, "full")], r[(name, "half")]
            rows.append([str(n), name, ms(full), ms(half), ratio(full / half)])
    text = "\n".join(
        [
            f"**Padding**, forward+backward, b={BATCH}: valid lengths `[n/2, n/4]` vs `[n, n]` "
            "(nn.MHA: the same lengths as `key_padding_mask`):",
            "",
            table(["n", "contender", "full ms", "padded ms", "full / padded"], rows),
            "",
            spread_note(spread),
            "",
        ]
    )
    return text, {"results": results}


# --------------------------------------------------------------------------- real-model features


def _fwd_and_fwd_bwd(mha: nn.Module, x: torch.Tensor, grad: torch.Tensor, **kwargs):
    def fwd():
        with torch.no_grad():
            return mha(x, x, x, **kwargs)

    def fwd_bwd():
        mha.zero_grad(set_to_none=True)
        x.grad = None
        mha(x, x, x, **kwargs).backward(grad)

    return fwd, fwd_bwd


def ragged_flop_ratio(n: int, lengths: list[int], *, skip_padded_queries: bool = False) -> float:
    """Matmul FLOPs of all-full self-attention over those of the ragged path (non-causal).

    Per sequence of valid length ``m``: W_k and W_v on ``m`` rows (2·d² each per row). By default
    every query row is kept: W_q and W_o on all ``n`` rows and ``n`` queries against ``m`` keys
    (4·n·m·d). With ``skip_padded_queries`` only the ``m`` valid rows: W_q and W_o on ``m`` rows
    and ``m`` queries against ``m`` keys (4·m²·d).
    """
    d = NUM_HIDDENS

    def flops(m: int) -> float:
        queries = m if skip_padded_queries and m < n else n
        return 4 * queries * d * d + 4 * m * d * d + 4 * queries * m * d

    return len(lengths) * flops(n) / sum(flops(m) for m in lengths)


def run_ragged(args, device: torch.device) -> tuple[list[str], list[list[str]]]:
    """Per-sequence valid lengths vs the same batch at full length (valid_lens=None)."""
    batch, n = 4, args.ragged_n
    mha = make_selfattn(device=device)
    skipping = make_selfattn(device=device)  # the same weights, padded query rows not computed
    skipping.skip_padded_queries = True
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(batch, n, NUM_HIDDENS, generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(batch, n, NUM_HIDDENS, generator=gen).to(device)
    skip = ", skip padded queries"
    layouts = {
        "all full, no valid_lens": None,
        "all full, valid_lens = n": [n] * batch,
        "[n, n/4, n/4, n/4]": [n] + [n // 4] * (batch - 1),
        "[n/4, n, n/4, n/4] (scattered group)": [n // 4, n] + [n // 4] * (batch - 2),
        "all n/2": [n // 2] * batch,
        f"[n, n/4, n/4, n/4]{skip}": [n] + [n // 4] * (batch - 1),
        f"all n/2{skip}": [n // 2] * batch,
    }
    cases: dict = {}
    for label, lens in layouts.items():
        valid_lens = None if lens is None else torch.tensor(lens, device=device)
        fwd, fwd_bwd = _fwd_and_fwd_bwd(skipping if label.endswith(skip) else mha, x, grad, valid_lens=valid_lens)
        cases[(label, "fwd")], cases[(label, "fwd+bwd")] = fwd, fwd_bwd
    log(f"ragged b={batch} n={n}")
    spread: dict = {}
    r = measure(cases, device=device, spread=spread, **args.timing)
    log(f"  {r}")
    base = "all full, no valid_lens"
    rows = []
    for label in layouts:
        row = [label]
        for kind in ("fwd", "fwd+bwd"):
            row += [ms(r[(label, kind)]), ratio(r[(base, kind)] / r[(label, kind)])]
        rows.append(row)
    header = ["valid lengths", "fwd ms (no_grad)", "fwd speedup", "fwd+bwd ms", "fwd+bwd speedup"]
    quarter, half = [n] + [n // 4] * (batch - 1), [n // 2] * batch
    text = [
        f"**Ragged batch**, b={batch}, n={n}, d={NUM_HIDDENS}, {NUM_HEADS} heads: speedup over the all-full batch "
        "measured in the same rounds (one fused call per distinct valid length, each on its own keys; a group of "
        "neighbouring sequences is read as a view, a scattered one is gathered first). In the rows without "
        "*skip padded queries* (the default, the chapter's semantics) query rows past a valid length still "
        "attend over its valid keys, as on the masked path, so the matmul FLOP ratio to all full is "
        f"{ragged_flop_ratio(n, quarter):.2f}x for [n, n/4, n/4, n/4] and {ragged_flop_ratio(n, half):.2f}x for "
        "all n/2. The rows *skip padded queries* use `MultiHeadAttention(..., skip_padded_queries=True)`: "
        "padded query rows are not computed (their output is zero), W_q, attention and W_o run on each "
        "sequence's valid rows only, so the FLOP ratio is "
        f"{ragged_flop_ratio(n, quarter, skip_padded_queries=True):.2f}x and "
        f"{ragged_flop_ratio(n, half, skip_padded_queries=True):.2f}x. The two ragged goals are read from "
        "these opt-in rows:",
        "",
        table(header, rows),
        "",
        spread_note(spread),
        "",
    ]
    targets = []
    for label, goal in ((f"[n, n/4, n/4, n/4]{skip}", 1.8), (f"all n/2{skip}", 1.7)):
        for kind in ("fwd", "fwd+bwd"):
            speedup = r[(base, kind)] / r[(label, kind)]
            targets.append(
                [f"ragged {label} {kind}: >= {goal}x faster than all full", ratio(speedup), verdict(speedup >= goal)]
            )
    same = r[(base, "fwd+bwd")] / r[("all full, valid_lens = n", "fwd+bwd")]
    targets.append(["ragged all full with valid_lens: no slower (ratio >= 0.95)", ratio(same), verdict(same >= 0.95)])
    return text, targets


class _Bare(nn.Identity):
    """An identity in place of a projection; its ``weight`` only tells the input checks the dtype and device."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.register_buffer("weight", torch.zeros(1, device=device))


def run_window(args, device: torch.device) -> tuple[list[str], list[list[str]]]:
    """Causal sliding window vs full causal attention at the same n (eval, no_grad forward).

    Timed twice: the whole module, and its attention alone (the four projections swapped for
    identities in both contenders, so only head splitting, attention and merging remain).
    """
    n, window = args.window_n, args.window
    full = make_selfattn(device=device).eval()
    banded = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, window=window).to(device).eval()
    banded.load_state_dict(full.state_dict())
    bare_full = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS).to(device).eval()
    bare_banded = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, window=window).to(device).eval()
    for module in (bare_full, bare_banded):
        module.W_q = module.W_k = module.W_v = module.W_o = _Bare(device)
    x = torch.randn(1, n, NUM_HIDDENS, generator=torch.Generator().manual_seed(n)).to(device)
    cases = {
        ("module", "full"): lambda: full(x, x, x, causal=True),
        ("module", "window"): lambda: banded(x, x, x, causal=True),
        ("attention", "full"): lambda: bare_full(x, x, x, causal=True),
        ("attention", "window"): lambda: bare_banded(x, x, x, causal=True),
    }
    log(f"window n={n} w={window}")
    spread: dict = {}
    with torch.no_grad():
        r = measure(cases, device=device, spread=spread, **args.window_timing)
    log(f"  {r}")
    rows, speedups = [], {}
    for part in ("module", "attention"):
        speedups[part] = r[(part, "full")] / r[(part, "window")]
        rows.append([part, ms(r[(part, "full")]), ms(r[(part, "window")]), ratio(speedups[part])])
    # Matmul FLOPs: attention 4·n·d per scored pair; the module adds 8·n·d² of projections.
    pairs_full, pairs_window = n * n / 2, n * window
    projections = 2 * n * NUM_HIDDENS  # in units of 4·d FLOPs: 8·n·d² / (4·d)
    text = [
        f"**Sliding window**, causal, b=1, n={n}, d={NUM_HIDDENS}, {NUM_HEADS} heads, eval forward, window={window} "
        "vs full causal (`attention`: the same modules with the four projections replaced by identities):",
        "",
        table(["part", "full causal ms", "window ms", "full / window"], rows),
        "",
        f"Matmul FLOP ratios: attention alone {pairs_full / pairs_window:.0f}x; the module with its projections "
        f"{(pairs_full + projections) / (pairs_window + projections):.1f}x.",
        "",
        spread_note(spread),
        "",
    ]
    targets = [
        [
            f"window causal n={n} w={window}: attention forward >= 8x faster than full causal",
            ratio(speedups["attention"]),
            verdict(speedups["attention"] >= 8),
        ],
        ["(information) the same, whole module with projections", ratio(speedups["module"]), "-"],
    ]
    return text, targets


def run_compiled(args, device: torch.device) -> tuple[list[str], list[list[str]]]:
    """torch.compile(fullgraph=True) vs eager on the same module and inputs."""
    from selfattn.positional import build

    n = args.compile_n
    rows = []
    spread: dict = {}
    for label, position, kwargs in (
        ("causal", None, {"causal": True}),
        ("causal + ALiBi", "alibi", {"causal": True}),
        ("valid_lens + rotary", "rotary", {"valid_lens": "lens"}),
    ):
        enc = None if position is None else build(position, num_hiddens=NUM_HIDDENS, num_heads=NUM_HEADS)
        torch.manual_seed(0)
        mha = selfattn.MultiHeadAttention(NUM_HIDDENS, NUM_HEADS, position=enc).to(device).eval()
        x = torch.randn(BATCH, n, NUM_HIDDENS, generator=torch.Generator().manual_seed(n)).to(device)
        call_kwargs = {k: (torch.tensor([n, n // 2], device=device) if v == "lens" else v) for k, v in kwargs.items()}
        compiled = torch.compile(mha, fullgraph=True)
        log(f"compile {label} n={n}")
        with torch.no_grad():
            started = time.perf_counter()
            compiled(x, x, x, **call_kwargs)
            compile_s = time.perf_counter() - started
            torch.testing.assert_close(
                compiled(x, x, x, **call_kwargs), mha(x, x, x, **call_kwargs), atol=1e-4, rtol=1e-4
            )
            noise: dict = {}
            r = measure(
                {
                    "eager": lambda mha=mha, x=x, kw=call_kwargs: mha(x, x, x, **kw),
                    "compiled": lambda compiled=compiled, x=x, kw=call_kwargs: compiled(x, x, x, **kw),
                },
                device=device,
                spread=noise,
                **args.timing,
            )
        spread.update({(label, k): v for k, v in noise.items()})
        log(f"  {r}")
        rows.append([label, ms(r["eager"]), ms(r["compiled"]), ratio(r["eager"] / r["compiled"]), f"{compile_s:.0f} s"])
    text = [
        f"**torch.compile(fullgraph=True) vs eager**, eval forward, b={BATCH}, n={n}, d={NUM_HIDDENS}, "
        f"{NUM_HEADS} heads (`eager / compiled` above 1: compiled is faster):",
        "",
        table(["case", "eager ms", "compiled ms", "eager / compiled", "first call (compiling)"], rows),
        "",
        spread_note(spread),
        "",
    ]
    return text, []


def run_models(args, device: torch.device) -> None:
    started = time.perf_counter()
    header = machine_lines(device)
    ragged_text, ragged_targets = run_ragged(args, device)
    window_text, window_targets = run_window(args, device)
    compiled_text, _ = run_compiled(args, device)
    parts = [f"## Attention for real models ({device.type}{', quick smoke run' if args.quick else ''})", "", *header]
    parts += [f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s", ""]
    parts += ["**Targets**:", "", table(["target", "measured", "status"], ragged_targets + window_targets), ""]
    parts += [*ragged_text, *window_text, *compiled_text]
    emit("\n".join(parts), output=args.output, section=f"attention-models-{device.type}")


# --------------------------------------------------------------------------- memory


def memory_child(contender: str, n: int, allowed_bytes: int) -> dict:
    """One no_grad forward at b=1; returns the growth of peak RSS over the RSS before the call."""
    torch.set_grad_enabled(False)
    module, run = training_contenders(torch.device("cpu"))[contender]
    module.eval()
    run(torch.randn(1, 64, NUM_HIDDENS), None)  # load kernels and thread pools outside the measurement
    x = torch.randn(1, n, NUM_HIDDENS, generator=torch.Generator().manual_seed(n))
    return measure_peak_rss(lambda: run(x, None), allowed_bytes)


def run_memory(args) -> tuple[str, dict]:
    contenders = ["selfattn", "textbook", "nn.MHA"]
    measured: dict[tuple[str, int], dict] = {}
    for name in contenders:
        last = None  # (n, peak) of the largest n measured so far
        for n in args.memory_sizes:
            allowed, available = memory_headroom(args.memory_margin_gib)
            predicted = None if last is None else last[1] * (n / last[0]) ** 2 + 256 * MIB
            if predicted is not None and predicted > allowed:
                measured[(name, n)] = {
                    "skipped": f"predicted {predicted / GIB:.1f} GiB > {allowed / GIB:.1f} GiB "
                    f"(MemAvailable {available / GIB:.1f} GiB minus a {args.memory_margin_gib:g} GiB margin)",
                    "extrapolated": predicted - 256 * MIB,
                    "from_n": last[0],
                }
                log(f"memory {name} n={n}: skipped, {measured[(name, n)]['skipped']}")
                continue
            log(f"memory {name} n={n} (allowed {allowed / GIB:.1f} GiB)")
            result = run_memory_child(Path(__file__).resolve(), [name, str(n)], allowed)
            if "error" in result and last is not None:
                result["extrapolated"] = last[1] * (n / last[0]) ** 2
                result["from_n"] = last[0]
            measured[(name, n)] = result
            log(f"  {result}")
            if "peak_bytes" in result:
                last = (n, result["peak_bytes"])

    def cell(result: dict) -> str:
        if "peak_bytes" in result:
            return size(result["peak_bytes"])
        note = "failed" if "error" in result else "not run"
        if "extrapolated" in result:
            return f"~{result['extrapolated'] / GIB:.1f} GiB (*extrapolated* from n={result['from_n']} as n², {note})"
        return note

    rows = [[str(n)] + [cell(measured[(name, n)]) for name in contenders] for n in args.memory_sizes]
    ratio_rows = []
    for n in args.memory_sizes:
        base = measured[("textbook", n)].get("peak_bytes") or measured[("textbook", n)].get("extrapolated")
        own = measured[("selfattn", n)].get("peak_bytes")
        if base and own:
            ratio_rows.append(f"n={n}: {base / own:.0f}x")
    notes = [
        f"- n={n} {name}: {r.get('skipped') or r.get('error')}"
        for (name, n), r in measured.items()
        if "skipped" in r or "error" in r
    ]
    methods = sorted({r["method"] for r in measured.values() if "method" in r})
    text = "\n".join(
        [
            f"**Peak memory of one forward**, b=1, d={NUM_HIDDENS}, {NUM_HEADS} heads, eval + `torch.no_grad()`, "
            "each (contender, n) in its own process; growth of the resident set during the call "
            f"({'; '.join(methods) or 'no measurement'}), so the input and the weights are not counted:",
            "",
            table(["n", "selfattn", "textbook", "nn.MHA (bias=False, need_weights=False)"], rows),
            "",
            ("textbook / selfattn: " + ", ".join(ratio_rows) + ".") if ratio_rows else "",
            *notes,
            "",
        ]
    )
    return text, {"measured": measured}


# --------------------------------------------------------------------------- report


def targets(args, device: torch.device, speed: dict, inference: dict, padding: dict, memory: dict) -> str:
    """The issue's targets, each read from this run, with whether it is met."""
    results, rows = speed["results"], []

    def add(target: str, measured: str, met: bool | None) -> None:
        rows.append([target, measured, "-" if met is None else verdict(met)])

    n_train = 1024 if 1024 in args.sizes else max(args.sizes)
    fb = results[("fwd+bwd", n_train)]
    add(
        f"fwd+bwd n={n_train}: >= 2x faster than the textbook",
        ratio(fb["textbook"] / fb["selfattn"]),
        fb["textbook"] / fb["selfattn"] >= 2,
    )
    add(
        f"fwd+bwd n={n_train}: no slower than nn.MHA (time ratio <= 1.10)",
        f"{fb['selfattn'] / fb['nn.MHA']:.2f}",
        fb["selfattn"] / fb["nn.MHA"] <= 1.10,
    )

    n_flops = 4096 if 4096 in args.sizes else max(args.sizes)
    fwd = results[("fwd", n_flops)]
    fraction = percent_of_peak(fwd, "selfattn", n_flops, speed["gemm_flops"])
    gemm_rate = speed["gemm_flops"] / fwd[GEMM] / 1e9
    add(f"forward n={n_flops}: >= 75% of GEMM peak", f"{fraction:.0%} of {gemm_rate:.0f} GFLOP/s", fraction >= 0.75)
    if n_flops in inference["results"]:
        r = inference["results"][n_flops]
        add(
            f"(information) inference forward n={n_flops}: % of GEMM peak",
            f"{percent_of_peak(r, inference['selfattn'], n_flops, inference['gemm_flops']):.0%}",
            None,
        )

    for n, r in inference["results"].items():
        speedup = r[inference["defaults"]] / r[inference["selfattn"]]
        # What the speedup would be if selfattn ran every FLOP at the GEMM rate: a hard ceiling.
        ceiling = r[inference["defaults"]] / (forward_flops(BATCH, n) / (inference["gemm_flops"] / r[GEMM]))
        add(
            f"inference n={n}: >= 2x faster than nn.MHA defaults",
            f"{ratio(speedup)} (ceiling at 100% of GEMM peak: {ratio(ceiling)})",
            speedup >= 2,
        )

    n_memory = 16384 if 16384 in args.memory_sizes or not args.memory_sizes else max(args.memory_sizes)
    result = memory["measured"].get(("selfattn", n_memory), {})
    peak = result.get("peak_bytes")
    add(
        f"forward n={n_memory} b=1: < 1 GiB peak",
        "not measured" if peak is None else size(peak),
        None if peak is None else peak < GIB,
    )

    for n, r in padding["results"].items():
        speedup = r[("selfattn", "full")] / r[("selfattn", "half")]
        add(f"padding n={n}: valid lengths <= n/2 >= 1.5x faster than full", ratio(speedup), speedup >= 1.5)

    where = f"{os.cpu_count()}-core CPU" if device.type == "cpu" else device.type
    lines = [f"**Targets** ({where}):", "", table(["target", "measured", "status"], rows), ""]
    if args.quick:
        lines += ["*Quick smoke run: small n and few repeats; the targets are read at the sizes measured.*", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small n, few repeats; prints only, unless --output")
    parser.add_argument("--output", help=f"markdown file to update (default {BENCHMARKS_MD.name}; none with --quick)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (memory is measured on CPU only)")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the peak-memory subprocesses")
    parser.add_argument("--memory-margin-gib", type=float, default=4.0, help="RAM left free for others (GiB)")
    parser.add_argument(
        "--only",
        choices=["all", "core", "models", "ragged"],
        default="all",
        help="core: speed/inference/padding/memory; models: ragged, window, compiled (own section); "
        "ragged: the ragged-batch part of models alone, printed only",
    )
    parser.add_argument("--memory-child", nargs=3, metavar=("CONTENDER", "N", "ALLOWED_BYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.inference_sizes, args.padding_sizes = [128, 256], [256], [256]
        args.memory_sizes = [512, 1024]
        args.timing = {"min_repeats": 2, "max_repeats": 3, "budget_s": 0.5}
        args.gemm_size, args.gemm_repeats = 1024, 3
        args.ragged_n, args.window_n, args.window, args.compile_n = 256, 1024, 64, 128
        args.window_timing = args.timing
    else:
        args.sizes, args.inference_sizes = [128, 512, 1024, 2048, 4096], [1024, 4096]
        args.padding_sizes = [1024, 4096]
        args.memory_sizes = [1024, 2048, 4096, 8192, 16384]
        args.timing = {"min_repeats": 5, "max_repeats": 15, "budget_s": 6.0}
        args.gemm_size, args.gemm_repeats = 4096, 5
        args.ragged_n, args.window_n, args.window, args.compile_n = 2048, 16384, 512, 1024
        args.window_timing = {"min_repeats": 3, "max_repeats": 5, "budget_s": 30.0}
    if args.output is None and not args.quick:
        args.output = str(BENCHMARKS_MD)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        name, n, allowed = args.memory_child
        print(json.dumps(memory_child(name, int(n), int(allowed))))
        return 0
    device = resolve_device(args.device)
    if args.only == "ragged":
        ragged_text, ragged_targets = run_ragged(args, device)
        print("\n".join([table(["target", "measured", "status"], ragged_targets), "", *ragged_text]))
        return 0
    if args.only in ("all", "models"):
        run_models(args, device)
    if args.only == "models":
        return 0
    started = time.perf_counter()
    header = machine_lines(device)
    speed_text, speed = run_speed(args, device)
    inference_text, inference = run_inference(args, device)
    padding_text, padding = run_padding(args, device)
    if args.skip_memory or device.type != "cpu":
        memory_text, memory = "*Peak memory not measured in this run.*\n", {"measured": {}}
        args.memory_sizes = []
    else:
        memory_text, memory = run_memory(args)
    parts = [f"## Attention ({device.type}{', quick smoke run' if args.quick else ''})", "", *header]
    parts += [f"- load average at end: {load_average()}; wall time {time.perf_counter() - started:.0f} s", ""]
    parts.append(targets(args, device, speed, inference, padding, memory))
    parts += [speed_text, inference_text, padding_text, memory_text]
    emit("\n".join(parts), output=args.output, section=f"attention-{device.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
