"""Numerics pinned independently of the library: E4M3 codes of every bf16 and fp16 bit pattern
against ml_dtypes, the fp8_ds_mla tile scale at its boundaries, dequantization, the RoPE table."""

import jax
import numpy as np
import pytest
from _util import (
    ACT,
    BF16,
    DS_MLA_BYTES,
    DS_MLA_PE,
    FP8,
    Case,
    L,
    R,
    assert_bits_equal,
    assert_equal_nan_aware,
    check_untouched_rows,
    ds_mla_scale,
    e4m3,
    jitted,
    make_case,
    np_ds_mla_encode,
    put,
    to_numpy,
)

import jax_kimi_mla

SCALE_INVS = [1.0, 0.5, 3.7, 1 / 448, 1e3]


def all_bit_patterns(act: str) -> np.ndarray:
    """Every 16-bit pattern of the dtype, padded (with a repeat) to whole 576-value rows."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    rows = -(-patterns.size // 576)
    return np.resize(patterns, rows * 576).view(ACT[act]).reshape(rows, 576)


@pytest.mark.parametrize("impl", [jax_kimi_mla, jax_kimi_mla.reference], ids=["ffi", "reference"])
@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_e4m3_every_16bit_pattern(backend, act, impl):
    """Decode with a plain fp8 cache and no RoPE quantizes [ql_nope | q_pe] with q_scale_inv
    and [kv_c_normed | k_pe] with cache_scale_inv: each row here carries 576 bit patterns."""
    if impl is jax_kimi_mla.reference and backend != "cpu":
        pytest.skip("the reference is checked on the CPU")
    x = all_bit_patterns(act)
    B = x.shape[0]
    rng = np.random.default_rng(0)
    a = {
        "ql_nope": x[:, None, :L], "q_pe": x[:, None, L:], "kv_c_normed": x[:, :L], "k_pe": x[:, L:],
        "kv_cache": rng.integers(0, 256, (B, 1, 576), dtype=np.uint8).view(FP8),
        "slot_mapping": rng.permutation(B).astype(np.int32),
    }
    op = jitted(impl, "decode_fp8")
    x32 = x.astype(np.float32)
    for i, q_s in enumerate(SCALE_INVS):
        c_s = SCALE_INVS[(i + 2) % len(SCALE_INVS)]
        a["q_scale_inv"], a["cache_scale_inv"] = np.float32(q_s), np.float32(c_s)
        mqa_q, cache = to_numpy(op(put(a, backend)))
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs are the point
            want_q, want_cache = e4m3(x32 * np.float32(q_s)), e4m3(x32 * np.float32(c_s))
        assert_equal_nan_aware(mqa_q[:, 0], want_q, f"mqa_q, scale_inv {q_s}")
        assert_equal_nan_aware(cache[a["slot_mapping"], 0], want_cache, f"cache, scale_inv {c_s}")
        # NaN stays NaN (not -448), and +-inf saturates to +-448.
        inf = np.isinf(x32)
        assert np.isnan(mqa_q[:, 0][np.isnan(x32)].astype(np.float32)).all()
        assert_bits_equal(mqa_q[:, 0][inf], np.where(x32[inf] > 0, 448.0, -448.0).astype(FP8), "+-inf")


def test_e4m3_oracle():
    """The numpy oracle above is the spec's: saturation, NaN, round-to-nearest-even."""
    x = np.array([np.inf, -np.inf, 1e6, 449.0, 464.0, 480.0, np.nan, 17.0, 19.0, 2.0**-10, 2.0**-9 * 1.5], np.float32)
    want = np.array([448, -448, 448, 448, 448, 448, np.nan, 16, 20, 0, 2.0**-8], np.float32)
    assert_equal_nan_aware(e4m3(x), want.astype(FP8), "e4m3 oracle")


# ---------------------------------------------------------------- fp8_ds_mla tile scale

