"""mla_decode_attention against its jnp reference, on the CPU handler and the CUDA kernel.

Every case is fresh random data over a paged cache whose unused blocks hold NaN, with hostile
table entries past each sequence's length, out-of-range block ids inside it (masked), blocks
shared between sequences (prefix caching), ragged lengths (0, 1, bs - 1, bs, bs + 1 and long
ones) and S_q = 1, 2 or 4 causal queries.

Tolerances, against the float32 reference on the same dequantized cache:
- out: the CPU handler differs only by float32 summation order and the final rounding, the
  CUDA kernel also rounds the probabilities to the 16-bit MMA type (relative 2^-9 for bf16,
  2^-11 for fp16) before the weighted sum: |diff| <= 2^-6 (1 + |ref|) for bf16 outputs covers
  one output ulp (2^-8 relative) plus that; fp16 outputs get 2^-8.
- lse: float32 scores of exactly widened inputs, summed in another order: 1e-3 absolute. An
  fp16 mqa_q over an fp8 or fp8_ds_mla cache is rounded to bf16 on the GPU (relative 2^-9 per
  element, about 1e-2 on scores of magnitude ~5): 3e-2 there, and 2^-5 on out. An E4M3 mqa_q's
  scores on sm_90a are the tensor cores' fp8 sums (measured over 576 columns: within 6e-4 of the
  largest |S|; rs_attention_kernel adds five such sums, one a 128-column chunk, in float32), whose
  error a row that sees one token shows unaveraged (1.03e-3 on an H100): 3e-3 there.
- -inf (no visible token) and NaN positions must match exactly.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kimi_mla
from jax_kimi_mla import reference
from jax_kimi_mla.numerics import ds_mla_encode, quantize_e4m3

L, ENTRY = 512, 576
SCALE = 192**-0.5
GARBAGE_IDS = (2147480000, -5, -1)  # table entries past a length: never read
FP8_CACHE_SCALE_INV, FP8_Q_SCALE_INV = 448.0 / 8.0, 448.0 / 32.0

# (cache format, mqa_q dtype)
FORMATS = (
    ("bf16", "bfloat16"),
    ("bf16", "float16"),
    ("fp8", "bfloat16"),
    ("fp8", "float8_e4m3fn"),
    ("fp8_ds_mla", "bfloat16"),
    ("fp8_ds_mla", "float16"),
)


def tolerances(fmt: str, q_dtype: str) -> tuple[float, float]:
    """(out, lse) tolerances of the module docstring."""
    if q_dtype == "float16" and fmt != "bf16":
        return 2.0**-5, 3e-2
    if q_dtype == "float8_e4m3fn":
        return 2.0**-6, 3e-3
    return (2.0**-8 if q_dtype == "float16" else 2.0**-6), 1e-3


def nan_entry(fmt: str, dtype) -> np.ndarray:
    """One cache row that decodes to NaN everywhere (in the format's own bits)."""
    if fmt == "fp8_ds_mla":
        row = np.full(656, 0x7F, np.uint8)  # E4M3 NaN codes, NaN scales, bf16 NaN k_pe
        row[528:] = np.frombuffer(np.full(64, 0x7FC0, np.uint16).tobytes(), np.uint8)
        return row
    return np.full(ENTRY, np.nan, np.float32).astype(dtype)


def entries(fmt: str, q_dtype: str, latents: np.ndarray) -> np.ndarray:
    """Cache rows [n, width] of float32 [n, 576] values in the format."""
    if fmt == "fp8_ds_mla":
        return np.array(ds_mla_encode(jnp.asarray(latents[:, :L]), jnp.asarray(latents[:, L:], jnp.bfloat16)))
    if fmt == "fp8":
        return np.array(quantize_e4m3(jnp.asarray(latents), jnp.float32(FP8_CACHE_SCALE_INV)))
    return latents.astype(np.dtype(q_dtype))


def make_case(fmt, q_dtype, *, lens, q_tokens=1, heads=3, block_size=16, index=np.int32, seed=0, nan_token=None,
              row_exponents=None):
    """Named numpy inputs of one call (and its keyword arguments). row_exponents=(lo, hi): each cache
    row times 2^e, e uniform in [lo, hi], and q times 2^-hi (scores stay of order 1)."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    max_blocks = max(1, -(-max(lens) // block_size))
    num_blocks = B * max_blocks + 3
    q = rng.standard_normal((B, q_tokens, heads, ENTRY)).astype(np.float32)
    if row_exponents is not None:
        q *= 2.0 ** -row_exponents[1]
    kw = {"softmax_scale": SCALE}
    if q_dtype == "float8_e4m3fn":
        q = np.asarray(quantize_e4m3(jnp.asarray(q), jnp.float32(FP8_Q_SCALE_INV)))
        kw["q_scale_inv"] = np.float32(FP8_Q_SCALE_INV)
    else:
        q = q.astype(np.dtype(q_dtype))
    if fmt == "fp8":
        kw["cache_scale_inv"] = np.float32(FP8_CACHE_SCALE_INV)
    if fmt == "fp8_ds_mla":
        kw["ds_mla"] = True
    values = rng.standard_normal((num_blocks * block_size, ENTRY)).astype(np.float32)
    if row_exponents is not None:
        values *= 2.0 ** rng.integers(row_exponents[0], row_exponents[1] + 1, (len(values), 1))
    cache = entries(fmt, q_dtype, values)
    # Blocks: a permutation; the last sequence shares its first block with the one before it
    # (a common prefix; the one before must fill that block, or its NaN tail would be shared).
    ids = rng.permutation(num_blocks)[: B * max_blocks].reshape(B, max_blocks).astype(np.int64)
    if B > 1 and lens[-2] >= block_size:
        ids[-1, 0] = ids[-2, 0]
    used = np.zeros(num_blocks, bool)
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        ids[b, nb:] = [GARBAGE_IDS[i % len(GARBAGE_IDS)] for i in range(max_blocks - nb)]
        if nb > 1:  # an out-of-range id inside the length: those tokens are masked out
            ids[b, nb - 2] = num_blocks + b
        used[ids[b, :nb][(ids[b, :nb] >= 0) & (ids[b, :nb] < num_blocks)]] = True
    rows = cache.reshape(num_blocks, block_size, -1)
    rows[~used] = nan_entry(fmt, cache.dtype)
    # Rows past the length inside a sequence's last block hold NaN too.
    for b, n in enumerate(lens):
        if n % block_size and 0 <= ids[b, n // block_size] < num_blocks:
            rows[ids[b, n // block_size], n % block_size :] = nan_entry(fmt, cache.dtype)
    if nan_token is not None:  # (b, t): a NaN inside the length
        b, t = nan_token
        rows[ids[b, t // block_size], t % block_size] = nan_entry(fmt, cache.dtype)
    args = dict(mqa_q=q, kv_cache=rows, block_tables=ids.astype(index), context_lens=np.asarray(lens, index))
    return args, kw


def run(fn, args, kw, backend):
    """fn under jax.jit on the backend's first device -> numpy (out as float32, lse)."""
    arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray | np.floating)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    step = jax.jit(lambda a, s: fn(*a, **s, **static, return_lse=True))
    a, s = jax.device_put((list(args.values()), arrays), jax.devices(backend)[0])
    out, lse = step(a, s)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def poisoned_run(args, kw, backend):
    """The FFI op, after a call of the same shapes whose outputs are all NaN (a NaN query): an
    output element the kernel fails to write keeps a NaN from the allocator's last buffer."""
    q = args["mqa_q"]
    nan_q = np.full(q.shape, np.nan, np.float32).astype(q.dtype)  # E4M3 too: NaN -> 0x7F
    nan_args = dict(args, mqa_q=nan_q)
    run(jax_kimi_mla.mla_decode_attention, nan_args, kw, backend)
    return run(jax_kimi_mla.mla_decode_attention, args, kw, backend)


