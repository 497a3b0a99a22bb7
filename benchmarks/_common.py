"""Shared pieces of the benchmark scripts: timing, machine description, ``BENCHMARKS.md`` sections."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
GIB = 1024**3
MIB = 1024**2

_HEADER = """# selfattn benchmarks

Written by the scripts in `benchmarks/` (do not edit by hand): each script replaces only its own
section, delimited by `<!-- begin: NAME -->` / `<!-- end: NAME -->`. Timings are medians of
repeats taken round-robin (every contender once per round, after a warm-up round), so a busy
machine slows all contenders alike; compare ratios measured in the same run, not across runs.
"""


def log(message: str) -> None:
    """Progress goes to stderr so stdout stays the markdown report."""
    print(message, file=sys.stderr, flush=True)


def command_line() -> str:
    """The exact command that ran this script, relative to the repository root where possible."""
    exe = sys.executable
    with contextlib.suppress(ValueError):  # another drive (Windows): the path as it is
        exe = os.path.relpath(exe, REPO_ROOT) if Path(exe).is_relative_to(REPO_ROOT) else exe
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT)
    return " ".join(shlex.quote(part) for part in [exe, script, *sys.argv[1:]])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if "flags" in text else set()
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)


def mem_info_bytes(field: str) -> int | None:
    """A field of ``/proc/meminfo`` (e.g. ``MemTotal``, ``MemAvailable``) in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_lines(device: torch.device, load_at_start: str | None = None) -> list[str]:
    """Markdown bullet lines describing where the figures were taken (``load_at_start``: the load average read
    when the run began, for a report written at its end; else read now)."""
    total = mem_info_bytes("MemTotal")
    lines = [
        f"- date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command_line()}`",
        f"- CPU: {_cpu_model()}, {os.cpu_count()} logical cores ({_cpu_flags()}), "
        f"torch threads {torch.get_num_threads()}" + (f", {total / GIB:.1f} GiB RAM" if total else ""),
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.machine()}",
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"- GPU: {props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}")
    lines.append(f"- load average (1/5/15 min) at start: {load_at_start or load_average()}")
    return lines


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure(
    cases: dict[str, Callable[[], object]],
    *,
    device: torch.device,
    min_repeats: int,
    max_repeats: int,
    budget_s: float,
    warmup: int = 1,
    spread: dict | None = None,
    rounds: dict | None = None,
    prepare: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each case, timed round-robin.

    Each round calls every case once, so a burst of load from elsewhere hits all of them; odd rounds
    go in reverse order, so no case always runs right after the same other one (whose traces in the
    caches, or whose absence, it would otherwise always meet).
    Rounds continue until ``max_repeats``, or past ``min_repeats`` once the timed rounds have
    taken ``budget_s`` seconds. If ``spread`` is given, it receives ``(max - min) / median``
    of each case, a plain gauge of how noisy the machine was. If ``rounds`` is given, it receives each
    case's list of times, round by round (for :func:`paired_ratio`). ``prepare[name]``, if given, is called
    untimed before each call of that case (e.g. one model switched to the case's attention implementation).
    """
    sync = synchronizer(device)
    prepare = prepare or {}
    for _ in range(warmup):
        for name, fn in cases.items():
            if name in prepare:
                prepare[name]()
            fn()
            sync()
    times: dict[str, list[float]] = {name: [] for name in cases}
    started = time.perf_counter()
    for round_index in range(max_repeats):
        if round_index >= min_repeats and time.perf_counter() - started > budget_s:
            break
        for name, fn in cases.items() if round_index % 2 == 0 else reversed(cases.items()):
            if name in prepare:
                prepare[name]()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    if rounds is not None:
        rounds.update(times)
    if spread is not None:
        spread.update({name: (max(ts) - min(ts)) / medians[name] for name, ts in times.items()})
    return medians


def paired_ratio(numerators: list[float], denominators: list[float]) -> tuple[float, float, float]:
    """The median over rounds of ``numerator / denominator`` (two cases' times in the same round), and a
    distribution-free 95% interval of that median (order statistics: the sign test's binomial bounds).

    A round's two calls share the machine's load of that moment, so their ratio moves less than the
    ratio of two medians taken apart when the load drifts over the run.
    """
    ratios = sorted(a / b for a, b in zip(numerators, denominators, strict=True))
    n = len(ratios)
    # The largest k with P(Binomial(n, 1/2) < k) <= 2.5%: [ratios[k - 1], ratios[n - k]] covers the median.
    below, k = 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    low, high = (ratios[k - 1], ratios[n - k]) if k > 0 else (ratios[0], ratios[-1])
    return statistics.median(ratios), low, high


def spread_note(spread: dict) -> str:
    """One sentence naming the noisiest case of a table."""
    if not spread:
        return ""
    name, worst = max(spread.items(), key=lambda item: item[1])
    label = " ".join(str(part) for part in name) if isinstance(name, tuple) else str(name)
    return f"Noise gauge: the widest (max - min) / median over the repeats was {worst:.0%} ({label})."


def gemm_case(device: torch.device, size: int) -> tuple[Callable[[], object], float]:
    """A square fp32 ``torch.mm`` to time next to other cases, and its FLOPs."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device)
    b = torch.randn(size, size, generator=gen).to(device)
    out = torch.empty(size, size, device=device)
    return (lambda: torch.mm(a, b, out=out)), 2.0 * size**3


def gemm_peak_gflops(device: torch.device, *, size: int, repeats: int) -> float:
    """Achieved fp32 GFLOP/s of a large square ``torch.mm`` (median of ``repeats``)."""
    call, flops = gemm_case(device, size)
    seconds = measure({"mm": call}, device=device, min_repeats=repeats, max_repeats=repeats, budget_s=0.0)["mm"]
    return flops / seconds / 1e9


def size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.0f} MiB"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_headroom(margin_gib: float) -> tuple[int, int]:
    """(bytes a child may use, MemAvailable): what is available now minus a margin left to others."""
    available = mem_info_bytes("MemAvailable") or 0
    return available - int(margin_gib * GIB), available


def measure_peak_rss(run: Callable[[], object], allowed_bytes: int) -> dict:
    """Growth of this process's peak resident set during ``run()`` (call it in a fresh process).

    The address space is capped at ``allowed_bytes`` above its current size, so a call that
    would not fit fails with an error here instead of waking the OOM killer for everyone.
    """
    limit = _status_kib("VmSize") * 1024 + allowed_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    before = _status_kib("VmRSS") * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS high-water mark
        method = "VmHWM after reset - VmRSS before"
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        method = "ru_maxrss after - ru_maxrss before"
    t0 = time.perf_counter()
    try:
        out = run()
    except (RuntimeError, MemoryError) as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    seconds = time.perf_counter() - t0
    if method.startswith("VmHWM"):
        peak = _status_kib("VmHWM") * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del out
    return {"peak_bytes": peak - before, "seconds": seconds, "method": method}


def run_memory_child(script: Path, child_args: list[str], allowed_bytes: int, timeout_s: float | None = None) -> dict:
    """Run ``script --memory-child *child_args allowed_bytes`` and read the JSON line it prints."""
    command = [sys.executable, str(script), "--memory-child", *child_args, str(allowed_bytes)]
    # A fixed mmap threshold keeps glibc from parking freed large blocks in the heap, where a
    # later allocation would reuse them without the resident set showing it.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"child exited {proc.returncode}: {tail[:160]}"}


def update_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section ``name`` of the markdown file at ``path``."""
    begin, end = f"<!-- begin: {name} -->", f"<!-- end: {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    partial = path.with_name(path.name + ".partial")  # written whole, then renamed: never half a file
    partial.write_text(text)
    partial.replace(path)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def verdict(met: bool) -> str:
    return "**met**" if met else "**not met**"


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available here")
    return device


def emit(report: str, *, output: str | None, section: str) -> None:
    """Print the report, and write it as ``section`` of ``output`` unless ``output`` is None."""
    print(report)
    if output is not None:
        update_section(Path(output), section, report)
        log(f"wrote section {section!r} of {output}")
