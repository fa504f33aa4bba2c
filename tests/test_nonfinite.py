"""NaN and +-inf in every input of every op and cache format.

What the handlers do (numerics.h, epilogue.h) and what these tests pin:

- Copies stay copies: without RoPE every bf16/fp16 output value, and the bf16 k_pe of a ds_mla
  entry written from bf16 input, is the input's bit pattern, NaN payload and sign included
  (signalling NaNs are not quieted).
- Plain fp8: code = E4M3(clamp(x * scale_inv)): +-inf saturates to +-448 (0x7E / 0xFE), NaN gives
  a NaN code. A NaN scale makes every code of its tensor NaN; an infinite scale saturates every
  non-zero value and turns zeros into NaN (0 * inf).
- fp8_ds_mla: a tile's amax ignores NaN, signalling ones included (an all-NaN tile gets the
  minimum scale 2^-13); an inf in the tile makes amax, and so the stored scale, +inf. The codes
  are x * (1 / s) = x * 0: finite values encode as +-0, inf and NaN as NaN, so the whole tile
  dequantizes to NaN (code * inf).
- RoPE with a NaN or inf input or cos/sin entry yields NaN (or inf) where IEEE arithmetic says so.
- Which NaN bit pattern arithmetic or a conversion produces is numerics.h's choice, not checked
  here: the reference (XLA), x86 and the GPU differ in NaN signs and payloads. Only NaN-ness is.
- Rows no valid slot addresses never change, whatever the values.

So every output matches the reference with NaN where the reference has NaN, non-NaN values
bit-exact (RoPE'd ones within one step, the documented tolerance), and without RoPE every output
matches a numpy model of the spec, copies bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _util import (
    BF16,
    DS_MLA_PE,
    FORMATS,
    FP8,
    OUTPUTS,
    Case,
    addressed_rows,
    assert_bits_equal,
    assert_equal_nan_aware,
    assert_within_steps,
    check_untouched_rows,
    jitted,
    make_case,
    nope_expected,
    put,
    to_numpy,
    x64_if,
)

import jax_kimi_mla
from jax_kimi_mla import reference

# Bit patterns injected, by dtype: NaNs with payloads and either sign, a signalling NaN, +-inf.
PATTERNS = {
    "nan": {
        np.dtype(BF16): [0x7FC1, 0xFFC5, 0x7F81],
        np.dtype(np.float16): [0x7E01, 0xFE05, 0x7C01],
        np.dtype(np.float32): [0x7FC00001, 0xFFC00005, 0x7F800001],
    },
    "inf": {
        np.dtype(BF16): [0x7F80, 0xFF80],
        np.dtype(np.float16): [0x7C00, 0xFC00],
        np.dtype(np.float32): [0x7F800000, 0xFF800000],
    },
}
UINT = {2: np.uint16, 4: np.uint32}

# XLA:CPU of jax < 0.11 canonicalizes bf16 NaN payloads where 0.11.2 keeps them.
JAX_BEFORE_0_11 = jax.__version_info__ < (0, 11)


def inject(x: np.ndarray, kind: str) -> np.ndarray:
    """A copy of x with every 7th element (and every scalar) replaced by the kind's patterns."""
    x = np.array(x)
    flat = x.reshape(-1).view(UINT[x.dtype.itemsize])
    targets = flat[3::7] if flat.size > 1 else flat
    targets[...] = np.resize(np.array(PATTERNS[kind][x.dtype], flat.dtype), targets.shape)
    return x


# (format, RoPE, input): every float input of every call, the cos/sin table and fp8 scales included.
TARGETS = [
    (fmt, rope, name)
    for fmt in FORMATS
    for rope in (False, True)
    for name in make_case(Case(fmt, rope=rope))
    if name not in ("kv_cache", "slot_mapping", "positions")
]


def run(impl, fmt: str, a: dict, backend: str) -> list:
    with x64_if(a["slot_mapping"].dtype):
        return to_numpy(jitted(impl, fmt)(put(a, backend)))


def views(kind: str, x: np.ndarray) -> list:
    """(label, array, has RoPE'd tail from column) for the parts of one output's rows."""
    if kind != "ds_mla":
        return [("", x, None)]
    rows = x.reshape(-1, x.shape[-1])
    part = lambda lo, hi, dt: np.ascontiguousarray(rows[:, lo:hi]).view(dt)  # noqa: E731
    return [("codes", part(0, 512, FP8), None), ("scales", part(512, DS_MLA_PE, np.float32), None),
            ("k_pe", part(DS_MLA_PE, 656, BF16), 0)]