def assert_close(fmt, q_dtype, got, want):
    out_tol, lse_tol = tolerances(fmt, q_dtype)
    (out, lse), (ref_out, ref_lse) = got, want
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse), err_msg="lse NaN positions")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf positions")
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=lse_tol, rtol=0, err_msg="lse")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out), err_msg="out NaN positions")
    ok = ~np.isnan(ref_out)
    err = np.abs(out[ok] - ref_out[ok]) - out_tol * (1 + np.abs(ref_out[ok]))
    assert err.max(initial=-1) <= 0, f"out differs by up to {np.abs(out[ok] - ref_out[ok]).max()}"
    empty = np.isneginf(ref_lse)
    assert not np.any(out[np.broadcast_to(empty[..., None], out.shape)]), "rows with nothing visible must be zeros"


LENS = (0, 1, 15, 16, 17, 100)  # block size 16: 0, 1, bs - 1, bs, bs + 1, a longer one


@pytest.mark.parametrize("q_tokens", (1, 2, 4))
@pytest.mark.parametrize("fmt,q_dtype", FORMATS)
def test_matches_reference(backend, fmt, q_dtype, q_tokens):
    args, kw = make_case(fmt, q_dtype, lens=LENS, q_tokens=q_tokens, seed=q_tokens)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, kw, backend), want)


@pytest.mark.parametrize("block_size", (1, 16, 32, 64, 128, 48))
@pytest.mark.parametrize("fmt,q_dtype", (("bf16", "bfloat16"), ("fp8_ds_mla", "bfloat16")))
def test_block_sizes_and_int64_indices(backend, fmt, q_dtype, block_size):
    with jax.enable_x64(True):
        args, kw = make_case(fmt, q_dtype, lens=(0, 5, 3 * block_size + 1, 300), block_size=block_size, index=np.int64)
        assert_close(fmt, q_dtype, poisoned_run(args, kw, backend), run(reference.mla_decode_attention, args, kw, "cpu"))


# S_q = 1 and S_q = 2 mask differently in the kernels (per token; per query row).
@pytest.mark.parametrize("num_splits", (1, 2, 3, 7, 40))
@pytest.mark.parametrize("q_tokens", (1, 2))
@pytest.mark.parametrize("fmt,q_dtype", (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn"), ("fp8_ds_mla", "bfloat16")))
def test_split_count_does_not_change_the_result(backend, fmt, q_dtype, q_tokens, num_splits):
    args, kw = make_case(fmt, q_dtype, lens=(700, 64, 1, 0, 129), q_tokens=q_tokens, heads=20)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, dict(kw, num_splits=num_splits), backend), want)


