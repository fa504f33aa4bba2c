"""jax.export of a jitted prefill + decode step (epilogues, then the decode attention over the
cache they wrote): the artifact names the versioned FFI targets, survives serialize/deserialize,
and called on CPU gives what the direct call gives."""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kimi_mla as jkm
from jax_kimi_mla import _ffi

T, B, H, N, BS = 6, 3, 4, 4, 8
TARGETS = {
    "kv": ("prefill_kv_cache", "decode_kv_cache", "mla_decode_attention"),
    "ds_mla": ("prefill_ds_mla", "decode_ds_mla", "mla_decode_attention"),
    "fp8": ("prefill_fp8", "decode_fp8", "mla_decode_attention"),
}
ABI_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ABI.md"


def step(fmt, prefill, decode, cos_sin_cache):
    """One serving step on one cache: insert a prefill chunk (RoPE on), then a decode batch, which
    attends over the cache (two splits, fixed, so that export and direct call run one kernel)."""
    rope = dict(positions=prefill["positions"], cos_sin_cache=cos_sin_cache)
    cache = prefill["kv_cache"]
    args = (prefill["q"], prefill["k_nope"], prefill["k_pe"], prefill["kv_c_normed"])
    if fmt == "fp8":
        scales = (prefill["q_scale_inv"], prefill["k_scale_inv"], prefill["v_scale_inv"], prefill["cache_scale_inv"])
        *prefill_out, cache = jkm.fused_mla_qkv_quant_kv_cache_fp8_insert(
            *args, prefill["v"], cache, prefill["slot_mapping"], *scales, **rope
        )
        decode_format = dict(q_scale_inv=decode["q_scale_inv"], cache_scale_inv=prefill["cache_scale_inv"])
    else:
        op = jkm.fused_mla_key_concat_ds_mla_insert if fmt == "ds_mla" else jkm.fused_mla_key_concat_kv_cache_insert
        *prefill_out, cache = op(*args, cache, prefill["slot_mapping"], **rope)
        decode_format = dict(ds_mla=fmt == "ds_mla")
    mqa_q, cache = jkm.fused_mla_decode_q_concat_kv_cache_insert(
        decode["ql_nope"], decode["q_pe"], decode["kv_c_normed"], decode["k_pe"], cache, decode["slot_mapping"],
        positions=decode["positions"], cos_sin_cache=cos_sin_cache, **decode_format,
    )
    out, lse = jkm.mla_decode_attention(
        mqa_q, cache, decode["block_tables"], decode["context_lens"], softmax_scale=0.125, return_lse=True,
        num_splits=2, **decode_format,
    )
    return (*prefill_out, mqa_q, out, lse, cache)


def make_inputs(fmt, seed):
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 3, dtype)

    slots = rng.permutation(N * BS)[: T + B].astype(np.int32)
    slots[1] = -1  # one padding token
    if fmt == "ds_mla":
        cache = jnp.asarray(rng.integers(0, 256, (N, BS, 656), dtype=np.uint8))
    else:
        cache = normal(N, BS, 576, dtype=jnp.float8_e4m3fn if fmt == "fp8" else jnp.bfloat16)
    prefill = dict(
        q=normal(T, H, 192), k_nope=normal(T, H, 128), k_pe=normal(T, 64), kv_c_normed=normal(T, 512),
        kv_cache=cache, slot_mapping=slots[:T], positions=jnp.asarray(rng.integers(0, 32, T), jnp.int32),
    )
    decode = dict(
        ql_nope=normal(B, H, 512), q_pe=normal(B, H, 64), kv_c_normed=normal(B, 512), k_pe=normal(B, 1, 64),
        slot_mapping=slots[T:], positions=jnp.asarray(rng.integers(32, 64, B), jnp.int32),
        block_tables=jnp.asarray(rng.integers(0, N, (B, 2)), jnp.int32),
        context_lens=jnp.asarray(rng.integers(0, 2 * BS + 1, B), jnp.int32),
    )
    if fmt == "fp8":
        prefill.update(v=normal(T, H, 128), **{f"{n}_scale_inv": jnp.float32(rng.uniform(4, 16)) for n in "qkv"})
        prefill["cache_scale_inv"] = jnp.float32(rng.uniform(4, 16))
        decode["q_scale_inv"] = jnp.float32(rng.uniform(4, 16))
    return prefill, decode, jkm.make_cos_sin_cache(64)


