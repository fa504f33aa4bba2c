"""Benchmark of the MLA layer's prefill step: against the sum of its parts, its peak memory, TFLOP/s.

Per case (``jax_kimi_mla.layer.prefill``, Kimi-K3 shapes: hidden 7168, q_lora_rank 1536, the
output gate, a bf16 cache of 64-token blocks, jitted with the cache donated):

- **step**: device time per call (``jax_kimi_mla._profile``, as bench.py), and the **sum of its
  parts**, each jitted and timed alone in the same run on inputs of its shape: every GEMM (q_a,
  q_b, kv_a, kv_b's k_nope and v, the context's kv_b, the gate, o_proj), the two RMSNorms, the gate's sigmoid
  product, the epilogue, the context gather, assembling the context's k, and the attention
  call(s) of the implementation the step runs. Target: step <= 1.25x the sum. The parts run on
  all heads at once; a step that runs its heads in groups (``layer.prefill_head_groups``, the
  ``head groups`` column) does the same work in pieces, and the ratio includes what that costs.
- **peak memory**: ``memory_stats()["peak_bytes_in_use"]`` of a fresh process that builds the
  case and runs one step (a subprocess per case: the peak never goes down within a process; with
  jax's default preallocated pool, where the peak is what XLA plans),
  against the weights + the step's inputs and outputs + a cache holding exactly the run's tokens
  plus one block per sequence. Target: <= 1.5x. Beside it, the layer's own estimate of its
  temporaries (``layer.prefill_temp_bytes``) as an estimated peak over the same budget.
- **TFLOP/s**: the step's GEMM and attention FLOPs (causal: half the chunk's square) over its
  time, against a dense bf16 matmul 8192^3 measured in the same run.

Cases: T = 8192 as one sequence and as 8 packed sequences of 1024, each at H = 12 and 96; the 8 x
1024 chunks after 1024 cached tokens each (the gather and the two-call attention); T = 32768 as
one sequence at H = 12.

    python -P benchmarks/bench_prefill.py              # all cases (about 3 minutes on an H200)
    python -P benchmarks/bench_prefill.py --quick      # tiny sizes: a smoke run, fine on CPU
    python -P benchmarks/bench_prefill.py --only packed --impl blockwise
    python -P benchmarks/bench_prefill.py --head-groups 1      # all heads at once, whatever the memory

Writes results.csv and RESULTS.md (the targets judged PASS/MISS) under --out (default
benchmarks/results/<platform>-prefill[-quick]).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import jax_kimi_mla
from jax_kimi_mla import _workloads, layer, prefill_attention
from jax_kimi_mla._checks import columns
from jax_kimi_mla.formats import CACHE_FORMATS, ENTRY, L, P, R, V

# bench.py sits beside this file; python -P does not put the script's folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Timing, measure

BLOCK = _workloads.BLOCK_SIZE
Q_LORA_RANK = 1536
MAX_STEP_OVER_PARTS = 1.25
MAX_PEAK_OVER_BUDGET = 1.5
FIELDS = ["name", "heads", "seqs", "new", "context", "impl", "step_us", "step_kernels", "step_wall_us", "parts_us",
          "step_over_parts", "tflop", "tflops", "matmul_fraction", "peak_bytes", "budget_bytes", "peak_over_budget",
          "xla_temp_bytes", "head_groups", "estimated_over_budget", "time_source", "parts", "error"]


@dataclass(frozen=True)
class Case:
    heads: int
    seqs: int  # S sequences packed in the call
    new: int  # new tokens per sequence
    context: int = 0  # cached tokens per sequence, before its new ones

    @property
    def tokens(self) -> int:
        return self.seqs * self.new

    @property
    def name(self) -> str:
        kind = "one" if self.seqs == 1 else f"packed {self.seqs}x{self.new}"
        ctx = f" after {self.context}" if self.context else ""
        return f"{kind} T={self.tokens}{ctx} H={self.heads}"


@dataclass(frozen=True)
class Sizes:
    hidden: int = 7168
    cases: tuple = (Case(12, 1, 8192), Case(96, 1, 8192), Case(12, 8, 1024), Case(96, 8, 1024),
                    Case(12, 8, 1024, 1024), Case(96, 8, 1024, 1024), Case(12, 1, 32768))
    matmul: int = 8192


FULL = Sizes()
QUICK = Sizes(hidden=256, cases=(Case(2, 1, 64), Case(2, 4, 16), Case(2, 4, 16, 40), Case(2, 1, 128)), matmul=256)


# MLAConfig.head_groups of every case (--head-groups: a number, or "auto" for the size rule).
HEAD_GROUPS: int | None = None


def config_of(case: Case, sizes: Sizes, impl: str) -> layer.MLAConfig:
    return layer.MLAConfig(hidden_size=sizes.hidden, num_heads=case.heads, q_lora_rank=Q_LORA_RANK, output_gate=True,
                           attention_impl=impl, head_groups=HEAD_GROUPS)


# ---- inputs ----

def layout(case: Case) -> dict:
    """Host index arrays of the step: each sequence's blocks (a random permutation of a cache of
    exactly the blocks the run needs), its new tokens' positions and slots, cu_seqlens."""
    per_seq = math.ceil((case.context + case.new) / BLOCK)
    num_blocks = case.seqs * per_seq
    tables = np.random.default_rng(0).permutation(num_blocks).reshape(case.seqs, per_seq).astype(np.int32)
    pos = case.context + np.arange(case.new)
    positions = np.tile(pos, case.seqs).astype(np.int32)
    slots = np.concatenate([tables[s, pos // BLOCK] * BLOCK + pos % BLOCK for s in range(case.seqs)]).astype(np.int32)
    cu = (np.arange(case.seqs + 1) * case.new).astype(np.int32)
    return dict(num_blocks=num_blocks, tables=tables, positions=positions, slots=slots, cu=cu,
                lens=np.full(case.seqs, case.context, np.int32))


def step_and_args(case: Case, sizes: Sizes, impl: str, host: bool = False) -> tuple:
    """(jitted step, args, donated) of one prefill call; the cache holds valid entries. ``host``:
    the arrays are numpy (bf16 through ml_dtypes), made without any device scratch."""
    config = config_of(case, sizes, impl)
    lay = layout(case)
    if host:
        rng = np.random.default_rng(0)
        bf16 = lambda shape: (0.05 * rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16)
        shapes = jax.eval_shape(functools.partial(layer.init_params, config=config), jax.random.key(0))
        params = jax.tree.map(lambda a: bf16(a.shape) if a.ndim > 1 else np.ones(a.shape, a.dtype), shapes)
        x = bf16((case.tokens, sizes.hidden))
        cache = bf16((lay["num_blocks"], BLOCK, ENTRY))
    else:
        k_params, k_x, k_cache = jax.random.split(jax.random.key(0), 3)
        params = layer.init_params(k_params, config)
        x = jax.random.normal(k_x, (case.tokens, sizes.hidden), jnp.float32).astype(jnp.bfloat16)
        cache = _workloads.random_cache(k_cache, "bf16", lay["num_blocks"])
    kw = {}
    if case.seqs > 1 or case.context:
        kw["cu_seqlens"] = lay["cu"]
    if case.context:
        kw |= dict(block_table=lay["tables"], context_len=lay["lens"])

    @functools.partial(jax.jit, donate_argnums=4)
    def step(params, x, positions, slots, cache, kw):
        return layer.prefill(params, x, positions, slots, cache, config=config, context_tokens=case.seqs * case.context or None,
                             **kw)

    args = [params, x, lay["positions"], lay["slots"], cache, kw]
    if not host:
        args = [params, x, *jax.device_put(args[2:4]), cache, jax.device_put(kw)]
    return step, args, {4: 1}


def budget_bytes(case: Case, sizes: Sizes, impl: str) -> int:
    """Weights + the step's inputs and outputs + a cache of exactly the run's tokens plus one
    block per sequence."""
    shapes = jax.eval_shape(functools.partial(layer.init_params, config=config_of(case, sizes, impl)), jax.random.key(0))
    weights = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    io = 2 * case.tokens * sizes.hidden * 2 + 2 * 4 * case.tokens + 4 * (2 * case.seqs + 1)
    if case.context:
        io += 4 * case.seqs * math.ceil((case.context + case.new) / BLOCK)
    cache = (case.seqs * (case.context + case.new) + case.seqs * BLOCK) * CACHE_FORMATS["bf16"].entry_bytes()
    return weights + io + cache


def flops(case: Case, sizes: Sizes) -> float:
    """GEMMs (2 per multiply-add) and attention: per head q.k over 192 and p.v over 128 columns,
    for each query's visible keys (the context, and itself and the chunk tokens before it)."""
    d, h, t, c = sizes.hidden, case.heads, case.tokens, case.seqs * case.context
    gemm = t * (d * Q_LORA_RANK + Q_LORA_RANK * h * (P + R) + d * ENTRY + L * h * (P + V) + 2 * d * h * V) + c * L * h * (P + V)
    visible = case.seqs * (case.new * (case.new + 1) // 2 + case.new * case.context)
    return 2.0 * gemm + 2.0 * h * (P + R + V) * visible


# ---- the parts ----

def parts(case: Case, sizes: Sizes, impl: str) -> dict:
    """{name: (jitted fn, args, donated)}: each piece of the step alone, on inputs of its shape."""
    config = config_of(case, sizes, impl)
    t, d, h, c = case.tokens, sizes.hidden, case.heads, case.seqs * case.context
    keys = (jax.random.fold_in(jax.random.key(1), i) for i in range(1 << 30))
    bf16 = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32).astype(jnp.bfloat16)
    proj = lambda spec: jax.jit(functools.partial(layer._proj, spec))
    norm = jax.jit(functools.partial(layer._rms_norm, eps=config.rms_norm_eps))
    lay = layout(case)
    out = {
        "q_a_proj": (proj("td,dr->tr"), [bf16(t, d), bf16(d, Q_LORA_RANK)], {}),
        "q_a_norm": (norm, [bf16(t, Q_LORA_RANK), bf16(Q_LORA_RANK)], {}),
        "q_b_proj": (proj("tr,rhc->thc"), [bf16(t, Q_LORA_RANK), bf16(Q_LORA_RANK, h, P + R)], {}),
        "kv_a_proj": (proj("td,de->te"), [bf16(t, d), bf16(d, ENTRY)], {}),
        "kv_a_norm": (norm, [bf16(t, L), bf16(L)], {}),
        "kv_b_proj k_nope": (proj("tl,lhc->thc"), [bf16(t, L), bf16(L, h, P)], {}),
        "kv_b_proj v": (proj("tl,lhc->thc"), [bf16(t, L), bf16(L, h, V)], {}),
    }

    @functools.partial(jax.jit, donate_argnums=4)
    def epilogue(q, k_nope, kv_a, kv_c_normed, cache, slots):
        k, _, cache = jax_kimi_mla.fused_mla_key_concat_kv_cache_insert(q, k_nope, columns(kv_a, L), kv_c_normed, cache, slots)
        return cache, k  # not the unchanged (NoPE) q: returning an argument from a jit copies it

    cache = jnp.zeros((lay["num_blocks"], BLOCK, ENTRY), jnp.bfloat16)
    out["epilogue"] = (epilogue, [bf16(t, h, P + R), bf16(t, h, P), bf16(t, ENTRY), bf16(t, L), cache, jnp.asarray(lay["slots"])], {4: 0})
    ctx = None
    if case.context:
        gather = jax.jit(functools.partial(jax_kimi_mla.gather_mla_cache, num_tokens=c))
        filled = _workloads.random_cache(next(keys), "bf16", lay["num_blocks"])
        out["gather"] = (gather, [filled, jnp.asarray(lay["tables"]), jnp.asarray(lay["lens"])], {})
        out["context kv_b_proj k_nope"] = (proj("sl,lhc->shc"), [bf16(c, L), bf16(L, h, P)], {})
        out["context kv_b_proj v"] = (proj("sl,lhc->shc"), [bf16(c, L), bf16(L, h, V)], {})

        @jax.jit
        def context_k(k_nope, ctx_latent):
            k_pe = jnp.broadcast_to(ctx_latent[:, None, L:], (ctx_latent.shape[0], h, R))
            return jnp.concatenate([k_nope, k_pe], -1)

        out["context k"] = (context_k, [bf16(c, h, P), bf16(c, ENTRY)], {})
        ctx = (bf16(c, h, P + R), bf16(c, h, V), jnp.asarray(lay["lens"]))
    chosen = prefill_attention.choose(impl, packed=case.seqs > 1, context=bool(case.context))
    q, k, v, cu = bf16(t, h, P + R), bf16(t, h, P + R), bf16(t, h, V), jnp.asarray(lay["cu"])
    if chosen == "blockwise":
        attn = jax.jit(lambda q, k, v, cu, lens, ck, cv: prefill_attention.blockwise_attention(
            q, k, v, cu, lens, ck, cv, scale=config.attention_scale, block=config.attention_block))
        lens = ctx[2] if ctx else jnp.zeros(case.seqs, jnp.int32)
        out[f"attention ({chosen})"] = (attn, [q, k, v, cu, lens, *(ctx[:2] if ctx else (None, None))], {})
    else:
        def attention(q, k, v, cu, ctx_k=None, ctx_v=None, ctx_lens=None):
            return prefill_attention.cudnn_attention(q, k, v, cu, scale=config.attention_scale, ctx_k=ctx_k, ctx_v=ctx_v,
                                                     ctx_lens=ctx_lens, api=chosen)

        out[f"attention ({chosen})"] = (jax.jit(attention), [q, k, v, cu, *(ctx or ())], {})
    out["gate proj"] = (jax.jit(layer._gate_logits), [bf16(t, d), bf16(d, h, V)], {})  # float32 logits, as in the step
    out["gate sigmoid * o"] = (jax.jit(lambda g, o: (o.astype(jnp.float32) * jax.nn.sigmoid(g)).astype(o.dtype)),
                               [bf16(t, h, V).astype(jnp.float32), bf16(t, h, V)], {})
    out["o_proj"] = (proj("thv,hvd->td"), [bf16(t, h, V), bf16(h, V, d)], {})
    return out


# ---- measuring ----

def _message(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def peak_of(case: Case, sizes: Sizes, impl: str, quick: bool) -> dict | None:
    """Peak device bytes of a fresh process that runs one step of the case, and XLA's own account
    of the step's temporaries (None on the CPU)."""
    if jax.devices()[0].memory_stats() is None:
        return None
    command = [sys.executable, "-P", __file__, "--memory-of", case.name, "--impl", impl,
               "--head-groups", "auto" if HEAD_GROUPS is None else str(HEAD_GROUPS), *(["--quick"] if quick else [])]
    # The allocator as a server runs it: one preallocated pool (jax's default). Under
    # XLA_PYTHON_CLIENT_PREALLOCATE=false the pool grows region by region, and a request then
    # takes a whole free chunk when what would be left is under 128 MB and under the request's
    # size: peak_bytes_in_use counts that slack (73 MB more at H = 12, T = 8192; docs/PREFILL.md).
    env = os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    if result.returncode or not lines:
        raise RuntimeError(f"memory subprocess failed: {(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def memory_of(name: str, sizes: Sizes, impl: str) -> None:
    """In the subprocess: one step of the named case, then the device's peak bytes as JSON, with
    the compiled step's temporaries as XLA plans them (``memory_analysis``: what its buffer
    assignment holds beyond the arguments and outputs, not counting cuBLAS/cuDNN workspaces). The
    step is compiled (and autotuned) before any input is on the device, and the inputs are made
    on the host, so the peak is the step's own."""
    case = next(c for c in sizes.cases if c.name == name)
    step, args, _ = step_and_args(case, sizes, impl, host=True)
    compiled = step.lower(*jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)).compile()
    jax.block_until_ready(compiled(*jax.device_put(args)))
    stats = jax.devices()[0].memory_stats() or {}
    analysis = compiled.memory_analysis()
    temp = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
    print(json.dumps({"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "xla_temp_bytes": temp}))


def measure_case(case: Case, sizes: Sizes, impl: str, matmul_tflops: float | None, quick: bool, memory: bool) -> dict:
    row = dict(name=case.name, heads=case.heads, seqs=case.seqs, new=case.new, context=case.context, error="")
    row["impl"] = prefill_attention.choose(impl, packed=case.seqs > 1, context=bool(case.context))
    step, args, donated = step_and_args(case, sizes, impl)
    timing = measure(step, args, donated)
    del args
    row |= dict(step_us=timing.seconds * 1e6, step_kernels=timing.kernels, step_wall_us=timing.wall_s * 1e6, time_source=timing.source)
    times = {}
    for name, (fn, part_args, part_donated) in parts(case, sizes, impl).items():
        times[name] = measure(fn, part_args, part_donated).seconds
        del part_args
    row["parts"] = "; ".join(f"{n} {s * 1e6:.1f}" for n, s in times.items())
    row["parts_us"] = sum(times.values()) * 1e6
    row["step_over_parts"] = row["step_us"] / row["parts_us"]
    row["tflop"] = flops(case, sizes) / 1e12
    row["tflops"] = row["tflop"] / timing.seconds
    if matmul_tflops:
        row["matmul_fraction"] = row["tflops"] / matmul_tflops
    row["budget_bytes"] = budget_bytes(case, sizes, impl)
    config, shape = config_of(case, sizes, impl), dict(packed=case.seqs > 1, context_tokens=case.seqs * case.context)
    row["head_groups"] = layer.prefill_head_groups(config, case.tokens, **shape)
    row["estimated_over_budget"] = 1 + layer.prefill_temp_bytes(config, case.tokens, row["head_groups"], **shape) / row["budget_bytes"]
    if memory:
        peak = peak_of(case, sizes, impl, quick)
        if peak is not None:
            row["peak_bytes"] = peak["peak_bytes_in_use"]
            row["peak_over_budget"] = row["peak_bytes"] / row["budget_bytes"]
            row["xla_temp_bytes"] = peak.get("xla_temp_bytes")
    return row


def matmul_calibration(n: int) -> tuple[float, Timing]:
    a, b = jax.random.normal(jax.random.key(1), (2, n, n), jnp.float32).astype(jnp.bfloat16)
    timing = measure(jax.jit(jnp.matmul), [a, b], {})
    return 2 * n**3 / timing.seconds / 1e12, timing


# ---- RESULTS.md ----

def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or x == "" else fmt.format(x)


def target_lines(rows: list[dict], sizes: Sizes) -> list[str]:
    lines = ["| target | status | measured |", "|---|---|---|"]

    def judge(target, points, good, measured):
        status = ("PASS" if good else "**MISS**") if points else "not measured"
        lines.append(f"| {target} | {status} | {measured if points else '-'} |")

    ok = [r for r in rows if r.get("step_us") is not None]
    judge(f"step <= {MAX_STEP_OVER_PARTS}x the sum of its parts", ok, all(r["step_over_parts"] <= MAX_STEP_OVER_PARTS for r in ok),
          ", ".join(f"{r['name']}: {r['step_over_parts']:.2f}x" for r in ok))
    mem = [r for r in ok if r.get("peak_over_budget") is not None]
    judge(f"peak memory <= {MAX_PEAK_OVER_BUDGET}x weights + inputs/outputs + exact cache", mem,
          all(r["peak_over_budget"] <= MAX_PEAK_OVER_BUDGET for r in mem),
          ", ".join(f"{r['name']}: {r['peak_over_budget']:.2f}x" for r in mem))
    longest = max(c.tokens for c in sizes.cases)
    long = [r for r in rows if r["seqs"] * r["new"] == longest]
    judge(f"T = {longest} runs", long, all(r.get("step_us") is not None for r in long),
          ", ".join(f"{r['name']}: {_num(r.get('step_us'), '{:.0f} us')}{' ' + r['error'] if r['error'] else ''}" for r in long))
    return lines


def write_markdown(path: Path, meta: dict, rows: list[dict], sizes: Sizes) -> None:
    lines = [
        "# MLA layer prefill: step vs its parts, peak memory, TFLOP/s",
        "",
        f"- date: {meta['date']}; jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {platform.python_version()}",
        f"- device: {meta['device']}",
        f"- time per call: {meta['time_note']}",
        f"- dense bf16 matmul {sizes.matmul}^3: {_num(meta['matmul_us'], '{:.1f}')} us, {_num(meta['matmul_tflops'], '{:.1f}')} TFLOP/s",
        f"- layer: hidden {sizes.hidden}, q_lora_rank {Q_LORA_RANK}, output gate, bf16 cache of {BLOCK}-token blocks, "
        f"attention_impl={meta['impl']!r}; the parts are each timed alone under jit on inputs of their shape",
        "- budget = weights + the step's inputs and outputs + a cache of exactly the run's tokens plus one block per sequence; "
        "peak = memory_stats()['peak_bytes_in_use'] of a fresh process running one step; estimated = budget + "
        "layer.prefill_temp_bytes, over the budget; head groups = layer.prefill_head_groups; XLA temp = the compiled step's "
        "temporaries (memory_analysis().temp_size_in_bytes: buffers beyond arguments and outputs, no library workspaces)",
        "",
        "## Targets, from this run",
        "",
        *([] if meta["device_timed"] else ["Not all times are device times (see above): the judgements mean nothing.", ""]),
        *target_lines(rows, sizes),
        "",
        "## Cases",
        "",
        "| case | attention | head groups | step us | kernels | parts us | step / parts | TFLOP | TFLOP/s | of matmul | peak MB "
        "| budget MB | peak / budget | estimated | XLA temp MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r.get('impl', '-')} | {_num(r.get('head_groups'), '{:g}')} | {_num(r.get('step_us'), '{:.1f}')} "
            f"| {_num(r.get('step_kernels'), '{:g}')} "
            f"| {_num(r.get('parts_us'), '{:.1f}')} | {_num(r.get('step_over_parts'), '{:.2f}x')} | {_num(r.get('tflop'), '{:.3f}')} "
            f"| {_num(r.get('tflops'), '{:.1f}')} | {_num(r.get('matmul_fraction'), '{:.0%}')} "
            f"| {_num(r.get('peak_bytes') and r['peak_bytes'] / 1e6, '{:.0f}')} | {_num(r.get('budget_bytes') and r['budget_bytes'] / 1e6, '{:.0f}')} "
            f"| {_num(r.get('peak_over_budget'), '{:.2f}x')} | {_num(r.get('estimated_over_budget'), '{:.2f}x')} "
            f"| {_num(r.get('xla_temp_bytes') and r['xla_temp_bytes'] / 1e6, '{:.0f}')} |")
    lines += ["", "## The parts (us each)", ""]
    lines += [f"- {r['name']}: {r['parts']}" for r in rows if r.get("parts")]
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "## Errors", "", *(f"- {r['name']}: {r['error']}" for r in errors)]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--out", type=Path, help="output directory (default: benchmarks/results/<platform>-prefill[-quick])")
    parser.add_argument("--only", help="comma-separated substrings of case names, e.g. packed,32768")
    parser.add_argument("--impl", choices=prefill_attention.IMPLS, default="auto", help="the layer's attention_impl")
    parser.add_argument("--head-groups", default="auto",
                        help="the layer's head_groups: auto (the size rule, the layer's default) or a number (a divisor of every case's heads)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: the subprocess of one case
    opts = parser.parse_args(argv)
    global HEAD_GROUPS
    HEAD_GROUPS = None if opts.head_groups == "auto" else int(opts.head_groups)
    sizes = QUICK if opts.quick else FULL
    if opts.memory_of:
        memory_of(opts.memory_of, sizes, opts.impl)
        return 0

    started = time.monotonic()
    wanted = [w for w in (opts.only or "").split(",") if w]
    todo = [c for c in sizes.cases if not wanted or any(w in c.name for w in wanted)]
    if not todo:
        sys.exit(f"--only {opts.only!r} matches no case; the names: {', '.join(c.name for c in sizes.cases)}")
    device = jax.devices()[0]
    out = opts.out or Path(__file__).parent / "results" / f"{device.platform}-prefill{'-quick' if opts.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform}); {len(todo)} cases; writing to {out}", flush=True)
    matmul_tflops, matmul = matmul_calibration(sizes.matmul)
    print(f"matmul bf16 {sizes.matmul}^3: {matmul.seconds * 1e6:.1f} us, {matmul_tflops:.1f} TFLOP/s [{matmul.source}]", flush=True)
    rows = []
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for case in todo:
            try:
                row = measure_case(case, sizes, opts.impl, matmul_tflops, opts.quick, not opts.no_memory)
            except Exception as e:  # out of memory, a refused shape: record it, go on
                row = dict(name=case.name, heads=case.heads, seqs=case.seqs, new=case.new, context=case.context, error=_message(e))
            rows.append(row)
            writer.writerow(row)
            f.flush()
            print(f"{row['name']:36} {row.get('impl', '-'):12} step {_num(row.get('step_us'), '{:10.1f}')} us  parts "
                  f"{_num(row.get('parts_us'), '{:10.1f}')} us ({_num(row.get('step_over_parts'), '{:.2f}x')})  "
                  f"{_num(row.get('tflops'), '{:.1f}')} TFLOP/s  peak/budget {_num(row.get('peak_over_budget'), '{:.2f}x')} "
                  f"(estimated {_num(row.get('estimated_over_budget'), '{:.2f}x')}, {_num(row.get('head_groups'), '{:g}')} head groups, "
                  f"XLA temp {_num(row.get('xla_temp_bytes') and row['xla_temp_bytes'] / 1e6, '{:.0f}')} MB)"
                  f"{'  ERROR ' + row['error'] if row['error'] else ''}", flush=True)
    sources = {r["time_source"] for r in rows if r.get("time_source")}
    device_timed = sources == {"device"}
    meta = dict(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        device=f"{device.device_kind} ({device.platform}), {jax.device_count()} device(s)",
        impl=opts.impl, matmul_us=matmul.seconds * 1e6, matmul_tflops=matmul_tflops, device_timed=device_timed,
        time_note=("device time, the median over the profiled calls of the summed kernel durations of one call" if device_timed else
                   f"source {', '.join(sorted(sources)) or '-'}: 'wall' is wall clock per call (no device trace: CPU)"),
    )
    write_markdown(out / "RESULTS.md", meta, rows, sizes)
    failed = sum(bool(r["error"]) for r in rows)
    print(f"done in {time.monotonic() - started:.0f} s: {len(rows)} cases, {failed} with errors; see {out / 'RESULTS.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
