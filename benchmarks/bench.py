"""Benchmark of the Kimi-K3 MLA epilogues: FFI op vs jnp reference vs the memory floor.

For every variant (``jax_kimi_mla._workloads.VARIANTS``), head count and size: the device time
per call of the FFI op and of the jitted reference (cache donated; with RoPE in prefill q too),
their wall time per call and kernel count per call, and the floor, the least bytes a call must
move divided by the copy ceiling measured in the same run (a jitted ``jnp.copy`` of a 2 GiB
array, read + write bytes). Then one op with a 64 MiB and with a 16 GiB cache: with donation
the time must not depend on the cache size.

Device time is the median over several hundred (at least 10) calls in a ``jax.profiler``
trace. Without a device trace (the CPU backend) the wall time stands in, marked "wall".

    python benchmarks/bench.py              # all sizes, on the default backend
    python benchmarks/bench.py --quick      # a handful of sizes: a smoke run, fine on CPU

Writes RESULTS.md, results.csv (row by row, so a killed run keeps what it measured) and
plots/<variant>.png under --out (default: benchmarks/results/<platform>[-quick]).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jax_kimi_mla._profile import device_time_per_call, wall_time_per_call
from jax_kimi_mla._workloads import VARIANTS, Variant, fresh_copy, run

DTYPE = jnp.bfloat16
HEADS = (12, 96)  # Kimi-K3: 96 heads, 12 per GPU at TP8
SIZES = {"decode": (1, 4, 16, 64, 256, 1024, 4096), "prefill": (512, 2048, 8192, 32768)}
QUICK_HEADS = (12,)
QUICK_SIZES = {"decode": (1, 16, 64), "prefill": (128, 512)}
COPY_BYTES, QUICK_COPY_BYTES = 2 << 30, 256 << 20
CACHE_BYTES, QUICK_CACHE_BYTES = (64 << 20, 16 << 30), (64 << 20, 1 << 30)
CACHE_CASE = ("decode_bf16_nope", 64, 12)  # variant, B, H of the cache-size check
PROFILED_SECONDS = 0.03  # wall time the profiled calls of one measurement should take
MIN_CALLS, MAX_CALLS = 10, 400
WALL_SECONDS, MIN_WALL_CALLS, MAX_WALL_CALLS = 0.02, 5, 200

FIELDS = [
    "variant", "phase", "cache_format", "rope", "heads", "tokens", "min_bytes", "floor_us",
    "ffi_us", "ffi_kernels", "ffi_wall_us", "ffi_bw_fraction",
    "ref_us", "ref_kernels", "ref_wall_us", "ref_bw_fraction", "time_source", "error",
]


@dataclass(frozen=True)
class Timing:
    wall_s: float
    device_s: float | None
    kernels: float | None
    source: str  # "device", "device-mean" (calls could not be told apart) or "wall"
    span_s: float | None = None  # first kernel's start to last kernel's end (device, per call)

    @property
    def seconds(self) -> float:
        return self.wall_s if self.device_s is None else self.device_s


def _clamp(x: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, x)))


def measure(step, args: list, donated: dict[int, int], max_calls: int = MAX_CALLS) -> Timing:
    """Compiles and warms ``step`` up, then times it; ``args`` are consumed (donated)."""
    jax.block_until_ready(run(step, args, donated))
    start = time.perf_counter()
    jax.block_until_ready(run(step, args, donated))
    estimate = time.perf_counter() - start
    wall = wall_time_per_call(step, args, donated, _clamp(WALL_SECONDS / estimate, MIN_WALL_CALLS, MAX_WALL_CALLS), warmup=0)
    device = device_time_per_call(step, args, donated, _clamp(PROFILED_SECONDS / wall, MIN_CALLS, max_calls))
    if device is None:
        return Timing(wall, None, None, "wall")
    return Timing(wall, device.seconds, device.kernels, "device" if device.per_call else "device-mean", device.span_seconds)


def copy_ceiling(nbytes: int) -> tuple[float, Timing]:
    """Bytes per second of a jitted ``jnp.copy`` (read + write), and its timing."""
    x = jnp.full((nbytes,), 0x5A, jnp.uint8)
    # Few calls: each returns a new buffer of nbytes, and calls queue up ahead of the device.
    timing = measure(jax.jit(jnp.copy), [x], {}, max_calls=MIN_CALLS)
    return 2 * nbytes / timing.seconds, timing


def empty_kernel_time() -> Timing:
    """One kernel that does nearly nothing (a one-element add, its buffer donated), timed as the ops
    are: the floor under the small decode calls' device time."""
    step = jax.jit(lambda x: (x + 1,), donate_argnums=0)
    return measure(step, [jnp.zeros((1,), jnp.int32)], {0: 0})


