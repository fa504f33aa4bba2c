"""The C++ handlers' own checks (docs/ABI.md: "A malformed call ... returns an FFI error"): a
hand-written jax.ffi.ffi_call that bypasses the Python checks fails with the handler's message
instead of touching memory. On the CPU handlers (the same checks run on the GPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kimi_mla import _ffi
from jax_kimi_mla.formats import EPILOGUES

BF16 = jnp.bfloat16
NO_SCALE = np.zeros((0,), np.float32)


def raw_call(op, operands, results, **attrs):
    fn = jax.ffi.ffi_call(_ffi.target_name(op), [jax.ShapeDtypeStruct(s, d) for s, d in results])
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.block_until_ready(fn(*operands, **attrs))


def attention(q_shape=(2, 3, 576), q_dtype=BF16, cache=((4, 2, 576), BF16), tables=(2, 2), lens=(2,), out=None, lse=None,
              partials=0, q_tokens=1, num_splits=1, scales=(NO_SCALE, NO_SCALE), **launch):
    """A raw call; ``num_splits=None`` leaves that attribute out, ``launch`` adds the optional ones."""
    B = q_shape[0]
    operands = [np.zeros(q_shape, q_dtype), np.zeros(*cache), np.zeros(tables, np.int32), np.ones(lens, np.int32), *scales]
    results = [(out or (B, q_shape[1], 512), BF16), (lse or (B, q_shape[1]), jnp.float32), ((partials,), jnp.float32)]
    attrs = dict(softmax_scale=np.float32(0.1), q_tokens=np.int64(q_tokens), **launch)
    if num_splits is not None:
        attrs["num_splits"] = np.int64(num_splits)
    return raw_call("mla_decode_attention", operands, results, **attrs)


def test_a_well_formed_raw_call_runs():
    out, lse, _ = attention()
    assert out.shape == (2, 3, 512) and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q_shape=(2, 3, 512)), "q must be [B * S_q, H, 576]"),
        (dict(q_tokens=5), "q_tokens (S_q) must be 1..4"),
        (dict(q_tokens=3), "q must be [B * S_q, H, 576]"),  # 2 rows do not split into S_q = 3
        (dict(cache=((4, 2, 560), BF16)), "kv_cache rows must hold an entry and be a multiple of 16 bytes"),
        (dict(cache=((4, 2, 576), jnp.float16)), "a bf16/fp16 kv_cache must have the dtype of q"),
        (dict(cache=((4, 2, 576), jnp.float8_e4m3fn)), "cache_scale_inv must be float32 [1] exactly for the plain fp8 cache, else [0]"),
        (dict(tables=(3, 2)), "block_tables must be int32/int64 [B, max_blocks]"),
        (dict(lens=(3,)), "context_lens must be int32/int64 [B]"),
        (dict(out=(2, 3, 500)), "out must be [B * S_q, H, 512] in the output dtype"),
        (dict(lse=(2, 4)), "lse must be float32 [B * S_q, H]"),
        (dict(num_splits=2), "partials must be float32 [num_splits * B * S_q * H * 517] (or * 513: no balancing; empty for one split)"),
        (dict(num_splits=2, partials=2 * 2 * 3 * 515), "partials must be float32 [num_splits * B * S_q * H * 517] (or * 513: no balancing; empty for one split)"),
        (dict(num_splits=0), "num_splits must be 1..1024"),
        (dict(num_splits=None), "the attributes softmax_scale (f32), q_tokens and num_splits (i64) are required"),
        (dict(kernel="fast"), 'kernel must be the string "auto", "mma", "rs", "rs-combine" or "wide"'),
        (dict(programmatic_combine=np.int64(0)), "programmatic_combine must be a bool"),
        (dict(balance_splits=np.int64(0)), "balance_splits must be a bool"),
        (dict(balance_splits="false"), "balance_splits must be a bool"),
        (dict(work_splits=np.float32(1)), "work_splits must be an i64"),
        (dict(work_splits=np.int64(-1)), "work_splits must be 0..num_splits"),
        (dict(work_splits=np.int64(2)), "work_splits must be 0..num_splits"),  # one split
    ],
)
def test_malformed_attention_calls_fail_with_the_handlers_message(kwargs, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"jax_kimi_mla mla_decode_attention: {re.escape(message)}"):
        attention(**kwargs)


@pytest.mark.parametrize("launch", [{}, dict(balance_splits=False), dict(balance_splits=True), dict(work_splits=np.int64(2))])
@pytest.mark.parametrize("row_floats", [517, 513])
def test_split_scratch_with_or_without_the_claims(row_floats, launch):
    """The split-KV scratch of 517 floats a partial row (16 bytes of claims, 512 outputs, an lse),
    or of 513 (programs exported before the claims: no balancing), with or without balance_splits
    or splits by work: accepted, and on the CPU the one-split call's result (the CPU handler
    ignores the splits)."""
    rng = np.random.default_rng(7)
    B, H, splits = 2, 3, 3
    operands = [rng.standard_normal((B, H, 576)).astype(np.float32).astype(BF16), rng.standard_normal((4, 16, 576)).astype(np.float32).astype(BF16),
                np.array([[0, 1], [2, 3]], np.int32), np.array([20, 32], np.int32), NO_SCALE, NO_SCALE]

    def call(partials, num_splits, **attrs):
        results = [((B, H, 512), BF16), ((B, H), jnp.float32), ((partials,), jnp.float32)]
        out, lse, _ = raw_call("mla_decode_attention", operands, results, softmax_scale=np.float32(0.1), q_tokens=np.int64(1),
                               num_splits=np.int64(num_splits), **attrs)
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    want = call(0, 1)
    got = call(splits * B * H * row_floats, splits, **launch)
    assert np.isfinite(want[1]).all()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "operands, out, message",
    [
        ([np.zeros((4, 2, 576), BF16), np.zeros((2, 2), np.int32), np.zeros(3, np.int32), NO_SCALE], (8, 576), "context_lens must be int32/int64 [B]"),
        ([np.zeros((4, 2, 576), BF16), np.zeros((2, 2), np.float32), np.zeros(2, np.int32), NO_SCALE], (8, 576), "block_tables must be int32/int64 [B, max_blocks]"),
        ([np.zeros((4, 2, 656), np.uint8), np.zeros((2, 2), np.int32), np.zeros(2, np.int32), NO_SCALE], (8, 512), "out must be [num_tokens, 576]"),
        ([np.zeros((4, 2, 576), np.float32), np.zeros((2, 2), np.int32), np.zeros(2, np.int32), NO_SCALE], (8, 576), "kv_cache must be bfloat16, float16, float8_e4m3fn or uint8"),
    ],
)
def test_malformed_gather_calls_fail_with_the_handlers_message(operands, out, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"jax_kimi_mla gather_mla_cache: {re.escape(message)}"):
        raw_call("gather_mla_cache", operands, [(out, BF16)])


def test_malformed_epilogue_call_fails_with_the_handlers_message():
    """decode_kv_cache with kv_c_normed of the wrong width (operand 2)."""
    operands = [np.zeros((2, 3, 512), BF16), np.zeros((2, 3, 64), BF16), np.zeros((2, 500), BF16), np.zeros((2, 64), BF16),
                np.zeros((4, 2, 576), BF16), np.zeros(2, np.int32), np.zeros((0,), np.int32), np.zeros((0, 64), np.float32)]
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_kimi_mla decode_kv_cache: kv_c_normed must be"):
        raw_call("decode_kv_cache", operands, [((2, 3, 576), BF16), ((4, 2, 576), BF16)])


@pytest.mark.parametrize("target", [e.target for e in EPILOGUES.values()])
def test_every_epilogue_handler_names_its_target(target):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"jax_kimi_mla {target}: wrong number of operands"):
        raw_call(target, [np.zeros(2, np.int32)], [((2,), np.int32)])


def _decode_kv_cache(cache_shape=(4, 2, 576), rope=False, **attrs):
    """A raw decode_kv_cache call (B = 2, H = 3), with RoPE operands when ``rope``."""
    rng = np.random.default_rng(0)
    act = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(BF16)  # noqa: E731
    positions, table = (np.array([1, 2], np.int32), np.ones((4, 64), np.float32)) if rope else (np.zeros((0,), np.int32), np.zeros((0, 64), np.float32))
    operands = [act(2, 3, 512), act(2, 3, 64), act(2, 512), act(2, 64), act(*cache_shape), np.array([0, 5], np.int32), positions, table]
    return raw_call("decode_kv_cache", operands, [((2, 3, 576), BF16), (cache_shape, BF16)], **attrs)


@pytest.mark.parametrize("style", ["NeoX", ""])
def test_epilogue_handler_rejects_an_unknown_rope_style(style):
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape('jax_kimi_mla decode_kv_cache: rope_style must be the string "gptj" or "neox"')):
        _decode_kv_cache(rope=True, rope_style=style)


def test_epilogue_handler_rejects_misaligned_cache_rows():
    with pytest.raises(jax.errors.JaxRuntimeError, match="jax_kimi_mla decode_kv_cache: kv_cache rows must hold an entry and be a multiple of 16 bytes"):
        _decode_kv_cache(cache_shape=(4, 2, 580))


def test_epilogue_handler_writes_padded_rows_and_reads_the_style():
    mqa_q, cache = _decode_kv_cache(cache_shape=(4, 2, 640), rope=True, rope_style="neox")
    assert cache.shape == (4, 2, 640) and np.isfinite(np.asarray(mqa_q, np.float32)).all()


def test_a_raw_attention_call_reads_padded_rows_on_the_cpu():
    out, lse, _ = attention(cache=((4, 2, 640), BF16))
    assert out.shape == (2, 3, 512) and np.isfinite(np.asarray(lse)).all()