def assert_matches(got, want, fmt: str, rope: bool, slots, what: str):
    """NaN where ``want`` has NaN (any sign or payload); every other value bit-exact, RoPE'd
    values within one step. Of the cache, the rows valid slots address."""
    for (name, kind, rope_from), g, w in zip(OUTPUTS[fmt], got, want):
        if name == "kv_cache":
            rows = addressed_rows(slots, g.shape[0] * g.shape[1])
            g, w = g.reshape(-1, g.shape[-1])[rows], w.reshape(-1, w.shape[-1])[rows]
        for (part, gp, from_), (_, wp, _) in zip(views(kind, g), views(kind, w)):
            label = f"{what}: {fmt} {name} {part}"
            split = rope_from if kind != "ds_mla" else from_
            if not rope or split is None:
                assert_equal_nan_aware(gp, wp, label)
            else:
                assert_equal_nan_aware(gp[..., :split], wp[..., :split], label)
                assert_within_steps(gp[..., split:], wp[..., split:], label + " (RoPE'd)")


def ds_mla_model(latent: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """uint8 [T, 656] entries from the spec, inf and NaN included (inf amax -> inf scale)."""
    T = latent.shape[0]
    tiles = latent.astype(np.float32).reshape(T, 4, 128)
    amax = np.max(np.where(np.isnan(tiles), 0, np.abs(tiles)), axis=-1)
    ratio = np.maximum(amax / np.float32(448), np.float32(1e-4)).astype(np.float32)
    mant, exp = np.frexp(ratio)
    scale = np.where(np.isinf(ratio) | (mant == 0.5), ratio, np.ldexp(np.float32(1), exp)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        codes = np.clip(tiles / scale[..., None], -448, 448).astype(FP8)
    pe = k_pe.reshape(T, 64)
    if pe.dtype != BF16:
        with np.errstate(invalid="ignore"):
            pe = pe.astype(np.float32).astype(BF16)
    return np.concatenate([codes.reshape(T, 512).view(np.uint8), scale.view(np.uint8).reshape(T, 16),
                           pe.view(np.uint8).reshape(T, 128)], axis=1)


def spec_model(fmt: str, a: dict) -> list:
    """Every output of a call without RoPE, from the spec in numpy."""
    with np.errstate(invalid="ignore", over="ignore"):
        want = list(nope_expected(fmt, a))
    if fmt.endswith("ds_mla"):
        entries = ds_mla_model(a["kv_c_normed"], a["k_pe"])
        flat = want[-1].reshape(-1, 656)
        for t, slot in enumerate(a["slot_mapping"].astype(np.int64)):
            if 0 <= slot < flat.shape[0]:
                flat[slot] = entries[t]
    return want


def assert_spec(got, want, fmt: str, a: dict, what: str):
    """Against the numpy model: copies (activation-dtype outputs, and the bf16 k_pe of a ds_mla
    entry from bf16 input) bit for bit, NaN payloads included; quantized values NaN-aware."""
    for (name, kind, _), g, w in zip(OUTPUTS[fmt], got, want):
        for (part, gp, _), (_, wp, _) in zip(views(kind, g), views(kind, w)):
            copy = kind == "act" or (part == "k_pe" and a["k_pe"].dtype == BF16)
            (assert_bits_equal if copy else assert_equal_nan_aware)(gp, wp, f"{what}: {fmt} {name} {part}")


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize("fmt, rope, name", TARGETS, ids=[f"{f}-{'rope' if r else 'nope'}-{n}" for f, r, n in TARGETS])
def test_nonfinite_input(backend, fmt, rope, name, act, kind):
    a = make_case(Case(fmt, rope=rope, act=act, tokens=6, block_size=4, seed=3))
    a[name] = inject(a[name], kind)
    got = run(jax_kimi_mla, fmt, a, backend)
    want = run(reference, fmt, a, "cpu")
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])
    assert_matches(got, want, fmt, rope, a["slot_mapping"], f"{backend} handler vs reference")
    if not rope:
        assert_spec(got, spec_model(fmt, a), fmt, a, f"{backend} handler vs spec")
    if backend != "cpu":
        assert_matches(got, run(jax_kimi_mla, fmt, a, "cpu"), fmt, rope, a["slot_mapping"], f"{backend} handler vs CPU handler")


