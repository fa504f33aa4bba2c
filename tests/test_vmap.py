"""jax.vmap over the ops (jax_kimi_mla/_batching.py): a batch of epilogue calls is one call on the
stacked caches, in place; a batch of mla_decode_attention or gather_mla_cache calls is one call over
the batch's sequences; what cannot be folded (per-element scales or cos/sin tables) runs as a
loop. Each is checked bit for bit against the calls one by one, on fresh random data, with slots
and block ids that lie just past one element's cache (they must not reach the next element's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_decode_attention as attention
from _util import FORMATS, OUTPUTS, Case, assert_bits_equal, check_untouched_rows, invoke, jitted, make_case, put, to_numpy
from test_copy_traps import aliased_parameters, compiled, copies, copy_fusions, parameters_of_shape

import jax_kimi_mla
from jax_kimi_mla import _batching
from jax_kimi_mla.formats import EPILOGUES

V = 3
SHARED = ("cos_sin_cache", "q_scale_inv", "k_scale_inv", "v_scale_inv", "cache_scale_inv")


def epilogue_batch(fmt, rope=True, **case):
    """V calls' named inputs (fresh data each; the same cos/sin table and scales), stacked, and the
    shared ones apart."""
    # 13 tokens: the slot patterns include -1 and num_rows (t = 8, 12), next to other elements' rows.
    cases = [make_case(Case(fmt, 13, 2, rope=rope, seed=s, **case)) for s in range(V)]
    shared = {k: v for k, v in cases[0].items() if k in SHARED}
    batched = {k: np.stack([a[k] for a in cases]) for k in cases[0] if k not in shared}
    return cases, batched, shared


def vmapped(fmt):
    """The op of ``fmt`` vmapped over its batched inputs (the first dict), the shared ones apart."""
    return jax.jit(jax.vmap(lambda b, s: invoke(jax_kimi_mla, fmt, {**b, **s}), in_axes=(0, None)))


def check_against_one_by_one(fmt, got, cases, backend):
    for i, a in enumerate(cases):
        # Which of two tokens writing one row wins is unspecified (the GPU's order differs between
        # a single call and a folded one), so a bit-for-bit comparison needs distinct rows.
        slots, rows = a["slot_mapping"], a["kv_cache"].size // a["kv_cache"].shape[-1]
        valid = slots[(slots >= 0) & (slots < rows)]
        assert np.unique(valid).size == valid.size, f"case {i}: two tokens write one row"
        one = to_numpy(jitted(jax_kimi_mla, fmt)(put(a, backend)))
        for (name, _, _), g, w in zip(OUTPUTS[fmt], got, one):
            assert_bits_equal(g[i], w, f"vmap {fmt} {name}[{i}] vs a single call")
        check_untouched_rows(got[-1][i], a["kv_cache"], a["slot_mapping"], f"vmap {fmt} kv_cache[{i}]")


def one_call(hlo: str) -> bool:
    """One FFI call, and no loop around it."""
    return hlo.count('custom_call_target="jax_kimi_mla_') == 1 and " while(" not in hlo


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_epilogue_batch_is_one_call(backend, fmt, rope):
    """Batched caches and tokens, shared scales: one FFI call, the stacked cache updated in place
    (donated: aliased, never copied), each element as its own call would leave it."""
    cases, batched, shared = epilogue_batch(fmt, rope)
    step = vmapped(fmt)
    got = to_numpy(step(put(batched, backend), put(shared, backend)))
    check_against_one_by_one(fmt, got, cases, backend)
    if backend == "cpu":
        op = jax.vmap(lambda b, c, s: invoke(jax_kimi_mla, fmt, {**b, "kv_cache": c, **s}), in_axes=(0, 0, None))
        rest = {k: v for k, v in batched.items() if k != "kv_cache"}
        hlo = compiled(jax.jit(op, donate_argnums=1), rest, batched["kv_cache"], shared)
        assert one_call(hlo), hlo
        stack = batched["kv_cache"].shape
        assert set(parameters_of_shape(hlo, stack)) <= aliased_parameters(hlo), "the stacked cache is not aliased"
        assert not copies(hlo, [stack]), "the stacked cache is copied"


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("fmt", ["prefill_bf16", "prefill_fp8_ds_mla"])
def test_vmapped_standalone_prefill_step_copies_nothing(fmt, rope):
    """The op docstring's standalone prefill step (q and the cache donated, q returned first), under
    jax.vmap: q, rotated in place with RoPE, reaches the call with the batch in front, so neither
    q nor the stacked cache is copied."""
    _, batched, shared = epilogue_batch(fmt, rope)
    op = getattr(jax_kimi_mla, EPILOGUES[fmt].op)
    rope_kw = {"positions": batched.pop("positions"), "cos_sin_cache": shared["cos_sin_cache"]} if rope else {}

    def prefill_epilogue(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, rope_kw):
        k, q, kv_cache = op(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, **rope_kw)
        return q, k, kv_cache

    axes = {"positions": 0, "cos_sin_cache": None} if rope else {}
    step = jax.jit(jax.vmap(prefill_epilogue, in_axes=(0, 0, 0, 0, 0, 0, axes)), donate_argnums=(0, 4))
    args = [batched[n] for n in ("q", "k_nope", "k_pe", "kv_c_normed", "kv_cache", "slot_mapping")]
    hlo = compiled(step, *args, rope_kw)
    assert one_call(hlo)
    q, stack = batched["q"].shape, batched["kv_cache"].shape
    watched = [q, (q[0] * q[1], *q[2:]), stack]
    assert not copies(hlo, watched) and not copy_fusions(hlo, watched), "q or the cache is copied"
    assert set(parameters_of_shape(hlo, stack)) <= aliased_parameters(hlo)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batches_of_no_elements(backend, fmt):
    """vmap over 0 elements: outputs of 0 elements, each of one call's shape (the readers too)."""
    cases, batched, shared = epilogue_batch(fmt)
    empty = {k: v[:0] for k, v in batched.items()}
    one = jax.eval_shape(lambda b, s: invoke(jax_kimi_mla, fmt, {**b, **s}), cases[0], shared)
    got = vmapped(fmt)(put(empty, backend), put(shared, backend))
    assert [g.shape for g in got] == [(0, *o.shape) for o in one]


