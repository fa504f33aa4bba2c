"""Every op and cache format against the jnp reference (and, without RoPE, against the spec
written out in numpy), on each backend, jitted and eager, vmapped; on a GPU also CUDA vs CPU."""

import contextlib
import functools

import jax
import numpy as np
import pytest
from _util import (
    FORMATS,
    OUTPUTS,
    Case,
    addressed_rows,
    assert_bits_equal,
    assert_equal_nan_aware,
    check_against_reference,
    check_output,
    check_untouched_rows,
    clamped,
    invoke,
    jitted,
    make_case,
    nope_expected,
    put,
    run_reference,
    to_numpy,
    x64_if,
)

import jax_kimi_mla

# A covering set instead of the full product: with each format, every value of every axis
# (T, H, dtype, index dtype, RoPE, k_pe rank, jit/eager, scale shape) appears at least once, and
# the combinations that matter most (RoPE with many heads, RoPE with int64, empty calls, all
# slots invalid) are there explicitly.
SHAPES = [
    # tokens, heads, act, index, rope, k_pe_3d, mode, extra
    (0, 12, "bf16", "int32", False, False, "jit", {}),
    (0, 0, "fp16", "int64", True, True, "eager", {}),
    (1, 1, "fp16", "int64", True, True, "eager", {"scale_shape": (1,)}),
    (13, 0, "bf16", "int64", True, False, "jit", {}),
    (13, 12, "bf16", "int32", True, True, "jit", {"slots": "all_invalid", "scale_shape": (1,)}),
    (67, 96, "fp16", "int32", True, False, "jit", {}),
    (67, 12, "bf16", "int32", False, True, "eager", {}),
    (13, 1, "fp16", "int64", False, False, "jit", {}),
]

CASES = [
    pytest.param(Case(fmt, T, H, act, index, rope, k3, **extra), mode, id=f"{fmt}-T{T}-H{H}-{act}-{index}-{'rope' if rope else 'nope'}-kpe{3 if k3 else 2}-{mode}")
    for fmt in FORMATS
    for T, H, act, index, rope, k3, mode, extra in SHAPES
]

def run_op(fmt, mode, a):
    fn = jitted(jax_kimi_mla, fmt) if mode == "jit" else functools.partial(invoke, jax_kimi_mla, fmt)
    return to_numpy(fn(a))


@pytest.mark.parametrize("case,mode", CASES)
def test_op_matches_reference(backend, case, mode):
    a = make_case(case)
    pristine = a["kv_cache"].copy()  # on the CPU, device arrays may share a's memory
    with x64_if(case.index):
        want = run_reference(case.fmt, a)
        dev = put(a, backend)
        got = run_op(case.fmt, mode, dev)
        assert_bits_equal(np.asarray(dev["kv_cache"]), pristine, "the input cache after a call without donation")
        if case.rope:  # out-of-range positions read the clamped row, whatever the backend
            same = run_op(case.fmt, mode, put(dict(a, positions=clamped(a["positions"], case.max_position)), backend))
            for (name, _, _), g, s in zip(OUTPUTS[case.fmt], got, same):
                assert_bits_equal(g, s, f"{name}: out-of-range positions vs the clamped ones")
    check_against_reference(case.fmt, got, want, case.rope, a["slot_mapping"])
    check_untouched_rows(got[-1], pristine, a["slot_mapping"])
    if not case.rope:
        for (name, _, _), g, w in zip(OUTPUTS[case.fmt], got, nope_expected(case.fmt, a)):
            assert_bits_equal(g, w, f"{case.fmt} {name} vs the spec in numpy (no RoPE: exact)")


def _vmapped_and_batch(backend, fmt):
    """A batch of 3 independent calls (own cache, slots, scales; shared cos/sin table) under
    jax.vmap, and the batch's inputs."""
    cases = [make_case(Case(fmt, 5, 2, rope=True, seed=s)) for s in range(3)]
    for i, a in enumerate(cases):  # distinct scales per batch element
        for name in a:
            if name.endswith("scale_inv"):
                a[name] = a[name] * np.float32(1 + 0.25 * i)
    shared = {"cos_sin_cache": cases[0]["cos_sin_cache"]}
    batched = {k: np.stack([a[k] for a in cases]) for k in cases[0] if k not in shared}
    vmapped = jax.jit(jax.vmap(lambda b, s: invoke(jax_kimi_mla, fmt, {**b, **s}), in_axes=(0, None)))
    return to_numpy(vmapped(put(batched, backend), put(shared, backend))), cases


