"""The layer with its weights sharded by heads (tensor parallelism) under a plain ``jax.jit``, on a
mesh of Explicit axes (``jax.make_mesh``'s default) and on one of Auto axes: on 4 of the host
CPU devices. On Explicit axes the layer runs as on Auto ones (jax_kimi_mla.layer,
``_auto_axes_under_explicit_meshes``): the same bits, out sharded like x and the cache like the
cache, the donated cache updated in place. A sharded run may differ from the single-device one in
the last bits (the heads' sums meet in another order), so the two meshes are compared with each
other, and the single device within the layer's tolerance."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import bits
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from jax_kimi_mla import layer as ml

D = 4
CONFIG = dict(hidden_size=256, num_heads=2 * D)
BS, BLOCKS = 16, 8
# Heads over the axis: q_b_proj and kv_b_proj [.., H, ..] by their head axis, o_proj [H, v, hidden]
# by its first; everything else replicated (the cache included).
HEAD_AXIS = {"q_b_proj": 1, "kv_b_proj": 1, "g_proj": 1, "o_proj": 0}


def meshes():
    devices = jax.devices("cpu")
    if len(devices) < D:
        pytest.skip(f"needs {D} CPU devices (tests/conftest.py asks for 8)")
    grid = np.array(devices[:D])
    return {kind: Mesh(grid, ("tp",), axis_types=(kind,)) for kind in (AxisType.Explicit, AxisType.Auto)}


def shard_params(params, mesh, stacked=False):
    def place(name, value):
        if name not in HEAD_AXIS or not hasattr(value, "ndim"):
            return jax.device_put(value, NamedSharding(mesh, PS()))
        spec = [None] * value.ndim
        spec[HEAD_AXIS[name] + stacked] = "tp"
        return jax.device_put(value, NamedSharding(mesh, PS(*spec)))

    return {k: jax.tree.map(lambda v, k=k: place(k, v), v) for k, v in params.items()}


def replicated(x, mesh):
    return jax.device_put(x, NamedSharding(mesh, PS()))


def inputs(fmt, seed=0):
    # attention_impl "auto": on a GPU machine it chose cuDNN for these CPU-device arrays until it
    # followed the lowering platform (test_prefill_attention.py::test_auto_follows_the_lowering_platform).
    config = ml.MLAConfig(**CONFIG, cache_format=fmt, output_gate=True)
    key = jax.random.split(jax.random.key(seed), 4)
    params = ml.init_params(key[0], config)
    x = jax.random.normal(key[1], (16, CONFIG["hidden_size"]), jnp.bfloat16)
    x2 = jax.random.normal(key[2], (8, CONFIG["hidden_size"]), jnp.bfloat16)
    xd = jax.random.normal(key[3], (2, CONFIG["hidden_size"]), jnp.bfloat16)
    return config, params, x, x2, xd


def run_steps(fmt, mesh):
    """Prefill of a 16-token prompt, a second chunk of 8 after it (its context read back from the
    cache), and a decode step of two sequences; -> [(out, its sharding, cache, its sharding)], the
    arrays as numpy (each cache is donated to the next step)."""
    config, params, x, x2, xd = inputs(fmt)
    if mesh is not None:
        params = shard_params(params, mesh)
    put = (lambda a: replicated(a, mesh)) if mesh is not None else (lambda a: a)
    cache = put(ml.allocate_cache(config, BLOCKS, BS))
    pos = jnp.arange(16, dtype=jnp.int32)
    prefill = jax.jit(functools.partial(ml.prefill, config=config), donate_argnums=4)
    results = []

    def keep(out, cache):
        results.append((np.asarray(out), out.sharding, np.asarray(cache), cache.sharding))
        return cache

    out, new = prefill(params, put(x), pos, pos, cache)
    assert cache.is_deleted()
    cache = keep(out, new)
    table = jnp.array([0, 1, 2, 3, 4, 5, 6, 7], jnp.int32)
    pos2 = jnp.arange(16, 24, dtype=jnp.int32)
    cache = keep(*prefill(params, put(x2), pos2, pos2, cache, block_table=table, context_len=jnp.int32(16)))
    decode = jax.jit(functools.partial(ml.decode, config=config), donate_argnums=6)
    tables = jnp.array([[0, 1, 7], [2, 3, 6]], jnp.int32)
    args = (put(xd), jnp.array([24, 0], jnp.int32), jnp.array([24, 32], jnp.int32), tables, jnp.array([25, 1], jnp.int32))
    keep(*decode(params, *args, cache))
    return results


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_tensor_parallel_layer_on_explicit_axes_is_the_auto_run(fmt):
    m = meshes()
    explicit, auto = run_steps(fmt, m[AxisType.Explicit]), run_steps(fmt, m[AxisType.Auto])
    single = run_steps(fmt, None)
    for (out_e, out_sharding, cache_e, cache_sharding), (out_a, _, cache_a, _), (out_1, *_) in zip(explicit, auto, single):
        np.testing.assert_array_equal(bits(out_e), bits(out_a))
        np.testing.assert_array_equal(bits(cache_e), bits(cache_a))
        assert out_sharding.spec == PS(None, None) and cache_sharding.spec == PS(None, None, None)
        assert out_sharding.mesh.axis_types == cache_sharding.mesh.axis_types == (AxisType.Explicit,)
        np.testing.assert_allclose(out_e.astype(np.float32), out_1.astype(np.float32), atol=0.03)


def test_layer_stack_and_reference_on_explicit_axes():
    """scan_layers over a head-sharded stack of 3 layers (the cache passed by keyword inside), and
    reference_attention, on Explicit axes: as on Auto ones, and the stack updated in place."""
    m = meshes()
    config, _, x, _, _ = inputs("bf16")
    params = ml.init_params(jax.random.key(7), config, num_layers=3)
    pos = jnp.arange(16, dtype=jnp.int32)
    step = jax.jit(lambda p, x, c, *a: ml.scan_layers(functools.partial(ml.prefill, config=config), p, x, c, *a),
                   donate_argnums=2)
    reference = jax.jit(functools.partial(ml.reference_attention, config=config))
    got = {}
    for kind, mesh in m.items():
        stacked = shard_params(params, mesh, stacked=True)
        cache = replicated(ml.allocate_cache(config, BLOCKS, BS, num_layers=3), mesh)
        hlo = step.lower(stacked, replicated(x, mesh), cache, pos, pos).compile().as_text()
        assert not [line for line in hlo.splitlines() if " copy(" in line and "[24,16,576]" in line]
        out, new = step(stacked, replicated(x, mesh), cache, pos, pos)
        assert cache.is_deleted()
        one = {k: v[0] for k, v in params.items()}
        got[kind] = (out, new, reference(shard_params(one, mesh), replicated(x, mesh), pos))
    for e, a in zip(got[AxisType.Explicit], got[AxisType.Auto]):
        np.testing.assert_array_equal(bits(e), bits(a))
    assert got[AxisType.Explicit][2].sharding.spec == PS(None, None)
