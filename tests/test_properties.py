"""Property tests: the handlers against the jnp reference on hostile inputs.

Hypothesis draws shapes (from a few buckets, so jitted functions are reused), the activation
dtype, RoPE on/off, cos/sin tables, fp8 scales and, above all, slot_mapping and positions:
padding, out of range, duplicated, at the int32/int64 limits. For every op and cache format:

- outputs equal the reference bit for bit, except RoPE'd values, which may be 1 ulp of the
  output dtype apart (one E4M3 step for fp8): the spec's documented tolerance;
- every cache row that no valid slot addresses is left bit-for-bit as it was;
- a row addressed by several tokens holds one of those tokens' entries (which one is undefined).

The candidate entries of a duplicated row come from re-running the same implementation once per
candidate ("rounds"): round k keeps the k-th token of each duplicate group and pads the others.
On the "cuda" backend the CUDA handler is checked against the reference and, bit for bit, against
the CPU handler. JKM_PROPERTY_EXAMPLES sets the examples per cache format (default 200).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from _util import (
    BF16,
    FORMATS,
    FP8,
    OUTPUTS,
    cache_shape_dtype,
    check_against_reference,
    check_untouched_rows,
    device,
    invoke,
    jitted,
    put,
    sentinel,
    x64_if,
)
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import jax_kimi_mla
from jax_kimi_mla import reference

EXAMPLES = int(os.environ.get("JKM_PROPERTY_EXAMPLES", "200"))
# `backend` is a plain string fixture: nothing in it needs resetting between examples.
PROFILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ACT = {"bf16": BF16, "fp16": np.dtype(np.float16)}


@dataclass(frozen=True)
class Bucket:
    """One compiled shape. Index dtype, k_pe rank, scale shape and whether inputs come as
    columns() of wider tensors ride along, to keep compiles few."""

    tokens: int
    heads: int
    block_size: int
    num_blocks: int
    max_position: int
    index_dtype: str
    k_pe_rank: int
    scale_shape: tuple
    columns: bool


BUCKETS = (
    Bucket(0, 2, 4, 2, 3, "int32", 2, (), False),  # no tokens: empty outputs, cache unchanged
    Bucket(1, 1, 1, 1, 1, "int64", 3, (1,), False),  # one-row cache, one-row cos/sin table
    Bucket(5, 0, 4, 3, 7, "int32", 3, (), True),  # H = 0: cache-only work
    Bucket(9, 3, 2, 4, 16, "int64", 2, (1,), True),  # more tokens than cache rows
    Bucket(16, 2, 16, 1, 40, "int32", 2, (), False),
)
# Inputs that may be columns(wide, start) of a wider producer tensor: (start, wide last dim).
COLUMNS = {"k_nope": (0, 256), "v": (128, 256), "k_pe": (512, 576), "q_pe": (128, 192)}


def index_values(valid: int, index_dtype: str):
    """Indices into a table of ``valid`` entries: in range, just outside, at the dtype limits, and
    for int64 values that a truncation to int32 would bring back into range (2**32 + i)."""
    lo, hi = (-(2**31), 2**31 - 1) if index_dtype == "int32" else (-(2**63), 2**63 - 1)
    edges = [-1, -2, valid, valid + 1, lo, hi, lo + 1, hi - 1]
    if index_dtype == "int64":
        edges += [2**31, -(2**31) - 1, 2**32, 2**32 + valid - 1, -(2**32)]
    return st.one_of(st.integers(0, valid - 1), st.sampled_from(edges), st.integers(lo, hi))


@dataclass(frozen=True)
class Case:
    """Everything one example draws; the arrays follow deterministically from it."""

    fmt: str
    bucket: Bucket
    act: str
    rope: bool
    seed: int
    slots: tuple
    positions: tuple
    random_table: bool = False
    scales: tuple = (1.0, 0.5, 2.0, 0.25)  # q, k, v, cache scale_inv of the fp8 formats

    @property
    def num_rows(self) -> int:
        return self.bucket.num_blocks * self.bucket.block_size


SCALES = st.sampled_from([1.0, 0.25, 3.0, 1 / 448, 448.0, 1e-3, 7.5])


@st.composite
def cases(draw, fmt: str):
    b = draw(st.sampled_from(BUCKETS))
    T, rows = b.tokens, b.num_blocks * b.block_size
    slots = draw(st.one_of(
        st.lists(index_values(rows, b.index_dtype), min_size=T, max_size=T),
        st.lists(st.integers(0, rows - 1), min_size=T, max_size=T),  # all valid, duplicates likely
    ))
    return Case(
        fmt=fmt,
        bucket=b,
        act=draw(st.sampled_from(sorted(ACT))),
        rope=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
        slots=tuple(slots),
        positions=tuple(draw(st.lists(index_values(b.max_position, b.index_dtype), min_size=T, max_size=T))),
        random_table=draw(st.booleans()),
        scales=tuple(draw(st.lists(SCALES, min_size=4, max_size=4))),
    )


def activations(rng, shape, dtype):
    """Normal values whose magnitude changes every 64 elements (2**-12 .. 2**12), some groups
    zero: ds_mla tiles and fp8 saturation see small, large, mixed and all-zero data."""
    groups = (*shape[:-1], shape[-1] // 64, 1)
    magnitude = 2.0 ** rng.integers(-12, 13, groups) * (rng.random(groups) > 0.1)
    x = rng.standard_normal((*shape[:-1], shape[-1] // 64, 64)) * magnitude
    return x.reshape(shape).astype(np.float32).astype(dtype)


def column_spec(case: Case) -> tuple:
    """((name, start), ...) of the inputs this case passes as columns of a wider tensor."""
    if not case.bucket.columns:
        return ()
    per_head = ("q_pe",) if case.fmt.startswith("decode") else ("k_nope", "v") if case.fmt == "prefill_fp8" else ("k_nope",)
    return tuple((name, COLUMNS[name][0]) for name in (*per_head, "k_pe"))


def build(case: Case) -> dict:
    """The named numpy inputs of a case (the keys _util.invoke expects); an input passed as
    columns is the wider tensor, random outside its columns."""
    b, act = case.bucket, ACT[case.act]
    rng = np.random.default_rng(case.seed)
    T, H = b.tokens, b.heads
    a = dict(
        kv_c_normed=activations(rng, (T, 512), act),
        k_pe=activations(rng, (T, 64) if b.k_pe_rank == 2 else (T, 1, 64), act),
    )
    if case.fmt.startswith("decode"):
        a.update(ql_nope=activations(rng, (T, H, 512), act), q_pe=activations(rng, (T, H, 64), act))
    else:
        a.update(q=activations(rng, (T, H, 192), act), k_nope=activations(rng, (T, H, 128), act))
    if case.fmt == "prefill_fp8":
        a["v"] = activations(rng, (T, H, 128), act)
    scales = dict(zip(("q", "k", "v", "cache"), case.scales))
    for name in {"prefill_fp8": ("q", "k", "v", "cache"), "decode_fp8": ("q", "cache")}.get(case.fmt, ()):
        a[f"{name}_scale_inv"] = np.full(b.scale_shape, scales[name], np.float32)
    a["kv_cache"] = sentinel(rng, *cache_shape_dtype(case.fmt, act, b.num_blocks, b.block_size))
    a["slot_mapping"] = np.array(case.slots, b.index_dtype)
    if case.rope:
        a["positions"] = np.array(case.positions, b.index_dtype)
        a["cos_sin_cache"] = (rng.uniform(-1.5, 1.5, (b.max_position, 64)).astype(np.float32) if case.random_table
                              else np.asarray(jax_kimi_mla.make_cos_sin_cache(b.max_position)))
    for name, start in column_spec(case):
        x = a[name]
        wide = activations(rng, (*x.shape[:-1], COLUMNS[name][1]), act)
        wide[..., start : start + x.shape[-1]] = x
        a[name] = wide
    return a


@functools.cache
def jitted_with_columns(impl, fmt: str, spec: tuple):
    """_util.jitted, with the inputs named in ``spec`` passed as columns(wide, start)."""
    def call(a):
        return invoke(impl, fmt, dict(a, **{name: jax_kimi_mla.columns(a[name], start) for name, start in spec}))
    return jax.jit(call)


# ---- comparing outputs row by row ----


def rows_of(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1, x.shape[-1])


def row_bits(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def ordered(x) -> np.ndarray:
    """Sign-magnitude float bits as integers in value order: neighbouring values differ by 1."""
    u = np.ascontiguousarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint8).astype(np.int64)
    sign = 1 << (8 * x.dtype.itemsize - 1)
    return np.where(u & sign, -(u & (sign - 1)), u)


def rope_regions(case: Case, act) -> list:
    """Per output: None, or (start, stop, dtype) of its RoPE'd values along the last axis, in the
    output's own elements (bytes for a ds_mla cache), with the dtype to compare them in."""
    out = []
    for _, kind, rope_from in OUTPUTS[case.fmt]:
        if not case.rope or (rope_from is None and kind != "ds_mla"):
            out.append(None)
        elif kind == "ds_mla":
            out.append((528, 656, BF16))
        else:
            out.append((rope_from, None, act if kind == "act" else FP8))
    return out