@pytest.mark.parametrize("fmt", FORMATS)
def test_vmap_matches_loop(backend, fmt):
    """vmap equals the calls one by one (of the cache: the rows valid slots address)."""
    got, cases = _vmapped_and_batch(backend, fmt)
    for i, a in enumerate(cases):
        one = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, backend)))
        for (name, _, _), g, w in zip(OUTPUTS[fmt], got, one):
            g = g[i]
            if name == "kv_cache":
                rows = addressed_rows(a["slot_mapping"], g.shape[0] * g.shape[1])
                g, w = g.reshape(-1, g.shape[-1])[rows], w.reshape(-1, w.shape[-1])[rows]
            assert_bits_equal(g, w, f"vmap {fmt} {name}[{i}] vs a single call")


@pytest.mark.parametrize("fmt", FORMATS)
def test_vmap_keeps_untouched_rows(backend, fmt):
    got, cases = _vmapped_and_batch(backend, fmt)
    for i, a in enumerate(cases):
        check_untouched_rows(got[-1][i], a["kv_cache"], a["slot_mapping"], f"vmap {fmt} kv_cache[{i}]")


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_keeps_untouched_rows(backend, fmt):
    """The oracle itself: sentinel rows (NaN payloads included) come back bit for bit."""
    case = Case(fmt, 13, 2, rope=True)
    a = make_case(case)
    got = to_numpy(jitted(jax_kimi_mla.reference, fmt)(put(a, backend)))
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"], f"reference {fmt} kv_cache")


def _words(row):
    return np.ascontiguousarray(row).view(np.uint8).view(np.uint32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_duplicate_slots(backend, fmt):
    """Tokens sharing a slot: the CPU handler keeps the last (as the reference). On CUDA the
    tokens' threads race and each store lands whole (16, 8 or 4 bytes), so every 4-byte word of
    the row is the same word of one of the candidates' entries (the row may mix candidates)."""
    case = Case(fmt, 9, 2, rope=True)
    a = make_case(case)
    a["slot_mapping"] = np.array([4, 4, 9, 4, -1, 9, 2, 30, 2], np.int32)
    got = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, backend)))
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])
    if backend == "cpu":
        check_against_reference(fmt, got, run_reference(fmt, a), True, a["slot_mapping"])
        return
    # Each token's own entry, from the same kernel: token t alone in row t.
    alone = to_numpy(jitted(jax_kimi_mla, fmt)(put(dict(a, slot_mapping=np.arange(case.tokens, dtype=np.int32)), backend)))[-1]
    entries = alone.reshape(-1, alone.shape[-1])
    rows = got[-1].reshape(-1, got[-1].shape[-1])
    for slot in {4, 9, 2, 30}:
        candidates = [t for t, s in enumerate(a["slot_mapping"]) if s == slot]
        words = np.stack([_words(entries[t]) for t in candidates])
        from_a_candidate = (words == _words(rows[slot])[None]).any(axis=0)
        assert from_a_candidate.all(), f"row {slot}: words {np.flatnonzero(~from_a_candidate)[:8]} are no candidate's ({candidates})"
    for (name, kind, rope_from), g, w in zip(OUTPUTS[fmt][:-1], got, run_reference(fmt, a)):
        check_output(g, w, kind, rope_from, True, f"{fmt} {name}")


# ---------------------------------------------------------------- GPU only