def cache_size_check(cache_bytes: tuple[int, ...]) -> list[dict]:
    """One op at one shape with caches of different sizes: donation makes the size irrelevant."""
    name, tokens, heads = CACHE_CASE
    variant = VARIANTS[name]
    rows = []
    for nbytes in cache_bytes:
        row = dict(variant=name, tokens=tokens, heads=heads, cache_mib=nbytes >> 20)
        num_blocks = variant.num_blocks_for(nbytes, DTYPE)
        for label, fn in (("ffi", variant.op), ("ref", variant.reference)):
            # Built anew per op so that only one large cache is alive at a time.
            args = variant.inputs(tokens, heads, DTYPE, num_blocks=num_blocks)
            row[label] = measure(variant.step(fn), args, variant.donated)
            del args
        rows.append(row)
        print(f"  cache {nbytes >> 20:6d} MiB: ffi {row['ffi'].seconds * 1e6:9.1f} us,"
              f" ref {row['ref'].seconds * 1e6:9.1f} us ({row['ffi'].source})", flush=True)
    return rows


def sweep_point(variant: Variant, tokens: int, heads: int, ceiling: float) -> dict:
    args = variant.inputs(tokens, heads, DTYPE)
    ref_args = fresh_copy(args, variant.donated)
    ffi = measure(variant.step(variant.op), args, variant.donated)
    del args
    ref = measure(variant.step(variant.reference), ref_args, variant.donated)
    min_bytes = variant.min_bytes(tokens, heads, DTYPE)
    floor = min_bytes / ceiling
    return dict(
        variant=variant.name, phase=variant.phase, cache_format=variant.cache_format, rope=variant.rope,
        heads=heads, tokens=tokens, min_bytes=min_bytes, floor_us=floor * 1e6,
        ffi_us=ffi.seconds * 1e6, ffi_kernels=ffi.kernels, ffi_wall_us=ffi.wall_s * 1e6, ffi_bw_fraction=floor / ffi.seconds,
        ref_us=ref.seconds * 1e6, ref_kernels=ref.kernels, ref_wall_us=ref.wall_s * 1e6, ref_bw_fraction=floor / ref.seconds,
        time_source=ffi.source if ffi.source == ref.source else f"{ffi.source}/{ref.source}", error="",
    )


def _num(x, digits=1) -> str:
    if x is None or x == "":
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


DISPATCH_CASES = (("decode_bf16_nope", 1, 12), ("decode_fp8_ds_mla_rope", 1, 12))
DISPATCH_CALLS, DISPATCH_REPEATS = 200, 5