def rows_match(got, want, region) -> np.ndarray:
    """Per row: bit-equal outside ``region``; inside it at most 1 ulp apart, NaN matching NaN."""
    got, want = rows_of(got), rows_of(want)
    if region is None:
        return (row_bits(got) == row_bits(want)).all(1)
    lo, hi, dtype = region
    hi = hi or got.shape[1]
    outside = (row_bits(got[:, :lo]) == row_bits(want[:, :lo])).all(1)
    outside &= (row_bits(got[:, hi:]) == row_bits(want[:, hi:])).all(1)
    g, w = (np.ascontiguousarray(x[:, lo:hi]).view(dtype) for x in (got, want))
    g_nan, w_nan = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    close = np.where(g_nan | w_nan, g_nan & w_nan, np.abs(ordered(g) - ordered(w)) <= 1)
    return outside & close.all(1)


def duplicate_groups(slots, num_rows: int) -> dict:
    """Valid slot -> the tokens that write it, in token order."""
    groups = {}
    for t, s in enumerate(slots):
        if 0 <= s < num_rows:
            groups.setdefault(s, []).append(t)
    return groups


def rounds(slots: np.ndarray, groups: dict) -> list:
    """slot_mappings in which every duplicate group has one writer: round k keeps member k."""
    out = []
    for k in range(max((len(g) for g in groups.values()), default=1)):
        s = slots.copy()
        for group in groups.values():
            for i, t in enumerate(group):
                if i != min(k, len(group) - 1):
                    s[t] = -1
        out.append(s)
    return out