def _with_special_values(a, rng):
    """Puts NaN, +-inf, huge, subnormal and signed-zero values into every activation input."""
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 6e4, -6e4, 3e38, 1e-7, -1e-7, 0.0, -0.0, 448.0, 449.0, 464.0], np.float32)
    for name, x in a.items():
        if name in ("q", "k_nope", "k_pe", "kv_c_normed", "v", "ql_nope", "q_pe"):
            flat = x.reshape(-1).copy()
            where = rng.choice(flat.size, size=max(1, flat.size // 20), replace=False)
            with np.errstate(over="ignore"):  # 3e38 becomes inf in float16, as intended
                flat[where] = rng.choice(special, size=where.size).astype(x.dtype)
            a[name] = flat.reshape(x.shape)
    return a


@pytest.mark.cuda
@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_cuda_matches_cpu_handler(fmt, rope, act):
    """Same inputs (special values included) through the CUDA kernel and the CPU handler: the
    same bits, NaN matching NaN."""
    index = "int64" if rope else "int32"
    case = Case(fmt, 37, 5, act, index, rope, k_pe_3d=rope)
    a = _with_special_values(make_case(case), np.random.default_rng(1))
    with x64_if(index):
        gpu = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, "cuda")))
        cpu = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, "cpu")))
    for (name, _, _), g, c in zip(OUTPUTS[fmt], gpu, cpu):
        assert_equal_nan_aware(g, c, f"{fmt} {name}: CUDA vs CPU handler")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["decode_bf16", "prefill_bf16"])
def test_cuda_many_tokens(fmt):
    """More tokens than one grid dimension holds (65535): every token is still written."""
    case = Case(fmt, 65536 + 37, 2, block_size=64)
    a = make_case(case)
    got = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, "cuda")))
    for (name, _, _), g, w in zip(OUTPUTS[fmt], got, nope_expected(fmt, a)):
        assert_bits_equal(g, w, f"{fmt} {name} with T = {case.tokens}")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_128_heads(fmt):
    case = Case(fmt, 9, 128, "bf16", "int32", rope=True)
    a = make_case(case)
    got = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, "cuda")))
    check_against_reference(fmt, got, run_reference(fmt, a), True, a["slot_mapping"])
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])