def test_reader_batches_of_no_elements(backend):
    cases, _ = attention_batch("bf16", "bfloat16", 2)
    q, cache, tables, lens = (np.stack([a[k] for a in cases])[:0] for k in ("mqa_q", "kv_cache", "block_tables", "context_lens"))
    device = jax.devices(backend)[0]
    out, lse = jax.vmap(lambda *a: jax_kimi_mla.mla_decode_attention(*a, softmax_scale=0.1, return_lse=True))(
        *jax.device_put((q, cache, tables, lens), device))
    assert out.shape == (0, *q.shape[1:-1], 512) and lse.shape == (0, *q.shape[1:-1])
    rows = jax.vmap(lambda *a: jax_kimi_mla.gather_mla_cache(*a, num_tokens=50))(*jax.device_put((cache, tables, lens), device))
    assert rows.shape == (0, 50, 576)
@pytest.mark.parametrize("fmt", ["prefill_fp8_ds_mla", "decode_fp8"])
def test_epilogue_batch_of_int64_slots(backend, fmt):
    """int64 slots (x64 on), among them values congruent to valid rows modulo 2^32."""
    with jax.enable_x64(True):
        cases, batched, shared = epilogue_batch(fmt, index="int64")
        got = to_numpy(vmapped(fmt)(put(batched, backend), put(shared, backend)))
        check_against_one_by_one(fmt, got, cases, backend)