@pytest.mark.parametrize("fmt", ("bf16", "fp8", "fp8_ds_mla"))
def test_nan_inside_the_length_propagates(backend, fmt):
    args, kw = make_case(fmt, "bfloat16", lens=(40, 40), nan_token=(0, 35))  # block 2: not shared, not masked
    out, lse = run(jax_kimi_mla.mla_decode_attention, args, kw, backend)
    assert np.isnan(lse[0]).all() and np.isnan(out[0]).all()
    assert np.isfinite(lse[1]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("fmt,q_dtype", (("bf16", "bfloat16"), ("fp8_ds_mla", "bfloat16")))
def test_nan_in_a_new_token_reaches_only_the_queries_that_see_it(backend, fmt, q_dtype):
    """S_q = 3: the newest token holds NaN; queries 0 and 1 do not see it, query 2 does."""
    args, kw = make_case(fmt, q_dtype, lens=(40,), q_tokens=3, nan_token=(0, 39))
    for impl in (jax_kimi_mla, reference):
        out, lse = run(impl.mla_decode_attention, args, kw, backend if impl is jax_kimi_mla else "cpu")
        assert np.isfinite(lse[0, :2]).all() and np.isfinite(out[0, :2]).all(), impl.__name__
        assert np.isnan(lse[0, 2]).all() and np.isnan(out[0, 2]).all(), impl.__name__


@pytest.mark.parametrize("shape", ((0, 3, ENTRY), (2, 0, ENTRY), (0, 2, 3, ENTRY)))
def test_empty_batch_or_heads(backend, shape):
    q = np.zeros(shape, ml_dtypes.bfloat16)
    B = shape[0]
    args = dict(mqa_q=q, kv_cache=np.zeros((4, 16, ENTRY), ml_dtypes.bfloat16), block_tables=np.zeros((B, 2), np.int32), context_lens=np.zeros((B,), np.int32))
    out, lse = run(jax_kimi_mla.mla_decode_attention, args, {"softmax_scale": SCALE}, backend)
    assert out.shape == (*shape[:-1], L) and lse.shape == shape[:-1]


@pytest.mark.parametrize("cache_blocks, table_width", ((0, 2), (4, 0)))
def test_no_blocks_or_no_table_columns(backend, cache_blocks, table_width):
    """A cache of no blocks, or tables of no columns: nothing to read, so zeros and an lse of
    -inf, from the op and the reference alike (the reference also stands in on pre-Hopper GPUs)."""
    q = np.random.default_rng(3).normal(size=(2, 3, ENTRY)).astype(ml_dtypes.bfloat16)
    args = dict(mqa_q=q, kv_cache=np.zeros((cache_blocks, 16, ENTRY), ml_dtypes.bfloat16),
                block_tables=np.ones((2, table_width), np.int32), context_lens=np.array([3, 40], np.int32))
    for impl in (jax_kimi_mla, reference):
        out, lse = run(impl.mla_decode_attention, args, {"softmax_scale": SCALE}, backend if impl is jax_kimi_mla else "cpu")
        assert out.shape == (2, 3, L) and not out.astype(np.float32).any(), impl.__name__
        assert (lse == -np.inf).all(), impl.__name__


def test_three_and_four_dim_queries_agree():
    args, kw = make_case("bf16", "bfloat16", lens=(30, 7), q_tokens=1)
    out4, lse4 = run(jax_kimi_mla.mla_decode_attention, args, kw, "cpu")
    out3, lse3 = run(jax_kimi_mla.mla_decode_attention, dict(args, mqa_q=args["mqa_q"][:, 0]), kw, "cpu")
    np.testing.assert_array_equal(out3, out4[:, 0])
    np.testing.assert_array_equal(lse3, lse4[:, 0])


def test_returns_out_alone_without_lse():
    args, kw = make_case("bf16", "bfloat16", lens=(30,))
    out = jax_kimi_mla.mla_decode_attention(*args.values(), **kw)
    assert isinstance(out, jax.Array) and out.shape == (1, 1, 3, L) and out.dtype == jnp.bfloat16


def test_default_split_count_fills_the_gpu():
    split = jax_kimi_mla.ops.default_num_splits
    assert split(64, 12, 16384, 0) == 1  # no GPU: one split, no combine
    assert split(1, 12, 4096, 132) == 64  # B = 1: one split per 64-token tile, up to the SMs
    assert split(64, 12, 16384, 132) == 2  # 128 blocks: one wave of 132 SMs
    assert split(4096, 12, 16384, 132) == 1
    assert split(1, 12, 64, 132) == 1  # never more splits than tiles
    assert split(1, 128, 4096, 132, rows_per_cta=64) == 63  # the 64-row kernel: 2 blocks a split, 126 in all
    assert split(64, 128, 8192, 132, rows_per_cta=64) == 1
    wide = jax_kimi_mla.ops.wide_kernel_applies  # the 64-row kernel (sm_90): 16-bit caches, S_q = 1, many rows
    assert wide(jnp.bfloat16, 1, 1, 64) and wide(jnp.float16, 8, 1, 32) and not wide(jnp.bfloat16, 4, 1, 32)
    assert not wide(jnp.bfloat16, 64, 2, 64) and not wide(jnp.uint8, 64, 1, 128) and not wide(jnp.float8_e4m3fn, 64, 1, 128)
    # ... or as the call asks: "wide" with fewer rows too, "mma" never; the format and S_q still rule
    assert wide(jnp.bfloat16, 4, 1, 12, "wide") and not wide(jnp.bfloat16, 1, 1, 64, "mma")
    assert not wide(jnp.bfloat16, 4, 2, 12, "wide") and not wide(jnp.uint8, 4, 1, 12, "wide") and wide(jnp.bfloat16, 1, 1, 64, "rs")


def test_split_plan_shares_the_default_count_out_by_work():
    plan = jax_kimi_mla.ops.split_plan
    # A serve loop's decode batch (B 32, tables of 514 blocks of 64): 4 splits a sequence on
    # average, a long one up to 16 of them.
    assert plan(32, 12, 32896, 132) == (16, 4)
    assert plan(32, 12, 32896, 132, split_by_work=False) == (4, 0)
    assert plan(64, 12, 16384, 132) == (8, 2)
    assert plan(4096, 12, 16384, 132) == (1, 0)  # one split: nothing to share out
    assert plan(128, 12, 16384, 132) == (8, 2)  # one split a sequence, one wave: two by work
    assert plan(128, 12, 16384, 132, split_by_work=False) == (1, 0)
    assert plan(128, 12, 1024, 132) == (1, 0)  # splits of 8 tiles: by count
    assert plan(256, 12, 8192, 132) == (1, 0)  # two waves of one split
    assert plan(200, 12, 8192, 132) == (3, 0)  # more sequences than SMs: by count
    assert plan(64, 128, 8192, 132, 64) == (1, 0)  # one wave, but two row groups a sequence
    assert plan(64, 12, 16384, 0) == (1, 0)  # no GPU
    assert plan(1, 12, 32768, 132) == (126, 0)  # one sequence: nothing to share out
    assert plan(2, 12, 65536, 132) == (126, 63)  # the longer of two takes at most their 2 x 63
    assert plan(3, 12, 4096, 132) == (42, 0)  # splits of 2 tiles: by count
    assert plan(8, 12, 32768, 132) == (64, 16)  # 32 tiles a split


def test_launch_choices_reach_the_handler_only_when_asked():
    """kernel=, programmatic_combine= and balance_splits= become FFI attributes only where they
    differ from their defaults (a default call lowers as before they existed); the CPU handler
    checks and ignores them, so every choice gives the default's bits there, which agree with the
    reference."""
    args, kw = make_case("bf16", "bfloat16", lens=(70, 1, 0), heads=4, block_size=16, seed=3)

    def custom_call(**choice):
        step = jax.jit(lambda *a: jax_kimi_mla.mla_decode_attention(*a, **kw, **choice))
        return next(line for line in step.lower(*args.values()).as_text().splitlines() if "mla_decode_attention_v" in line)

    default = custom_call()
    assert "kernel" not in default and "programmatic_combine" not in default and "balance_splits" not in default
    assert "balance_splits" not in custom_call(balance_splits=True)
    line = custom_call(kernel="rs-combine", programmatic_combine=False, balance_splits=False)
    assert 'kernel = "rs-combine"' in line and "programmatic_combine = false" in line and "balance_splits = false" in line
    want = run(jax_kimi_mla.mla_decode_attention, args, kw, "cpu")
    for kernel in jax_kimi_mla._checks.DECODE_KERNELS:
        choice = dict(kernel=kernel, programmatic_combine=kernel == "auto", balance_splits=kernel != "auto")
        got = run(jax_kimi_mla.mla_decode_attention, args, dict(kw, **choice), "cpu")
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    unbalanced = dict(kw, num_splits=3, balance_splits=False)
    assert_close("bf16", "bfloat16", run(jax_kimi_mla.mla_decode_attention, args, unbalanced, "cpu"),
                 run(reference.mla_decode_attention, args, unbalanced, "cpu"))
    # Splits by work (a GPU's split plan; none on the CPU) are the attribute work_splits.
    assert "work_splits" not in default
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax_kimi_mla.ops, "split_plan", lambda *a, **k: (5, 2))
        assert "num_splits = 5 : i64" in custom_call() and "work_splits = 2 : i64" in custom_call()
        got = run(jax_kimi_mla.mla_decode_attention, args, kw, "cpu")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # Under jax.vmap the folded call keeps the choice.
    batched = {name: np.stack([x, x]) for name, x in args.items()}
    folded = jax.jit(jax.vmap(lambda *a: jax_kimi_mla.mla_decode_attention(*a, **kw, kernel="mma", return_lse=True)))
    assert 'kernel = "mma"' in folded.lower(*batched.values()).as_text()
    with jax.default_device(jax.devices("cpu")[0]):
        out, lse = folded(*batched.values())
    for element in (0, 1):
        np.testing.assert_array_equal(np.asarray(out[element].astype(jnp.float32)), want[0])
        np.testing.assert_array_equal(np.asarray(lse[element]), want[1])


