"""gather_mla_cache against its jnp reference, on the CPU handler and the CUDA kernel.

Fresh random entries in every format; hostile table entries past each length, an out-of-range
block id inside one (a zero row), blocks shared between sequences, NaN in every row no table
slot inside a length names, ragged lengths (negative and past the table's capacity too), and
num_tokens below, at and above the tokens there are. The outputs are poisoned first (a call of
the same shapes on an all-NaN cache), so a row the kernel fails to write keeps a NaN.

Exactness: every value is one rounding of an exact float32 value (the dequantized entry), so
the op equals the reference bit for bit; except for the plain fp8 cache, whose value is
code / cache_scale_inv: XLA evaluates the reference's division as a product with the reciprocal,
which can be one unit in the last place off, so those outputs agree within one step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _util import assert_bits_equal, assert_within_steps

import jax_kimi_mla
from jax_kimi_mla import reference
from jax_kimi_mla.numerics import ds_mla_encode, quantize_e4m3

ENTRY = 576
FORMATS = (("bf16", "bfloat16"), ("bf16", "float16"), ("fp8", None), ("fp8_ds_mla", None))
OUT_DTYPES = ("bfloat16", "float16", "float32")
CACHE_SCALE_INV = 448.0 / 10.0


def dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_case(fmt, cache16, lens, block_size=8, seed=0, index=np.int32, scale_inv=CACHE_SCALE_INV):
    rng = np.random.default_rng(seed)
    B, max_blocks = len(lens), max(1, -(-max(max(lens), 1) // block_size))
    num_blocks = B * max_blocks + 2
    values = rng.standard_normal((num_blocks * block_size, ENTRY)).astype(np.float32)
    kw = {}
    if fmt == "fp8_ds_mla":
        cache = np.array(ds_mla_encode(jnp.asarray(values[:, :512]), jnp.asarray(values[:, 512:], jnp.bfloat16)))
        nan_row = np.full(656, 0x7F, np.uint8)
        kw["ds_mla"] = True
    elif fmt == "fp8":
        cache = np.array(quantize_e4m3(jnp.asarray(values), jnp.float32(scale_inv)))
        nan_row = np.full(ENTRY, np.nan, np.float32).astype(cache.dtype)
        kw["cache_scale_inv"] = np.float32(scale_inv)
    else:
        cache = values.astype(dtype(cache16))
        nan_row = np.full(ENTRY, np.nan, np.float32).astype(cache.dtype)
    cache = cache.reshape(num_blocks, block_size, -1)
    ids = rng.permutation(num_blocks)[: B * max_blocks].reshape(B, max_blocks).astype(np.int64)
    readable = np.zeros((num_blocks, block_size), bool)
    for b, n in enumerate(lens):
        n = max(0, min(n, max_blocks * block_size))
        nb = -(-n // block_size)
        ids[b, nb:] = [(2147480000, -7)[i % 2] for i in range(max_blocks - nb)]
        if nb > 2:
            ids[b, 1] = num_blocks + 5  # inside the length: masked, a zero row
        if b == B - 1 and B > 1 and lens[0] >= block_size and nb:
            ids[b, 0] = ids[0, 0]  # a block shared with the first sequence
        for t in range(n):
            block = ids[b, t // block_size]
            if 0 <= block < num_blocks:
                readable[block, t % block_size] = True
    cache[~readable] = nan_row
    return dict(kv_cache=cache, block_tables=ids.astype(index), context_lens=np.asarray(lens, index)), kw


def run(fn, args, kw, backend, num_tokens, out_dtype):
    arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray | np.floating)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    step = jax.jit(lambda a, s: fn(*a, **s, **static, num_tokens=num_tokens, out_dtype=out_dtype))
    a, s = jax.device_put((list(args.values()), arrays), jax.devices(backend)[0])
    return np.asarray(step(a, s))


def poisoned_run(args, kw, backend, num_tokens, out_dtype):
    cache = args["kv_cache"]
    nan_cache = np.full(cache.shape, 0x7F, np.uint8) if cache.dtype == np.uint8 else np.full(cache.shape, np.nan, np.float32).astype(cache.dtype)
    run(jax_kimi_mla.gather_mla_cache, dict(args, kv_cache=nan_cache), kw, backend, num_tokens, out_dtype)
    return run(jax_kimi_mla.gather_mla_cache, args, kw, backend, num_tokens, out_dtype)


LENS = (9, 0, 1, 7, 8, 40, -3)  # block size 8: bs + 1, 0, 1, bs - 1, bs, longer, negative


@pytest.mark.parametrize("num_tokens", (None, 30, 200, 300))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("fmt,cache16", FORMATS)
def test_matches_reference(backend, fmt, cache16, out_dtype, num_tokens):
    args, kw = make_case(fmt, cache16, LENS)
    got = poisoned_run(args, kw, backend, num_tokens, dtype(out_dtype))
    want = run(reference.gather_mla_cache, args, kw, "cpu", num_tokens, dtype(out_dtype))
    assert got.shape == want.shape == ((len(LENS) * 5 * 8 if num_tokens is None else num_tokens), ENTRY)
    if fmt == "fp8":
        assert_within_steps(got, want, f"{fmt} -> {out_dtype}")
    else:
        assert_bits_equal(got, want, f"{fmt} -> {out_dtype}")
    assert not np.isnan(got.astype(np.float32)).any(), "no readable row holds NaN: a NaN is an unwritten or misread row"
    filled = sum(max(0, min(n, 40)) for n in LENS)
    assert not got[filled:].astype(np.float32).any(), "rows past the last token are zeros"


@pytest.mark.parametrize("scale_inv", (32.0, 1.0, 2.0**-3, 2.0**-90, 2.0**90))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fp8_power_of_two_scale_is_exact(backend, out_dtype, scale_inv):
    """A power-of-two cache_scale_inv divides exactly (the kernel then multiplies by its inverse):
    bit for bit the reference, and the CPU handler's true division."""
    args, kw = make_case("fp8", None, LENS, scale_inv=scale_inv, seed=6)
    got = poisoned_run(args, kw, backend, None, dtype(out_dtype))
    assert_bits_equal(got, run(reference.gather_mla_cache, args, kw, "cpu", None, dtype(out_dtype)), f"scale {scale_inv}")
    assert_bits_equal(got, run(jax_kimi_mla.gather_mla_cache, args, kw, "cpu", None, dtype(out_dtype)), "CPU handler")


