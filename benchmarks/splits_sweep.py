"""Device time of mla_decode_attention against its split count: the data behind ops.default_num_splits.

    python -P benchmarks/splits_sweep.py                      # the default grid (GPU)
    python -P benchmarks/splits_sweep.py bf16:1:4096:12 --splits 1,8,16,32,64

Each case is FORMAT:B:CONTEXT:H (S_q = 1, block size 64, inputs as bench_attention.py builds
them); each line prints the device time per call (kernels summed, median over calls) for every
split count, and marks the op's default.
"""

from __future__ import annotations

import argparse
import functools

import jax

from jax_kimi_mla import _device, _profile, _workloads, ops

DEFAULT_CASES = ["bf16:1:4096:12", "bf16:1:32768:12", "bf16:4:16384:12", "bf16:8:32768:12",
                 "fp8_ds_mla:1:4096:12", "bf16:16:16384:12", "bf16:64:16384:12"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--splits", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--calls", type=int, default=20)
    opts = parser.parse_args(argv)
    sm_count = _device.sm_count()
    for case in opts.cases:
        fmt, batch, context, heads = case.split(":")
        batch, context, heads = int(batch), int(context), int(heads)
        args = _workloads.attention_inputs(fmt, batch, context, heads)
        cache_dtype = jax.numpy.bfloat16 if fmt == "bf16" else jax.numpy.uint8  # the rule needs 16 bits or not
        default = ops.default_num_splits(batch, heads, context, sm_count, ops._decode_rows_per_cta(cache_dtype, batch, 1, heads))
        cells = []
        for splits in sorted({int(s) for s in opts.splits.split(",")} | {default}):
            if splits > -(-context // 64):
                continue
            fn = functools.partial(ops.mla_decode_attention, num_splits=splits)
            step = _workloads.attention_step(fn, fmt)
            jax.block_until_ready(step(*args))
            t = _profile.device_time_per_call(step, args, {}, opts.calls)
            us = f"{t.seconds * 1e6:.1f}" if t else "-"
            cells.append(f"{splits}{'*' if splits == default else ''}: {us}")
        print(f"{case:>22}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