def test_gpus_before_hopper_fall_back_to_the_reference(monkeypatch):
    """Where the kernel cannot run (a GPU below sm_90) the op is the jnp reference: no custom
    call in the program, the reference's values bit for bit."""
    args, kw = make_case("fp8_ds_mla", "bfloat16", lens=(70, 1, 0), heads=4, block_size=16, seed=5)
    monkeypatch.setattr(jax_kimi_mla._device, "gpu_before_hopper", lambda: True)
    lowered = jax.jit(lambda *a: jax_kimi_mla.mla_decode_attention(*a, **kw)).lower(*args.values())
    assert "custom_call" not in lowered.as_text()
    got = run(jax_kimi_mla.mla_decode_attention, args, kw, "cpu")
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.cuda
@pytest.mark.parametrize("q_tokens", (1, 2))
@pytest.mark.parametrize("fmt,q_dtype", FORMATS)
def test_cuda_long_contexts(fmt, q_dtype, q_tokens):
    """Thousands of tokens per sequence, many splits, the GPU's default split count."""
    args, kw = make_case(fmt, q_dtype, lens=(5000, 1, 4096, 2049), q_tokens=q_tokens, heads=16, block_size=64, seed=3)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), want)


# The kernels a call takes only when asked (kernel=): rs (fp8_ds_mla at S_q = 1
# on sm_90, also where its splits are too short to be the default; the plain fp8 cache under an
# E4M3 query, its tiles by tensor-map boxes, S^T on E4M3 wgmma), and mma, the general kernel
# where the plain fp8 cache under an E4M3 query, or fp8_ds_mla with long splits, at S_q = 1 would
# take its own (fp8_attention_kernel, rs_attention_kernel): long and ragged lengths, split
# counts, block sizes, a NaN inside a length.
REQUESTED_CASES = {
    "long": dict(lens=(5000, 1, 0, 2049, 77), heads=16, block_size=64),
    "one split": dict(lens=(700, 64, 1, 0, 129), heads=20, num_splits=1),
    "many splits": dict(lens=(700, 64, 1, 0, 129), heads=20, num_splits=40),
    "block 16": dict(lens=(0, 5, 49, 300), block_size=16),
    "block 128": dict(lens=(0, 5, 385, 300), block_size=128),
    "block 48": dict(lens=(0, 5, 145, 300), block_size=48),
    "nan": dict(lens=(40, 40), nan_token=(0, 35)),
}


