"""Runs one benchmark variant a few times and exits: a target for profilers (ncu, compute-sanitizer).

    python -P benchmarks/run_once.py prefill_fp8_rope 8192 96    # variant, T or B, H
"""

import sys

import jax

from jax_kimi_mla._workloads import VARIANTS, run


def main(name: str, tokens: str, heads: str) -> None:
    variant = VARIANTS[name]
    args = variant.inputs(int(tokens), int(heads))
    step = variant.step(variant.op)
    for _ in range(4):  # ncu --launch-skip 2 profiles the third call, past compilation and warm-up
        outputs = run(step, args, variant.donated)
    jax.block_until_ready(outputs)


if __name__ == "__main__":
    main(*sys.argv[1:])
