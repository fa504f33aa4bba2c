"""Malformed calls fail while jax.jit traces them, before anything runs, with a ValueError or
TypeError that names the offending argument; the FFI op and the reference fail identically."""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from _util import FORMATS, Case, invoke, make_case

import jax_kimi_mla
from jax_kimi_mla import reference, sharding

FIRST = {fmt: "q" if fmt.startswith("prefill") else "ql_nope" for fmt in FORMATS}


def base(fmt):
    return make_case(Case(fmt, 3, 2, rope=True, seed=1))


def shaped(a, name, shape, dtype=None):
    """The argument with a new shape (random data) and optionally dtype."""
    dtype = np.dtype(dtype or a[name].dtype)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    return dict(a, **{name: x.astype(dtype)})


def retyped(a, name, dtype):
    return dict(a, **{name: np.asarray(a[name]).astype(dtype)})


def dropped(a, name):
    return {k: v for k, v in a.items() if k != name}


def with_(a, **kw):
    return dict(a, **kw)


def grown(a, name, axis, by=1):
    shape = list(a[name].shape)
    shape[axis] += by
    return shaped(a, name, tuple(shape))


def common_cases(fmt):
    """(id, mutation, error type, argument the message must name) valid for every format."""
    first = FIRST[fmt]
    per_head = ("k_nope", "v") if fmt == "prefill_fp8" else ("k_nope",) if fmt.startswith("prefill") else ("q_pe",)
    cases = [
        ("first-float32", lambda a: retyped(a, first, np.float32), TypeError, first),
        ("first-rank2", lambda a: shaped(a, first, a[first].shape[::2]), ValueError, first),
        ("first-width", lambda a: grown(a, first, 2, -1), ValueError, first),
        ("kv_c_normed-other-act", lambda a: retyped(a, "kv_c_normed", np.float16), TypeError, "kv_c_normed"),
        ("kv_c_normed-rank3", lambda a: shaped(a, "kv_c_normed", (3, 1, 512)), ValueError, "kv_c_normed"),
        ("kv_c_normed-width", lambda a: shaped(a, "kv_c_normed", (3, 576)), ValueError, "kv_c_normed"),
        ("kv_c_normed-T", lambda a: grown(a, "kv_c_normed", 0), ValueError, "kv_c_normed"),
        ("k_pe-float32", lambda a: retyped(a, "k_pe", np.float32), TypeError, "k_pe"),
        ("k_pe-width", lambda a: shaped(a, "k_pe", (3, 63)), ValueError, "k_pe"),
        ("k_pe-2-heads", lambda a: shaped(a, "k_pe", (3, 2, 64)), ValueError, "k_pe"),
        ("k_pe-rank4", lambda a: shaped(a, "k_pe", (3, 1, 1, 64)), ValueError, "k_pe"),
        ("k_pe-T", lambda a: grown(a, "k_pe", 0), ValueError, "k_pe"),
        ("slot_mapping-float", lambda a: retyped(a, "slot_mapping", np.float32), TypeError, "slot_mapping"),
        ("slot_mapping-int16", lambda a: retyped(a, "slot_mapping", np.int16), TypeError, "slot_mapping"),
        ("slot_mapping-T", lambda a: shaped(a, "slot_mapping", (4,)), ValueError, "slot_mapping"),
        ("slot_mapping-rank2", lambda a: shaped(a, "slot_mapping", (3, 1)), ValueError, "slot_mapping"),
        ("positions-float", lambda a: retyped(a, "positions", np.float32), TypeError, "positions"),
        ("positions-T", lambda a: shaped(a, "positions", (2,)), ValueError, "positions"),
        ("cos_sin_cache-bf16", lambda a: retyped(a, "cos_sin_cache", np.float16), TypeError, "cos_sin_cache"),
        ("cos_sin_cache-width", lambda a: shaped(a, "cos_sin_cache", (97, 32)), ValueError, "cos_sin_cache"),
        ("cos_sin_cache-rank1", lambda a: shaped(a, "cos_sin_cache", (64,)), ValueError, "cos_sin_cache"),
        ("cos_sin_cache-empty", lambda a: shaped(a, "cos_sin_cache", (0, 64)), ValueError, "cos_sin_cache"),
        ("positions-only", lambda a: dropped(a, "cos_sin_cache"), ValueError, "cos_sin_cache"),
        ("cos_sin_cache-only", lambda a: dropped(a, "positions"), ValueError, "positions"),
        ("kv_cache-rank2", lambda a: shaped(a, "kv_cache", a["kv_cache"].shape[1:]), ValueError, "kv_cache"),
        ("kv_cache-width", lambda a: grown(a, "kv_cache", 2, -1), ValueError, "kv_cache"),
        ("kv_cache-misaligned-padding", lambda a: grown(a, "kv_cache", 2, 4), ValueError, "kv_cache"),
        (f"{first}-missing", lambda a: with_(a, **{first: None}), TypeError, first),
    ]
    for name in per_head:
        cases += [
            (f"{name}-other-act", lambda a, n=name: retyped(a, n, np.float16), TypeError, name),
            (f"{name}-width", lambda a, n=name: grown(a, n, 2, -1), ValueError, name),
            (f"{name}-T", lambda a, n=name: grown(a, n, 0), ValueError, name),
            (f"{name}-H", lambda a, n=name: grown(a, n, 1), ValueError, name),
            (f"{name}-rank2", lambda a, n=name: shaped(a, n, (3, a[n].shape[-1])), ValueError, name),
        ]
    return cases