KERNEL_CHOICES = [("rs", *f) for f in FORMATS if f[0] == "fp8_ds_mla"] + [
    ("rs", "fp8", "float8_e4m3fn"),
    ("mma", "fp8", "float8_e4m3fn"),
    ("mma", "fp8_ds_mla", "bfloat16"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", REQUESTED_CASES)
@pytest.mark.parametrize("kernel,fmt,q_dtype", KERNEL_CHOICES)
def test_cuda_kernels_taken_on_request(kernel, fmt, q_dtype, case):
    spec = dict(REQUESTED_CASES[case])
    splits = {"num_splits": spec.pop("num_splits")} if "num_splits" in spec else {}
    args, kw = make_case(fmt, q_dtype, seed=4, **spec)
    kw = dict(kw, kernel=kernel)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, dict(kw, **splits), "cuda"), want)
    if case == "nan":
        assert np.isnan(want[1][0]).all() and np.isfinite(want[1][1]).all()


# combine_kernel launched as a programmatic dependent of the attention kernel before it (the default)
# against the plain launch (programmatic_combine=False). Each case takes one combine shape (the CTAs a row and warps a CTA follow the
# rows against the SMs: B = 1 four column parts, B = 4 two, B = 8 one, B = 8 x 64 heads 4 warps)
# after each attention kernel that can precede it (attention_kernel, fp8_attention_kernel,
# rs_attention_kernel with the combine, wide_attention_kernel).
PDL_CASES = {
    "bf16, B 1": ("auto", "bf16", "bfloat16", dict(lens=(4096,), heads=12)),
    "bf16, B 4": ("auto", "bf16", "bfloat16", dict(lens=(0, 1, 700, 3000), heads=12)),
    "fp8, B 8": ("auto", "fp8", "float8_e4m3fn", dict(lens=(0, 1, 700, 3000, 129, 64, 5000, 2), heads=12)),
    "fp8_ds_mla rs, B 4": ("rs-combine", "fp8_ds_mla", "bfloat16", dict(lens=(0, 1, 700, 3000), heads=12)),
    "fp8_ds_mla, B 1, a NaN": ("auto", "fp8_ds_mla", "bfloat16", dict(lens=(4096,), heads=12, nan_token=(0, 2000))),
    "bf16 wide, B 8 x 64 heads": ("auto", "bf16", "bfloat16", dict(lens=(0, 1, 700, 3000, 129, 64, 5000, 2), heads=64)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", PDL_CASES)
def test_cuda_combine_by_programmatic_launch(case):
    """The same bits with and without the programmatic launch, and the reference's values."""
    kernel, fmt, q_dtype, spec = PDL_CASES[case]
    args, kw = make_case(fmt, q_dtype, block_size=64, seed=14, **spec)
    kw = dict(kw, num_splits=64 if len(spec["lens"]) == 1 else 8, kernel=kernel)
    plain = poisoned_run(args, dict(kw, programmatic_combine=False), "cuda")
    programmatic = poisoned_run(args, kw, "cuda")
    for got, want in zip(programmatic, plain):
        np.testing.assert_array_equal(got, want)  # NaN where NaN
    assert_close(fmt, q_dtype, programmatic, run(reference.mla_decode_attention, args, kw, "cpu"))


# rs_attention_kernel's splits of a sequence share out their last tiles at run time by default
# (claims in the partials scratch, the float rounding then depends on timing): fp8_ds_mla's from 4
# tiles a split, plain fp8's from 64; balance_splits=False keeps each split's tiles as cut. Several
# splits through combine_kernel ("rs-combine"), ragged lengths (splits past a length, a last split
# too short to share, a sequence of one tile, plain fp8 sequences with and without shared tails), B 4.
@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", (4, 8))
@pytest.mark.parametrize("fmt,q_dtype,lens", (("fp8_ds_mla", "bfloat16", (4096, 1, 3000, 2049)),
                                              ("fp8", "float8_e4m3fn", (40000, 1, 9000, 16385))))
def test_cuda_balanced_and_unbalanced_splits(fmt, q_dtype, lens, num_splits):
    """Both agree with the reference; two unbalanced runs give the same bits."""
    args, kw = make_case(fmt, q_dtype, lens=lens, heads=16, block_size=64, seed=15)
    kw = dict(kw, num_splits=num_splits, kernel="rs-combine")
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), want)
    unbalanced = poisoned_run(args, dict(kw, balance_splits=False), "cuda")
    assert_close(fmt, q_dtype, unbalanced, want)
    again = poisoned_run(args, dict(kw, balance_splits=False), "cuda")
    for got, first in zip(again, unbalanced, strict=True):
        np.testing.assert_array_equal(got, first)


# Splits by work (ops.split_plan, here patched to the plans below: num_splits, the most splits a
# sequence may take, and work_splits, B x which the grid holds, a CTA for each live split in
# order: the work list): a padded, ragged batch, each split at least the fewest whole tiles with
# which the batch has at most B x work_splits live splits, so the long sequences take up to
# num_splits splits and the short ones fewer (plans 8by1 and 40by3: the share's search takes 7 and
# 3 counts); every kernel, rs_attention_kernel by its combine (no cluster) and by the tail-sharing
# claims.
BY_WORK_LENS = (0, 9000, 1, 0, 300, 65, 4096, 0, 2500, 129)
BY_WORK_CASES = (("bf16", "bfloat16", "mma", 1, 12), ("bf16", "bfloat16", "mma", 2, 12), ("bf16", "bfloat16", "wide", 1, 64),
                 ("fp8", "float8_e4m3fn", "auto", 1, 12), ("fp8", "bfloat16", "auto", 1, 12),
                 ("fp8", "float8_e4m3fn", "rs", 1, 12), ("fp8_ds_mla", "bfloat16", "auto", 1, 12),
                 ("fp8_ds_mla", "bfloat16", "mma", 1, 12))


