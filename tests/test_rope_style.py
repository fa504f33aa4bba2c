"""NeoX-style (rotate-half) RoPE, ``rope_style="neox"``: every epilogue and format against the
jnp reference on each backend; against GPT-J on the same values laid out interleaved (bit for
bit: the same pairs, the same arithmetic); q rotated in place; the reference against the formula
of the issue; the layer; bad values of ``rope_style``."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    DS_MLA_PE,
    FORMATS,
    OUTPUTS,
    Case,
    R,
    addressed_rows,
    assert_bits_equal,
    assert_equal_nan_aware,
    check_against_reference,
    check_untouched_rows,
    invoke,
    make_case,
    nope_expected,
    put,
    to_numpy,
    x64_if,
)

import jax_kimi_mla
from jax_kimi_mla import numerics

# x[TO_GPTJ] puts NeoX pair i (elements i, i + 32) at GPT-J's places (2i, 2i + 1); y[FROM_GPTJ]
# moves a GPT-J result back.
TO_GPTJ = np.stack([np.arange(R // 2), np.arange(R // 2) + R // 2], axis=-1).reshape(-1)
FROM_GPTJ = np.argsort(TO_GPTJ)
ROPE_INPUTS = {"q": slice(128, 192), "k_pe": slice(0, R), "q_pe": slice(0, R)}


@functools.cache
def styled(impl, fmt, style):
    """The jitted op (or reference) of ``fmt`` with ``rope_style`` bound (a static keyword)."""
    return jax.jit(lambda a: invoke(impl, fmt, dict(a, rope_style=style)))


def run(impl, fmt, style, a, backend):
    return to_numpy(styled(impl, fmt, style)(put(a, backend)))


def reference(fmt, style, a):
    return run(jax_kimi_mla.reference, fmt, style, a, "cpu")


ACTIVATIONS = ("q", "k_nope", "k_pe", "kv_c_normed", "v", "ql_nope", "q_pe")


def poisoned_run(fmt, style, a, backend):
    """The op, after a call of the same shapes on all-NaN activations: an output element the
    kernel fails to write keeps a NaN from the allocator's last buffer."""
    nan = {n: np.full(x.shape, np.nan, np.float32).astype(x.dtype) if n in ACTIVATIONS else x for n, x in a.items()}
    run(jax_kimi_mla, fmt, style, nan, backend)
    return run(jax_kimi_mla, fmt, style, a, backend)


NEOX_CASES = [
    pytest.param(Case(fmt, 7, 3, act, index, True, k_pe_3d=k3, seed=5), id=f"{fmt}-{act}-{index}-kpe{3 if k3 else 2}")
    for fmt in FORMATS
    for act, index, k3 in (("bf16", "int32", False), ("fp16", "int64", True))
]