def scale_cases(names):
    cases = []
    for name in names:
        cases += [
            (f"{name}-shape2", lambda a, n=name: with_(a, **{n: np.ones(2, np.float32)}), ValueError, name),
            (f"{name}-shape1x1", lambda a, n=name: with_(a, **{n: np.ones((1, 1), np.float32)}), ValueError, name),
            (f"{name}-float16", lambda a, n=name: with_(a, **{n: np.float16(1.0)}), TypeError, name),
            (f"{name}-int", lambda a, n=name: with_(a, **{n: np.int32(1)}), TypeError, name),
        ]
    return cases


def cache(shape_dtype):
    return lambda a: with_(a, kv_cache=np.zeros(shape_dtype[0], shape_dtype[1]))


N_BS = (3, 16)
FORMAT_CASES = {
    "prefill_bf16": [
        ("uint8-cache", cache(((*N_BS, 576), np.uint8)), TypeError, "kv_cache"),
        ("fp16-cache-for-bf16", cache(((*N_BS, 576), np.float16)), TypeError, "kv_cache"),
        ("ds_mla-cache", cache(((*N_BS, 656), np.uint8)), TypeError, "kv_cache"),
    ],
    "prefill_fp8_ds_mla": [
        ("bf16-cache", cache(((*N_BS, 656), jax.numpy.bfloat16)), TypeError, "kv_cache"),
        ("plain-width", cache(((*N_BS, 576), np.uint8)), ValueError, "kv_cache"),
    ],
    "prefill_fp8": [
        ("bf16-cache", cache(((*N_BS, 576), jax.numpy.bfloat16)), TypeError, "kv_cache"),
        ("uint8-cache", cache(((*N_BS, 576), np.uint8)), TypeError, "kv_cache"),
        ("v-missing", lambda a: with_(a, v=None), TypeError, "v"),
        *scale_cases(("q_scale_inv", "k_scale_inv", "v_scale_inv", "cache_scale_inv")),
    ],
    "decode_bf16": [
        ("ds_mla-cache-without-flag", cache(((*N_BS, 656), np.uint8)), TypeError, "kv_cache"),
        ("fp8-cache-without-scales", cache(((*N_BS, 576), jax.numpy.float8_e4m3fn)), TypeError, "kv_cache"),
        ("fp16-cache-for-bf16", cache(((*N_BS, 576), np.float16)), TypeError, "kv_cache"),
    ],
    "decode_fp8": [
        ("only-q_scale_inv", lambda a: dropped(a, "cache_scale_inv"), ValueError, "cache_scale_inv"),
        ("only-cache_scale_inv", lambda a: dropped(a, "q_scale_inv"), ValueError, "q_scale_inv"),
        ("bf16-cache-with-scales", cache(((*N_BS, 576), jax.numpy.bfloat16)), TypeError, "kv_cache"),
        ("ds_mla-cache-with-scales", cache(((*N_BS, 656), np.uint8)), TypeError, "kv_cache"),
        *scale_cases(("q_scale_inv", "cache_scale_inv")),
    ],
    "decode_fp8_ds_mla": [
        ("bf16-cache", cache(((*N_BS, 576), jax.numpy.bfloat16)), TypeError, "kv_cache"),
        ("fp8-cache", cache(((*N_BS, 576), jax.numpy.float8_e4m3fn)), TypeError, "kv_cache"),
        ("plain-width", cache(((*N_BS, 576), np.uint8)), ValueError, "kv_cache"),
        ("with-scales", lambda a: with_(a, q_scale_inv=np.float32(1), cache_scale_inv=np.float32(1)), ValueError, "q_scale_inv"),
    ],
}

CASES = [
    pytest.param(fmt, mutate, exc, name, id=f"{fmt}-{case_id}")
    for fmt in FORMATS
    for case_id, mutate, exc, name in common_cases(fmt) + FORMAT_CASES[fmt]
]


def trace_error(impl, fmt, a):
    """The exception raised while tracing the call under jax.jit (nothing is run)."""
    with pytest.raises(Exception) as info:
        jax.jit(functools.partial(invoke, impl, fmt)).trace(a)
    return info.value


@pytest.mark.parametrize("fmt,mutate,exc,name", CASES)
def test_malformed_call_raises_at_trace_time(fmt, mutate, exc, name):
    a = mutate(base(fmt))
    err = trace_error(jax_kimi_mla, fmt, a)
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert re.search(rf"(?<![\w]){name}(?![\w])", str(err)), f"message does not name {name}: {err}"
    ref = trace_error(jax_kimi_mla.reference, fmt, a)
    assert (type(ref), str(ref)) == (type(err), str(err)), "the reference raises differently"