@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["prefill_bf16", "decode_bf16"])
def test_reference_copies_nan_payloads(fmt, act):
    """The spec's "exact copy" holds for the reference too (without RoPE), NaN payloads included."""
    a = make_case(Case(fmt, act=act, tokens=6, block_size=4, seed=3))
    for name in ("k_pe", "kv_c_normed", "k_nope" if fmt == "prefill_bf16" else "ql_nope"):
        a[name] = inject(a[name], "nan")
    got = run(reference, fmt, a, "cpu")
    want = spec_model(fmt, a)
    for (name, _, _), g, w in zip(OUTPUTS[fmt], got, want):
        if name == "kv_cache":
            rows = addressed_rows(a["slot_mapping"], g.shape[0] * g.shape[1])
            g, w = g.reshape(-1, g.shape[-1])[rows], w.reshape(-1, w.shape[-1])[rows]
        assert_bits_equal(g, w, f"reference {fmt} {name}")


@pytest.mark.parametrize("fmt", ["prefill_fp8_ds_mla", "decode_fp8_ds_mla"])
def test_ds_mla_amax_ignores_signalling_nan(backend, fmt):
    """A signalling NaN is ignored by the tile amax like any NaN. (glibc's fmaxf answers NaN for a
    signalling NaN operand: an amax folded with it forgets the maximum seen before, and the tile
    scale comes out too small.)"""
    a = make_case(Case(fmt, tokens=1, block_size=1, seed=1))
    a["slot_mapping"] = np.zeros(1, np.int32)
    latent = np.ones((1, 512), BF16)
    latent[0, 0] = 100.0
    latent.view(np.uint16)[0, 1] = 0x7F81  # signalling NaN right after the tile's max
    a["kv_c_normed"] = latent
    entry = run(jax_kimi_mla, fmt, a, backend)[-1].reshape(-1, 656)[0]
    assert np.ascontiguousarray(entry[512:516]).view(np.float32)[0] == 0.25  # 100 / 448 -> 2^-2
    assert entry[:1].view(FP8).astype(np.float32)[0] == 384.0  # 100 / 0.25 -> nearest E4M3


@pytest.mark.parametrize("fmt", ["prefill_fp8_ds_mla", "decode_fp8_ds_mla"])
def test_ds_mla_tile_scales(backend, fmt):
    """The four tile cases spelled out: all NaN, NaN among finite values, one inf, all finite."""
    a = make_case(Case(fmt, tokens=3, block_size=4, seed=5))
    latent = a["kv_c_normed"].astype(np.float32)
    latent[:, :128] = np.nan
    latent[:, 128:256:3] = np.nan
    latent[:, 300] = np.inf
    a["kv_c_normed"] = latent.astype(BF16)
    latent = a["kv_c_normed"].astype(np.float32)  # the values the op sees
    finite_amax = np.abs(np.where(np.isnan(latent[:, 128:256]), 0, latent[:, 128:256])).max(1)
    got = run(jax_kimi_mla, fmt, a, backend)
    want = run(reference, fmt, a, "cpu")
    slots = a["slot_mapping"].astype(np.int64)
    entries = got[-1].reshape(-1, 656)
    for t, slot in enumerate(slots):
        if not 0 <= slot < entries.shape[0]:
            continue
        scale = np.ascontiguousarray(entries[slot, 512:528]).view(np.float32)
        assert scale[0] == 2.0**-13, f"token {t}: an all-NaN tile gets the minimum scale, got {scale[0]}"
        assert finite_amax[t] / 448 <= scale[1] < 2 * max(finite_amax[t] / 448, 1e-4), (t, scale[1], finite_amax[t])
        assert scale[2] == np.inf, f"token {t}: a tile holding inf has scale inf, got {scale[2]}"
        codes = entries[slot, :512].view(FP8).astype(np.float32)
        assert np.isnan(codes[:128]).all() and np.isnan(codes[128:256:3]).all()
        assert np.isnan(codes[300]) and (codes[256:384][np.arange(128) != 44] == 0).all()
        latent_back, _ = jax_kimi_mla.ds_mla_dequantize(entries[slot])
        assert np.isnan(np.asarray(latent_back)[256:384]).all(), "a tile with scale inf reads back as NaN"
    assert_matches(got, want, fmt, False, a["slot_mapping"], f"{backend} handler vs reference")
    assert_spec(got, spec_model(fmt, a), fmt, a, f"{backend} handler vs spec")
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])