def export(fmt, platforms):
    disabled = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(op)) for op in _ffi.FFI_TARGETS]
    fn = jax.jit(lambda p, d, cs: step(fmt, p, d, cs))
    return jax.export.export(fn, platforms=platforms, disabled_checks=disabled)(*make_inputs(fmt, seed=0))


def bits(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda")], ids=["cpu", "cpu+cuda"])
@pytest.mark.parametrize("fmt", sorted(TARGETS))
def test_exported_step_round_trips_and_matches_the_direct_call(fmt, platforms):
    exported = export(fmt, platforms)
    assert exported.platforms == platforms
    targets = re.findall(r"stablehlo\.custom_call @(\w+)\(", exported.mlir_module())
    assert targets == [f"jax_kimi_mla_{op}_v{jkm.ABI_VERSION}" for op in TARGETS[fmt]]

    blob = exported.serialize()
    assert isinstance(blob, (bytes, bytearray)) and blob
    restored = jax.export.deserialize(blob)
    # A CPU-only export runs on the CPU; the two-platform one on the default device (a GPU there).
    device = jax.devices("cpu")[0] if platforms == ("cpu",) else jax.devices()[0]
    with jax.default_device(device):
        inputs = make_inputs(fmt, seed=1)  # other data than the export was traced with
        got = jax.jit(restored.call)(*inputs)
        want = jax.jit(lambda p, d, cs: step(fmt, p, d, cs))(*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(bits(g), bits(w))
    # The step did write the cache: the exported call is not an identity on it.
    assert not np.array_equal(bits(got[-1]), bits(inputs[0]["kv_cache"]))


def test_export_without_disabling_the_custom_call_check_is_refused():
    fn = jax.jit(lambda p, d, cs: step("kv", p, d, cs))
    with pytest.raises(ValueError, match=_ffi.target_name("prefill_kv_cache")):
        jax.export.export(fn, platforms=("cpu",))(*make_inputs("kv", seed=2))


def test_abi_doc_names_every_target_with_its_version():
    doc = ABI_DOC.read_text()
    for op in _ffi.FFI_TARGETS:
        assert f"`{_ffi.target_name(op)}`" in doc
    assert f"ABI_VERSION = {jkm.ABI_VERSION}" in doc


def test_exported_neox_step_records_its_rope_style():
    """rope_style is an attribute of each epilogue call in the artifact (a v1 handler would not
    know it: hence the _v2 names); the round trip gives the direct call's bits."""
    prefill, decode, cos_sin = make_inputs("kv", seed=3)
    args = (prefill["q"], prefill["k_nope"], prefill["k_pe"], prefill["kv_c_normed"], prefill["kv_cache"], prefill["slot_mapping"])

    def neox(*args):
        return jkm.fused_mla_key_concat_kv_cache_insert(*args, positions=prefill["positions"], cos_sin_cache=cos_sin, rope_style="neox")

    disabled = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(op)) for op in _ffi.FFI_TARGETS]
    exported = jax.export.export(jax.jit(neox), platforms=("cpu",), disabled_checks=disabled)(*args)
    assert re.search(r'rope_style = "neox"', exported.mlir_module()), "rope_style is not in the artifact"
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.export.deserialize(exported.serialize()).call(*args)
        want = jax.jit(neox)(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_exported_decode_attention_records_a_launch_choice():
    """kernel=, programmatic_combine= and balance_splits= are optional attributes of the decode
    attention call in the artifact (docs/ABI.md); a default call has none. The round trip gives the direct call's bits."""
    prefill, decode, _ = make_inputs("kv", seed=5)
    mqa_q = jnp.asarray(np.random.default_rng(5).standard_normal((B, H, 576), np.float32), jnp.bfloat16)
    args = (mqa_q, prefill["kv_cache"], decode["block_tables"], decode["context_lens"])

    def attend(*args, **launch):
        return jkm.mla_decode_attention(*args, softmax_scale=0.125, num_splits=2, **launch)

    disabled = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(op)) for op in _ffi.FFI_TARGETS]
    chosen = functools.partial(attend, kernel="rs-combine", programmatic_combine=False, balance_splits=False)
    exported = jax.export.export(jax.jit(chosen), platforms=("cpu",), disabled_checks=disabled)(*args)
    module = exported.mlir_module()
    assert re.search(r'kernel = "rs-combine"', module) and "programmatic_combine = false" in module and "balance_splits = false" in module
    default = jax.export.export(jax.jit(attend), platforms=("cpu",), disabled_checks=disabled)(*args)
    assert "kernel =" not in default.mlir_module() and "programmatic_combine" not in default.mlir_module()
    assert "balance_splits" not in default.mlir_module()
    balanced = jax.export.export(jax.jit(functools.partial(attend, balance_splits=True)), platforms=("cpu",), disabled_checks=disabled)(*args)
    assert "balance_splits" not in balanced.mlir_module()
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.export.deserialize(exported.serialize()).call(*args)
        want = jax.jit(attend)(*args)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_version_1_names_still_run_as_gptj():
    """A v1 call (no rope_style attribute) through its old name gives what the v2 GPT-J call gives."""
    assert 1 in _ffi.COMPATIBLE_ABI_VERSIONS and jkm.ABI_VERSION == 2
    rng = np.random.default_rng(4)
    B_, H_ = 3, 2
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)  # noqa: E731
    operands = [bf16(B_, H_, 512), bf16(B_, H_, 64), bf16(B_, 512), bf16(B_, 64), bf16(2, 4, 576),
                jnp.asarray([1, -1, 6], jnp.int32), jnp.asarray([0, 5, 9], jnp.int32), jkm.make_cos_sin_cache(16)]
    results = [jax.ShapeDtypeStruct((B_, H_, 576), jnp.bfloat16), jax.ShapeDtypeStruct((2, 4, 576), jnp.bfloat16)]
    with jax.default_device(jax.devices("cpu")[0]):
        v1 = jax.ffi.ffi_call(_ffi.target_name("decode_kv_cache", 1), results)(*operands)
        v2 = jax.ffi.ffi_call(_ffi.target_name("decode_kv_cache"), results)(*operands, rope_style="gptj")
        op = jkm.fused_mla_decode_q_concat_kv_cache_insert(*operands[:6], positions=operands[6], cos_sin_cache=operands[7])
    for a, b, c in zip(v1, v2, op):
        np.testing.assert_array_equal(bits(a), bits(b))
        np.testing.assert_array_equal(bits(a), bits(c))