# One token per row: 4 tiles, each given (amax, the scale the spec demands).
SCALE_CASES = [
    ((336.0, 1.0), (0.0, 2.0**-13), (448.0, 1.0), (450.0, 2.0)),
    ((448.0 * 8, 8.0), (448.0 / 8, 1 / 8), (448.0 * 2**-10, 2.0**-10), (448.0 * 32, 32.0)),
    ((448.0 * 2**-13, 2.0**-13), (2.0**-7, 2.0**-13), (448.0 * 2**-12, 2.0**-12), (0.04443359375, 2.0**-13)),
    ((1.0, 2.0**-8), (336.0 * 4, 4.0), (-448.0 * 4, 4.0), (57.0, 2.0**-2)),
]


def _tile_inputs(act: str, rng):
    """kv_c_normed [T, 512] whose tile j of token t has max |x| = SCALE_CASES[t][j][0] exactly."""
    dt = ACT[act]
    latent = np.zeros((len(SCALE_CASES), 4, 128), np.float32)
    for t, tiles in enumerate(SCALE_CASES):
        for j, (amax, _) in enumerate(tiles):
            if amax == 0.0:
                latent[t, j] = np.where(rng.random(128) < 0.5, -0.0, 0.0)  # signed zeros
                continue
            vals = rng.uniform(-abs(amax), abs(amax), 128).astype(dt).astype(np.float32)
            vals = np.clip(vals, -abs(amax) * 0.99, abs(amax) * 0.99)
            vals[rng.integers(128)] = amax
            latent[t, j] = vals
    latent[0, 0, 7] = np.nan  # NaN is ignored by the tile's amax and stays NaN
    out = latent.reshape(-1, L).astype(dt)
    assert np.array_equal(np.nanmax(np.abs(out.astype(np.float32).reshape(-1, 4, 128)), -1),
                          np.abs([[a for a, _ in tiles] for tiles in SCALE_CASES]).astype(np.float32)), "amax not representable"
    return out


@pytest.mark.parametrize("fmt", ["prefill_fp8_ds_mla", "decode_fp8_ds_mla"])
@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_ds_mla_tile_scales(backend, fmt, act):
    rng = np.random.default_rng(3)
    T = len(SCALE_CASES)
    a = make_case(Case(fmt, T, 2, act), rng)
    a["kv_c_normed"] = _tile_inputs(act, rng)
    a["slot_mapping"] = np.arange(T, dtype=np.int32) * 3  # rows 0, 3, 6, 9: the rest untouched
    cache = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, backend)))[-1]
    entries = cache.reshape(-1, DS_MLA_BYTES)[a["slot_mapping"]]
    scales = np.ascontiguousarray(entries[:, L:DS_MLA_PE]).view("<f4")
    want_scales = np.array([[s for _, s in tiles] for tiles in SCALE_CASES], np.float32)
    assert_bits_equal(scales, want_scales, "ds_mla tile scales")
    want = np_ds_mla_encode(a["kv_c_normed"].astype(np.float32), a["k_pe"].astype(np.float32).astype(BF16))
    assert_equal_nan_aware(entries[:, :L].view(FP8), want[:, :L].view(FP8), "ds_mla codes")
    assert_bits_equal(entries[:, L:], want[:, L:], "ds_mla scales and bf16 k_pe")
    assert np.isnan(entries[0, 7:8].view(FP8).astype(np.float32)).all(), "NaN latent must stay NaN"
    check_untouched_rows(cache, a["kv_cache"], a["slot_mapping"])