@pytest.mark.cuda
@pytest.mark.parametrize("plan", ((16, 4), (8, 1), (4, 4), (40, 3)), ids=lambda p: f"{p[0]}by{p[1]}")
@pytest.mark.parametrize("fmt,q_dtype,kernel,q_tokens,heads", BY_WORK_CASES)
def test_cuda_splits_by_work(monkeypatch, fmt, q_dtype, kernel, q_tokens, heads, plan):
    args, kw = make_case(fmt, q_dtype, lens=BY_WORK_LENS, q_tokens=q_tokens, heads=heads, block_size=64, seed=16)
    kw = dict(kw, kernel=kernel)
    monkeypatch.setattr(jax_kimi_mla.ops, "split_plan", lambda *a, **k: plan)
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), run(reference.mla_decode_attention, args, kw, "cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,q_dtype,kernel", (("bf16", "bfloat16", "mma"), ("fp8_ds_mla", "bfloat16", "rs-combine")))
def test_cuda_splits_by_work_cut_a_uniform_batch_as_by_count(monkeypatch, fmt, q_dtype, kernel):
    """Sequences of one length: 16 splits by work of 4 on average are the 4 splits by count, bit
    for bit (the work list's CTAs take them in order)."""
    args, kw = make_case(fmt, q_dtype, lens=(5000,) * 6, heads=12, block_size=64, seed=17)
    kw = dict(kw, kernel=kernel, balance_splits=False)
    by_count = poisoned_run(args, dict(kw, num_splits=4), "cuda")
    monkeypatch.setattr(jax_kimi_mla.ops, "split_plan", lambda *a, **k: (16, 4))
    for got, want in zip(poisoned_run(args, kw, "cuda"), by_count, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,q_dtype", (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn"), ("fp8_ds_mla", "bfloat16")))
def test_cuda_one_wave_batch_splits_by_work(fmt, q_dtype):
    """A batch of one CTA an SM (the GPU's own SM count, the plan not patched): split_plan shares
    out two splits a sequence by work; padded and ragged lengths agree with the reference."""
    batch = jax_kimi_mla._device.sm_count()
    lens = np.random.default_rng(19).integers(0, 4097, batch)
    lens[::5], lens[1] = 0, 4096  # padding rows; tables 4096 tokens wide
    args, kw = make_case(fmt, q_dtype, lens=tuple(int(n) for n in lens), heads=12, block_size=64, seed=19)
    rows_per_cta = jax_kimi_mla.ops._decode_rows_per_cta(args["kv_cache"].dtype, batch, 1, 12)
    assert jax_kimi_mla.ops.split_plan(batch, 12, 4096, batch, rows_per_cta) == (8, 2)
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), run(reference.mla_decode_attention, args, kw, "cpu"))


# Past 32 sequences by work, combine_kernel takes the split share that the attention kernel stored
# in the scratch (DecodeAttention::stored_share) instead of searching it again. Two batches of the
# same shapes whose shares differ (plan 16 by 2: 6 and 20 tiles) run back to back: a share left in
# the scratch by the call before would merge the wrong splits.
STORED_SHARE_LENS = (0, 2500, 1, 0, 300, 65, 1800, 0, 700, 129) * 4


@pytest.mark.cuda
@pytest.mark.parametrize("programmatic", (True, False), ids=("programmatic", "plain"))
@pytest.mark.parametrize("fmt,q_dtype,kernel", (("bf16", "bfloat16", "mma"), ("fp8", "float8_e4m3fn", "rs"),
                                                ("fp8_ds_mla", "bfloat16", "auto"), ("fp8_ds_mla", "bfloat16", "mma")))
def test_cuda_combine_takes_the_stored_share_past_32_sequences(monkeypatch, fmt, q_dtype, kernel, programmatic):
    monkeypatch.setattr(jax_kimi_mla.ops, "split_plan", lambda *a, **k: (16, 2))
    batches = []
    for lens in (STORED_SHARE_LENS, tuple(2500 if n else 0 for n in STORED_SHARE_LENS)):
        args, kw = make_case(fmt, q_dtype, lens=lens, heads=12, block_size=64, seed=20)
        kw = dict(kw, kernel=kernel, programmatic_combine=programmatic)
        batches.append((args, kw, run(reference.mla_decode_attention, args, kw, "cpu")))
    (args_a, kw_a, want_a), (args_b, kw_b, want_b) = batches
    assert_close(fmt, q_dtype, poisoned_run(args_a, kw_a, "cuda"), want_a)
    assert_close(fmt, q_dtype, run(jax_kimi_mla.mla_decode_attention, args_b, kw_b, "cuda"), want_b)
    assert_close(fmt, q_dtype, run(jax_kimi_mla.mla_decode_attention, args_a, kw_a, "cuda"), want_a)


# A uniform batch by work takes a path of its own (work_place: the share is the lower bound, a
# CTA's place a division, no scan): sequences of one length, none (all padding) and one token; a
# plan with room for no more splits a sequence than the average (4 by 4: at most num_splits).
@pytest.mark.cuda
@pytest.mark.parametrize("plan", ((16, 4), (4, 4)), ids=lambda p: f"{p[0]}by{p[1]}")
@pytest.mark.parametrize("lens", ((5000,) * 6, (0,) * 4, (1,) * 3), ids=("5000x6", "0x4", "1x3"))
@pytest.mark.parametrize("fmt,q_dtype,kernel", (("bf16", "bfloat16", "mma"), ("fp8", "float8_e4m3fn", "rs"),
                                                ("fp8_ds_mla", "bfloat16", "auto")))