def run(impl, case: Case, a: dict, backend: str, slots=None) -> list:
    a = a if slots is None else {**a, "slot_mapping": slots}
    spec = column_spec(case)
    fn = jitted_with_columns(impl, case.fmt, spec) if spec else jitted(impl, case.fmt)
    return [np.asarray(x) for x in fn(put(a, backend))]


def assert_outputs(got, want, regions, what: str):
    """The per-token outputs (all but the cache) match."""
    for i, (g, w, r) in enumerate(zip(got[:-1], want[:-1], regions)):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (what, i, g.shape, w.shape, g.dtype, w.dtype)
        bad = np.flatnonzero(~rows_match(g, w, r))
        assert bad.size == 0, f"{what}: output {i} differs in rows {bad[:8]} of its [T*H, width] rows"


def addressed_rows_only_changed(got, initial, groups, what: str) -> np.ndarray:
    """Asserts that rows no valid slot addresses are unchanged; returns the addressed-row mask."""
    addressed = np.zeros(len(got), bool)
    addressed[list(groups)] = True
    unchanged = (row_bits(got) == row_bits(initial)).all(1)
    bad = np.flatnonzero(~addressed & ~unchanged)
    assert bad.size == 0, f"{what}: rows {bad[:8]} changed although no valid slot addresses them"
    return addressed


def assert_cache(got, initial, candidates, groups, region, what: str):
    """Unaddressed rows unchanged; each addressed row equal to one of its candidates' rows."""
    got, initial = rows_of(got), rows_of(initial)
    addressed = addressed_rows_only_changed(got, initial, groups, what)
    ok = np.zeros(len(got), bool)
    for c in candidates:
        ok |= rows_match(got, c, region)
    bad = np.flatnonzero(addressed & ~ok)
    assert bad.size == 0, f"{what}: rows {bad[:8]} hold none of their tokens' entries {[groups[r] for r in bad[:8]]}"


