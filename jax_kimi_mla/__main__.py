"""``python -m jax_kimi_mla``: check every op (epilogues, decode attention, context gather) against the reference, and time both.

For each variant and shape the FFI op and its jnp reference run from identical inputs (cache
and, with RoPE in prefill, q donated). Every output is compared in float32, NaN-safe; fp8
outputs after dequantization, fp8_ds_mla caches through ``ds_mla_dequantize``. Without RoPE
the results must match exactly; with RoPE each value may differ by ROPE_ULPS units in the last
place of its format (bf16/fp16, or E4M3 steps), the rounding freedom the float32 RoPE leaves.
Times are wall clock per call under ``jax.jit`` with donation, median after warm-up.
Exits with status 1 when any op disagrees with the reference or fails to run.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from . import ops, reference
from ._profile import wall_time_per_call
from ._workloads import VARIANTS, Variant, attention_inputs, attention_step, fresh_copy, gather_inputs, gather_step, run
from .formats import CACHE_FORMATS
from .numerics import ds_mla_dequantize

# (tokens, heads): tokens is the decode batch B or the prefill length T. Kimi-K3 has 96 heads,
# 12 per GPU at TP8.
SHAPES = {
    "decode": [(b, h) for h in (12, 96) for b in (1, 64, 256)],
    "prefill": [(t, h) for h in (12, 96) for t in (1024, 8192)],
}
QUICK_SHAPES = {"decode": [(1, 12), (64, 96)], "prefill": [(1024, 12)]}
# On the CPU backend prefill shapes beyond this many token-heads take too long (the reference
# materializes float32 copies); they are skipped and listed as skipped.
CPU_MAX_PREFILL_TOKEN_HEADS = 1024 * 96
# mla_decode_attention: (B, context, H, S_q) per format; every sequence at the full context.
ATTENTION_SHAPES = [(1, 4096, 12, 1), (64, 4096, 12, 1), (16, 2048, 12, 2), (8, 1024, 128, 1)]
QUICK_ATTENTION_SHAPES = [(2, 256, 12, 1), (2, 128, 12, 2)]
GATHER_SHAPES = [(1, 4096), (16, 4096), (64, 16384)]  # (B, context)
QUICK_GATHER_SHAPES = [(2, 256)]
CPU_MAX_GATHER_TOKENS = 16 * 4096
CPU_MAX_ATTENTION_WORK = 2 * 4096 * 12  # B x context x H x S_q beyond this is slow on the CPU
# Against the float32 reference: the GPU rounds probabilities to bf16 before the weighted sum,
# the output is bf16 (tests/test_decode_attention.py explains these).
ATTENTION_OUT_TOLERANCE, ATTENTION_LSE_TOLERANCE = 2.0**-6, 1e-3
TIMING_BUDGET_S = 0.25  # wall time spent timing each of the op and the reference, per shape

# RoPE'd values may differ from the (CPU) reference by one unit in the last place: XLA may round
# x0*c - x1*s its own way where the kernel uses one FMA.
ROPE_ULPS = 1

# (mantissa bits, smallest normal exponent) of the formats the outputs are rounded to.
_FLOAT_FORMATS = {"bfloat16": (7, -126), "float16": (10, -14), "float8_e4m3fn": (3, -6)}


def _ulp(x, fmt: str):
    """One unit in the last place of |x| in ``fmt`` (the subnormal spacing near 0)."""
    mantissa, min_exp = _FLOAT_FORMATS[fmt]
    _, exp = jnp.frexp(jnp.abs(x))
    exp = jnp.where(x == 0, min_exp, jnp.maximum(exp - 1, min_exp))
    return jnp.ldexp(jnp.float32(1), exp - mantissa)


def _pieces(x, scale_inv):
    """An output as (float32 values, rounding format or None for exact, divisor to real units)."""
    if x.dtype == jnp.uint8:  # fp8_ds_mla entries: the latent must be exact, k_pe is bf16
        latent, k_pe = ds_mla_dequantize(x)
        return [(latent, None, 1.0), (k_pe.astype(jnp.float32), "bfloat16", 1.0)]
    divisor = 1.0 if scale_inv is None else jnp.reshape(scale_inv, ()).astype(jnp.float32)
    return [(x.astype(jnp.float32), str(x.dtype), divisor)]


def compare(variant: Variant, args: list, got, want) -> tuple[float, bool]:
    """(max abs error in real units, every value within tolerance) over all outputs."""
    scales = [None if i is None else args[i] for i in variant.output_scale_args]
    worst, ok = jax.jit(functools.partial(_compare, variant.rope))(got, want, scales)
    return float(worst), bool(ok)


def _compare(rope: bool, got, want, scales):
    worst, ok = jnp.float32(0), jnp.bool_(True)
    for g, w, scale_inv in zip(got, want, scales):
        for (a, fmt, divisor), (b, _, _) in zip(_pieces(g, scale_inv), _pieces(w, scale_inv)):
            if not a.size:
                continue
            same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))
            diff = jnp.where(same, 0.0, jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.inf, jnp.abs(a - b)))
            tolerance = ROPE_ULPS * _ulp(jnp.maximum(jnp.abs(a), jnp.abs(b)), fmt) if rope and fmt else 0.0
            worst = jnp.maximum(worst, jnp.max(diff / divisor))
            ok = ok & jnp.all(diff <= tolerance)
    return worst, ok


def check_and_time(variant: Variant, tokens: int, heads: int, dtype) -> dict:
    args = variant.inputs(tokens, heads, dtype)
    ffi_step, ref_step = variant.step(variant.op), variant.step(variant.reference)
    ffi_args, ref_args = fresh_copy(args, variant.donated), fresh_copy(args, variant.donated)
    # The check's reference runs on the CPU, whose float32 arithmetic is plain IEEE: XLA:GPU
    # evaluates the reference's RoPE with its own contractions (seen up to 2+ ulps off on an H200,
    # where the kernel, the CPU handler and the CPU reference agree bit for bit). The timed
    # reference below runs on the op's device. Scales and other undonated inputs are shared.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        want = run(variant.step(variant.reference), [jax.device_put(x, cpu) for x in fresh_copy(args, variant.donated)], variant.donated)
        got = jax.device_put(run(ffi_step, ffi_args, variant.donated), cpu)
        err, ok = compare(variant, [jax.device_put(x, cpu) for x in args], got, want)
    return dict(err=err, ok=ok, ffi_s=_time(ffi_step, ffi_args, variant), ref_s=_time(ref_step, ref_args, variant))


def check_and_time_attention(fmt: str, batch: int, context: int, heads: int, q_tokens: int, device) -> dict:
    """mla_decode_attention on ``device`` against the reference on the CPU, and both timed."""
    args = attention_inputs(fmt, batch, context, heads, q_tokens if q_tokens > 1 else None)
    ffi_step = attention_step(ops.mla_decode_attention, fmt, return_lse=True)
    ref_step = attention_step(reference.mla_decode_attention, fmt, return_lse=True)
    cpu = jax.devices("cpu")[0]
    got = jax.device_put(ffi_step(*jax.device_put(args, device)), cpu)
    with jax.default_device(cpu):
        want = ref_step(*jax.device_put(args, cpu))
        (out, lse), (ref_out, ref_lse) = [[x.astype(jnp.float32) for x in pair] for pair in (got, want)]
        err = float(jnp.maximum(jnp.max(jnp.abs(out - ref_out)), jnp.max(jnp.abs(lse - ref_lse))))
        ok = bool(jnp.all(jnp.abs(out - ref_out) <= ATTENTION_OUT_TOLERANCE * (1 + jnp.abs(ref_out)))
                  & jnp.all(jnp.abs(lse - ref_lse) <= ATTENTION_LSE_TOLERANCE))
    args = jax.device_put(args, device)
    return dict(err=err, ok=ok, ffi_s=_time(ffi_step, args), ref_s=_time(ref_step, args))


def check_and_time_gather(fmt: str, batch: int, context: int, device) -> dict:
    """gather_mla_cache on ``device`` against the reference on the CPU (one bf16 rounding of
    the same float32 values; plain fp8 divides, which XLA may do as a product with the reciprocal:
    one bf16 step), and both timed."""
    args = gather_inputs(fmt, batch, context)
    ffi_step, ref_step = gather_step(ops.gather_mla_cache, fmt), gather_step(reference.gather_mla_cache, fmt)
    cpu = jax.devices("cpu")[0]
    got = jax.device_put(ffi_step(*jax.device_put(args, device)), cpu).astype(jnp.float32)
    with jax.default_device(cpu):
        want = ref_step(*jax.device_put(args, cpu)).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)))
        ok = bool(jnp.all(jnp.abs(got - want) <= 2.0**-7 * jnp.abs(want)))
    args = jax.device_put(args, device)
    return dict(err=err, ok=ok, ffi_s=_time(ffi_step, args), ref_s=_time(ref_step, args))


def _report(row: str, check) -> bool:
    """Runs one check-and-time, prints its line; True when it failed (or raised)."""
    try:
        r = check()
    except Exception as e:  # report it and go on with the others
        print(f"{row} {'':>10} ERROR  {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        traceback.print_exc(limit=3, file=sys.stderr)
        return True
    err = f"{r['err']:10.3g}" if math.isfinite(r["err"]) else f"{r['err']:>10}"
    print(f"{row} {err} {'PASS' if r['ok'] else 'FAIL':6} {_fmt_time(r['ffi_s'])} {_fmt_time(r['ref_s'])}"
          f" {r['ref_s'] / r['ffi_s']:6.1f}x", flush=True)
    return not r["ok"]


def _time(step, args, variant: Variant | None = None) -> float:
    donated = variant.donated if variant else {}
    start = time.perf_counter()
    jax.block_until_ready(run(step, args, donated))
    estimate = time.perf_counter() - start
    calls = max(3, min(100, int(TIMING_BUDGET_S / max(estimate, 1e-6))))
    return wall_time_per_call(step, args, donated, calls, warmup=1)


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:10.1f}" if seconds < 1 else f"{seconds:9.2f}s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_kimi_mla", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small shapes only")
    parser.add_argument("--backend", choices=("cpu", "gpu"), help="default: JAX's default backend")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    opts = parser.parse_args(argv)

    try:
        device = jax.devices(opts.backend)[0] if opts.backend else jax.devices()[0]
    except RuntimeError as e:
        print(f"backend {opts.backend!r} is not available: {e}", file=sys.stderr)
        return 2
    on_cpu = device.platform == "cpu"
    shapes = QUICK_SHAPES if opts.quick else SHAPES
    dtype = jnp.dtype(opts.dtype)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}), activations {dtype}")
    print("prefill bf16 / fp8_ds_mla / fp8: fused_mla_key_concat_kv_cache_insert / fused_mla_key_concat_ds_mla_insert"
          " / fused_mla_qkv_quant_kv_cache_fp8_insert; decode: fused_mla_decode_q_concat_kv_cache_insert")
    print("times: wall clock per call in us, jit with the cache (and q in RoPE prefill) donated, median after warm-up\n")
    header = f"{'op':8} {'cache':10} {'rope':4} {'shape':13} {'max err':>10} {'result':6} {'ffi us':>10} {'ref us':>10} {'speedup':>7}"
    print(header)
    print("-" * len(header))

    failures, skipped = 0, []
    with jax.default_device(device):
        for variant in VARIANTS.values():
            for tokens, heads in shapes[variant.phase]:
                shape = f"{'B' if variant.phase == 'decode' else 'T'}={tokens} H={heads}"
                row = f"{variant.phase:8} {variant.cache_format:10} {'on' if variant.rope else 'off':4} {shape:13}"
                if on_cpu and variant.phase == "prefill" and tokens * heads > CPU_MAX_PREFILL_TOKEN_HEADS:
                    skipped.append(f"{variant.name} {shape}")
                    continue
                failures += _report(row, functools.partial(check_and_time, variant, tokens, heads, dtype))
        print("\nmla_decode_attention: every sequence at the full context, against the float32 reference")
        for batch, context, heads, q_tokens in QUICK_ATTENTION_SHAPES if opts.quick else ATTENTION_SHAPES:
            for fmt in CACHE_FORMATS:
                shape = f"B={batch} ctx={context} H={heads}" + (f" S_q={q_tokens}" if q_tokens > 1 else "")
                if on_cpu and batch * context * heads * q_tokens > CPU_MAX_ATTENTION_WORK:
                    skipped.append(f"mla_decode_attention {fmt} {shape}")
                    continue
                check = functools.partial(check_and_time_attention, fmt, batch, context, heads, q_tokens, device)
                failures += _report(f"{'attend':8} {fmt:10} {'':4} {shape:13}", check)
        print("\ngather_mla_cache: every sequence at the full context, bfloat16 out, against the reference")
        for batch, context in QUICK_GATHER_SHAPES if opts.quick else GATHER_SHAPES:
            for fmt in CACHE_FORMATS:
                if on_cpu and batch * context > CPU_MAX_GATHER_TOKENS:
                    skipped.append(f"gather_mla_cache {fmt} B={batch} ctx={context}")
                    continue
                check = functools.partial(check_and_time_gather, fmt, batch, context, device)
                failures += _report(f"{'gather':8} {fmt:10} {'':4} {f'B={batch} ctx={context}':13}", check)
    if skipped:
        print(f"\nskipped on CPU (too slow there, run on a GPU): {', '.join(skipped)}")
    if on_cpu:
        print("\nOn the CPU the handlers exist for correctness and portability (plain C++ loops, exact"
              " numerics): their speed against XLA's vectorized jnp says nothing about the GPU kernels.")
    print(f"\n{'all ops agree with the reference' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