@pytest.mark.parametrize("op", ["epilogue", "decode_attention", "gather"])
def test_shape_polymorphic_export_is_a_clear_error(op):
    """A symbolic dimension reaches the argument checks, which name the argument (the ops' static
    attributes follow the shapes): ABI.md, "Exporting"."""
    disabled = [jax.export.DisabledSafetyCheck.custom_call(_ffi.target_name(o)) for o in _ffi.FFI_TARGETS]
    (b,) = jax.export.symbolic_shape("b")
    cache = jax.ShapeDtypeStruct((N, BS, 576), jnp.bfloat16)
    if op == "epilogue":
        fn = jkm.fused_mla_decode_q_concat_kv_cache_insert
        args = (jax.ShapeDtypeStruct((b, H, 512), jnp.bfloat16), jax.ShapeDtypeStruct((b, H, 64), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, 512), jnp.bfloat16), jax.ShapeDtypeStruct((b, 64), jnp.bfloat16), cache,
                jax.ShapeDtypeStruct((b,), jnp.int32))
        name = "ql_nope"
    elif op == "decode_attention":
        fn = functools.partial(jkm.mla_decode_attention, softmax_scale=0.125)
        args = (jax.ShapeDtypeStruct((b, H, 576), jnp.bfloat16), cache, jax.ShapeDtypeStruct((b, 2), jnp.int32),
                jax.ShapeDtypeStruct((b,), jnp.int32))
        name = "mqa_q"
    else:
        fn = jkm.gather_mla_cache
        args = (cache, jax.ShapeDtypeStruct((b, 2), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
        name = "block_tables"
    with pytest.raises(ValueError, match=rf"^{name} has a symbolic shape .*concrete shapes"):
        jax.export.export(jax.jit(fn), platforms=("cpu",), disabled_checks=disabled)(*args)
