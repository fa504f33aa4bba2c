"""In-place updates: with the cache (and, under RoPE, prefill's q) donated, the compiled program
aliases it to the output with no copy, and the result lives in the donated buffer; without
donation the result is the same and the input is untouched. Plus the op among other work, and
a multi-layer cache updated layer by layer under lax.scan."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    OUTPUTS,
    Case,
    assert_bits_equal,
    assert_equal_nan_aware,
    check_against_reference,
    check_untouched_rows,
    invoke,
    make_case,
    nope_expected,
    positional,
    put,
    run_reference,
    split_args,
    to_numpy,
)

import jax_kimi_mla
from jax_kimi_mla.formats import EPILOGUES


def op_of(fmt):
    """The public op of ``fmt``, its target selected: a function of positional(fmt) plus keyword
    arrays."""
    e = EPILOGUES[fmt]
    return functools.partial(getattr(jax_kimi_mla, e.op), **e.static_kwargs)


def output_index(fmt, name):
    return [n for n, _, _ in OUTPUTS[fmt]].index(name)


def check_result(fmt, got, a, rope):
    """Correct whatever the aliasing: against the reference, untouched rows against the input."""
    check_against_reference(fmt, got, run_reference(fmt, a), rope, a["slot_mapping"])
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])


def aliased_param(hlo: str, output: int):
    """The parameter an output of the entry computation is aliased to, from the module header."""
    m = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", hlo)
    if m is None:
        return None
    hit = re.search(rf"\{{{output}\}}:\s*\((\d+),\s*\{{\}}", m.group(1))
    return None if hit is None else int(hit.group(1))


def copies_of(hlo: str, shape: tuple) -> list:
    """Copy instructions producing an array of this shape (an aliased buffer must not be copied)."""
    dims = ",".join(map(str, shape))
    entry = hlo[hlo.index("\nENTRY"):]  # a copy inside a fusion body is part of computing a value
    return [line for line in entry.splitlines() if re.search(rf"\[{dims}\]\{{[^}}]*\}} copy(-start)?\(", line)]


def owned(x):
    """A device buffer XLA owns: device_put of a numpy array on the CPU may borrow the numpy
    memory, and such a buffer is copied instead of donated."""
    return jnp.copy(x)


def run_donated(backend, fmt, a, donated):
    """Jits the op with ``donated`` operands donated; returns (compiled text, input pointers,
    outputs)."""
    argnums = tuple(i for i, n in enumerate(positional(fmt)) if n in donated)
    step = jax.jit(op_of(fmt), donate_argnums=argnums)
    args, kwargs = split_args(fmt, put(a, backend))
    args = [owned(x) if n in donated else x for n, x in zip(positional(fmt), args)]
    hlo = step.lower(*args, **kwargs).compile().as_text()
    pointers = {n: args[positional(fmt).index(n)].unsafe_buffer_pointer() for n in donated}
    return hlo, pointers, step(*args, **kwargs)


def check_in_place(fmt, name, hlo, pointers, got, shape):
    param, out = positional(fmt).index(name), output_index(fmt, name)
    assert aliased_param(hlo, out) == param, f"{name}: output {out} is not aliased to parameter {param}"
    assert not copies_of(hlo, shape), f"{name} is copied: {copies_of(hlo, shape)}"
    assert got[out].unsafe_buffer_pointer() == pointers[name], f"{name}: the result is not in the donated buffer"


CASES = [
    pytest.param(fmt, rope, id=f"{fmt}-{'rope' if rope else 'nope'}")
    for fmt in OUTPUTS
    for rope in (False, True)
]


@pytest.mark.parametrize("fmt,rope", CASES)
def test_donated_cache_is_updated_in_place(backend, fmt, rope):
    a = make_case(Case(fmt, 11, 3, rope=rope, seed=7))
    hlo, pointers, got = run_donated(backend, fmt, a, {"kv_cache"})
    check_in_place(fmt, "kv_cache", hlo, pointers, got, a["kv_cache"].shape)
    check_result(fmt, to_numpy(got), a, rope)


@pytest.mark.parametrize("fmt", ["prefill_bf16", "prefill_fp8_ds_mla"])
def test_q_is_rotated_in_place_inside_a_step(backend, fmt):
    """With RoPE the prefill ops return q aliased to their q operand. In a model step q is an
    intermediate (q_b_proj's output), so XLA rotates it in its own buffer: no copy of q."""
    a = make_case(Case(fmt, 11, 3, rope=True, seed=7))
    q_shape = a["q"].shape

    def step(minus_q_flat, rest):
        q = (-minus_q_flat).reshape(q_shape)  # produced inside the step (exactly), as by a projection
        return invoke(jax_kimi_mla, fmt, dict(rest, q=q))

    rest = put({k: v for k, v in a.items() if k != "q"}, backend)
    q_flat = put(-a["q"].reshape(q_shape[0], -1), backend)
    hlo = jax.jit(step).lower(q_flat, rest).compile().as_text()
    assert re.search(r"output_to_operand_aliasing=\{\{1\}: \(0, \{\}\)", hlo), "q out is not aliased to q"
    assert not copies_of(hlo, q_shape), f"q is copied: {copies_of(hlo, q_shape)}"
    check_result(fmt, to_numpy(jax.jit(step)(q_flat, rest)), a, True)


@pytest.mark.xfail(strict=True, reason="jax pairs a donated argument with the FIRST output of its "
                   "shape; k [T,H,192] comes before q, so XLA copies q (documented in ops.py)")
@pytest.mark.parametrize("fmt", ["prefill_bf16", "prefill_fp8_ds_mla"])
def test_donated_q_argument_is_rotated_in_place(backend, fmt):
    a = make_case(Case(fmt, 11, 3, rope=True, seed=7))
    hlo, pointers, got = run_donated(backend, fmt, a, {"q", "kv_cache"})
    check_result(fmt, to_numpy(got), a, True)
    check_in_place(fmt, "kv_cache", hlo, pointers, got, a["kv_cache"].shape)
    check_in_place(fmt, "q", hlo, pointers, got, a["q"].shape)


@pytest.mark.parametrize("fmt,rope", CASES)
def test_without_donation_input_is_kept(backend, fmt, rope):
    a = make_case(Case(fmt, 11, 3, rope=rope, seed=8))
    pristine = {k: v.copy() for k, v in a.items()}  # on the CPU, device arrays may share a's memory
    args, kwargs = split_args(fmt, put(a, backend))
    got = to_numpy(jax.jit(op_of(fmt))(*args, **kwargs))
    check_result(fmt, got, pristine, rope)
    for name, x in zip(positional(fmt), args):
        assert_bits_equal(np.asarray(x), pristine[name], f"input {name} after the call")


def test_chained_steps_stay_in_one_buffer(backend):
    """Several decode steps on one donated cache: always the same buffer, every step's rows there."""
    base = make_case(Case("decode_bf16", 4, 2, seed=9))
    step = jax.jit(op_of("decode_bf16"), donate_argnums=(4,))
    cache = owned(put(base["kv_cache"], backend))
    pointer = cache.unsafe_buffer_pointer()
    want = base["kv_cache"].copy()
    for i in range(3):
        a = make_case(Case("decode_bf16", 4, 2, seed=10 + i))
        a["slot_mapping"] = np.arange(4 * i, 4 * i + 4, dtype=np.int32)
        a["kv_cache"] = want
        want = nope_expected("decode_bf16", a)[-1]
        args, kwargs = split_args("decode_bf16", put({k: v for k, v in a.items() if k != "kv_cache"} | {"kv_cache": cache}, backend))
        _, cache = step(*args, **kwargs)
        assert cache.unsafe_buffer_pointer() == pointer, f"step {i}: the cache moved"
    assert_bits_equal(np.asarray(cache), want, "cache after 3 steps")


@pytest.mark.parametrize("fmt,rope", [("prefill_bf16", False), ("decode_fp8_ds_mla", True)])
def test_op_among_other_work(backend, fmt, rope):
    """A matmul produces the op's inputs and a reduction consumes its outputs, in one jit with
    the cache donated: the same as the reference in the same program."""
    T, H, D = 9, 2, 32
    case = Case(fmt, T, H, rope=rope, seed=12)
    a = make_case(case)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = (rng.standard_normal((D, 576)) / np.sqrt(D)).astype(np.float32)

    def layer(impl, x, w, kv_cache, a):
        latent = (x @ w).astype(a["kv_c_normed"].dtype)  # [kv_c | k_pe], as kv_a_proj gives it
        a = dict(a, kv_c_normed=latent[:, :512], k_pe=latent[:, 512:], kv_cache=kv_cache)
        out = invoke(impl, fmt, a)
        first = out[0].astype(jnp.float32)
        return jnp.sum(first * first, axis=(1, 2)), out

    rest = {k: v for k, v in a.items() if k != "kv_cache"}
    cache = owned(put(a["kv_cache"], backend))
    pointer = cache.unsafe_buffer_pointer()
    got_sum, got = jax.jit(functools.partial(layer, jax_kimi_mla), donate_argnums=(2,))(*put((x, w), backend), cache, put(rest, backend))
    assert got[-1].unsafe_buffer_pointer() == pointer, "the cache was not updated in place"
    # The reference on the same backend: both sides then start from the same matmul result.
    want_sum, want = jax.jit(functools.partial(layer, jax_kimi_mla.reference))(*put((x, w, a["kv_cache"], rest), backend))
    got, want = to_numpy(got), to_numpy(want)
    check_against_reference(fmt, got, want, rope, a["slot_mapping"], steps=1 if backend == "cpu" else 2)
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])
    np.testing.assert_allclose(np.asarray(got_sum), np.asarray(want_sum), rtol=1e-3 if rope else 1e-6)

