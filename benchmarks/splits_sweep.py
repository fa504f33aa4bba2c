"""Device time of mla_decode_attention against its split count: the data behind ops.split_plan.

    python -P benchmarks/splits_sweep.py                      # the default grid (GPU)
    python -P benchmarks/splits_sweep.py bf16:1:4096:12 --splits 1,8,16,32,64
    python -P benchmarks/splits_sweep.py bf16:32:32768:12:17  # a serving batch: 17 live rows of 32
    python -P benchmarks/splits_sweep.py fp8_ds_mla:128:16384:12:100 --splits 1,4 --by-work 8x2,16x4

Each case is FORMAT:B:CONTEXT:H[:LIVE] (S_q = 1, block size 64, inputs as bench_attention.py
builds them, tables CONTEXT tokens wide). With LIVE, only LIVE rows (at random places) hold a
sequence, of a random length in [256, CONTEXT], and the others are padding (length 0), as in a
serve loop's fixed-size decode batch; else every sequence is CONTEXT tokens long. Each line prints
the op's default first where it splits by work (ops.split_plan: "N by work of W", N the most
splits a sequence may take, W a sequence's on average), then for every split count by count, the
device time per call (median over calls: the span from the first kernel's start to the last one's
end, which counts the combine's programmatic launch once, then the kernels summed); "*" marks
default_num_splits where the op splits by count. --by-work MOSTxWORK,... also times those plans by
work, whatever split_plan would choose (ops.split_plan patched for the call: up to MOST splits a
sequence, B x WORK in all).
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import jax
import numpy as np

from jax_kimi_mla import _device, _profile, _workloads, ops

DEFAULT_CASES = ["bf16:1:4096:12", "bf16:1:32768:12", "bf16:4:16384:12", "bf16:8:32768:12",
                 "fp8_ds_mla:1:4096:12", "bf16:16:16384:12", "bf16:64:16384:12"]


def case_inputs(case: str):
    """(format, B, context, H, attention_inputs' list) of a case FORMAT:B:CONTEXT:H[:LIVE]."""
    fmt, batch, context, heads, *live = case.split(":")
    batch, context, heads = int(batch), int(context), int(heads)
    args = _workloads.attention_inputs(fmt, batch, context, heads)
    if live:
        rng = np.random.default_rng(1)
        lens = np.zeros(batch, np.int32)
        lens[: int(live[0])] = rng.integers(min(256, context), context + 1, int(live[0]))
        args[3] = jax.numpy.asarray(rng.permutation(lens))
    return fmt, batch, context, heads, args


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--splits", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--by-work", type=by_work_plans, default=[], help="plans by work to time too: MOSTxWORK,...")
    parser.add_argument("--calls", type=int, default=20)
    opts = parser.parse_args(argv)
    sm_count = _device.sm_count()
    for case in opts.cases:
        fmt, batch, context, heads, args = case_inputs(case)
        cache_dtype = jax.numpy.bfloat16 if fmt == "bf16" else jax.numpy.uint8  # the rule needs 16 bits or not
        rows_per_cta = ops._decode_rows_per_cta(cache_dtype, batch, 1, heads)
        most, work = ops.split_plan(batch, heads, context, sm_count, rows_per_cta)
        default = work or most  # default_num_splits: the plan's average by work, else its count
        cells = []
        if work:
            cells.append(f"{most} by work of {work}: {device_us(ops.mla_decode_attention, fmt, args, opts.calls)}")
        for splits in sorted({int(s) for s in opts.splits.split(",")} | {default}):
            if splits > -(-context // 64):
                continue
            us = device_us(functools.partial(ops.mla_decode_attention, num_splits=splits), fmt, args, opts.calls)
            cells.append(f"{splits}{'*' if splits == default and not work else ''}: {us}")
        for plan in opts.by_work:
            with forced_split_plan(plan):
                cells.append(f"{plan[0]}x{plan[1]} by work: {device_us(ops.mla_decode_attention, fmt, args, opts.calls)}")
        print(f"{case:>22}  " + "  ".join(cells), flush=True)


def by_work_plans(text: str) -> list[tuple[int, int]]:
    """'8x2,16x4' -> [(8, 2), (16, 4)]: (num_splits, work_splits) with 1 <= WORK <= MOST."""
    plans = []
    for item in filter(None, text.split(",")):
        most, _, work = item.partition("x")
        if not (most.isdigit() and work.isdigit() and 1 <= int(work) <= int(most)):
            raise argparse.ArgumentTypeError(f"a plan by work is MOSTxWORK with 1 <= WORK <= MOST, not {item!r}")
        plans.append((int(most), int(work)))
    return plans


def forced_split_plan(plan: tuple[int, int]):
    """A context in which ops.split_plan returns plan (for the calls traced inside it)."""
    return mock.patch.object(ops, "split_plan", lambda *args, **kwargs: plan)


def device_us(fn, fmt, args, calls) -> str:
    """'span (summed)' device us per call of fn's jitted step, or '-' without device time."""
    step = _workloads.attention_step(fn, fmt)
    jax.block_until_ready(step(*args))
    t = _profile.device_time_per_call(step, args, {}, calls)
    return f"{(t.span_seconds or t.seconds) * 1e6:.1f} ({t.seconds * 1e6:.1f})" if t else "-"


if __name__ == "__main__":
    main()