def assert_cache_words(got, initial, candidates, groups, what: str):
    """On the GPU, tokens sharing a slot race and each of their stores (16, 8 or 4 bytes) lands
    whole: unaddressed rows unchanged; every 4-byte word of an addressed row is that word of one of
    its candidates' rows, bit for bit."""
    got, initial = rows_of(got), rows_of(initial)
    addressed = addressed_rows_only_changed(got, initial, groups, what)
    words = row_bits(got).view(np.uint32)
    ok = np.zeros(words.shape, bool)
    for c in candidates:
        ok |= words == row_bits(rows_of(c)).view(np.uint32)
    bad = np.flatnonzero(addressed & ~ok.all(1))
    assert bad.size == 0, f"{what}: rows {bad[:8]} hold words of none of their tokens {[groups[r] for r in bad[:8]]}"


def check(case: Case, backend: str):
    a = build(case)
    regions = rope_regions(case, ACT[case.act])
    groups = duplicate_groups(case.slots, case.num_rows)
    slot_rounds = rounds(a["slot_mapping"], groups)
    with x64_if(case.bucket.index_dtype):
        candidates = [run(reference, case, a, "cpu", s)[-1] for s in slot_rounds]
        want = run(reference, case, a, "cpu")
        got = run(jax_kimi_mla, case, a, backend)
        if backend != "cpu":
            cpu_candidates = [run(jax_kimi_mla, case, a, "cpu", s)[-1] for s in slot_rounds]
            cpu_got = run(jax_kimi_mla, case, a, "cpu")
    # The reference itself: unaddressed rows kept, a duplicated row holds exactly one candidate.
    assert_cache(want[-1], a["kv_cache"], candidates, groups, None, "reference")
    assert_outputs(got, want, regions, f"{backend} handler vs reference")
    if backend == "cpu":
        assert_cache(got[-1], a["kv_cache"], candidates, groups, regions[-1], "cpu handler vs reference")
    else:  # the CPU handler is checked against the reference on the "cpu" run
        exact = [None] * len(regions)
        assert_outputs(got, cpu_got, exact, f"{backend} handler vs CPU handler")
        assert_cache_words(got[-1], a["kv_cache"], cpu_candidates, groups, f"{backend} handler vs CPU handler")


@pytest.mark.parametrize("fmt", FORMATS)
@PROFILE
@given(data=st.data())
def test_handler_matches_reference(backend, fmt, data):
    case = data.draw(cases(fmt), label="case")
    note(f"duplicate groups: {duplicate_groups(case.slots, case.num_rows)}")
    check(case, backend)


# Hostile indices that a careless kernel gets wrong, checked on every run whatever hypothesis draws.
EDGE_CASES = {
    "int64 indices that truncate into range": (
        Bucket(9, 3, 2, 4, 16, "int64", 2, (1,), True),
        (2**32, 2**32 + 7, -(2**32), 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 3, 3),
        (2**32 + 5, -(2**32) + 1, 2**63 - 1, -(2**63), 15, 16, -1, 0, 2**31),
    ),
    "int32 limits": (
        Bucket(5, 0, 4, 3, 7, "int32", 3, (), True),
        (2**31 - 1, -(2**31), 12, -1, 11),
        (2**31 - 1, -(2**31), 7, -1, 6),
    ),
    "every token on one slot": (Bucket(16, 2, 16, 1, 40, "int32", 2, (), False), (15,) * 16, tuple(range(16))),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("edge", sorted(EDGE_CASES))
def test_edge_indices(backend, fmt, rope, edge):
    bucket, slots, positions = EDGE_CASES[edge]
    check(Case(fmt, bucket, "bf16", rope, 7, slots, positions), backend)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int64_numpy_indices_without_x64(backend, fmt):
    """With x64 off, numpy int64 indices cannot become jax int64 arrays. The op must not truncate
    them silently: slot 2**32 + 1 must not write row 1, position 2**32 + 3 must be clamped, not
    read as 3. (The reference, run with x64 on, says what is right.)"""
    b = Bucket(2, 2, 4, 2, 16, "int64", 2, (), False)
    case = Case(fmt, b, "bf16", True, 11, (2**32 + 1, -(2**32) + 2), (2**32 + 3, -(2**32) + 5))
    a = build(case)
    with x64_if("int64"):
        want = run(reference, case, a, "cpu")
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: int64 indices stay int64")
    with jax.default_device(device(backend)):  # the op maps them (docs/SPEC.md), it does not refuse them
        got = [np.asarray(x) for x in invoke(jax_kimi_mla, fmt, a)]
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"], f"{fmt} kv_cache (numpy int64 slots, x64 off)")
    check_against_reference(fmt, got, want, True, a["slot_mapping"])
