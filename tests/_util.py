"""Shared test helpers: random inputs per op and cache format, sentinel caches, bit-level checks.

Every op/format pair is a "format" name below; ``make_case`` builds its named numpy inputs,
``invoke`` calls the FFI op or the reference on them, ``check_against_reference`` compares the
outputs with the spec's tolerance (bit-exact except RoPE'd values: 1 ulp of the output dtype,
or one E4M3 step), and ``check_untouched_rows`` pins every cache row no valid slot addresses.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

import jax_kimi_mla
from jax_kimi_mla.formats import EPILOGUES

L, P, R, V = 512, 128, 64, 128
ENTRY = L + R
DS_MLA_BYTES = 656
DS_MLA_PE = L + 16  # first byte of the bf16 k_pe part of a ds_mla entry

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
ACT = {"bf16": BF16, "fp16": FP16}

# The epilogue targets by name ("prefill_bf16", ..., "decode_fp8_ds_mla"): jax_kimi_mla.formats.
FORMATS = tuple(EPILOGUES)


def _output_facts(e) -> tuple:
    """(name, kind, first RoPE'd column or None) of each output of an epilogue, in order. Kinds:
    "act" (the activation dtype), "fp8" (E4M3 codes), "ds_mla" (656-byte entries)."""
    fmt = e.cache_format.name
    facts = {
        "k": ("act", P), "q": ("act", P), "q_fp8": ("fp8", P), "k_fp8": ("fp8", P), "v_fp8": ("fp8", None),
        "mqa_q": ("fp8" if fmt == "fp8" else "act", L),
        "kv_cache": {"bf16": ("act", L), "fp8": ("fp8", L), "fp8_ds_mla": ("ds_mla", None)}[fmt],
    }
    return tuple((name, *facts[name]) for name in e.outputs)


OUTPUTS = {name: _output_facts(e) for name, e in EPILOGUES.items()}


def cache_kind(fmt: str) -> str:
    return {name: kind for name, kind, _ in OUTPUTS[fmt]}["kv_cache"]


# ---------------------------------------------------------------- devices


@functools.cache
def gpu_available() -> bool:
    if not jax_kimi_mla.HAS_CUDA_MODULE:
        return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:  # no GPU platform in this process
        return False


def device(backend: str):
    return jax.devices(backend)[0]


def put(tree, backend: str):
    """numpy inputs -> arrays committed to the backend's first device (the op then runs there)."""
    return jax.device_put(tree, device(backend))


def x64_if(index_dtype) -> contextlib.AbstractContextManager:
    """int64 indices only survive as int64 with x64 on; everything of such a case runs inside."""
    return jax.enable_x64(True) if np.dtype(index_dtype) == np.int64 else contextlib.nullcontext()


# ---------------------------------------------------------------- inputs


def random_act(rng, shape, dtype, scale=2.0):
    """Non-zero normal values, ~1% of them 100x larger (so fp8 outputs saturate somewhere)."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    big = rng.random(shape) < 0.01
    x[big] *= 100.0
    x[x == 0] = 0.5  # never zeros
    return x.astype(dtype)


def sentinel(rng, shape, dtype):
    """A cache of random bytes (NaN and inf patterns included): untouched rows must keep them."""
    dtype = np.dtype(dtype)
    return rng.integers(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=np.uint8).view(dtype)


def cache_shape_dtype(fmt: str, act, num_blocks: int, block_size: int):
    kind = cache_kind(fmt)
    if kind == "ds_mla":
        return (num_blocks, block_size, DS_MLA_BYTES), np.dtype(np.uint8)
    return (num_blocks, block_size, ENTRY), (FP8 if kind == "fp8" else np.dtype(act))


def slot_mapping(rng, tokens: int, num_rows: int, index_dtype, pattern: str = "mixed"):
    """Distinct valid slots, interleaved with padding and out-of-range ones.

    The last row is never addressed by a valid slot; the invalid int64 slots are congruent to it
    modulo 2^32, so a handler that truncates slots to 32 bits writes it and is caught.
    """
    assert tokens <= num_rows - 1
    dt = np.dtype(index_dtype)
    valid = rng.permutation(num_rows - 1)[:tokens]
    if dt == np.int64:
        negatives = [-1, -(1 << 32) + num_rows - 1]
        too_large = [num_rows, (1 << 32) + num_rows - 1]
    else:
        negatives = [-1, np.iinfo(np.int32).min]
        too_large = [num_rows, np.iinfo(np.int32).max]
    slots = valid.astype(np.int64)
    for t in range(tokens):
        if pattern == "all_invalid" or t % 5 == 3:
            slots[t] = negatives[t % 2]
        elif t % 7 == 5:
            slots[t] = too_large[t % 2]
    return slots.astype(dt)


def positions(rng, tokens: int, max_position: int, index_dtype):
    """Positions in range, with some negative and some >= max_position (clamped by the ops)."""
    dt = np.dtype(index_dtype)
    pos = rng.integers(0, max_position, tokens).astype(np.int64)
    huge = (1 << 32) + 1 if dt == np.int64 else np.iinfo(np.int32).max  # int64: truncation -> 1
    for t in range(tokens):
        if t % 4 == 1:
            pos[t] = [-1, -max_position - 3][t % 2]
        elif t % 6 == 2:
            pos[t] = [max_position, huge][t % 2]
    return pos.astype(dt)


def clamped(pos, max_position: int):
    return np.clip(pos, 0, max_position - 1).astype(pos.dtype)


def scale_inv(value: float, shape=()):
    return np.full(shape, value, np.float32)


@dataclass(frozen=True)
class Case:
    """One call: format, sizes, dtypes, RoPE, k_pe rank, slot pattern, decode/prefill scale shape."""

    fmt: str
    tokens: int = 5
    heads: int = 3
    act: str = "bf16"
    index: str = "int32"
    rope: bool = False
    k_pe_3d: bool = False
    block_size: int = 16
    max_position: int = 97
    slots: str = "mixed"
    scale_shape: tuple = ()
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return (self.tokens + 2 * self.block_size) // self.block_size + 1


def make_case(case: Case, rng=None) -> dict:
    """The named numpy inputs of one call, fresh random data, sentinel cache."""
    rng = rng or np.random.default_rng(case.seed)
    T, H, act = case.tokens, case.heads, ACT[case.act]
    a = {}
    if case.fmt.startswith("prefill"):
        a["q"] = random_act(rng, (T, H, P + R), act)
        a["k_nope"] = random_act(rng, (T, H, P), act)
    else:
        a["ql_nope"] = random_act(rng, (T, H, L), act)
        a["q_pe"] = random_act(rng, (T, H, R), act)
    a["k_pe"] = random_act(rng, (T, 1, R) if case.k_pe_3d else (T, R), act)
    a["kv_c_normed"] = random_act(rng, (T, L), act)
    if case.fmt == "prefill_fp8":
        a["v"] = random_act(rng, (T, H, V), act)
    shape, dtype = cache_shape_dtype(case.fmt, act, case.num_blocks, case.block_size)
    a["kv_cache"] = sentinel(rng, shape, dtype)
    a["slot_mapping"] = slot_mapping(rng, T, case.num_blocks * case.block_size, case.index, case.slots)
    if case.fmt == "prefill_fp8":
        for name, value in (("q_scale_inv", 0.8), ("k_scale_inv", 1.7), ("v_scale_inv", 0.45), ("cache_scale_inv", 2.5)):
            a[name] = scale_inv(value, case.scale_shape)
    if case.fmt == "decode_fp8":
        a["q_scale_inv"] = scale_inv(1.3, case.scale_shape)
        a["cache_scale_inv"] = scale_inv(0.6, case.scale_shape)
    if case.rope:
        a["positions"] = positions(rng, T, case.max_position, case.index)
        a["cos_sin_cache"] = np.asarray(jax_kimi_mla.make_cos_sin_cache(case.max_position))
    return a


# ---------------------------------------------------------------- calling


def invoke(impl, fmt: str, a: dict):
    """Calls format ``fmt`` of ``impl`` (jax_kimi_mla or jax_kimi_mla.reference) on named inputs.

    Optional inputs (RoPE, decode scales) are passed exactly when their key is present; a
    ``ds_mla`` key overrides the decode format's own flag.
    """
    args, kwargs = split_args(fmt, a)
    return getattr(impl, EPILOGUES[fmt].op)(*args, **(EPILOGUES[fmt].static_kwargs | kwargs))


def positional(fmt: str) -> tuple[str, ...]:
    """The positional arguments of the public op of ``fmt``: its FFI inputs, then (in prefill)
    its scales."""
    e = EPILOGUES[fmt]
    return e.inputs + (e.scales if e.phase == "prefill" else ())


def split_args(fmt: str, a: dict):
    """Named inputs -> (positional, keyword) arguments of the public op of ``fmt``; the keyword
    arguments that select the target (``ds_mla=True``) are left to the caller."""
    names = positional(fmt)
    return [a[n] for n in names], {n: a[n] for n in a if n not in names}


@functools.cache
def jitted(impl, fmt: str):
    return jax.jit(functools.partial(invoke, impl, fmt))


def run_reference(fmt: str, a: dict):
    """The jnp reference, jitted on the CPU: the oracle for every backend."""
    return to_numpy(jitted(jax_kimi_mla.reference, fmt)(put(a, "cpu")))


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------- comparisons


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def isnan(x) -> np.ndarray:
    x = np.asarray(x)
    return np.isnan(x.astype(np.float32)) if x.dtype != np.uint8 else np.zeros(x.shape, bool)


def _order_key(x) -> np.ndarray:
    """Sign-magnitude bit patterns -> integers in value order (+0 and -0 meet): adjacent
    representable values differ by 1, so "within n ulps / n E4M3 steps" is |key difference| <= n."""
    b = bits(x).astype(np.int64)
    sign = 1 << (8 * np.asarray(x).dtype.itemsize - 1)
    return np.where(b & sign, -(b & (sign - 1)), b)


def _where(mask) -> str:
    idx = np.argwhere(mask)
    return f"{len(idx)} mismatches, first at {tuple(idx[0])}" if len(idx) else ""


def assert_bits_equal(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    bad = bits(got) != bits(want)
    assert not bad.any(), f"{what}: not bit-exact: {_where(bad)}: got {got[bad][:4]} want {want[bad][:4]}"


def assert_equal_nan_aware(got, want, what: str) -> None:
    """Bit-exact, except that a NaN matches any NaN (payloads may differ)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    nan_g, nan_w = isnan(got), isnan(want)
    bad = (nan_g != nan_w) | (~nan_g & (bits(got) != bits(want)))
    assert not bad.any(), f"{what}: {_where(bad)}: got {got[bad][:4]} want {want[bad][:4]}"


def assert_within_steps(got, want, what: str, steps: int = 1) -> None:
    """Same NaNs; every other value within ``steps`` representable values of the other."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    nan_g, nan_w = isnan(got), isnan(want)
    far = np.abs(_order_key(got) - _order_key(want)) > steps
    bad = (nan_g != nan_w) | (~nan_g & far)
    assert not bad.any(), f"{what}: more than {steps} step(s) apart: {_where(bad)}: got {got[bad][:4]} want {want[bad][:4]}"


def check_output(got, want, kind: str, rope_from, rope: bool, what: str, steps: int = 1) -> None:
    """Unrotated columns bit-exact; RoPE'd columns (from ``rope_from``) within ``steps`` steps
    when RoPE is on, bit-exact otherwise."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if got.size == 0:
        return
    if kind == "ds_mla":  # codes + scales of the latent are exact; the k_pe part is bf16
        g, w = got.reshape(-1, DS_MLA_BYTES), want.reshape(-1, DS_MLA_BYTES)
        assert_bits_equal(g[:, :DS_MLA_PE], w[:, :DS_MLA_PE], f"{what} (latent codes and scales)")
        g_pe, w_pe = (np.ascontiguousarray(x[:, DS_MLA_PE:]).view(BF16) for x in (g, w))
        assert_within_steps(g_pe, w_pe, f"{what} (bf16 k_pe)", steps) if rope else assert_bits_equal(g_pe, w_pe, f"{what} (bf16 k_pe)")
        return
    width = got.shape[-1]
    g, w = got.reshape(-1, width), want.reshape(-1, width)
    split = width if rope_from is None else rope_from
    assert_bits_equal(g[:, :split], w[:, :split], f"{what} (unrotated columns)")
    if rope:
        assert_within_steps(g[:, split:], w[:, split:], f"{what} (RoPE columns)", steps)
    else:
        assert_bits_equal(g[:, split:], w[:, split:], f"{what} (RoPE columns)")


def check_against_reference(fmt: str, got, want, rope: bool, slots, steps: int = 1) -> None:
    """Every output against the reference's; of the cache only the rows valid slots address
    (the others are pinned to the input by check_untouched_rows, not to the reference).
    ``steps``: the RoPE tolerance (1 against the CPU reference). XLA:GPU evaluates the
    reference's float32 RoPE less exactly (on an H200 about 1e-5 of the values differ from the CPU
    reference, by a few steps, while the kernel equals the CPU reference bit for bit), so a test
    that must use the GPU reference allows a little more."""
    assert len(got) == len(want) == len(OUTPUTS[fmt])
    for (name, kind, rope_from), g, w in zip(OUTPUTS[fmt], got, want):
        if name == "kv_cache":
            g, w = np.asarray(g), np.asarray(w)
            assert g.shape == w.shape, f"{fmt} kv_cache: shape {g.shape} vs {w.shape}"
            rows = addressed_rows(slots, g.shape[0] * g.shape[1])
            g, w = g.reshape(-1, g.shape[-1])[rows], w.reshape(-1, w.shape[-1])[rows]
        check_output(g, w, kind, rope_from, rope, f"{fmt} {name}", steps)


def addressed_rows(slots, num_rows: int) -> np.ndarray:
    slots = np.asarray(slots).astype(np.int64)
    mask = np.zeros(num_rows, bool)
    mask[slots[(slots >= 0) & (slots < num_rows)]] = True
    return mask


def check_untouched_rows(cache_out, cache_in, slots, what: str = "kv_cache") -> None:
    """Rows that no valid slot addresses are bit-for-bit the input's (sentinels included)."""
    cache_out, cache_in = np.asarray(cache_out), np.asarray(cache_in)
    width = cache_in.shape[-1]
    rows_out, rows_in = cache_out.reshape(-1, width), cache_in.reshape(-1, width)
    untouched = ~addressed_rows(slots, rows_in.shape[0])
    changed = np.flatnonzero(untouched & (bits(rows_out) != bits(rows_in)).any(axis=1))
    assert changed.size == 0, f"{what}: rows {changed[:8].tolist()} changed, but no valid slot addresses them"


# ---------------------------------------------------------------- independent numpy models


def e4m3(x_f32) -> np.ndarray:
    """The spec's code: E4M3 round-nearest-even of clamp(x, -448, 448) (NaN stays NaN)."""
    return np.clip(np.asarray(x_f32, np.float32), -448.0, 448.0).astype(FP8)


def ds_mla_scale(amax: np.ndarray) -> np.ndarray:
    """Smallest power of two >= max(amax / 448, 1e-4), via frexp (not the library's bit trick)."""
    ratio = np.maximum(np.float32(amax) / np.float32(448.0), np.float32(1e-4)).astype(np.float32)
    mant, exp = np.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    return np.where(mant == 0.5, ratio, np.ldexp(np.float32(1.0), exp)).astype(np.float32)


def np_ds_mla_encode(latent_f32, pe_bf16) -> np.ndarray:
    """uint8 [T, 656] ds_mla entries, written from the spec in numpy."""
    latent = np.asarray(latent_f32, np.float32)
    T = latent.shape[0]
    tiles = latent.reshape(T, 4, 128)
    amax = np.nanmax(np.where(np.isnan(tiles), 0.0, np.abs(tiles)), axis=-1).astype(np.float32)
    s = ds_mla_scale(amax)
    codes = e4m3(tiles / s[..., None]).reshape(T, L)
    return np.concatenate(
        [codes.view(np.uint8), s.astype("<f4").view(np.uint8).reshape(T, 16),
         np.asarray(pe_bf16, BF16).reshape(T, R).view(np.uint8).reshape(T, 2 * R)], axis=1)


def nope_expected(fmt: str, a: dict):
    """Every output of a call without RoPE, from the spec in numpy (independent of the library)."""
    T = a["kv_c_normed"].shape[0]
    H = (a["q"] if fmt.startswith("prefill") else a["ql_nope"]).shape[1]
    f32 = lambda x: np.asarray(x).astype(np.float32)  # noqa: E731
    k_pe = a["k_pe"].reshape(T, R)
    latent_row = np.concatenate([a["kv_c_normed"], k_pe], -1)
    kind = cache_kind(fmt)
    if kind == "ds_mla":
        entries = np_ds_mla_encode(f32(a["kv_c_normed"]), f32(k_pe).astype(BF16))
    elif kind == "fp8":
        entries = e4m3(f32(latent_row) * a["cache_scale_inv"].reshape(()))
    else:
        entries = latent_row
    cache = a["kv_cache"].copy()
    flat = cache.reshape(-1, cache.shape[-1])
    for t, slot in enumerate(np.asarray(a["slot_mapping"]).astype(np.int64)):
        if 0 <= slot < flat.shape[0]:
            flat[slot] = entries[t]
    if fmt.startswith("prefill"):
        k = np.concatenate([a["k_nope"], np.broadcast_to(k_pe[:, None, :], (T, H, R))], -1)
        if fmt == "prefill_fp8":
            q8 = lambda x, s: e4m3(f32(x) * a[s].reshape(()))  # noqa: E731
            return q8(a["q"], "q_scale_inv"), q8(k, "k_scale_inv"), q8(a["v"], "v_scale_inv"), cache
        return k, a["q"], cache
    mqa_q = np.concatenate([a["ql_nope"], a["q_pe"]], -1)
    if fmt == "decode_fp8":
        mqa_q = e4m3(f32(mqa_q) * a["q_scale_inv"].reshape(()))
    return mqa_q, cache


def load_script(path: Path, name: str):
    """A script outside the package (a benchmark, an example) imported as module ``name``, once.
    It is registered in sys.modules before it runs, as its dataclasses need."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
