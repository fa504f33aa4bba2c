"""Several Python threads stepping the ops on their own caches at once give the results of
sequential runs, bit for bit: the handlers keep no state between calls, and one jitted step
function may be traced, compiled and run from many threads.

Each worker owns one cache per op and cache format and runs a few steps of all of them, RoPE on
every other step, with the cos/sin table shared by all workers. Valid slots are distinct within
a call, so the results are deterministic on every backend.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from _util import FORMATS, Case, assert_bits_equal, invoke, make_case, put

import jax_kimi_mla

WORKERS, STEPS = 4, 3


@functools.cache
def jitted_step(fmt: str):
    """One step of one format, the cache donated (updated in place)."""
    return jax.jit(lambda a, cache: invoke(jax_kimi_mla, fmt, dict(a, kv_cache=cache)), donate_argnums=1)


def eager_step(fmt: str):
    return lambda a, cache: invoke(jax_kimi_mla, fmt, dict(a, kv_cache=cache))


def worker_inputs(worker: int) -> list:
    """Per step, per format: the numpy inputs; the caches start as step 0's sentinel caches."""
    return [
        {fmt: make_case(Case(fmt, tokens=7, heads=2, rope=step % 2 == 0, block_size=4, seed=1000 * worker + 10 * step + k))
         for k, fmt in enumerate(FORMATS)}
        for step in range(STEPS)
    ]


def work(backend: str, mode: str, inputs: list, cos_sin_cache, start=None):
    """Runs a worker's steps; returns every step's outputs and the final caches, as numpy."""
    step = jitted_step if mode == "jit" else eager_step
    caches = {fmt: put(inputs[0][fmt]["kv_cache"], backend) for fmt in FORMATS}
    if start is not None:
        start.wait()  # all workers begin together
    outputs = []
    for step_inputs in inputs:
        for fmt in FORMATS:
            a = {k: v for k, v in step_inputs[fmt].items() if k != "kv_cache"}
            if "cos_sin_cache" in a:
                a["cos_sin_cache"] = cos_sin_cache
            *out, caches[fmt] = step(fmt)(put(a, backend), caches[fmt])
            outputs.append(out)
    return [[np.asarray(x) for x in out] for out in outputs], {fmt: np.asarray(c) for fmt, c in caches.items()}


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_concurrent_steps_match_sequential(backend, mode):
    inputs = [worker_inputs(w) for w in range(WORKERS)]
    shared_table = put(inputs[0][0][FORMATS[0]]["cos_sin_cache"], backend)
    start = threading.Barrier(WORKERS)
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = [pool.submit(work, backend, mode, inputs[w], shared_table, start) for w in range(WORKERS)]
        concurrent = [f.result() for f in futures]
    for w in range(WORKERS):
        outputs, caches = work(backend, mode, inputs[w], shared_table)
        got_outputs, got_caches = concurrent[w]
        for i, (got, want) in enumerate(zip(got_outputs, outputs)):
            for j, (g, x) in enumerate(zip(got, want)):
                assert_bits_equal(g, x, f"worker {w}, call {i} ({FORMATS[i % len(FORMATS)]}), output {j}")
        for fmt in FORMATS:
            assert_bits_equal(got_caches[fmt], caches[fmt], f"worker {w}, {fmt} kv_cache")