def test_packing_and_zero_rows():
    """The layout by hand: sequence 1 starts after sequence 0's tokens; a masked block is zeros."""
    args, kw = make_case("bf16", "bfloat16", (9, 17), seed=4)
    out = run(jax_kimi_mla.gather_mla_cache, args, kw, "cpu", None, dtype("float32"))
    cache, ids = args["kv_cache"].astype(np.float32), args["block_tables"]
    assert np.array_equal(out[0], cache[ids[0, 0], 0]) and np.array_equal(out[8], cache[ids[0, 1], 0])
    assert np.array_equal(out[9], cache[ids[1, 0], 0])  # the first token of sequence 1
    assert not out[9 + 8 : 9 + 16].any()  # its block 1 is out of range: zero rows
    assert np.array_equal(out[9 + 16], cache[ids[1, 2], 0])


def test_nan_in_a_read_entry_propagates(backend):
    args, kw = make_case("bf16", "bfloat16", (9,), seed=5)
    args["kv_cache"][args["block_tables"][0, 0], 3, 100] = np.nan
    out = run(jax_kimi_mla.gather_mla_cache, args, kw, backend, None, dtype("float32"))
    assert np.isnan(out[3, 100]) and np.isnan(out).sum() == 1


def test_int64_indices_and_block_sizes(backend):
    with jax.enable_x64(True):
        for block_size in (1, 16, 64):
            args, kw = make_case("fp8_ds_mla", None, (70, 3), block_size=block_size, index=np.int64, seed=block_size)
            got = poisoned_run(args, kw, backend, None, dtype("bfloat16"))
            assert_bits_equal(got, run(reference.gather_mla_cache, args, kw, "cpu", None, dtype("bfloat16")), f"block size {block_size}")


def test_empty_batch_and_zero_rows(backend):
    cache = np.zeros((4, 8, ENTRY), ml_dtypes.bfloat16)
    out = run(jax_kimi_mla.gather_mla_cache, dict(kv_cache=cache, block_tables=np.zeros((0, 2), np.int32), context_lens=np.zeros(0, np.int32)), {}, backend, 5, dtype("bfloat16"))
    assert out.shape == (5, ENTRY) and not out.astype(np.float32).any()
    out = run(jax_kimi_mla.gather_mla_cache, dict(kv_cache=cache, block_tables=np.zeros((1, 2), np.int32), context_lens=np.ones(1, np.int32)), {}, backend, 0, dtype("bfloat16"))
    assert out.shape == (0, ENTRY)


def test_no_blocks_in_the_cache(backend):
    """A cache of no blocks: every table entry is outside it, so zero rows, op and reference alike."""
    args = dict(kv_cache=np.zeros((0, 8, ENTRY), ml_dtypes.bfloat16), block_tables=np.ones((2, 2), np.int32),
                context_lens=np.array([3, 9], np.int32))
    for impl in (jax_kimi_mla, reference):
        out = run(impl.gather_mla_cache, args, {}, backend if impl is jax_kimi_mla else "cpu", 12, dtype("bfloat16"))
        assert out.shape == (12, ENTRY) and not out.astype(np.float32).any(), impl.__name__


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,cache16", FORMATS)
def test_cuda_large(fmt, cache16):
    """Many sequences (a prefix sum over several scan rounds) and long ones."""
    lens = tuple(int(x) for x in np.random.default_rng(7).integers(-5, 300, 600))
    args, kw = make_case(fmt, cache16, lens, block_size=16, seed=8)
    got = poisoned_run(args, kw, "cuda", None, dtype("bfloat16"))
    want = run(reference.gather_mla_cache, args, kw, "cpu", None, dtype("bfloat16"))
    (assert_within_steps if fmt == "fp8" else assert_bits_equal)(got, want, f"{fmt} large")
