"""Padded cache rows: caches whose last dimension is wider than the entry (576 elements for the
bf16/fp16 and fp8 caches, 656 bytes for fp8_ds_mla), rows a multiple of 16 bytes. The epilogues
write the entry into the first columns and leave the padding bit-for-bit as it was; every reader
(mla_decode_attention, gather_mla_cache, ds_mla_dequantize) reads the first columns. Other widths
are trace-time errors naming kv_cache (or row_width)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_decode_attention as attn
from _util import (
    FORMATS,
    Case,
    assert_bits_equal,
    cache_kind,
    check_against_reference,
    check_untouched_rows,
    invoke,
    make_case,
    put,
    sentinel,
    to_numpy,
    x64_if,
)

import jax_kimi_mla
from jax_kimi_mla import layer as ml
from jax_kimi_mla import reference

# Padded widths per cache kind (elements of the cache dtype): one 16-byte step past the entry,
# and tpu-inference's 640 (the ds_mla entry pads to 672 and 768).
PADDED = {"act": (584, 640), "fp8": (592, 640), "ds_mla": (672, 768)}
ENTRY_WIDTH = {"act": 576, "fp8": 576, "ds_mla": 656}
LAYER_KIND = {"bf16": "act", "fp8": "fp8", "fp8_ds_mla": "ds_mla"}  # layer format -> cache kind


@functools.cache
def jitted(impl, fmt, style="gptj"):
    return jax.jit(lambda a: invoke(impl, fmt, dict(a, rope_style=style)))


def padded_case(fmt, width, rope, seed, act="bf16", index="int32"):
    """make_case with its sentinel cache widened to ``width`` (random bits in the padding too)."""
    a = make_case(Case(fmt, 9, 3, act, index, rope, seed=seed))
    narrow = a["kv_cache"]
    wide = sentinel(np.random.default_rng(seed + 100), (*narrow.shape[:-1], width), narrow.dtype)
    wide[..., : narrow.shape[-1]] = narrow
    return dict(a, kv_cache=wide)


def entry_columns(outputs, entry_width):
    """The outputs with the cache cut to its entry columns (the padding is checked on its own)."""
    return (*outputs[:-1], np.ascontiguousarray(np.asarray(outputs[-1])[..., :entry_width]))


def check_padding_untouched(got, pristine, entry_width, what):
    assert_bits_equal(np.asarray(got)[..., entry_width:], pristine[..., entry_width:], f"{what}: the padding columns")


EPILOGUE_CASES = [
    pytest.param(fmt, width, rope, id=f"{fmt}-W{width}-{'rope' if rope else 'nope'}")
    for fmt in FORMATS
    for width in PADDED[cache_kind(fmt)]
    for rope in (False, True)
]


@pytest.mark.parametrize("fmt,width,rope", EPILOGUE_CASES)
def test_epilogue_writes_the_first_columns(backend, fmt, width, rope):
    """Against the reference (which pads the same way), and against the same call on the
    unpadded cache: the entry columns equal bit for bit; the padding and every row no valid slot
    addresses keep their bits."""
    a = padded_case(fmt, width, rope, seed=width)
    entry = ENTRY_WIDTH[cache_kind(fmt)]
    pristine = a["kv_cache"].copy()
    got = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, backend)))
    want = to_numpy(jitted(reference, fmt)(put(a, "cpu")))
    check_against_reference(fmt, entry_columns(got, entry), entry_columns(want, entry), rope, a["slot_mapping"])
    check_untouched_rows(got[-1], pristine, a["slot_mapping"])
    check_padding_untouched(got[-1], pristine, entry, f"{fmt} kv_cache")
    check_padding_untouched(want[-1], pristine, entry, f"reference {fmt} kv_cache")
    unpadded = to_numpy(jitted(jax_kimi_mla, fmt)(put(dict(a, kv_cache=np.ascontiguousarray(pristine[..., :entry])), backend)))
    for g, u in zip(got[:-1], unpadded[:-1]):
        assert_bits_equal(g, u, f"{fmt}: outputs with a padded vs an unpadded cache")
    assert_bits_equal(got[-1][..., :entry], unpadded[-1], f"{fmt}: the entries in padded vs unpadded rows")


@pytest.mark.parametrize("fmt", FORMATS)
def test_neox_int64_fp16_into_padded_rows(backend, fmt):
    width = PADDED[cache_kind(fmt)][1]
    a = padded_case(fmt, width, True, seed=3, act="fp16", index="int64")
    pristine = a["kv_cache"].copy()
    with x64_if("int64"):
        got = to_numpy(jitted(jax_kimi_mla, fmt, "neox")(put(a, backend)))
        want = to_numpy(jitted(reference, fmt, "neox")(put(a, "cpu")))
    entry = ENTRY_WIDTH[cache_kind(fmt)]
    check_against_reference(fmt, entry_columns(got, entry), entry_columns(want, entry), True, a["slot_mapping"])
    check_untouched_rows(got[-1], pristine, a["slot_mapping"])
    check_padding_untouched(got[-1], pristine, entry, fmt)


@pytest.mark.parametrize("fmt", ["prefill_bf16", "decode_fp8_ds_mla"])
def test_donated_padded_cache_is_updated_in_place(backend, fmt):
    a = padded_case(fmt, PADDED[cache_kind(fmt)][1], True, seed=4)
    pristine = a["kv_cache"].copy()
    names = [n for n in a if n != "kv_cache"]

    def step(cache, rest):
        return invoke(jax_kimi_mla, fmt, dict(rest, kv_cache=cache))

    cache = jnp.copy(put(a["kv_cache"], backend))
    pointer = cache.unsafe_buffer_pointer()
    got = jax.jit(step, donate_argnums=0)(cache, put({n: a[n] for n in names}, backend))
    assert got[-1].unsafe_buffer_pointer() == pointer, "the padded cache was not updated in place"
    check_padding_untouched(got[-1], pristine, ENTRY_WIDTH[cache_kind(fmt)], fmt)
    check_untouched_rows(np.asarray(got[-1]), pristine, a["slot_mapping"])


# ---------------------------------------------------------------- readers


def _pad(cache, width, seed):
    """cache [N, bs, entry] widened to ``width`` with NaN-patterned garbage (0xFF bytes) and
    random bits in the padding: a reader that looks there is caught."""
    pad = sentinel(np.random.default_rng(seed), (*cache.shape[:-1], width - cache.shape[-1]), cache.dtype)
    pad.view(np.uint8)[..., ::3] = 0xFF
    return np.concatenate([cache, pad], -1)


READER_CASES = [
    pytest.param(fmt, q_dtype, width, id=f"{fmt}-{q_dtype}-W{width}")
    for fmt, q_dtype in attn.FORMATS
    for width in PADDED[LAYER_KIND[fmt]][:1]
] + [pytest.param("fp8_ds_mla", "bfloat16", 768, id="fp8_ds_mla-bfloat16-W768"), pytest.param("bf16", "bfloat16", 640, id="bf16-bfloat16-W640")]


@pytest.mark.parametrize("fmt,q_dtype,width", READER_CASES)
def test_decode_attention_reads_padded_rows(backend, fmt, q_dtype, width):
    """The same results as over the unpadded cache: bit for bit on one backend."""
    args, kw = attn.make_case(fmt, q_dtype, lens=(0, 1, 17, 40), q_tokens=2, seed=6)
    wide = dict(args, kv_cache=_pad(args["kv_cache"], width, seed=7))
    narrow_out = attn.run(jax_kimi_mla.mla_decode_attention, args, kw, backend)
    wide_out = attn.poisoned_run(wide, kw, backend)
    for g, w, what in zip(wide_out, narrow_out, ("out", "lse")):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: padded vs unpadded cache")
    ref = attn.run(reference.mla_decode_attention, wide, kw, "cpu")
    attn.assert_close(fmt, q_dtype, wide_out, ref)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "fmt,q_dtype,width",
    [("fp8_ds_mla", "bfloat16", 672), ("fp8_ds_mla", "bfloat16", 768), ("fp8", "float8_e4m3fn", 640), ("fp8", "float8_e4m3fn", 768)],
)
def test_rs_attention_kernel_reads_padded_rows(fmt, q_dtype, width):
    """The 1-byte formats at S_q = 1 with splits of several tiles (rs_attention_kernel on sm_90,
    which copies a padded fp8_ds_mla row by row and lands plain fp8 by tensor-map boxes over the
    row stride): the same bits as over the unpadded cache."""
    args, kw = attn.make_case(fmt, q_dtype, lens=(700, 1, 2049), heads=16, block_size=64, seed=9)
    kw = dict(kw, num_splits=2)
    wide = dict(args, kv_cache=_pad(args["kv_cache"], width, seed=10))
    narrow_out = attn.run(jax_kimi_mla.mla_decode_attention, args, kw, "cuda")
    wide_out = attn.poisoned_run(wide, kw, "cuda")
    for g, w, what in zip(wide_out, narrow_out, ("out", "lse")):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: padded vs unpadded cache")
    attn.assert_close(fmt, q_dtype, wide_out, attn.run(reference.mla_decode_attention, wide, kw, "cpu"))


def _gather_kwargs(kw):
    return {k: v for k, v in kw.items() if k in ("ds_mla", "cache_scale_inv")}


@pytest.mark.parametrize("fmt,q_dtype,width", READER_CASES)
def test_gather_reads_padded_rows(backend, fmt, q_dtype, width):
    args, kw = attn.make_case(fmt, q_dtype, lens=(0, 1, 17, 40), seed=8)
    kw = _gather_kwargs(kw)
    wide = _pad(args["kv_cache"], width, seed=9)
    tables, lens = args["block_tables"], args["context_lens"]

    def gather(impl, cache, dev):
        arrays = {k: v for k, v in kw.items() if isinstance(v, np.floating)}
        static = {k: v for k, v in kw.items() if k not in arrays}
        step = jax.jit(lambda c, t, n, s: impl.gather_mla_cache(c, t, n, num_tokens=96, **s, **static))
        return np.asarray(step(*jax.device_put((cache, tables, lens, arrays), jax.devices(dev)[0])))

    got = gather(jax_kimi_mla, wide, backend)
    assert_bits_equal(got, gather(jax_kimi_mla, args["kv_cache"], backend), "gather: padded vs unpadded cache")
    assert_bits_equal(gather(reference, wide, "cpu"), gather(reference, args["kv_cache"], "cpu"), "reference gather")
    assert_bits_equal(got, gather(reference, wide, "cpu"), "gather vs its reference")


def test_ds_mla_dequantize_reads_padded_rows():
    rng = np.random.default_rng(10)
    entries = np.asarray(jax_kimi_mla.numerics.ds_mla_encode(jnp.asarray(rng.standard_normal((3, 5, 512)).reshape(15, 512), jnp.float32),
                                                             jnp.asarray(rng.standard_normal((15, 64)), jnp.bfloat16))).reshape(3, 5, 656)
    wide = _pad(entries, 672, seed=11)
    for got, want in zip(jax_kimi_mla.ds_mla_dequantize(wide), jax_kimi_mla.ds_mla_dequantize(entries)):
        assert_bits_equal(np.asarray(got), np.asarray(want), "ds_mla_dequantize: padded vs unpadded")


# ---------------------------------------------------------------- errors


def _width_error(call):
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_misaligned_padding_is_a_trace_time_error(fmt):
    kind = cache_kind(fmt)
    entry = ENTRY_WIDTH[kind]
    bad = entry + (4 if kind == "act" else 8)  # wider, but not a multiple of 16 bytes
    a = padded_case(fmt, bad, True, seed=12)
    messages = {_width_error(lambda impl=impl: jax.jit(lambda a: invoke(impl, fmt, a)).trace(put(a, "cpu"))) for impl in (jax_kimi_mla, reference)}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith(f"kv_cache: rows wider than the {entry}-element entry"), message
    assert "multiple of 16 bytes" in message and f"{tuple(a['kv_cache'].shape)}" in message


@pytest.mark.parametrize("reader", ["mla_decode_attention", "gather_mla_cache"])
def test_readers_reject_misaligned_padding(reader):
    cache = np.zeros((2, 4, 580), jnp.bfloat16)
    tables, lens = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    for impl in (jax_kimi_mla, reference):
        if reader == "mla_decode_attention":
            call = functools.partial(impl.mla_decode_attention, np.zeros((1, 2, 576), jnp.bfloat16), cache, tables, lens, softmax_scale=0.1)
        else:
            call = functools.partial(impl.gather_mla_cache, cache, tables, lens)
        assert _width_error(call).startswith("kv_cache: rows wider than the 576-element entry")


def test_ds_mla_dequantize_rejects_misaligned_padding():
    with pytest.raises(ValueError, match="entries must be uint8"):
        jax_kimi_mla.ds_mla_dequantize(np.zeros((2, 660), np.uint8))


@pytest.mark.parametrize("row_width, match", [(570, "row_width must be None or an int >= 576"), (580, "row_width: rows wider"), (600.0, "row_width must be")])
def test_allocate_cache_row_width_errors(row_width, match):
    with pytest.raises(ValueError, match=match):
        ml.allocate_cache(ml.MLAConfig(), 2, 4, row_width=row_width)


@pytest.mark.parametrize("fmt, width", [("bf16", 640), ("fp8", 640), ("fp8_ds_mla", 672)])
def test_allocate_cache_row_width(fmt, width):
    cache = ml.allocate_cache(ml.MLAConfig(cache_format=fmt), 3, 4, num_layers=2, row_width=width)
    assert cache.shape == (2, 3, 4, width)


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("fmt, rope, seed", [("bf16", False, 61), ("fp8", True, 62), ("fp8_ds_mla", True, 63)])
def test_layer_over_padded_rows_matches_reference(fmt, rope, seed):
    """allocate_cache(..., row_width=) caches through prefill (with context) and decode: the same
    tolerance as unpadded, the padding of every row untouched."""
    from test_layer import BLOCK, NUM_BLOCKS, Run, as_bits, run_and_check

    kind = LAYER_KIND[fmt]
    run = Run(fmt, rope, seed, rope_style="neox" if fmt == "fp8" else "gptj")
    width, entry = PADDED[kind][1], ENTRY_WIDTH[kind]
    empty = ml.allocate_cache(run.config, NUM_BLOCKS, BLOCK, row_width=width)
    assert empty.shape == (NUM_BLOCKS, BLOCK, width)
    garbage = np.random.default_rng(seed).integers(0, 256, empty.size * empty.dtype.itemsize, np.uint8)
    run.cache = jnp.asarray(garbage.view(empty.dtype).reshape(empty.shape))
    run.initial_bits = as_bits(run.cache)
    run_and_check(run)  # outputs against the reference, rows never written untouched
    assert run.cache.shape == (NUM_BLOCKS, BLOCK, width)
    np.testing.assert_array_equal(as_bits(run.cache)[..., entry:], run.initial_bits[..., entry:], err_msg="padding columns")