@pytest.mark.parametrize("fmt", FORMATS)
def test_well_formed_call_traces(fmt):
    """The base call of the cases above is valid: each error comes from its one mutation."""
    a = base(fmt)
    for impl in (jax_kimi_mla, jax_kimi_mla.reference):
        jax.jit(functools.partial(invoke, impl, fmt)).trace(a)
        jax.jit(functools.partial(invoke, impl, fmt)).trace(dropped(dropped(a, "positions"), "cos_sin_cache"))


def test_eager_call_raises_the_same():
    a = retyped(base("decode_bf16"), "slot_mapping", np.float32)
    with pytest.raises(TypeError, match="slot_mapping") as eager:
        invoke(jax_kimi_mla, "decode_bf16", a)
    assert str(eager.value) == str(trace_error(jax_kimi_mla, "decode_bf16", a))


# ---- errors beyond single calls (docs/ERRORS.md, "Beyond single calls") ----


def test_gradient_through_an_op_names_the_reference():
    q = np.zeros((2, 3, 576), ml_dtypes.bfloat16)
    cache = np.zeros((4, 2, 576), ml_dtypes.bfloat16)
    tables, lens = np.zeros((2, 2), np.int32), np.ones(2, np.int32)

    def loss(impl, q):
        return impl.mla_decode_attention(q, cache, tables, lens, softmax_scale=0.1).astype(np.float32).sum()

    with pytest.raises(TypeError) as e:
        jax.grad(functools.partial(loss, jax_kimi_mla))(q)
    assert str(e.value) == (
        "jax_kimi_mla.mla_decode_attention is inference-only and has no derivative; differentiate"
        " jax_kimi_mla.reference.mla_decode_attention (the same op in jax.numpy) instead"
    )
    assert jax.grad(functools.partial(loss, reference))(q).shape == q.shape


def test_epilogue_gradient_error_names_the_public_op():
    a = base("decode_bf16")
    with pytest.raises(TypeError, match="jax_kimi_mla.fused_mla_decode_q_concat_kv_cache_insert is inference-only"):
        jax.grad(lambda x: invoke(jax_kimi_mla, "decode_bf16", dict(a, ql_nope=x))[0].astype(np.float32).sum())(a["ql_nope"])


def test_unknown_mesh_axis_is_named():
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("tp",))
    with pytest.raises(ValueError) as e:
        sharding.tensor_parallel(jax_kimi_mla.fused_mla_decode_q_concat_kv_cache_insert, mesh, "x")
    assert str(e.value) == "mesh axis 'x' is not in the mesh, whose axes are ('tp',)"


def test_importing_the_source_tree_without_its_compiled_modules_says_what_to_do(tmp_path):
    """The package's Python files alone (no _cpu module): the ImportError says how to fix it.
    (Imported under another name: an editable install's import hook would find the real one.)"""
    package = Path(jax_kimi_mla.__file__).parent
    shutil.copytree(package, tmp_path / "source_tree_copy", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    result = subprocess.run([sys.executable, "-c", "import source_tree_copy"], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "compiled module _cpu was not found" in result.stderr and "pip install -e ." in result.stderr and "-P" in result.stderr


@pytest.mark.parametrize("fmt", ["decode_bf16", "reader"])
def test_gpu_call_without_the_cuda_module_says_how_to_build_it(fmt, monkeypatch):
    """Lowering for CUDA without the CUDA module fails with the build instructions, not XLA's
    unknown custom-call target (forced on machines that have the module); jax.export for CUDA
    still works without it (the artifact only names the targets)."""
    from jax_kimi_mla import _ffi

    monkeypatch.setattr(_ffi, "HAS_CUDA_MODULE", False)
    if fmt == "reader":
        name, args = "gather_mla_cache", (np.zeros((4, 2, 576), ml_dtypes.bfloat16), np.zeros((2, 2), np.int32), np.ones(2, np.int32))
        fn = jax.jit(jax_kimi_mla.gather_mla_cache)
    else:
        a = base(fmt)
        name, args = "fused_mla_decode_q_concat_kv_cache_insert", ()
        fn = jax.jit(lambda: invoke(jax_kimi_mla, fmt, a))
    with pytest.raises(RuntimeError) as e:
        fn.trace(*args).lower(lowering_platforms=("cuda",))
    message = str(e.value)
    assert message.startswith(f"jax_kimi_mla.{name} was called on a GPU, but jax_kimi_mla was built without its CUDA module")
    assert "JAX_KIMI_MLA_CUDA=ON pip install ." in message and "scripts/build_wheel.sh" in message
    disabled = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(op)) for op in _ffi.FFI_TARGETS]
    exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=disabled)(*args)
    assert _ffi.target_name(name if fmt == "reader" else "decode_kv_cache") in exported.mlir_module()
    assert len(fn.trace(*args).lower(lowering_platforms=("cpu",)).as_text()) > 0  # the CPU lowering is untouched