def dispatch_check() -> list[dict]:
    """Host time per call of a jitted step that holds the FFI op vs one that holds the reference,
    at sizes where the host sets the pace: calls issued back to back (each feeds the donated cache
    to the next), waited for once at the end; the median over a few repeats."""
    rows = []
    for name, tokens, heads in DISPATCH_CASES:
        variant = VARIANTS[name]
        row = dict(variant=name, tokens=tokens, heads=heads)
        for label, fn in (("ffi", variant.op), ("ref", variant.reference)):
            args = variant.inputs(tokens, heads, DTYPE)
            step = variant.step(fn)
            jax.block_until_ready(run(step, args, variant.donated))
            per_call = []
            for _ in range(DISPATCH_REPEATS):
                start = time.perf_counter()
                for _ in range(DISPATCH_CALLS):
                    outputs = run(step, args, variant.donated)
                jax.block_until_ready(outputs)
                per_call.append((time.perf_counter() - start) / DISPATCH_CALLS)
            row[label] = sorted(per_call)[len(per_call) // 2]
        rows.append(row)
        print(f"  {name} B={tokens} H={heads}: ffi {row['ffi'] * 1e6:.1f} us/call, ref {row['ref'] * 1e6:.1f} us/call",
              flush=True)
    return rows


def _span(values, fmt="{:.0f}%", scale=100.0) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def target_lines(rows: list[dict], cache_rows: list[dict], dispatch_rows: list[dict]) -> list[str]:
    """Issue 4's targets, judged from this run's rows."""
    ok = [r for r in rows if not r["error"]]
    large = [r for r in ok if (r["phase"] == "decode" and r["tokens"] >= 1024 and r["heads"] == 96)
             or (r["phase"] == "prefill" and r["tokens"] >= 8192)]
    bf16_nope = [r for r in large if r["cache_format"] == "bf16" and not r["rope"]]
    serving = [r for r in ok if r["phase"] == "decode" and r["tokens"] <= 64 and r["heads"] == 12]

    def verdict(good: bool) -> str:
        return "met" if good else "**not met**"

    def worst(points, key, n=3) -> str:
        return ", ".join(f"{r['variant']} H={r['heads']} n={r['tokens']}: {key(r)}"
                         for r in sorted(points, key=lambda r: r["ffi_bw_fraction"])[:n])

    below_85 = [r for r in large if r["ffi_bw_fraction"] < 0.85]
    slower = [r for r in ok if r["ffi_us"] > r["ref_us"]]
    small_miss = [r for r in serving if r["ffi_kernels"] != 1 or r["ffi_us"] > 1.5 or 2 * r["ffi_us"] > r["ref_us"]]
    by_variant = {}
    for r in large:
        by_variant.setdefault(r["variant"], []).append(r["ffi_bw_fraction"])
    cache_us = [c["ffi"].seconds * 1e6 for c in cache_rows]
    lines = [
        "## Against the targets (issue 4), from this run",
        "",
        "Large sizes: decode B >= 1024 with H = 96, prefill T >= 8192 (H = 12 and 96).",
        "",
        "| target | status | measured |",
        "|---|---|---|",
        f"| bf16 NoPE paths >= 90% of the copy ceiling at large sizes | "
        f"{verdict(all(r['ffi_bw_fraction'] >= 0.9 for r in bf16_nope))} | "
        f"{_span([r['ffi_bw_fraction'] for r in bf16_nope])} |",
        f"| every op and format >= 85% at large sizes | {verdict(not below_85)} | "
        + "; ".join(f"{v} {_span(f)}" for v, f in by_variant.items()) + " |",
        f"| never slower than the reference | {verdict(not slower)} | "
        + (f"{len(slower)} of {len(ok)} points slower: "
           + ", ".join(f"{r['variant']} H={r['heads']} n={r['tokens']}" for r in slower[:6])
           if slower else f"all {len(ok)} points faster, {_span([r['ref_us'] / r['ffi_us'] for r in ok], '{:.1f}x', 1)}")
        + " |",
        f"| decode B <= 64, H = 12: one kernel, <= 1.5 us, <= half the reference | {verdict(not small_miss)} | "
        f"kernels {_span([r['ffi_kernels'] for r in serving], '{:.0f}', 1)}; "
        f"{_span([r['ffi_us'] for r in serving], '{:.2f} us', 1)}; "
        f"reference / FFI {_span([r['ref_us'] / r['ffi_us'] for r in serving], '{:.1f}x', 1)}"
        + (f"; over 1.5 us: {len(small_miss)} of {len(serving)} points" if small_miss else "") + " |",
        f"| cache-size independence | {verdict(max(cache_us) <= 1.1 * min(cache_us))} | "
        + ", ".join(f"{c['cache_mib']} MiB: {c['ffi'].seconds * 1e6:.1f} us" for c in cache_rows) + " |",
        f"| no added host overhead per call | {verdict(all(d['ffi'] <= 1.05 * d['ref'] for d in dispatch_rows))} | "
        + ", ".join(f"{d['variant']} B={d['tokens']}: FFI {d['ffi'] * 1e6:.1f} vs reference {d['ref'] * 1e6:.1f} us/call"
                    for d in dispatch_rows) + " (calls back to back, see below) |",
        "",
    ]
    if below_85:
        lowest = worst(below_85, lambda r: f"{100 * r['ffi_bw_fraction']:.0f}%")
        lines += [f"Lowest at large sizes: {lowest}.", ""]
    return lines


# Issue 12's bandwidth targets: (label, the lowest BW fraction, which rows the target covers).
ISSUE12_BW_TARGETS = (
    ("prefill fp8 q/k/v + RoPE, H = 96, T >= 8192", 0.90,
     lambda r: r["variant"] == "prefill_fp8_rope" and r["heads"] == 96 and r["tokens"] >= 8192),
    ("prefill fp8 RoPE, H = 12, T >= 8192", 0.85,
     lambda r: r["variant"] == "prefill_fp8_rope" and r["heads"] == 12 and r["tokens"] >= 8192),
    ("decode fp8 RoPE, H = 96, B >= 1024", 0.92,
     lambda r: r["variant"] == "decode_fp8_rope" and r["heads"] == 96 and r["tokens"] >= 1024),
    ("prefill bf16/ds_mla RoPE, H = 96, T >= 8192", 0.92,
     lambda r: r["variant"] in ("prefill_bf16_rope", "prefill_fp8_ds_mla_rope") and r["heads"] == 96
     and r["tokens"] >= 8192),
    ("prefill, H = 12, T = 8192: bf16 and ds_mla (NoPE and RoPE), fp8 NoPE", 0.90,
     lambda r: r["variant"] in ("prefill_bf16_nope", "prefill_bf16_rope", "prefill_fp8_ds_mla_nope",
                                "prefill_fp8_ds_mla_rope", "prefill_fp8_nope")
     and r["heads"] == 12 and r["tokens"] == 8192),
)
ISSUE12_SMALL_DECODE_US = {False: 1.25, True: 1.4}  # NoPE, RoPE: decode B <= 64, H = 12


def issue12_lines(rows: list[dict], empty_us: float) -> list[str]:
    """Issue 12's targets, judged from this run's rows."""
    ok = [r for r in rows if not r["error"]]
    lines = ["## Against the targets (issue 12), from this run", "",
             "| path | target | status | measured |", "|---|---|---|---|"]
    for label, least, wanted in ISSUE12_BW_TARGETS:
        points = [r for r in ok if wanted(r)]
        if not points:
            lines.append(f"| {label} | >= {100 * least:.0f}% | not measured | - |")
            continue
        met = all(r["ffi_bw_fraction"] >= least for r in points)
        lines.append(f"| {label} | >= {100 * least:.0f}% | {'met' if met else '**not met**'} | "
                     f"{_span([r['ffi_bw_fraction'] for r in points])} |")
    for rope, most in ISSUE12_SMALL_DECODE_US.items():
        points = [r for r in ok if r["phase"] == "decode" and r["tokens"] <= 64 and r["heads"] == 12
                  and bool(r["rope"]) == rope]
        label = f"decode B <= 64, H = 12, every format, {'RoPE' if rope else 'NoPE'}"
        if not points:
            lines.append(f"| {label} | <= {most} us | not measured | - |")
            continue
        met = all(r["ffi_us"] <= most for r in points)
        lines.append(f"| {label} | <= {most} us | {'met' if met else '**not met**'} | "
                     f"{_span([r['ffi_us'] for r in points], '{:.2f} us', 1)} (an empty kernel: {empty_us:.2f} us) |")
    return lines + [""]


def write_markdown(path: Path, meta: dict, cache_rows: list[dict], dispatch_rows: list[dict], rows: list[dict],
                   skipped: list[str]) -> None:
    lines = [
        "# Kimi-K3 MLA epilogues: FFI op vs jnp reference",
        "",
        f"- date: {meta['date']}; jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {platform.python_version()}",
        f"- device: {meta['device']}; activations {jnp.dtype(DTYPE)}, block_size 64",
        f"- time per call: {meta['time_note']}",
        f"- copy ceiling: {meta['ceiling'] / 1e9:.1f} GB/s (jitted jnp.copy of {meta['copy_mib']} MiB, read + write bytes)",
        "- floor = minimum bytes / copy ceiling (each input read once, each output written once, only the",
        "  cache rows of valid slots; no q traffic in NoPE prefill); BW = floor / time, the fraction of the copy",
        "  ceiling reached. Both ops run under jax.jit with the cache donated (with RoPE in prefill, q too).",
        *([] if meta["device_timed"] else [
            "- not a GPU run: the copy ceiling is this machine's memory, which small calls' bytes beat from its",
            "  caches (BW above 100%), and XLA:CPU's reference scatter into a donated cache is not in place (its",
            "  time grows with the cache below). Only a GPU run's numbers say anything about the kernels."]),
        "",
        *(target_lines(rows, cache_rows, dispatch_rows) if meta["device_timed"] else []),
        *(issue12_lines(rows, meta["empty_us"]) if meta["device_timed"] else []),
        "## Cache-size independence",
        "",
        f"{CACHE_CASE[0]}, B={CACHE_CASE[1]}, H={CACHE_CASE[2]}: with donation, a call touches only the rows it writes.",
        "",
        "| cache | FFI us | reference us |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {r['cache_mib']} MiB | {r['ffi'].seconds * 1e6:.1f} | {r['ref'].seconds * 1e6:.1f} |" for r in cache_rows]
    lines += [
        "", "## Host time per call", "",
        f"{DISPATCH_CALLS} calls issued back to back, then waited for (median of {DISPATCH_REPEATS}): at these sizes the host,",
        "not the device, sets the pace, so this is the cost of dispatching each jitted step.", "",
        "| step | FFI us/call | reference us/call |", "|---|---:|---:|",
        *[f"| {d['variant']} B={d['tokens']} H={d['heads']} | {d['ffi'] * 1e6:.1f} | {d['ref'] * 1e6:.1f} |"
          for d in dispatch_rows],
        "", "## Results", "",
    ]
    for name in dict.fromkeys(r["variant"] for r in rows):
        size = "B" if name.startswith("decode") else "T"
        plotted = any(not r["error"] for r in rows if r["variant"] == name)
        lines += [
            f"### {name}", "",
            *([f"![{name}](plots/{name}.png)", ""] if plotted else []),
            f"| H | {size} | floor us | FFI us | ref us | speedup | FFI BW | ref BW | kernels FFI/ref | wall FFI/ref us |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["variant"] == name):
            if r["error"]:
                lines.append(f"| {r['heads']} | {r['tokens']} | error: {r['error']} |" + " |" * 7)
                continue
            lines.append(
                f"| {r['heads']} | {r['tokens']} | {r['floor_us']:.2f} | {r['ffi_us']:.2f} | {r['ref_us']:.2f}"
                f" | {r['ref_us'] / r['ffi_us']:.1f}x | {100 * r['ffi_bw_fraction']:.0f}% | {100 * r['ref_bw_fraction']:.0f}%"
                f" | {_num(r['ffi_kernels'])}/{_num(r['ref_kernels'])} | {r['ffi_wall_us']:.1f}/{r['ref_wall_us']:.1f} |"
            )
        lines.append("")
    if skipped:
        lines += ["## Not measured (time limit)", "", *[f"- {s}" for s in skipped], ""]
    path.write_text("\n".join(lines))


def write_plots(directory: Path, rows: list[dict], time_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if not r["error"]]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        heads = sorted({r["heads"] for r in mine})
        fig, axes = plt.subplots(1, len(heads), figsize=(5.5 * len(heads), 4), squeeze=False)
        for ax, h in zip(axes[0], heads):
            pts = sorted((r for r in mine if r["heads"] == h), key=lambda r: r["tokens"])
            x = [r["tokens"] for r in pts]
            ax.plot(x, [r["ffi_us"] for r in pts], "o-", label=f"FFI op ({time_label})")
            ax.plot(x, [r["ref_us"] for r in pts], "s-", label=f"jnp reference ({time_label})")
            ax.plot(x, [r["floor_us"] for r in pts], "k--", label="floor (min bytes / copy BW)")
            ax.set(xscale="log", yscale="log", title=f"{name}, H={h}",
                   xlabel="decode batch B" if name.startswith("decode") else "prefill tokens T",
                   ylabel="time per call (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / f"{name}.png", dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of small sizes (CPU smoke run)")
    parser.add_argument("--out", type=Path, help="output directory (default: benchmarks/results/<platform>[-quick])")
    parser.add_argument("--only", help="comma-separated substrings of variant names to run, e.g. decode_bf16,fp8_rope")
    parser.add_argument("--time-limit-s", type=float, default=420.0,
                        help="stop starting new sweep points after this many seconds; the rest is listed as not measured")
    opts = parser.parse_args(argv)

    started = time.monotonic()
    device = jax.devices()[0]
    out = opts.out or Path(__file__).parent / "results" / f"{device.platform}{'-quick' if opts.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    heads, sizes = (QUICK_HEADS, QUICK_SIZES) if opts.quick else (HEADS, SIZES)
    wanted = [w for w in (opts.only or "").split(",") if w]
    variants = [v for v in VARIANTS.values() if not wanted or any(w in v.name for w in wanted)]
    if not variants:
        sys.exit(f"--only {opts.only!r} matches no variant; the names: {', '.join(VARIANTS)}")
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); writing to {out}", flush=True)

    copy_bytes = QUICK_COPY_BYTES if opts.quick else COPY_BYTES
    ceiling, copy_timing = copy_ceiling(copy_bytes)
    print(f"copy ceiling: {ceiling / 1e9:.1f} GB/s ({copy_bytes >> 20} MiB jnp.copy, {copy_timing.source} time)", flush=True)
    empty = empty_kernel_time()
    print(f"an empty kernel: {empty.seconds * 1e6:.2f} us ({empty.source} time)", flush=True)
    print("cache-size independence:", flush=True)
    cache_rows = cache_size_check(QUICK_CACHE_BYTES if opts.quick else CACHE_BYTES)
    print("host time per call:", flush=True)
    dispatch_rows = dispatch_check()

    rows, skipped = [], []
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for variant in variants:
            for h in heads:
                for tokens in sizes[variant.phase]:
                    point = f"{variant.name} H={h} {'B' if variant.phase == 'decode' else 'T'}={tokens}"
                    if time.monotonic() - started > opts.time_limit_s:
                        skipped.append(point)
                        continue
                    try:
                        row = sweep_point(variant, tokens, h, ceiling)
                    except Exception as e:  # e.g. out of memory: record it, go on
                        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                        row = dict(variant=variant.name, phase=variant.phase, cache_format=variant.cache_format,
                                   rope=variant.rope, heads=h, tokens=tokens, error=message)
                        print(f"{point:40} ERROR {message}", flush=True)
                    else:
                        print(f"{point:40} floor {row['floor_us']:9.2f} us  ffi {row['ffi_us']:9.2f} us"
                              f" ({_num(row['ffi_kernels'])} k)  ref {row['ref_us']:9.2f} us ({_num(row['ref_kernels'])} k)"
                              f"  [{row['time_source']}]", flush=True)
                    rows.append(row)
                    writer.writerow({k: row.get(k, "") for k in FIELDS})
                    f.flush()

    sources = {r["time_source"] for r in rows if not r["error"]}
    device_timed = sources == {"device"}
    meta = dict(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        device=f"{device.device_kind} ({device.platform})",
        ceiling=ceiling, copy_mib=copy_bytes >> 20, device_timed=device_timed, empty_us=empty.seconds * 1e6,
        time_note=("device time, the median over the profiled calls of the summed kernel durations of one call"
                   if device_timed else
                   f"source {', '.join(sorted(sources)) or '-'}: 'wall' is wall clock per call (median, each call "
                   "waited for), standing in where the profiler has no device plane (CPU)"),
    )
    write_markdown(out / "RESULTS.md", meta, cache_rows, dispatch_rows, rows, skipped)
    write_plots(out / "plots", rows, "device" if device_timed else "wall")
    failed = sum(bool(r["error"]) for r in rows)
    print(f"done in {time.monotonic() - started:.0f} s: {len(rows) - failed} points, {failed} errors,"
          f" {len(skipped)} not measured; see {out / 'RESULTS.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