@pytest.mark.parametrize("fmt", FORMATS)
def test_epilogue_batch_of_stacks_and_nested_batches(backend, fmt):
    """vmap(vmap(op)) over caches that are themselves stacks of two layers: slots range over one
    element's whole stack and no further."""
    cases = [make_case(Case(fmt, 13, 2, rope=True, seed=s)) for s in range(2 * V)]
    for a in cases:
        layer_rows = a["kv_cache"].size // a["kv_cache"].shape[-1]
        a["kv_cache"] = np.stack([a["kv_cache"], a["kv_cache"][::-1]])
        s = a["slot_mapping"]
        to_layer_1 = (s >= 0) & (s < layer_rows) & (np.arange(s.size) % 2 == 1)
        # The slot just past one layer is inside the stack: move it just past the stack, or it
        # may meet a slot moved to layer 1's first row, and which write wins is unspecified.
        a["slot_mapping"] = np.select([to_layer_1, s == layer_rows], [s + layer_rows, 2 * layer_rows], s).astype(s.dtype)
    shared = {k: v for k, v in cases[0].items() if k in SHARED}
    batched = {k: np.stack([a[k] for a in cases]).reshape(2, V, *cases[0][k].shape) for k in cases[0] if k not in shared}
    one = jax.vmap(lambda b, s: invoke(jax_kimi_mla, fmt, {**b, **s}), in_axes=(0, None))
    step = jax.jit(jax.vmap(one, in_axes=(0, None)))
    got = to_numpy(step(put(batched, backend), put(shared, backend)))
    check_against_one_by_one(fmt, [x.reshape(-1, *x.shape[2:]) for x in got], cases, backend)
    if backend == "cpu":
        assert one_call(compiled(step, batched, shared))


@pytest.mark.parametrize("fmt", FORMATS)
def test_epilogue_batch_over_one_cache(backend, fmt):
    """Tokens batched, the cache not: each element updates its own copy of the cache (vmap's
    meaning), still in one call."""
    cases, batched, shared = epilogue_batch(fmt)
    for a in cases:
        a["kv_cache"] = cases[0]["kv_cache"]
    shared["kv_cache"] = batched.pop("kv_cache")[0]
    got = to_numpy(vmapped(fmt)(put(batched, backend), put(shared, backend)))
    check_against_one_by_one(fmt, got, cases, backend)


@pytest.mark.parametrize("fmt", ["prefill_fp8", "decode_fp8"])
def test_epilogue_batch_of_scales_loops(backend, fmt):
    """Per-element scales are not one call's operands: the batch loops, with the same results."""
    cases, batched, shared = epilogue_batch(fmt)
    for i, a in enumerate(cases):
        for name in a:
            if name.endswith("scale_inv"):
                a[name] = a[name] * np.float32(1 + 0.25 * i)
    for name in [n for n in shared if n.endswith("scale_inv")]:
        batched[name] = np.stack([a[name] for a in cases])
        del shared[name]
    step = vmapped(fmt)
    got = to_numpy(step(put(batched, backend), put(shared, backend)))
    check_against_one_by_one(fmt, got, cases, backend)
    if backend == "cpu":
        assert " while(" in compiled(step, batched, shared), "expected the loop"


def attention_batch(fmt, q_dtype, q_tokens):
    """V calls' inputs of one cache size (fresh data each, lengths differing), stacked."""
    lens = [[48, 1, 0], [40, 47, 17], [33, 5, 48]]  # 3 blocks of 16 at most: caches of one size
    cases = [attention.make_case(fmt, q_dtype, lens=lens[v], q_tokens=q_tokens, seed=v) for v in range(V)]
    for a, _ in cases:  # an id just past this element's cache, inside the length: masked, never
        a["block_tables"][0, 1] = a["kv_cache"].shape[0]  # the next element's block 0
    return [a for a, _ in cases], cases[0][1]