@pytest.mark.parametrize("fmt", list(EPILOGUES))
def test_stacked_cache_is_written_whole(backend, fmt):
    """A stack [layers, N, bs, W] is taken as it is: slot s addresses row s of the whole buffer,
    the same bits as the flat [layers * N, bs, W] view (docs/SPEC.md; the layer writes a stack of
    layers this way, without reshaping the donated buffer)."""
    a = make_case(Case(fmt, 7, 2, rope=True, seed=31))
    flat = a["kv_cache"]
    stacked = flat.reshape(flat.shape[0], 1, *flat.shape[1:])  # a stack of one-block layers
    want = to_numpy(jax.jit(functools.partial(invoke, jax_kimi_mla, fmt))(put(a, backend)))
    got = to_numpy(jax.jit(functools.partial(invoke, jax_kimi_mla, fmt))(put(dict(a, kv_cache=stacked), backend)))
    for (name, _, _), g, w in zip(OUTPUTS[fmt], got, want):
        assert_bits_equal(g.reshape(w.shape), w, f"{name}: stacked vs flat")
    assert got[-1].shape == stacked.shape


@pytest.mark.parametrize("fmt", ["decode_bf16", "prefill_fp8_ds_mla", "decode_fp8"])
def test_scan_over_layers(backend, fmt):
    """A [layers, N, bs, width] cache carried through lax.scan, each layer inserting into its
    own slice, equals a Python loop over the layers. (Values only: this slice-and-set pattern
    copies a layer each step; README pattern 4, the flat view with offset slots, is the copy-free
    one, tested for copies in test_copy_traps.py.)"""
    layers = 3
    per_layer = [make_case(Case(fmt, 7, 2, rope=True, seed=20 + i)) for i in range(layers)]
    stacked = {k: np.stack([a[k] for a in per_layer]) for k in per_layer[0] if k not in ("kv_cache", "cos_sin_cache")}
    caches = np.stack([a["kv_cache"] for a in per_layer])
    table = per_layer[0]["cos_sin_cache"]

    def model(caches, stacked, table):
        def body(caches, xs):
            i, inputs = xs
            out = invoke(jax_kimi_mla, fmt, dict(inputs, kv_cache=caches[i], cos_sin_cache=table))
            return caches.at[i].set(out[-1]), out[:-1]

        return jax.lax.scan(body, caches, (jnp.arange(layers), stacked))

    got_caches, got_outs = to_numpy(jax.jit(model, donate_argnums=(0,))(*put((caches, stacked, table), backend)))
    single = jax.jit(functools.partial(invoke, jax_kimi_mla, fmt))
    for i, a in enumerate(per_layer):
        want = to_numpy(single(put(a, backend)))
        for (name, _, _), g, w in zip(OUTPUTS[fmt][:-1], (o[i] for o in got_outs), want):
            assert_bits_equal(g, w, f"layer {i} {name}: scan vs loop")
        # This test's own dynamic_update_slice of a bf16 array may canonicalize the sentinels'
        # NaN payloads on the CPU (XLA, not the op): NaN matches NaN here.
        assert_equal_nan_aware(got_caches[i], want[-1], f"layer {i} kv_cache: scan vs loop")
