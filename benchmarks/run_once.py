"""Runs one benchmark variant a few times and exits: a target for profilers (ncu, compute-sanitizer).

    python -P benchmarks/run_once.py prefill_fp8_rope 8192 96           # epilogue variant, T or B, H
    python -P benchmarks/run_once.py attention fp8_ds_mla 64 16384 12   # decode attention: format, B, context, H
    python -P benchmarks/run_once.py gather fp8 16 4096                 # gather_mla_cache: format, B, context
"""

import sys

import jax

from jax_kimi_mla import _workloads, ops
from jax_kimi_mla._workloads import VARIANTS, run


def main(name: str, *sizes: str) -> None:
    if name == "attention":  # format, B, context, H
        fmt, batch, context, heads = sizes[0], *map(int, sizes[1:])
        args = _workloads.attention_inputs(fmt, batch, context, heads)
        step = _workloads.attention_step(ops.mla_decode_attention, fmt)
        for _ in range(4):  # ncu --launch-skip 2 profiles the third call, past compilation and warm-up
            outputs = step(*args)
    elif name == "gather":  # format, B, context; bfloat16 out, as bench_attention measures it
        fmt, batch, context = sizes[0], *map(int, sizes[1:])
        args = _workloads.gather_inputs(fmt, batch, context)
        step = _workloads.gather_step(ops.gather_mla_cache, fmt)
        for _ in range(4):
            outputs = step(*args)
    else:
        variant = VARIANTS[name]
        args = variant.inputs(int(sizes[0]), int(sizes[1]))
        step = variant.step(variant.op)
        for _ in range(4):
            outputs = run(step, args, variant.donated)
    jax.block_until_ready(outputs)


if __name__ == "__main__":
    main(*sys.argv[1:])