@pytest.mark.cuda
@pytest.mark.parametrize("style", [None, "gptj", "neox"], ids=["nope", "gptj", "neox"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_matches_cpu_handler_across_head_counts(fmt, style):
    """The kernel cuts each part of a token's lanes (the cache entry, a head row's nope or pe
    lanes) into blocks whose size it picks per call: head counts that fill them unevenly give the
    CPU handler's bits, the untouched cache rows included. A call of more than about one wave of
    lanes (1024 an SM: the last two cases, on any GPU of up to about 250 SMs) streams: where a
    token's part is smaller than a block, a block holds several tokens' sub-blocks (up to 8; 1029
    and 3001 tokens leave a block's last sub-blocks empty), and a thread of an fp8 nope row takes
    four lanes. From 33 heads a thread of prefill's shared k_pe part stores its rotated chunk for
    several heads (130 GPT-J heads: in two blocks)."""
    extra = {} if style is None else {"rope_style": style}
    step = jax.jit(lambda a: invoke(jax_kimi_mla, fmt, dict(a, **extra)))
    cases = ((2, 37), (3, 6), (7, 37), (12, 37), (17, 6), (33, 37), (65, 6), (96, 6), (130, 6), (12, 1029), (5, 3001))
    for heads, tokens in cases:
        a = make_case(Case(fmt, tokens, heads, rope=style is not None, seed=heads))
        gpu, cpu = to_numpy(step(put(a, "cuda"))), to_numpy(step(put(a, "cpu")))
        for (name, _, _), g, c in zip(OUTPUTS[fmt], gpu, cpu):
            assert_equal_nan_aware(g, c, f"{fmt} {name}, T = {tokens}, H = {heads}, {style or 'NoPE'}: CUDA vs CPU handler")
        check_untouched_rows(gpu[-1], a["kv_cache"], a["slot_mapping"])


@pytest.mark.parametrize("gain", (1.7, 0.3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_cos_sin_tables(backend, fmt, gain):
    """A table whose rows are not unit rotations (YaRN folds its mscale into cos and sin): no op
    may assume cos^2 + sin^2 = 1; each rotates by the table's values, as the reference does."""
    a = make_case(Case(fmt, 7, 3, rope=True, seed=17))
    a["cos_sin_cache"] = (a["cos_sin_cache"] * np.float32(gain)).astype(np.float32)
    pristine = a["kv_cache"].copy()
    want = run_reference(fmt, a)
    got = run_op(fmt, "jit", put(a, backend))
    check_against_reference(fmt, got, want, True, a["slot_mapping"])
    check_untouched_rows(got[-1], pristine, a["slot_mapping"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_jits_with_numpy_operands_closed_over(fmt):
    """The reference is the ops' fallback (and the readers' on pre-Hopper GPUs) and runs inside a
    user's jit, where numpy tables, slots and cos/sin tables are constants that a traced index
    meets: the same values as called eagerly (NaN for NaN: XLA:CPU may canonicalize the payloads of
    a constant's NaNs, here the sentinel cache's)."""
    a = make_case(Case(fmt, tokens=13, heads=3, rope=True))
    want = to_numpy(invoke(jax_kimi_mla.reference, fmt, a))
    got = to_numpy(jax.jit(lambda: invoke(jax_kimi_mla.reference, fmt, a))())
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_equal_nan_aware(g, w, f"{fmt} output {i}")


@pytest.mark.parametrize("reader", ["mla_decode_attention", "gather_mla_cache"])
def test_reader_references_jit_with_numpy_operands_closed_over(reader):
    rng = np.random.default_rng(5)
    cache = rng.standard_normal((6, 16, 576)).astype(np.float32).astype(jax.numpy.bfloat16)
    tables = rng.integers(-1, 7, (3, 4)).astype(np.int32)
    lens = np.array([0, 20, 64], np.int32)
    if reader == "gather_mla_cache":
        call = functools.partial(jax_kimi_mla.reference.gather_mla_cache, cache, tables, lens, num_tokens=90)
    else:
        q = rng.standard_normal((3, 2, 576)).astype(np.float32).astype(jax.numpy.bfloat16)
        call = functools.partial(jax_kimi_mla.reference.mla_decode_attention, q, cache, tables, lens, softmax_scale=0.1,
                                 return_lse=True)
    got, want = to_numpy(jax.jit(call)()), to_numpy(call())
    for i, (g, w) in enumerate(zip(got, want) if isinstance(want, tuple | list) else [(got, want)]):
        assert_bits_equal(g, w, f"{reader} output {i}")


@pytest.mark.parametrize("fmt", ["prefill_fp8", "decode_bf16"])
def test_columns_cross_a_jit_boundary(fmt):
    """columns(...) is a pytree: passed into jax.jit as an argument, it reads the same columns."""
    a = make_case(Case(fmt, tokens=9, heads=2, rope=True))
    if fmt == "prefill_fp8":
        wide = {"k_nope": np.concatenate([a["k_nope"], a["v"]], -1)}
        cols = {"k_nope": jax_kimi_mla.columns(wide["k_nope"], 0), "v": jax_kimi_mla.columns(wide["k_nope"], 128)}
    else:
        cols = {"q_pe": jax_kimi_mla.columns(np.concatenate([a["ql_nope"][..., :128], a["q_pe"]], -1), 128)}
    want = to_numpy(invoke(jax_kimi_mla, fmt, a))
    got = to_numpy(jax.jit(lambda c: invoke(jax_kimi_mla, fmt, dict(a, **c)))(cols))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"{fmt} output {i}")


@pytest.mark.parametrize("x64", [False, True])
def test_python_number_scales_are_float32(x64):
    """A Python float or int scale is taken as float32, with x64 on too (where jnp.asarray(2.5)
    would be float64); a float64 array stays an error naming the argument."""
    a = make_case(Case("decode_fp8", tokens=4, heads=2))
    want = to_numpy(invoke(jax_kimi_mla, "decode_fp8", a))
    with jax.enable_x64(True) if x64 else contextlib.nullcontext():
        got = to_numpy(invoke(jax_kimi_mla, "decode_fp8", dict(a, q_scale_inv=float(a["q_scale_inv"]),
                                                                 cache_scale_inv=float(a["cache_scale_inv"]))))
        ref = to_numpy(invoke(jax_kimi_mla.reference, "decode_fp8", dict(a, q_scale_inv=1, cache_scale_inv=2)))
        assert ref[0].dtype == np.dtype(jax.numpy.float8_e4m3fn)
        with pytest.raises(TypeError, match="q_scale_inv must have dtype float32, got float64"):
            invoke(jax_kimi_mla, "decode_fp8", dict(a, q_scale_inv=np.array(1.3, np.float64)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits_equal(g, w, f"output {i}")
