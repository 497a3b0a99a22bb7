"""Where a Llama decoding step's time goes inside ``generate()``: selfattn's attention function against ``sdpa``'s.

Run from the repository root::

    .venv/bin/python benchmarks/decoding_gap.py           # writes section decoding-gap-cpu of BENCHMARKS.md
    .venv/bin/python benchmarks/decoding_gap.py --quick   # few rounds, prints only

Issue 31 asks Llama's ``generate()`` with ``attn_implementation="selfattn"`` for at least ``sdpa``'s tokens/s
(benchmarks/decoding.py, section decoding-cpu). This script times the attention function itself, call by call,
inside the same ``generate()`` (the tiny Llama of that section, 64 new tokens after 8, one thread), for five
functions registered with transformers:

* ``sdpa``: transformers' own function;
* ``selfattn``: the backend, its decoding steps replayed by their plans;
* ``step, no checks``: the backend, but a one-query unmasked call of a layer that has a decoding plan runs the
  plan's step form with none of the checks of the call's kind: what selfattn computes (the guard, and the formula
  written out below 16 keys) at no checking cost, the most a plan's replay could gain (not a usable backend);
* ``kernel + guard``: ``F.scaled_dot_product_attention`` on one unmasked query after its infinities are made
  NaN (``q + 0 * q``), what selfattn's step computes, with none of a plan's checks;
* ``kernel``: the same call without that guard, what ``sdpa``'s function computes, with none of its own checks.

The two references run their prefill and masked calls through ``sdpa``'s function (``step, no checks``:
through selfattn's, and selfattn's mask function); only one-query calls with no
mask are timed, for all five. Each function is wrapped in the same timer (two ``perf_counter`` reads and a
frame), rounds alternate the order, and a figure is the median over rounds of the mean time per timed call.
The differences read the parts: ``selfattn`` minus ``step, no checks`` is the plans' checks, ``step, no checks``
minus ``kernel + guard`` the step form's call and its formula below 16 keys, ``kernel + guard`` minus ``kernel`` the guard, ``sdpa`` minus ``kernel`` ``sdpa``'s own wrapper. The rest of
a ``generate()``'s difference is read beside them: the time per ``generate()`` in the prompt's attention calls and
in the mask function (once per token), each under a timer of its own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import emit, load_average, log, machine_lines, paired_ratio, table
from decoding import _hf_model

NAMES = ("sdpa", "selfattn", "step, no checks", "kernel + guard", "kernel")
SELFATTN_MASKS = ("selfattn", "step, no checks")  # the functions whose model gets selfattn's mask function
HEADER = ["batch", "function", "us per call", "minus sdpa's", "prefill us", "masks us", "tokens/s", "ratio to sdpa",
          "same tokens"]  # fmt: skip


def _functions() -> dict[str, Callable[..., Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from selfattn.integrations import _hf_plan
    from selfattn.integrations.transformers import attention_forward

    def unchecked_step(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any) -> Any:
        plans = _hf_plan.plans_of(module) if q.shape[2] == 1 and mask is None else None
        if plans is not None and plans[0] is not None and plans[0].step is not None:
            return plans[0].step(q, k, v).transpose(1, 2).contiguous(), None  # (b, 1, h, dv)
        return attention_forward(module, q, k, v, mask, **kw)  # the first step of a layer makes its plan

    def reference(guarded: bool) -> Callable[..., Any]:
        def forward(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any) -> Any:
            if q.shape[2] != 1 or mask is not None:
                return sdpa_attention_forward(module, q, k, v, mask, **kw)
            if guarded:
                q = q.add(q, alpha=0)
            grouped = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=kw.get("scaling"), enable_gqa=grouped)
            return out.transpose(1, 2).contiguous(), None  # (b, 1, h, dv)

        return forward

    return {"sdpa": sdpa_attention_forward, "selfattn": attention_forward, "step, no checks": unchecked_step,
            "kernel + guard": reference(True), "kernel": reference(False)}  # fmt: skip


def _timed(function: Callable[..., Any], clock: dict[str, float]) -> Callable[..., Any]:
    def timed(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any) -> Any:
        started = time.perf_counter()
        out = function(module, q, k, v, mask, **kw)
        if q.shape[2] == 1 and mask is None:  # a decoding step with no mask: what the plans replay
            clock["seconds"] += time.perf_counter() - started
            clock["calls"] += 1
        else:  # the prompt's pass (no padding here: no decoding step has a mask)
            clock["prefill"] += time.perf_counter() - started
        return out

    return timed


def _timed_masks(function: Callable[..., Any], clock: dict[str, float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = function(*args, **kwargs)
        clock["masks"] += time.perf_counter() - started
        return out

    return timed


def rows(batch: int, rounds: int) -> tuple[list[list[str]], str]:
    """The table's rows for one batch size, and a line naming what the timed calls were."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from selfattn.integrations.transformers import model_masks

    clock = {"seconds": 0.0, "calls": 0.0, "prefill": 0.0, "masks": 0.0}
    for name, function in _functions().items():
        registered = f"gap {name}"
        AttentionInterface.register(registered, _timed(function, clock))
        AttentionMaskInterface.register(
            registered, _timed_masks(model_masks if name in SELFATTN_MASKS else sdpa_mask, clock)
        )
    model = _hf_model("llama", "sdpa")
    prompt = torch.randint(2, 128, (batch, 8), generator=torch.Generator().manual_seed(batch))
    per_call: dict[str, list[float]] = {name: [] for name in NAMES}
    prefill: dict[str, list[float]] = {name: [] for name in NAMES}  # seconds per generate()
    masks: dict[str, list[float]] = {name: [] for name in NAMES}
    total: dict[str, list[float]] = {name: [] for name in NAMES}
    tokens: dict[str, torch.Tensor] = {}
    for round_ in range(rounds + 1):  # the first round warms every function up and is not kept
        for name in NAMES if round_ % 2 else reversed(NAMES):
            model.set_attn_implementation(f"gap {name}")
            clock.update(seconds=0.0, calls=0.0, prefill=0.0, masks=0.0)
            started = time.perf_counter()
            with torch.no_grad():
                tokens[name] = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            if round_:
                total[name].append(time.perf_counter() - started)
                per_call[name].append(clock["seconds"] / clock["calls"])
                prefill[name].append(clock["prefill"])
                masks[name].append(clock["masks"])
    calls = int(clock["calls"])
    base = statistics.median(per_call["sdpa"])
    table_rows = []
    for name in NAMES:
        us = statistics.median(per_call[name]) * 1e6
        x, low, high = paired_ratio(total["sdpa"], total[name])
        same = "yes" if torch.equal(tokens[name], tokens["sdpa"]) else "**no**"
        table_rows.append([str(batch), name, f"{us:.1f}", f"{us - base * 1e6:+.1f}",
                           f"{statistics.median(prefill[name]) * 1e6:.0f}", f"{statistics.median(masks[name]) * 1e6:.0f}",
                           f"{batch * 64 / statistics.median(total[name]):.0f}", f"{x:.3f}x ({low:.3f}-{high:.3f})",
                           same])  # fmt: skip
    return table_rows, f"batch {batch}: {calls} timed calls per generate() (4 layers, 63 decoding steps)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds; prints only")
    parser.add_argument("--rounds", type=int, default=21, help="rounds per batch size (default 21)")
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file to update (none with --quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started, load_at_start = time.perf_counter(), load_average()
    rounds = 3 if args.quick else args.rounds
    all_rows, counts = [], []
    for batch in (1, 4):
        log(f"batch {batch}")
        batch_rows, count = rows(batch, rounds)
        all_rows += batch_rows
        counts.append(count)
    lines = [
        "## Decoding gap: Llama's attention call inside generate(), selfattn against sdpa (cpu)",
        "",
        *machine_lines(torch.device("cpu"), load_at_start),
        f"- load average at end: {load_average()}; run took {time.perf_counter() - started:.0f} s; {rounds} rounds",
        "",
        "Microseconds per one-query unmasked attention call inside `generate()` (the median over rounds of each "
        "round's mean; each function wrapped in the same timer), its difference from `sdpa`'s, the tokens/s of "
        "the whole `generate()`, and the paired ratio of `sdpa`'s time over the function's (the median over "
        "rounds, its 95% interval). Per `generate()` (medians over rounds), microseconds in its other attention "
        "calls (`prefill us`: the prompt's, one per layer) and in the mask function (`masks us`: one call per "
        "token; selfattn's is `model_masks`, the references' `sdpa_mask`). `step, no checks`, `kernel + guard` and "
        "`kernel` are references, not usable backends: they skip every check of the call (see the script's "
        "docstring); `step, no checks` computes what selfattn computes (its prompt and masks are selfattn's), the "
        "other two run their prompts through `sdpa`'s function. " + "; ".join(counts) + ".",
        "",
        table(HEADER, all_rows),
    ]
    emit("\n".join(lines), output=None if args.quick else args.output, section="decoding-gap-cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
