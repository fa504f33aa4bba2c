"""A few chosen points of bench.py and bench_attention.py, measured the same way, in one process: for
A/B comparisons inside one device call (build A, run this, build B, run it again), where the full
sweeps would not fit.

    python -P benchmarks/points.py --epilogue prefill_fp8_rope:8192:96,decode_fp8_rope:1024:96
    python -P benchmarks/points.py --attention "small bf16 H=12 B=1 ctx=4096" --kernels
    python -P benchmarks/points.py --tag A ...  # a label at the start of every line

An epilogue point is variant:tokens:heads (the op alone, against the floor; bench.py times the
reference beside it); an attention point is a case name of bench_attention.py (op and reference).
With --kernels, each attention point also prints the median device time of each kernel it runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -P leaves the script's folder out
import bench_attention
from bench import COPY_BYTES, DTYPE, copy_ceiling, measure

import jax_kimi_mla
from jax_kimi_mla import _workloads
from jax_kimi_mla._profile import kernel_durations

KERNEL_CALLS = 50


def epilogue_point(spec: str, ceiling: float) -> str:
    name, tokens, heads = spec.split(":")
    variant, tokens, heads = _workloads.VARIANTS[name], int(tokens), int(heads)
    args = variant.inputs(tokens, heads, DTYPE)
    t = measure(variant.step(variant.op), args, variant.donated)
    floor = variant.min_bytes(tokens, heads, DTYPE) / ceiling
    return f"{name} T={tokens} H={heads}: {t.seconds * 1e6:9.2f} us, {floor / t.seconds:6.1%} of the ceiling ({t.source})"


def attention_case(name: str) -> bench_attention.Case:
    for case in bench_attention.cases(bench_attention.FULL):
        if case.name == name:
            return case
    raise SystemExit(f"no bench_attention case is named {name!r}")


def attention_point(case: bench_attention.Case, ceiling: float, launch: dict) -> str:
    row = bench_attention.measure_case(case, bench_attention.FULL, ceiling, None, seed=0, launch=launch)
    if row.get("op_us") is None:
        return f"{case.name}: {row['error']}"
    summed = f" (kernels summed {row['op_kernel_sum_us']:.2f} us)" if row.get("op_kernel_sum_us") is not None else ""
    return (f"{case.name}: op {row['op_us']:9.2f} us{summed}, reference {row.get('ref_us') or float('nan'):9.2f} us, "
            f"{row['ceiling_fraction']:6.1%} of the ceiling")


def kernel_times(case: bench_attention.Case, launch: dict) -> str:
    """Median device time of each kernel of the op's call, over KERNEL_CALLS calls in one trace."""
    args = bench_attention.attention_inputs(case, seed=0)
    step = _workloads.attention_step(jax_kimi_mla.mla_decode_attention, case.fmt, **launch)
    jax.block_until_ready(_workloads.run(step, args, {}))
    durations = kernel_durations(step, args, {}, KERNEL_CALLS)
    if not durations:
        return f"{case.name}: no device kernels (a CPU backend)"
    return f"{case.name}: " + "; ".join(f"{short_kernel_name(name)} {statistics.median(d) * 1e6:.2f} us"
                                       for name, d in durations.items())


def short_kernel_name(name: str) -> str:
    """A trace's kernel name without its return type, namespaces and template arguments:
    "void ns::(anonymous namespace)::combine_kernel<16, 4>(...)" -> "combine_kernel"."""
    return name.removeprefix("void ").split("<")[0].split("(anonymous namespace)::")[-1].split("::")[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epilogue", default="", help="comma-separated variant:tokens:heads")
    parser.add_argument("--attention", default="", help="comma-separated bench_attention case names")
    parser.add_argument("--kernels", action="store_true", help="each attention point's kernels, timed apiece")
    parser.add_argument("--kernel", default="auto", help="mla_decode_attention's kernel= for the attention points")
    parser.add_argument("--plain-combine", action="store_true", help="programmatic_combine=False for the attention points")
    parser.add_argument("--unbalanced", action="store_true", help="balance_splits=False for the attention points")
    parser.add_argument("--tag", default="", help="a label at the start of every line")
    parser.add_argument("--copy-bytes", type=int, default=COPY_BYTES, help="bytes of the copy that sets the ceiling")
    opts = parser.parse_args(argv)
    prefix = f"[{opts.tag}] " if opts.tag else ""
    ceiling, _ = copy_ceiling(opts.copy_bytes)
    print(f"{prefix}copy ceiling {ceiling / 1e9:.1f} GB/s on {jax.devices()[0].device_kind}", flush=True)
    for spec in filter(None, opts.epilogue.split(",")):
        print(prefix + epilogue_point(spec, ceiling), flush=True)
    cases = [attention_case(name) for name in filter(None, opts.attention.split(","))]
    launch = {"kernel": opts.kernel, "programmatic_combine": not opts.plain_combine, "balance_splits": not opts.unbalanced}
    for case in cases:
        print(prefix + attention_point(case, ceiling, launch), flush=True)
    if opts.kernels:
        for case in cases:
            print(prefix + kernel_times(case, launch), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