@pytest.mark.parametrize("q_tokens", [1, 2])
@pytest.mark.parametrize(("fmt", "q_dtype"), attention.FORMATS)
def test_decode_attention_batch_is_one_call(backend, fmt, q_dtype, q_tokens):
    cases, kw = attention_batch(fmt, q_dtype, q_tokens)
    arrays = {k: v for k, v in kw.items() if isinstance(v, np.ndarray | np.floating)}
    static = {k: v for k, v in kw.items() if k not in arrays}

    def op(a, s):
        return jax_kimi_mla.mla_decode_attention(**a, **s, **static, return_lse=True)

    device = jax.devices(backend)[0]
    for cache_batched in (True, False):
        batched = {k: np.stack([a[k] for a in cases]) for k in cases[0]}
        if not cache_batched:
            batched["kv_cache"] = cases[0]["kv_cache"]
        axes = {k: (0 if cache_batched or k != "kv_cache" else None) for k in batched}
        step = jax.jit(jax.vmap(op, in_axes=(axes, None)))
        out, lse = step(*jax.device_put((batched, arrays), device))
        for v, a in enumerate(cases):
            one = dict(a, kv_cache=a["kv_cache"] if cache_batched else cases[0]["kv_cache"])
            want_out, want_lse = jax.jit(op)(*jax.device_put((one, arrays), device))
            what = f"vmap (cache {'batched' if cache_batched else 'shared'}) [{v}]"
            assert_bits_equal(np.asarray(out[v].astype(jnp.float32)), np.asarray(want_out.astype(jnp.float32)), f"out {what}")
            assert_bits_equal(np.asarray(lse[v]), np.asarray(want_lse), f"lse {what}")
        if backend == "cpu":
            assert one_call(compiled(step, batched, arrays))


@pytest.mark.parametrize("num_tokens", [None, 40, 128, 300])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_gather_batch_is_one_call(backend, fmt, num_tokens):
    """Each element's num_tokens rows as its own call packs them: rows past an element's total are
    zeros, rows past num_tokens dropped (40: every element cut; 300: zeros after each)."""
    cases, kw = attention_batch(fmt, "bfloat16", 1)
    static = {"ds_mla": kw.get("ds_mla", False), "cache_scale_inv": kw.get("cache_scale_inv"), "num_tokens": num_tokens}

    def op(c, t, n):
        return jax_kimi_mla.gather_mla_cache(c, t, n, **static)

    device = jax.devices(backend)[0]
    for cache_batched in (True, False):
        caches = np.stack([a["kv_cache"] for a in cases]) if cache_batched else cases[0]["kv_cache"]
        tables, lens = np.stack([a["block_tables"] for a in cases]), np.stack([a["context_lens"] for a in cases])
        step = jax.jit(jax.vmap(op, in_axes=(0 if cache_batched else None, 0, 0)))
        got = np.asarray(step(*jax.device_put((caches, tables, lens), device)).astype(jnp.float32))
        for v, a in enumerate(cases):
            cache = a["kv_cache"] if cache_batched else cases[0]["kv_cache"]
            want = jax.jit(op)(*jax.device_put((cache, a["block_tables"], a["context_lens"]), device))
            assert_bits_equal(got[v], np.asarray(want.astype(jnp.float32)), f"gather vmap (cache batched: {cache_batched}) [{v}]")
        if backend == "cpu":
            assert one_call(compiled(step, caches, tables, lens))


def test_offsets_that_overflow_the_index_dtype_loop_or_widen():
    ids = jnp.array([[0, 5, -1, 1 << 29]], jnp.int32)
    assert _batching._offset_ids(jnp.broadcast_to(ids, (3, 4)), 1 << 30, 3) is None
    with jax.enable_x64(True):
        got = _batching._offset_ids(jnp.broadcast_to(ids, (3, 4)), 1 << 30, 3)
        assert got.dtype == jnp.int64
        np.testing.assert_array_equal(got[2], [2 << 30, (2 << 30) + 5, -1, (2 << 30) + (1 << 29)])