@pytest.mark.parametrize("case", NEOX_CASES)
def test_neox_matches_reference(backend, case):
    a = make_case(case)
    pristine = a["kv_cache"].copy()
    with x64_if(case.index):
        want = reference(case.fmt, "neox", a)
        got = poisoned_run(case.fmt, "neox", a, backend)
    check_against_reference(case.fmt, got, want, True, a["slot_mapping"])
    check_untouched_rows(got[-1], pristine, a["slot_mapping"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_neox_differs_from_gptj(backend, fmt):
    """The keyword reaches the kernel: the rotated columns change with the style."""
    a = make_case(Case(fmt, 5, 2, rope=True, seed=8))
    a["positions"] = np.full_like(a["positions"], 37)  # no position 0 (the identity rotation)
    neox, gptj = run(jax_kimi_mla, fmt, "neox", a, backend), run(jax_kimi_mla, fmt, "gptj", a, backend)
    rows = addressed_rows(a["slot_mapping"], a["kv_cache"].shape[0] * a["kv_cache"].shape[1])
    cache_n, cache_g = (x.reshape(-1, x.shape[-1])[rows] for x in (neox[-1], gptj[-1]))
    assert not np.array_equal(cache_n, cache_g)


def _gptj_layout(x, columns):
    x = np.array(x)
    x[..., columns] = x[..., columns][..., TO_GPTJ]
    return x


def _back_from_gptj(fmt, outputs):
    """Every output with its rotated columns moved from GPT-J's places back to NeoX's."""
    back = []
    for (_, kind, rope_from), x in zip(OUTPUTS[fmt], outputs):
        x = np.array(x)
        if kind == "ds_mla":  # the bf16 k_pe part, two bytes per element
            pe = x[..., DS_MLA_PE:].reshape(*x.shape[:-1], R, 2)
            x[..., DS_MLA_PE:] = pe[..., FROM_GPTJ, :].reshape(*x.shape[:-1], 2 * R)
        elif rope_from is not None:
            cols = slice(rope_from, rope_from + R)
            x[..., cols] = x[..., cols][..., FROM_GPTJ]
        back.append(x)
    return back


@pytest.mark.parametrize("fmt", FORMATS)
def test_neox_is_gptj_of_the_interleaved_layout(backend, fmt):
    """NeoX of x equals GPT-J of x with its pairs interleaved, the result moved back: bit for bit
    on every output, since both turn the same pairs by the same cos/sin with the same operations.
    (Of the cache: the rows valid slots address.)"""
    case = Case(fmt, 9, 4, "bf16", rope=True, seed=9)
    a = make_case(case)
    interleaved = {n: _gptj_layout(x, ROPE_INPUTS[n]) if n in ROPE_INPUTS else x for n, x in a.items()}
    neox = run(jax_kimi_mla, fmt, "neox", a, backend)
    via_gptj = _back_from_gptj(fmt, run(jax_kimi_mla, fmt, "gptj", interleaved, backend))
    rows = addressed_rows(a["slot_mapping"], a["kv_cache"].shape[0] * a["kv_cache"].shape[1])
    for (name, _, _), n, g in zip(OUTPUTS[fmt], neox, via_gptj):
        if name == "kv_cache":
            n, g = n.reshape(-1, n.shape[-1])[rows], g.reshape(-1, g.shape[-1])[rows]
        assert_bits_equal(n, g, f"{fmt} {name}: NeoX vs GPT-J of the interleaved layout")


@pytest.mark.parametrize("fmt", FORMATS)
def test_style_without_rope_changes_nothing(backend, fmt):
    a = make_case(Case(fmt, 6, 2, seed=4))
    for (name, _, _), g, w in zip(OUTPUTS[fmt], run(jax_kimi_mla, fmt, "neox", a, backend), nope_expected(fmt, a)):
        assert_bits_equal(g, w, f"{fmt} {name}: NoPE with rope_style='neox'")


@pytest.mark.parametrize("tokens,heads", [(11, 3), (67, 96)])
@pytest.mark.parametrize("fmt", ["prefill_bf16", "prefill_fp8_ds_mla"])
def test_neox_q_is_rotated_in_place_inside_a_step(backend, fmt, tokens, heads):
    """q produced inside the step is rotated in its own buffer (aliased, no copy). A NeoX pair
    spans two chunks of the row: the kernel must read both halves before it writes either (with
    96 heads a token's lanes span several CUDA blocks)."""
    a = make_case(Case(fmt, tokens, heads, rope=True, seed=7))
    q_shape = a["q"].shape

    def step(minus_q_flat, rest):
        q = (-minus_q_flat).reshape(q_shape)  # an intermediate, as q_b_proj's output
        return invoke(jax_kimi_mla, fmt, dict(rest, q=q, rope_style="neox"))

    rest = put({k: v for k, v in a.items() if k != "q"}, backend)
    q_flat = put(-a["q"].reshape(q_shape[0], -1), backend)
    hlo = jax.jit(step).lower(q_flat, rest).compile().as_text()
    assert re.search(r"output_to_operand_aliasing=\{\{1\}: \(0, \{\}\)", hlo), "q out is not aliased to q"
    got = to_numpy(jax.jit(step)(q_flat, rest))
    check_against_reference(fmt, got, reference(fmt, "neox", a), True, a["slot_mapping"])


def test_reference_neox_is_the_formula_of_the_issue():
    """y[i] = x[i] c[i] - x[i+32] s[i], y[i+32] = x[i+32] c[i] + x[i] s[i], in float64 numpy."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 2, R)).astype(np.float32)
    table = np.asarray(jax_kimi_mla.make_cos_sin_cache(50)) * np.float32(1.3)  # a scaled table too
    pos = np.array([0, 3, 49, -2, 70, 11], np.int32)
    rows = table[np.clip(pos, 0, 49)].astype(np.float64)[:, None, :]
    c, s, x0, x1 = rows[..., :32], rows[..., 32:], x[..., :32].astype(np.float64), x[..., 32:].astype(np.float64)
    want = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], -1)
    got = np.asarray(numerics.rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(table), "neox"))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gain", (1.7, 0.3))
@pytest.mark.parametrize("fmt", FORMATS)
def test_neox_with_scaled_tables(backend, fmt, gain):
    a = make_case(Case(fmt, 7, 3, rope=True, seed=17))
    a["cos_sin_cache"] = (a["cos_sin_cache"] * np.float32(gain)).astype(np.float32)
    got = run(jax_kimi_mla, fmt, "neox", a, backend)
    check_against_reference(fmt, got, reference(fmt, "neox", a), True, a["slot_mapping"])


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["NeoX", "rotate_half", "", None, 1, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_rope_style_raises_at_trace_time(fmt, bad):
    a = put(make_case(Case(fmt, 3, 2, rope=True, seed=1)), "cpu")
    errors = []
    for impl in (jax_kimi_mla, jax_kimi_mla.reference):
        with pytest.raises(ValueError) as info:
            jax.jit(lambda a, impl=impl: invoke(impl, fmt, dict(a, rope_style=bad))).trace(a)
        errors.append(str(info.value))
    assert errors[0] == errors[1] == f'rope_style must be "gptj" (interleaved pairs) or "neox" (rotate-half), got {bad!r}'


def test_bad_rope_style_without_rope_still_raises():
    a = make_case(Case("decode_bf16", 2, 1, seed=1))
    with pytest.raises(ValueError, match="rope_style"):
        invoke(jax_kimi_mla, "decode_bf16", dict(a, rope_style="neo-x"))


@pytest.mark.parametrize("reader", ["mla_decode_attention", "gather_mla_cache"])
def test_readers_take_no_rope_style(reader):
    cache = np.zeros((2, 4, 576), jnp.bfloat16)
    tables, lens = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    args = (np.zeros((1, 2, 576), jnp.bfloat16), cache, tables, lens) if reader == "mla_decode_attention" else (cache, tables, lens)
    extra = {"softmax_scale": 0.1} if reader == "mla_decode_attention" else {}
    with pytest.raises(TypeError, match="rope_style"):
        getattr(jax_kimi_mla, reader)(*args, **extra, rope_style="neox")


def test_layer_config_rejects_a_bad_rope_style():
    with pytest.raises(ValueError, match=r'rope_style must be "gptj" .* got \'rotate\''):
        jax_kimi_mla.layer.MLAConfig(rope_style="rotate")


# ---------------------------------------------------------------- the layer


@pytest.mark.parametrize("fmt, seed", [("bf16", 51), ("fp8", 52), ("fp8_ds_mla", 53)])
def test_layer_with_neox_rope_matches_reference(fmt, seed):
    """MLAConfig(rope_style="neox"): prefill, then decode, against the naive float32 reference
    with NeoX RoPE."""
    from test_layer import Run, run_and_check

    run_and_check(Run(fmt, True, seed, rope_style="neox"))


# ---------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_cuda_neox_matches_cpu_handler(fmt, act):
    """Special values (NaN, inf, huge, subnormal) through the CUDA kernel and the CPU handler."""
    from test_ops import _with_special_values

    case = Case(fmt, 37, 5, act, "int64", True, k_pe_3d=True)
    a = _with_special_values(make_case(case), np.random.default_rng(2))
    with x64_if("int64"):
        gpu = run(jax_kimi_mla, fmt, "neox", a, "cuda")
        cpu = run(jax_kimi_mla, fmt, "neox", a, "cpu")
    for (name, _, _), g, c in zip(OUTPUTS[fmt], gpu, cpu):
        assert_equal_nan_aware(g, c, f"{fmt} {name}: CUDA vs CPU handler, NeoX")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_neox_128_heads(fmt):
    a = make_case(Case(fmt, 9, 128, "bf16", "int32", rope=True))
    got = run(jax_kimi_mla, fmt, "neox", a, "cuda")
    check_against_reference(fmt, got, reference(fmt, "neox", a), True, a["slot_mapping"])
    check_untouched_rows(got[-1], a["kv_cache"], a["slot_mapping"])


@pytest.mark.parametrize("fmt", ["prefill_bf16", "decode_fp8"])
def test_tensor_parallel_passes_the_style(fmt):
    """sharding.tensor_parallel keeps rope_style static (a string is no array to shard)."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    a = make_case(Case(fmt, 6, 4, rope=True, seed=21))
    e = jax_kimi_mla.formats.EPILOGUES[fmt]
    op = jax_kimi_mla.sharding.tensor_parallel(functools.partial(getattr(jax_kimi_mla, e.op), **e.static_kwargs), mesh, "tp")
    got = to_numpy(jax.jit(lambda a: invoke_with(op, fmt, a))(a))  # uncommitted: placed by the mesh
    want = run(jax_kimi_mla, fmt, "neox", a, "cpu")
    for (name, _, _), g, w in zip(OUTPUTS[fmt], got, want):
        assert_bits_equal(g, w, f"{fmt} {name}: tensor parallel vs one device, NeoX")


def invoke_with(fn, fmt, a):
    from _util import split_args

    args, kwargs = split_args(fmt, a)
    return fn(*args, **kwargs, rope_style="neox")