def test_cuda_splits_by_work_of_uniform_batches(monkeypatch, fmt, q_dtype, kernel, lens, plan):
    args, kw = make_case(fmt, q_dtype, lens=lens, heads=12, block_size=64, seed=18)
    kw = dict(kw, kernel=kernel)
    monkeypatch.setattr(jax_kimi_mla.ops, "split_plan", lambda *a, **k: plan)
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), run(reference.mla_decode_attention, args, kw, "cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["auto", "rs"])
def test_cuda_ds_mla_scales_far_apart(kernel):
    """fp8_ds_mla rows whose magnitudes span 2^16 (tile scales up to 2^9, where p x scale would
    overflow f16 if the kernel did not keep it in range) and sequences of several tiles. out is
    compared in units of the largest rows (2^16): its error is the probabilities' rounding times
    the values' magnitude, which cancelling signs do not shrink as they shrink out."""
    args, kw = make_case("fp8_ds_mla", "bfloat16", lens=(1, 700, 3000), heads=16, block_size=64, seed=6,
                         row_exponents=(0, 16))
    kw = dict(kw, kernel=kernel)
    (out, lse), (ref_out, ref_lse) = poisoned_run(args, kw, "cuda"), run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close("fp8_ds_mla", "bfloat16", (out * 2.0**-16, lse), (ref_out * 2.0**-16, ref_lse))


def gpu_kernel_names(fn) -> set[str]:
    """The names of the GPU kernels that fn() runs (from a profiler trace's stream lines)."""
    with tempfile.TemporaryDirectory(prefix="jkm_kernels_") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(fn())
        finally:
            jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(str(next(Path(trace_dir).rglob("*.xplane.pb"))))
    return {
        event.name
        for plane in data.planes
        if plane.name.startswith("/device:GPU:")
        for line in plane.lines
        if line.name.startswith("Stream")
        for event in line.events
    }


# Many heads over a 16-bit cache at S_q = 1: from WIDE_MIN_ROWS heads an sm_90 GPU takes the
# 64-row wgmma kernel (wide_attention_kernel) by default; "mma" asks for the 16-row one, "wide"
# for the 64-row one with fewer heads too. Rows that are not a multiple of 64 (padding rows), any
# block size, split counts, a NaN in a length.
WIDE_CASES = {
    "64 heads": dict(lens=(0, 1, 63, 64, 65, 700), heads=64, block_size=16),
    "24 heads": dict(lens=(0, 1, 63, 64, 65, 700), heads=24, block_size=64),
    "32 heads, 8 sequences": dict(lens=(0, 1, 63, 64, 65, 700, 300, 129), heads=32, block_size=64),
    "32 heads, 6 sequences": dict(lens=(0, 1, 63, 64, 65, 700), heads=32, block_size=64),
    "96 heads": dict(lens=(300, 5, 129), heads=96, block_size=64),
    "128 heads, long": dict(lens=(3000, 1, 2049), heads=128, block_size=128),
    "80 heads, block 48": dict(lens=(0, 145, 300), heads=80, block_size=48),
    "one split": dict(lens=(700, 64, 0, 129), heads=64, block_size=32, num_splits=1),
    "many splits": dict(lens=(700, 64, 0, 129), heads=64, block_size=32, num_splits=40),
    "nan": dict(lens=(40, 40), heads=64, nan_token=(0, 35)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", WIDE_CASES)
@pytest.mark.parametrize("kernel", ("auto", "mma", "wide"))
@pytest.mark.parametrize("q_dtype", ("bfloat16", "float16"))
def test_cuda_many_heads(q_dtype, kernel, case):
    spec = dict(WIDE_CASES[case])
    splits = {"num_splits": spec.pop("num_splits")} if "num_splits" in spec else {}
    args, kw = make_case("bf16", q_dtype, seed=6, **spec)
    kw = dict(kw, kernel=kernel)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close("bf16", q_dtype, poisoned_run(args, dict(kw, **splits), "cuda"), want)
    if case == "nan":
        assert np.isnan(want[1][0]).all() and np.isfinite(want[1][1]).all()
    if case in ("64 heads", "24 heads", "32 heads, 8 sequences", "32 heads, 6 sequences"):  # the kernel the call took
        names = gpu_kernel_names(lambda: run(jax_kimi_mla.mla_decode_attention, args, kw, "cuda"))
        if not names:  # the values were checked; only the trace is missing
            pytest.skip("no GPU kernels in the profiler's trace (compute-sanitizer holds the profiling interface)")
        wide = any("wide_attention_kernel" in n for n in names)
        applies = jax_kimi_mla.ops.wide_kernel_applies(jnp.bfloat16, len(spec["lens"]), 1, spec["heads"], kernel)
        assert wide == (applies and jax_kimi_mla._device.gpu_is_sm90()), sorted(names)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits,rs", ((64, False), (16, True), (1, True)))
@pytest.mark.parametrize("fmt,q_dtype", (("fp8_ds_mla", "bfloat16"), ("fp8", "float8_e4m3fn")))
def test_cuda_1byte_kernel_by_split_length(fmt, q_dtype, num_splits, rs):
    """fp8_ds_mla, and the plain fp8 cache under an fp8 mqa_q, at S_q = 1 take rs_attention_kernel
    on sm_90 by default where a split of the table's length holds at least 4 tiles (4096 tokens: 1
    tile in 64 splits, 4 in 16), and their other kernels below that; all agree with the reference."""
    args, kw = make_case(fmt, q_dtype, lens=(4096, 1000), heads=12, block_size=64, seed=8)
    kw = dict(kw, num_splits=num_splits)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), want)
    names = gpu_kernel_names(lambda: run(jax_kimi_mla.mla_decode_attention, args, kw, "cuda"))
    if not names:  # the values were checked; only the trace is missing
        pytest.skip("no GPU kernels in the profiler's trace (compute-sanitizer holds the profiling interface)")
    taken = any("rs_attention_kernel" in n for n in names)
    assert taken == (rs and jax_kimi_mla._device.gpu_is_sm90()), sorted(names)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", (12, 20))
@pytest.mark.parametrize("num_splits", (2, 3, 5, 8))
@pytest.mark.parametrize("kernel", ("rs", "rs-combine"))
@pytest.mark.parametrize("fmt,q_dtype", (("fp8_ds_mla", "bfloat16"), ("fp8", "float8_e4m3fn")))
def test_cuda_rs_splits_merged_in_a_cluster(fmt, q_dtype, kernel, num_splits, heads):
    """rs_attention_kernel's 2-8 splits of a sequence run as one thread block cluster and merge
    there: combine_kernel is not launched. "rs-combine" merges the same splits in combine_kernel.
    Ragged lengths leave splits past the length (0, 1 and 63 tokens: splits that only stage empty
    rows), a NaN inside one length reaches that sequence alone, and 20 heads add a second row group
    (4 real rows, 12 padding)."""
    args, kw = make_case(fmt, q_dtype, lens=(0, 1, 63, 700, 3000, 129), heads=heads, block_size=64,
                         seed=13, nan_token=(3, 650))
    kw = dict(kw, num_splits=num_splits, kernel=kernel)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert np.isnan(want[1][3]).all() and np.isfinite(want[1][4]).all()
    assert_close(fmt, q_dtype, poisoned_run(args, kw, "cuda"), want)
    names = gpu_kernel_names(lambda: run(jax_kimi_mla.mla_decode_attention, args, kw, "cuda"))
    if not names:  # the values were checked; only the trace is missing
        pytest.skip("no GPU kernels in the profiler's trace (compute-sanitizer holds the profiling interface)")
    if not jax_kimi_mla._device.gpu_is_sm90():
        return
    assert any("rs_attention_kernel" in n for n in names), sorted(names)
    assert any("combine_kernel" in n for n in names) == (kernel == "rs-combine"), sorted(names)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("fmt,q_dtype,kernel", (("bf16", "bfloat16", "mma"), ("bf16", "bfloat16", "wide"),
                                                 ("fp8", "float8_e4m3fn", "auto"), ("fp8_ds_mla", "bfloat16", "auto")))
def test_cuda_more_sequences_than_grid_z(fmt, q_dtype, kernel, num_splits):
    """B = 65535 + 45: attention_kernel, wide_attention_kernel and fp8_attention_kernel (the kernels
    of such a batch) take the sequences past grid y's 65535 as a second wave of splits in grid z,
    and combine_kernel loops over them. The batch repeats 40 sequences; every row of it is checked
    against the reference of those 40 (poisoned first)."""
    args, kw = make_case(fmt, q_dtype, lens=(0, 1, 63, 64, 65, 7, 200, 130) * 5, heads=4, block_size=64, seed=30)
    kw = dict(kw, num_splits=num_splits, kernel=kernel)
    small_out, small_lse = run(reference.mla_decode_attention, args, kw, "cpu")
    B = 65535 + 45
    pick = np.arange(B) % len(args["context_lens"])
    big = dict(args, mqa_q=args["mqa_q"][pick], block_tables=args["block_tables"][pick], context_lens=args["context_lens"][pick])
    assert_close(fmt, q_dtype, poisoned_run(big, kw, "cuda"), (small_out[pick], small_lse[pick]))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,q_dtype", (("bf16", "bfloat16"), ("fp8_ds_mla", "bfloat16")))
@pytest.mark.parametrize("q_tokens,num_splits", ((1, 11), (2, 5), (4, 3)), ids=("rows192", "rows384", "rows768"))
def test_cuda_combine_of_many_rows(fmt, q_dtype, q_tokens, num_splits):
    """B x S_q x H = 192, 384 and 768 rows, more than the SMs of the GPUs the kernel runs on (132 on
    an H100/H200): the combine's 8-warp CTAs (two a SM; 11 splits, so a warp merges two), its 4-warp
    ones (four a SM) and its 2-warp ones (the other tests take its 16-warp ones)."""
    lens = (0, 1, 63, 64, 65, 300, 511, 2, 129, 200, 77, 400)
    args, kw = make_case(fmt, q_dtype, lens=lens, q_tokens=q_tokens, heads=16, block_size=32, seed=11)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close(fmt, q_dtype, poisoned_run(args, dict(kw, num_splits=num_splits), "cuda"), want)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", (1, 3, 6), ids=lambda b: f"B{b}")
def test_cuda_combine_of_few_rows(batch):
    """16, 48 and 96 rows: on an H100/H200 (132 SMs) the combine then takes each row's columns in
    4, 2 and 1 CTAs (each CTA merges the same weights for its columns; the first writes lse), a
    row's splits in one round; ragged lengths, so that rows merge different counts of live splits."""
    lens = (700, 0, 129, 640, 1, 511)[:batch]
    args, kw = make_case("bf16", "bfloat16", lens=lens, heads=16, block_size=64, seed=12 + batch)
    want = run(reference.mla_decode_attention, args, kw, "cpu")
    assert_close("bf16", "bfloat16", poisoned_run(args, dict(kw, num_splits=11), "cuda"), want)
