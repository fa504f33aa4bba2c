"""Benchmark of paged MLA decode attention: FFI op vs jnp reference vs the HBM floor, and the layer step.

Per point: the device time per call of ``jax_kimi_mla.mla_decode_attention`` and of the jitted
``jax_kimi_mla.reference.mla_decode_attention`` (same inputs, nothing donated), and the floor, the
bytes a call must move divided by the copy ceiling measured in the same run (bench.py's jitted copy
of a 2 GiB array, read + write bytes):

    bytes = B * context * cache bytes per token (bf16 1152, fp8 576, fp8_ds_mla 656) + q + out

Every point: block size 64, every sequence at the same context, block tables exactly
ceil(context / 64) wide holding distinct random block ids (a permutation), a cache of just the
blocks needed (plus a few) filled with valid entries of normal latents and k_pe, a normal query
(plain fp8: an fp8 query with q_scale_inv, as the layer's decode feeds it), S_q = 1 unless stated.

1. memory: H 12, 16; B 16, 64, 128; context 16k, 32k; bf16, fp8, fp8_ds_mla.
2. small: H 12; B 1, 2, 4, 8; context 4k ... 128k; bf16, fp8_ds_mla.
3. multi: S_q 1, 2, 4 (mqa_q [B, S_q, H, 576]) at H 12, B 64, context 16k; bf16, fp8_ds_mla.
4. wide: H 128, bf16, B 64, context 8k: TFLOP/s against a dense bf16 matmul 8192^3.
5. reference: H 12, B 64, context 16k: the speedup over the jnp reference.
6. layer: ``jax_kimi_mla.layer.decode`` (hidden 7168, H 12, q_lora_rank 1536) jitted with the cache
   donated; floor = weights + the context's cache entries + activations, each moved once.

Device time is the median over the profiled calls (``jax_kimi_mla._profile``) of one call's summed
kernel durations; without a device trace (the CPU backend) the wall time stands in, marked "wall".

    python -P benchmarks/bench_attention.py                  # everything, on the default backend
    python -P benchmarks/bench_attention.py --quick          # tiny sizes: a smoke run, fine on CPU
    python -P benchmarks/bench_attention.py --only memory,layer

Writes results.csv (row by row, so a killed run keeps what it measured), RESULTS.md (a table per
section, the targets judged PASS/MISS) and plots/*.png under --out (default:
benchmarks/results/<platform>-attention[-quick]).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import jax_kimi_mla
from jax_kimi_mla import _workloads, layer
from jax_kimi_mla.formats import CACHE_FORMATS, ENTRY, L

# bench.py sits beside this file; python -P does not put the script's folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import COPY_BYTES, QUICK_COPY_BYTES, Timing, copy_ceiling, measure

BLOCK = _workloads.BLOCK_SIZE
HEADS = 12  # Kimi-K3 heads per GPU at TP8
Q_LORA_RANK = 1536
FORMATS = tuple(CACHE_FORMATS)
TWO_FORMATS = ("bf16", "fp8_ds_mla")
CACHE_ROW_BYTES = {name: fmt.entry_bytes() for name, fmt in CACHE_FORMATS.items()}
SECTIONS = {
    "memory": "1. Memory-bound regime",
    "small": "2. Small batches",
    "multi": "3. Several query tokens per sequence",
    "wide": "4. H = 128: compute",
    "reference": "5. Against the jnp reference",
    "layer": "6. Layer decode step",
    "gather": "7. Context gather (gather_mla_cache)",
}
# Targets.
MIN_CEILING_FRACTION = 0.85
MIN_DS_MLA_OVER_BF16 = 1.6
MAX_SMALL_US = 6.0
MIN_MATMUL_FRACTION = 0.5
MIN_SPEEDUP = {"bf16": 6.0, "fp8_ds_mla": 10.0}
MAX_LAYER_OVER_FLOOR = 1.5
MIN_GATHER_CEILING_FRACTION = 0.85  # issue 11: at >= 64k context tokens

FIELDS = [
    "section", "name", "cache_format", "heads", "batch", "context", "q_tokens", "bytes", "weight_bytes",
    "floor_us", "op_us", "op_kernels", "op_wall_us", "op_kernel_sum_us", "ceiling_fraction",
    "ref_us", "ref_kernels", "ref_wall_us", "speedup", "tflops", "matmul_fraction", "time_source", "error",
]


@dataclass(frozen=True)
class Sizes:
    memory: tuple = ((12, 16), (16, 64, 128), (16384, 32768))  # H, B, context
    small: tuple = ((1, 2, 4, 8), (4096, 16384, 65536, 131072))  # B, context (H = 12)
    point: tuple = (64, 16384)  # B, context of the multi-token and reference sections
    q_tokens: tuple = (1, 2, 4)
    wide: tuple = (128, 64, 8192)  # H, B, context
    matmul: int = 8192
    hidden: int = 7168
    layer: tuple = (("bf16", 64, 16384), ("fp8_ds_mla", 64, 16384), ("bf16", 1, 4096), ("bf16", 128, 32768))
    gather: tuple = ((16, 4096), (64, 16384), (1, 131072))  # B, context: 64k to 1M context tokens
    copy_bytes: int = COPY_BYTES


FULL = Sizes()
QUICK = Sizes(
    memory=((12,), (2,), (64, 128)), small=((1, 2), (64, 128)), point=(2, 64), wide=(128, 1, 64), matmul=512,
    hidden=1024, layer=(("bf16", 2, 64), ("fp8_ds_mla", 2, 64), ("bf16", 1, 64)), gather=((2, 128),),
    copy_bytes=QUICK_COPY_BYTES,
)


@dataclass(frozen=True)
class Case:
    section: str
    fmt: str
    heads: int
    batch: int
    context: int
    q_tokens: int = 1

    @property
    def name(self) -> str:
        tokens = f" S_q={self.q_tokens}" if self.section == "multi" else ""
        return f"{self.section} {self.fmt} H={self.heads} B={self.batch} ctx={self.context}{tokens}"


def cases(s: Sizes) -> list[Case]:
    heads, batches, contexts = s.memory
    out = [Case("memory", f, h, b, c) for h in heads for b in batches for c in contexts for f in FORMATS]
    out += [Case("small", f, HEADS, b, c) for b in s.small[0] for c in s.small[1] for f in TWO_FORMATS]
    b, c = s.point
    out += [Case("multi", f, HEADS, b, c, q) for f in TWO_FORMATS for q in s.q_tokens]
    h, wb, wc = s.wide
    out.append(Case("wide", "bf16", h, wb, wc))
    out += [Case("reference", f, HEADS, b, c) for f in TWO_FORMATS]
    out += [Case("layer", f, HEADS, lb, lc) for f, lb, lc in s.layer]
    out += [Case("gather", f, 1, gb, gc) for gb, gc in s.gather for f in FORMATS]
    return out


# ---- inputs ----

def attention_inputs(case: Case, seed: int) -> list:
    return _workloads.attention_inputs(case.fmt, case.batch, case.context, case.heads,
                                       case.q_tokens if case.section == "multi" else None, seed=seed)


def attention_bytes(case: Case) -> int:
    return _workloads.attention_bytes(case.fmt, case.batch, case.context, case.heads, case.q_tokens)


def layer_config(case: Case, hidden: int) -> layer.MLAConfig:
    return layer.MLAConfig(hidden_size=hidden, num_heads=case.heads, q_lora_rank=Q_LORA_RANK, cache_format=case.fmt)


def layer_inputs(case: Case, hidden: int, seed: int) -> list:
    """[params, x, positions, slot_mapping, block_tables, context_lens, kv_cache] of one decode step:
    every sequence's new token is its last (position context - 1), written to its table's slot."""
    tables, lens, num_blocks = _workloads.paging(case.batch, case.context, np.random.default_rng(seed))
    positions = lens - 1
    slots = (tables[np.arange(case.batch), positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32)
    k_params, k_x, k_cache = jax.random.split(jax.random.key(seed), 3)
    params = layer.init_params(k_params, layer_config(case, hidden))
    x = jax.random.normal(k_x, (case.batch, hidden), jnp.float32).astype(jnp.bfloat16)
    cache = _workloads.random_cache(k_cache, case.fmt, num_blocks)
    return [params, x, *map(jnp.asarray, (positions, slots, tables, lens)), cache]


def layer_bytes(case: Case, hidden: int) -> tuple[int, int]:
    """(weight bytes, all bytes) of the floor: weights, the context's cache entries and the
    activations (x, out, the index arrays), each moved once."""
    shapes = jax.eval_shape(functools.partial(layer.init_params, config=layer_config(case, hidden)), jax.random.key(0))
    weights = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    index = 4 * case.batch * (3 + math.ceil(case.context / BLOCK))
    activations = 2 * case.batch * hidden * 2 + index
    return weights, weights + case.batch * case.context * CACHE_ROW_BYTES[case.fmt] + activations


# ---- measuring ----

def _message(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def timed(step, args: list, donated: dict[int, int]) -> tuple[Timing | None, str]:
    try:
        return measure(step, args, donated), ""
    except Exception as e:  # e.g. out of memory: record it, go on
        return None, _message(e)


def _timing_columns(prefix: str, t: Timing | None) -> dict:
    if t is None:
        return {}
    columns = {f"{prefix}_us": call_seconds(t) * 1e6, f"{prefix}_kernels": t.kernels, f"{prefix}_wall_us": t.wall_s * 1e6}
    if prefix == "op":
        columns["op_kernel_sum_us"] = t.seconds * 1e6
    return columns


def call_seconds(t: Timing) -> float:
    """A call's device time: its first kernel's start to its last one's end where the profiler splits
    the trace into calls, else the summed kernel durations. The span counts the gaps between launches
    and not twice the time that overlapping kernels share (the combine by programmatic launch waits
    inside the attention kernel's time)."""
    return t.span_s if t.span_s is not None else t.seconds


def case_row(case: Case) -> dict:
    return dict(section=case.section, name=case.name, cache_format=case.fmt, heads=case.heads, batch=case.batch,
                context=case.context, q_tokens=case.q_tokens)


def measure_case(case: Case, sizes: Sizes, ceiling: float, matmul_tflops: float | None, seed: int, launch: dict | None = None) -> dict:
    """The case's row; an op or reference that fails leaves its columns empty and says why in error.
    ``launch``: mla_decode_attention's launch keywords for the attention cases (kernel,
    programmatic_combine, balance_splits)."""
    row = case_row(case)
    if case.section == "layer":
        step = jax.jit(functools.partial(layer.decode, config=layer_config(case, sizes.hidden)), donate_argnums=6)
        args = layer_inputs(case, sizes.hidden, seed)
        op, error = timed(step, args, {6: 1})
        del args
        row["weight_bytes"], row["bytes"] = layer_bytes(case, sizes.hidden)
    elif case.section == "gather":
        args = _workloads.gather_inputs(case.fmt, case.batch, case.context, seed=seed)
        op, op_error = timed(_workloads.gather_step(jax_kimi_mla.gather_mla_cache, case.fmt), args, {})
        ref, ref_error = timed(_workloads.gather_step(jax_kimi_mla.reference.gather_mla_cache, case.fmt), args, {})
        del args
        error = "; ".join(f"{who}: {e}" for who, e in (("op", op_error), ("reference", ref_error)) if e)
        row |= _timing_columns("ref", ref)
        # The valid rows read once (cache bytes), every output row written once (bf16).
        row["bytes"] = case.batch * case.context * (CACHE_ROW_BYTES[case.fmt] + 2 * ENTRY)
        if op is not None and ref is not None:
            row["speedup"] = call_seconds(ref) / call_seconds(op)
    else:
        args = attention_inputs(case, seed)
        op, op_error = timed(_workloads.attention_step(jax_kimi_mla.mla_decode_attention, case.fmt, **(launch or {})), args, {})
        ref, ref_error = timed(_workloads.attention_step(jax_kimi_mla.reference.mla_decode_attention, case.fmt), args, {})
        del args
        error = "; ".join(f"{who}: {e}" for who, e in (("op", op_error), ("reference", ref_error)) if e)
        row |= _timing_columns("ref", ref)
        row["bytes"] = attention_bytes(case)
        if op is not None and ref is not None:
            row["speedup"] = call_seconds(ref) / call_seconds(op)
    row |= _timing_columns("op", op)
    row["floor_us"] = row["bytes"] / ceiling * 1e6
    row["error"] = error
    if op is None:
        return row
    row["ceiling_fraction"] = row["floor_us"] / row["op_us"]
    row["time_source"] = op.source
    if case.section == "wide":
        # Per query row and context token: a 576-wide dot for the score, 512 multiply-adds for the output.
        row["tflops"] = 2 * (ENTRY + L) * case.batch * case.q_tokens * case.heads * case.context / call_seconds(op) / 1e12
        if matmul_tflops:
            row["matmul_fraction"] = row["tflops"] / matmul_tflops
    return row


def _calibration_row(name: str, t: Timing, **extra) -> dict:
    return dict(section="calibration", name=name, **_timing_columns("op", t), time_source=t.source, **extra)


def calibration(sizes: Sizes, with_matmul: bool) -> tuple[float, list[dict]]:
    """The copy ceiling (bytes / s), and rows for it, the smallest op and (for the wide section) a
    dense bf16 matmul: the yardsticks of this run."""
    ceiling, copy = copy_ceiling(sizes.copy_bytes)
    rows = [_calibration_row(f"copy {sizes.copy_bytes >> 20} MiB", copy, bytes=2 * sizes.copy_bytes)]
    smallest = measure(jax.jit(lambda x: x + 1), [jnp.zeros((1,), jnp.float32)], {})
    rows.append(_calibration_row("smallest op (x + 1, one float32)", smallest))
    if with_matmul:
        n = sizes.matmul
        a, b = jax.random.normal(jax.random.key(1), (2, n, n), jnp.float32).astype(jnp.bfloat16)
        matmul = measure(jax.jit(jnp.matmul), [a, b], {})
        del a, b
        rows.append(_calibration_row(f"matmul bf16 {n}^3", matmul, tflops=2 * n**3 / matmul.seconds / 1e12))
    for r in rows:
        print(f"{r['name']:48} {r['op_us']:10.2f} us  [{r['time_source']}]", flush=True)
    print(f"copy ceiling: {ceiling / 1e9:.1f} GB/s", flush=True)
    return ceiling, rows


# ---- RESULTS.md and plots ----

def _ok(rows: list[dict], section: str) -> list[dict]:
    return [r for r in rows if r["section"] == section and r.get("op_us") is not None]


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or x == "" else fmt.format(x)


def _span(values: list[float], fmt: str) -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _pairs(rows: list[dict], *keys: str) -> list[tuple[dict, dict]]:
    """(bf16 row, fp8_ds_mla row) pairs that agree on ``keys``."""
    ds = {tuple(r[k] for k in keys): r for r in rows if r["cache_format"] == "fp8_ds_mla"}
    return [(r, ds[tuple(r[k] for k in keys)]) for r in rows
            if r["cache_format"] == "bf16" and tuple(r[k] for k in keys) in ds]


def target_lines(rows: list[dict], sizes: Sizes) -> list[str]:
    """The targets judged from this run's rows, a table line each ("not measured" without points)."""
    lines = ["| target | status | measured |", "|---|---|---|"]

    def judge(target: str, points: list, good: bool, measured: str) -> None:
        status = ("PASS" if good else "**MISS**") if points else "not measured"
        lines.append(f"| {target} | {status} | {measured if points else '-'} |")

    memory = _ok(rows, "memory")
    lowest = min(memory, key=lambda r: r["ceiling_fraction"], default=None)
    judge(f"1. memory-bound: every format >= {MIN_CEILING_FRACTION:.0%} of the copy ceiling", memory,
          all(r["ceiling_fraction"] >= MIN_CEILING_FRACTION for r in memory),
          "; ".join(f"{f} {_span([r['ceiling_fraction'] for r in memory if r['cache_format'] == f], '{:.0%}')}"
                    for f in FORMATS if any(r["cache_format"] == f for r in memory))
          + (f"; lowest: {lowest['name']} {lowest['ceiling_fraction']:.0%}" if lowest else ""))
    ratios = [(bf["op_us"] / ds["op_us"], f"H={bf['heads']} B={bf['batch']} ctx={bf['context']}")
              for bf, ds in _pairs(memory, "heads", "batch", "context")]
    judge(f"1. memory-bound: fp8_ds_mla >= {MIN_DS_MLA_OVER_BF16}x faster than bf16 at the same H, B, context",
          ratios, all(x >= MIN_DS_MLA_OVER_BF16 for x, _ in ratios),
          f"{_span([x for x, _ in ratios], '{:.2f}x')}; lowest at {min(ratios)[1]}" if ratios else "")
    b, c = min(sizes.small[0]), min(sizes.small[1])
    small = [r for r in _ok(rows, "small") if r["batch"] == b and r["context"] == c]
    judge(f"2. B = {b}, context {c}, H = {HEADS}: <= {MAX_SMALL_US:g} us", small,
          all(r["op_us"] <= MAX_SMALL_US for r in small),
          ", ".join(f"{r['cache_format']} {r['op_us']:.2f} us (kernels summed {r['op_kernel_sum_us']:.2f})"
                    for r in small))
    wide = [r for r in _ok(rows, "wide") if r.get("matmul_fraction") is not None]
    h, wb, wc = sizes.wide
    judge(f"4. H = {h}, bf16, B = {wb}, context {wc}: >= {MIN_MATMUL_FRACTION:.0%} of the dense bf16 matmul rate",
          wide, all(r["matmul_fraction"] >= MIN_MATMUL_FRACTION for r in wide),
          ", ".join(f"{r['tflops']:.1f} TFLOP/s, {r['matmul_fraction']:.0%} of the matmul's" for r in wide))
    # The reference section's points; without it, the memory grid's, which time the reference too.
    def at_point(r: dict) -> bool:
        return r.get("speedup") is not None and (r["heads"], r["batch"], r["context"]) == (HEADS, *sizes.point)

    reference = [r for r in _ok(rows, "reference") if at_point(r)] or [r for r in _ok(rows, "memory") if at_point(r)]
    for fmt, least in MIN_SPEEDUP.items():
        mine = [r for r in reference if r["cache_format"] == fmt]
        judge(f"5. {fmt}: >= {least:g}x faster than the reference at B = {sizes.point[0]}, context {sizes.point[1]}",
              mine, all(r["speedup"] >= least for r in mine),
              ", ".join(f"{r['speedup']:.1f}x ({r['op_us']:.1f} vs {r['ref_us']:.1f} us)" for r in mine))
    # Issue 10 sets the layer's targets at the reference point only; its other points (B = 1, the
    # largest batch) are reported in the layer table, not judged.
    steps = [r for r in _ok(rows, "layer") if (r["batch"], r["context"]) == sizes.point]
    judge(f"6. layer decode step at B = {sizes.point[0]}, context {sizes.point[1]}: <= {MAX_LAYER_OVER_FLOOR}x "
          "its floor", steps, all(r["op_us"] <= MAX_LAYER_OVER_FLOOR * r["floor_us"] for r in steps),
          ", ".join(f"{r['cache_format']} {r['op_us'] / r['floor_us']:.2f}x" for r in steps))
    pairs = _pairs(steps, "batch", "context")
    judge(f"6. layer at B = {sizes.point[0]}, context {sizes.point[1]}: fp8_ds_mla step faster than bf16", pairs,
          all(ds["op_us"] < bf["op_us"] for bf, ds in pairs),
          ", ".join(f"{ds['op_us']:.1f} vs {bf['op_us']:.1f} us" for bf, ds in pairs))
    gathers = [r for r in _ok(rows, "gather") if r["batch"] * r["context"] >= 65536]
    judge(f"7. gather_mla_cache: every format >= {MIN_GATHER_CEILING_FRACTION:.0%} of the copy ceiling at >= 64k tokens",
          gathers, all(r["ceiling_fraction"] >= MIN_GATHER_CEILING_FRACTION for r in gathers),
          "; ".join(f"{f} {_span([r['ceiling_fraction'] for r in gathers if r['cache_format'] == f], '{:.0%}')}"
                    for f in FORMATS if any(r["cache_format"] == f for r in gathers)))
    return lines


def attention_table(rows: list[dict], extra: tuple = ()) -> list[str]:
    """A line per row; ``extra``: (header, row key, format) columns appended."""
    head = ["format", "H", "B", "context", "S_q", "MB moved", "floor us", "op us", "ref us", "speedup",
            "of ceiling", "kernels op/ref", *(h for h, _, _ in extra)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["cache_format"], r["heads"], r["batch"], r["context"], r["q_tokens"], f"{r['bytes'] / 1e6:.1f}",
                 _num(r["floor_us"]), _num(r.get("op_us")), _num(r.get("ref_us")), _num(r.get("speedup"), "{:.1f}x"),
                 _num(r.get("ceiling_fraction"), "{:.0%}"),
                 f"{_num(r.get('op_kernels'), '{:g}')}/{_num(r.get('ref_kernels'), '{:g}')}",
                 *(_num(r.get(key), fmt) for _, key, fmt in extra)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def layer_table(rows: list[dict]) -> list[str]:
    lines = ["| format | H | B | context | weights MB | MB moved | floor us | step us | step / floor | kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        over = r["op_us"] / r["floor_us"] if r.get("op_us") is not None else None
        lines.append(f"| {r['cache_format']} | {r['heads']} | {r['batch']} | {r['context']}"
                     f" | {r['weight_bytes'] / 1e6:.1f} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f}"
                     f" | {_num(r.get('op_us'), '{:.1f}')} | {_num(over, '{:.2f}x')}"
                     f" | {_num(r.get('op_kernels'), '{:g}')} |")
    return lines


def section_lines(section: str, rows: list[dict], sizes: Sizes) -> list[str]:
    if section == "layer":
        return [f"jax_kimi_mla.layer.decode, hidden {sizes.hidden}, q_lora_rank {Q_LORA_RANK}, jitted with the cache",
                "donated; floor = weights + each sequence's cache entries + activations, each moved once.", "",
                *layer_table(rows)]
    if section == "wide":
        return attention_table(rows, (("TFLOP/s", "tflops", "{:.1f}"), ("of matmul", "matmul_fraction", "{:.0%}")))
    if section == "multi":
        one = {r["cache_format"]: r["op_us"] for r in rows if r["q_tokens"] == 1 and r.get("op_us") is not None}
        for r in rows:
            if r.get("op_us") is not None and r["cache_format"] in one:
                r["over_one_token"] = r["op_us"] / one[r["cache_format"]]
        return attention_table(rows, (("op / S_q=1", "over_one_token", "{:.2f}x"),))
    if section == "small":  # latency-bound: the gap between the op's launches matters here
        return attention_table(rows, (("op kernels summed us", "op_kernel_sum_us", "{:.2f}"),))
    return attention_table(rows)


def write_markdown(path: Path, meta: dict, rows: list[dict], sizes: Sizes, plots: dict, skipped: list[str]) -> None:
    calibrations = [r for r in rows if r["section"] == "calibration" and not r["name"].startswith("copy")]
    lines = [
        "# Paged MLA decode attention: FFI op vs jnp reference vs the HBM floor",
        "",
        f"- date: {meta['date']}; jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}",
        f"- device: {meta['device']}",
        f"- time per call: {meta['time_note']}",
        f"- copy ceiling: {meta['ceiling'] / 1e9:.1f} GB/s (jitted jnp.copy of {sizes.copy_bytes >> 20} MiB, "
        "read + write bytes)",
        *(f"- {r['name']}: {r['op_us']:.2f} us" + (f", {r['tflops']:.1f} TFLOP/s" if r.get("tflops") else "")
          for r in calibrations),
        "- floor = bytes / copy ceiling; bytes = B * context * cache bytes per token (bf16 1152, fp8 576,",
        "  fp8_ds_mla 656) + q + out; \"of ceiling\" = floor / op time. Block size 64, every sequence at the",
        "  context shown, tables ceil(context / 64) wide of distinct random blocks, normal latents; the plain",
        "  fp8 query is fp8 (with q_scale_inv). Op and reference are jitted, num_splits chosen by the op.",
        "",
        "## Targets, from this run",
        "",
        *([] if meta["device_timed"] else ["Not all times are device times (see above): the judgements mean nothing.",
                                           ""]),
        *target_lines(rows, sizes),
        "",
    ]
    for section, title in SECTIONS.items():
        mine = [r for r in rows if r["section"] == section]
        if not mine:
            continue
        lines += [f"## {title}", ""]
        if plots.get(section):
            lines += [*(f"![{name}](plots/{name})" for name in plots[section]), ""]
        # Rows whose inputs could not be built have no sizes: only their error is listed.
        lines += section_lines(section, [r for r in mine if "bytes" in r], sizes)
        lines += ["", *(f"- {r['name']}: {r['error']}" for r in mine if r["error"]), ""]
    if skipped:
        lines += ["## Not measured (time limit)", "", *(f"- {s}" for s in skipped), ""]
    path.write_text("\n".join(lines))


def write_plots(directory: Path, rows: list[dict], time_label: str) -> dict[str, list[str]]:
    """Time vs context per format (memory and small sections, a panel per H, B) and the fraction of
    the copy ceiling vs bytes moved; returns the file names per section."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    colors = dict(zip(FORMATS, ("C0", "C1", "C2")))
    plots = {}
    for section in ("memory", "small"):
        mine = _ok(rows, section)
        panels = sorted({(r["heads"], r["batch"]) for r in mine})
        if not panels:
            continue
        cols = min(3, len(panels))
        grid = math.ceil(len(panels) / cols)
        height = 3.6 * grid + 0.9  # + one legend for all panels, below them
        fig, axes = plt.subplots(grid, cols, figsize=(5 * cols, height), squeeze=False)
        contexts = sorted({r["context"] for r in mine})
        for ax, (h, b) in zip(axes.flat, panels):
            for fmt in FORMATS:
                pts = sorted((r for r in mine if (r["heads"], r["batch"], r["cache_format"]) == (h, b, fmt)),
                             key=lambda r: r["context"])
                if not pts:
                    continue
                x = [r["context"] for r in pts]
                ax.plot(x, [r["op_us"] for r in pts], "o-", color=colors[fmt], label=f"{fmt} op")
                ref = [(r["context"], r["ref_us"]) for r in pts if r.get("ref_us") is not None]
                if ref:
                    ax.plot(*zip(*ref), "s--", color=colors[fmt], alpha=0.5, label=f"{fmt} reference")
                ax.plot(x, [r["floor_us"] for r in pts], ":", color=colors[fmt], label=f"{fmt} floor")
            ax.set(xscale="log", yscale="log", title=f"H={h}, B={b}", xlabel="context (tokens)",
                   ylabel=f"time per call (us, {time_label})")
            ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
            ax.set_xticks([], minor=True)
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
        # Three entries per format (op, reference, floor), filled column by column: a column per format.
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=math.ceil(len(legend) / 3), fontsize=8)
        fig.tight_layout(rect=(0, 0.7 / height, 1, 1))
        name = f"time_vs_context_{section}.png"
        fig.savefig(directory / name, dpi=110)
        plt.close(fig)
        plots[section] = [name]
    points = [r for s in ("memory", "small", "multi") for r in _ok(rows, s)]
    if points:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for fmt in FORMATS:
            pts = [r for r in points if r["cache_format"] == fmt]
            if pts:
                ax.plot([r["bytes"] / 1e6 for r in pts], [100 * r["ceiling_fraction"] for r in pts], "o",
                        color=colors[fmt], label=fmt, alpha=0.8)
        ax.axhline(100 * MIN_CEILING_FRACTION, color="k", ls="--", lw=1, label="target (memory-bound)")
        ax.set(xscale="log", xlabel="bytes a call moves (MB)", ylabel="floor / op time (% of copy ceiling)",
               title="Fraction of the copy ceiling (sections 1-3)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(directory / "ceiling_fraction.png", dpi=110)
        plt.close(fig)
        plots.setdefault("memory", []).append("ceiling_fraction.png")
    return plots


def _progress_line(row: dict) -> str:
    parts = [f"{row['name']:48}"]
    if "floor_us" in row:
        parts.append(f"floor {row['floor_us']:9.2f} us")
    if row.get("op_us") is not None:
        parts.append(f"op {row['op_us']:9.2f} us ({_num(row.get('op_kernels'), '{:g}')} k, "
                     f"{row['ceiling_fraction']:4.0%} of ceiling)")
    if row.get("ref_us") is not None:
        parts.append(f"ref {row['ref_us']:9.2f} us ({_num(row.get('ref_kernels'), '{:g}')} k)")
    if row.get("time_source"):
        parts.append(f"[{row['time_source']}]")
    if row["error"]:
        parts.append(f"ERROR {row['error']}")
    return "  ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: benchmarks/results/<platform>-attention[-quick])")
    parser.add_argument("--only",
                        help="comma-separated substrings of case names, e.g. memory,layer or 'small fp8_ds_mla'")
    parser.add_argument("--time-limit-s", type=float, default=420.0,
                        help="stop starting new cases after this many seconds; the rest is listed as not measured")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    started = time.monotonic()
    if not (hasattr(jax_kimi_mla, "mla_decode_attention") and hasattr(jax_kimi_mla.reference, "mla_decode_attention")):
        sys.exit(f"jax_kimi_mla ({jax_kimi_mla.__file__}) has no mla_decode_attention (op and reference), which every "
                 "case runs (layer.decode too): install a build that has it")
    sizes = QUICK if opts.quick else FULL
    wanted = [w for w in (opts.only or "").split(",") if w]
    todo = [c for c in cases(sizes) if not wanted or any(w in c.name for w in wanted)]
    if not todo:
        sys.exit(f"--only {opts.only!r} matches no case name (e.g. {cases(sizes)[0].name!r})")
    device = jax.devices()[0]
    out = opts.out or Path(__file__).parent / "results" / f"{device.platform}-attention{'-quick' if opts.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); {len(todo)} cases; writing to {out}",
          flush=True)

    ceiling, rows = calibration(sizes, any(c.section == "wide" for c in todo))
    matmul_tflops = next((r["tflops"] for r in rows if r.get("tflops")), None)
    skipped = []
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        for case in todo:
            if time.monotonic() - started > opts.time_limit_s:
                skipped.append(case.name)
                continue
            try:
                row = measure_case(case, sizes, ceiling, matmul_tflops, opts.seed)
            except Exception as e:  # building the inputs failed (out of memory?): record it, go on
                row = case_row(case) | dict(error=_message(e))
            rows.append(row)
            writer.writerow(row)
            f.flush()
            print(_progress_line(row), flush=True)

    measured = [r for r in rows if r["section"] != "calibration"]
    sources = {r["time_source"] for r in rows if r.get("time_source")}
    device_timed = sources == {"device"}
    meta = dict(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        device=f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s)",
        ceiling=ceiling, device_timed=device_timed,
        time_note=("device time, the median over the profiled calls of one call's span: its first kernel's start "
                   "to its last one's end (small batches also show the summed kernel durations)"
                   if device_timed else
                   f"source {', '.join(sorted(sources)) or '-'}: 'wall' is wall clock per call (median, each call "
                   "waited for), standing in where the profiler has no device plane (CPU); 'device-mean' is a mean "
                   "where the trace's events could not be split into calls"),
    )
    plots = write_plots(out / "plots", measured, "device" if device_timed else "wall")
    write_markdown(out / "RESULTS.md", meta, rows, sizes, plots, skipped)
    failed = sum(bool(r["error"]) for r in measured)
    print(f"done in {time.monotonic() - started:.0f} s: {len(measured)} cases, {failed} with errors,"
          f" {len(skipped)} not measured; see {out / 'RESULTS.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