def test_ds_mla_scale_oracle():
    """The numpy oracle's scale agrees with the spec's examples."""
    amax = np.array([336, 0, 448, 450, 448 * 2.0**-20, 448e-4, 1e30], np.float32)
    want = np.array([1, 2.0**-13, 1, 2, 2.0**-13, 2.0**-13, 2.0**91], np.float32)
    assert_bits_equal(ds_mla_scale(amax), want, "ds_mla_scale")


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_ds_mla_dequantize_round_trip(backend, act):
    """Dequantized latents are within half an E4M3 step of the input, relative to each value
    (absolute half a subnormal step, scaled by the tile scale, near zero); k_pe comes back."""
    a = make_case(Case("prefill_fp8_ds_mla", 40, 1, act, seed=5))
    a["slot_mapping"] = np.arange(40, dtype=np.int32)
    cache = to_numpy(jitted(jax_kimi_mla, "prefill_fp8_ds_mla")(put(a, backend)))[-1]
    entries = cache.reshape(-1, DS_MLA_BYTES)[:40]
    latent, k_pe = to_numpy(jax.jit(jax_kimi_mla.ds_mla_dequantize)(entries))
    assert latent.shape == (40, L) and latent.dtype == np.float32 and k_pe.shape == (40, R) and k_pe.dtype == BF16
    x = a["kv_c_normed"].astype(np.float32)
    s = np.repeat(np.ascontiguousarray(entries[:, L:DS_MLA_PE]).view("<f4"), 128, axis=1)
    bound = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10)
    err = np.abs(latent - x)
    assert (err <= bound).all(), f"worst relative error {np.max(err / bound)} of the bound"
    assert_bits_equal(k_pe, a["k_pe"].astype(np.float32).astype(BF16), "dequantized k_pe")
    with pytest.raises(ValueError, match="entries"):
        jax_kimi_mla.ds_mla_dequantize(np.zeros((2, 655), np.uint8))


# ---------------------------------------------------------------- RoPE table


def test_make_cos_sin_cache():
    table = np.asarray(jax_kimi_mla.make_cos_sin_cache(4096))
    assert table.shape == (4096, R) and table.dtype == np.float32
    assert_bits_equal(table[0], np.array([1.0] * 32 + [0.0] * 32, np.float32), "position 0")
    angles = np.arange(4096.0)[:, None] * 10000.0 ** (-np.arange(0, R, 2) / R)[None, :]
    np.testing.assert_allclose(table[:, :32], np.cos(angles), atol=2e-7)
    np.testing.assert_allclose(table[:, 32:], np.sin(angles), atol=2e-7)
    small = np.asarray(jax_kimi_mla.make_cos_sin_cache(3, base=100.0, rope_dim=4))
    angles = np.arange(3.0)[:, None] * np.array([1.0, 0.1])[None, :]
    np.testing.assert_allclose(small, np.concatenate([np.cos(angles), np.sin(angles)], 1), atol=2e-7)
    with pytest.raises(ValueError):
        jax_kimi_mla.make_cos_sin_cache(0)


def _rope_f64(x, rows):
    """The spec's GPT-J RoPE in float64, and the magnitude of its terms (for the tolerance)."""
    extra = (1,) * (x.ndim - 2)
    c = rows[:, :32].reshape(rows.shape[0], *extra, 32)
    s = rows[:, 32:].reshape(rows.shape[0], *extra, 32)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = np.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(x.shape)
    terms = np.stack([np.abs(x0 * c) + np.abs(x1 * s), np.abs(x0 * s) + np.abs(x1 * c)], -1).reshape(x.shape)
    return y, terms


def test_rope_formula(backend):
    """RoPE against the spec in float64 on an arbitrary (non-rotation) table, so a swapped
    cos/sin or a pairing mistake shared with the reference would show: float32 math then one
    bf16 rounding, so within half a bf16 ulp of the result plus float32 error of the terms."""
    rng = np.random.default_rng(11)
    a = make_case(Case("decode_bf16", 6, 2, rope=True, max_position=5), rng)
    a["cos_sin_cache"] = rng.standard_normal((5, R)).astype(np.float32)
    a["positions"] = np.array([0, 4, -3, 5, 1 << 30, 2], np.int32)
    a["slot_mapping"] = np.arange(6, dtype=np.int32)
    mqa_q, cache = to_numpy(jitted(jax_kimi_mla, "decode_bf16")(put(a, backend)))
    rows = a["cos_sin_cache"][np.clip(a["positions"], 0, 4)].astype(np.float64)
    for what, got, x in (("q_pe", mqa_q[..., L:], a["q_pe"]), ("k_pe", cache.reshape(-1, 576)[:6, L:], a["k_pe"])):
        want, terms = _rope_f64(x.astype(np.float64), rows)
        err = np.abs(got.astype(np.float64) - want)
        tol = 2.0**-8 * np.abs(want) + 2.0**-21 * terms
        assert (err <= tol).all(), f"{what}: worst error {np.max(err / tol)} of the tolerance"
    assert_bits_equal(mqa_q[..., :L], a["ql_nope"], "ql_nope part")
