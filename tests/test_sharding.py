"""The ops under jax_kimi_mla.sharding on 8 host CPU devices: bit-equal to the single-device run,
no collectives in the compiled program, and the donated cache updated in place on every device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_kimi_mla as jkm
from _util import ACT, FORMATS, Case, bits, cache_shape_dtype, make_case, sentinel
from jax_kimi_mla import sharding

CPUS = jax.devices("cpu")
D = 8
T, H, N, BS = 16, 8, 16, 4  # 2 tokens, 1 head, 2 cache blocks (8 rows) per device
ROWS_PER_SHARD = N // D * BS
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

OPS = {
    "prefill_kv": jkm.fused_mla_key_concat_kv_cache_insert,
    "prefill_ds_mla": jkm.fused_mla_key_concat_ds_mla_insert,
    "prefill_fp8": jkm.fused_mla_qkv_quant_kv_cache_fp8_insert,
    "decode_kv": jkm.fused_mla_decode_q_concat_kv_cache_insert,
    "decode_fp8": jkm.fused_mla_decode_q_concat_kv_cache_insert,
    "decode_ds_mla": jkm.fused_mla_decode_q_concat_kv_cache_insert,
}


def global_slots(rng):
    """Distinct slots, each in the cache shard of the device that gets its token under data
    parallelism, plus one padding token and one slot past the end of the cache."""
    slots = np.concatenate([d * ROWS_PER_SHARD + rng.permutation(ROWS_PER_SHARD)[: T // D] for d in range(D)])
    slots[rng.integers(0, T // 2)] = -1
    slots[rng.integers(T // 2, T)] = N * BS + 3
    return slots.astype(np.int32)


def make_inputs(fmt, rope, seed=0):
    """(op, keyword arguments, static argnames): the shared random inputs of ``fmt`` with an
    [N, BS] sentinel cache and slots laid out for data parallelism."""
    case = Case(fmt, tokens=T, heads=H, act="fp16" if fmt == "prefill_kv" else "bf16", rope=rope, block_size=BS, seed=seed)
    kw = make_case(case)
    rng = np.random.default_rng(seed + 1000)
    kw["kv_cache"] = sentinel(rng, *cache_shape_dtype(fmt, ACT[case.act], N, BS))
    kw["slot_mapping"] = global_slots(rng)
    if fmt == "decode_ds_mla":
        return OPS[fmt], dict(kw, ds_mla=True), ("ds_mla",)
    return OPS[fmt], kw, ()


def single_device(op, kw, static):
    placed = {n: x if n in static else jax.device_put(x, CPUS[0]) for n, x in kw.items()}
    return jax.jit(op, static_argnames=static)(**placed)


def run_sharded(fn, op, mesh, kw, static, **axes):
    """Places the inputs as ``sharding.input_specs`` says, runs ``fn`` jitted with the cache
    donated; returns (outputs, compiled HLO text, per-device cache pointers before the call)."""
    specs = sharding.input_specs(op, **axes)
    # .copy(): the CPU devices may share an aligned numpy buffer (zero-copy), which XLA cannot
    # donate; a device-side copy gives every device a buffer of its own.
    placed = {n: x if n in static else jax.device_put(x, NamedSharding(mesh, specs[n])).copy() for n, x in kw.items()}
    step = jax.jit(fn, static_argnames=static, donate_argnames="kv_cache")
    hlo = step.lower(**placed).compile().as_text()
    before = [s.data.unsafe_buffer_pointer() for s in placed["kv_cache"].addressable_shards]
    outputs = step(**placed)
    assert placed["kv_cache"].is_deleted()
    return outputs, hlo, before


def assert_in_place_without_collectives(outputs, hlo, before):
    collectives = [line.strip() for line in hlo.splitlines() if any(c in line for c in COLLECTIVES)]
    assert not collectives, "\n".join(collectives)
    assert "input_output_alias" in hlo
    assert [s.data.unsafe_buffer_pointer() for s in outputs[-1].addressable_shards] == before


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(CPUS[:D]), ("x",))


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("name", FORMATS)
def test_tensor_parallel_matches_single_device(mesh, name, rope):
    op, kw, static = make_inputs(name, rope)
    want = single_device(op, kw, static)
    got, hlo, before = run_sharded(sharding.tensor_parallel(op, mesh, "x"), op, mesh, kw, static, head_axis="x")
    assert_in_place_without_collectives(got, hlo, before)
    assert len(got) == len(want)
    for g, w in zip(got[:-1], want[:-1]):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "x")), g.ndim)
        np.testing.assert_array_equal(bits(g), bits(w))
    # The cache is replicated: every device's copy equals the single-device cache.
    assert len(got[-1].addressable_shards) == D
    for s in got[-1].addressable_shards:
        np.testing.assert_array_equal(bits(s.data), bits(want[-1]))


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("name", FORMATS)
def test_data_parallel_matches_single_device(mesh, name, rope):
    op, kw, static = make_inputs(name, rope)
    want = single_device(op, kw, static)
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, D))
    got, hlo, before = run_sharded(sharding.data_parallel(op, mesh, "x"), op, mesh, local, static, token_axis="x")
    assert_in_place_without_collectives(got, hlo, before)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("x")), g.ndim)
        np.testing.assert_array_equal(bits(g), bits(w))


def test_two_dimensional_mesh_matches_single_device():
    mesh = Mesh(np.array(CPUS[:D]).reshape(2, 4), ("dp", "tp"))
    op, kw, static = make_inputs("prefill_fp8", rope=True, seed=1)
    tokens_per_shard, rows = T // 2, N // 2 * BS
    # Slots in the 2-way cache split: token t writes into the half of the cache of its dp shard.
    slots = np.where(np.arange(T) < tokens_per_shard, 0, rows) + np.random.default_rng(2).permutation(rows)[:T]
    kw["slot_mapping"] = slots.astype(np.int32)
    want = single_device(op, kw, static)
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, 2))
    fn = sharding.shard(op, mesh, head_axis="tp", token_axis="dp")
    got, hlo, before = run_sharded(fn, op, mesh, local, static, head_axis="tp", token_axis="dp")
    assert_in_place_without_collectives(got, hlo, before)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_columns_inputs_are_sharded_like_their_tensor(mesh):
    op, kw, static = make_inputs("prefill_fp8", rope=False, seed=3)
    kv = np.concatenate([kw.pop("k_nope"), kw.pop("v")], axis=-1)  # kv_b_proj's [T, H, 256]
    want = single_device(op, dict(kw, k_nope=kv[..., :128], v=kv[..., 128:]), static)
    fn = sharding.tensor_parallel(op, mesh, "x")
    specs = sharding.input_specs(op, head_axis="x")
    placed = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in kw.items()}
    kv_sharded = jax.device_put(kv, NamedSharding(mesh, specs["k_nope"]))
    got = jax.jit(lambda kv, **a: fn(k_nope=jkm.columns(kv, 0), v=jkm.columns(kv, 128), **a))(kv_sharded, **placed)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_local_slot_mapping():
    # 4 shards of 2 blocks x 4 rows: shard d owns global rows [8d, 8d + 8), tokens [2d, 2d + 2).
    slots = jnp.array([3, 9, 8, 15, 16, -1, 31, 64], jnp.int32)
    got = sharding.local_slot_mapping(slots, (8, 4, 576), 4)
    # token 1 (shard 0) addresses row 9 of shard 1: dropped; token 7 is past the cache.
    np.testing.assert_array_equal(np.asarray(got), [3, -1, 0, 7, 0, -1, 7, -1])
    assert got.dtype == slots.dtype


def test_local_slots_keep_other_shards_rows_untouched(mesh):
    """A token whose page another device owns writes nothing, on any device."""
    op, kw, static = make_inputs("decode_kv", rope=False, seed=4)
    kw["slot_mapping"] = np.roll(kw["slot_mapping"], T // D)  # every token's row now lives elsewhere
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, D))
    assert (np.asarray(local["slot_mapping"]) == -1).all()
    got, _, _ = run_sharded(sharding.data_parallel(op, mesh, "x"), op, mesh, local, static, token_axis="x")
    np.testing.assert_array_equal(bits(got[-1]), bits(kw["kv_cache"]))


def test_heads_not_divisible_by_the_axis_is_a_clear_error(mesh):
    op, kw, static = make_inputs("decode_kv", rope=False)
    kw.update(ql_nope=kw["ql_nope"][:, :6], q_pe=kw["q_pe"][:, :6])
    with pytest.raises(ValueError, match="head count H = 6 must be a multiple of the size 8 of mesh axis 'x'"):
        sharding.tensor_parallel(op, mesh, "x")(**kw)


@pytest.mark.filterwarnings("ignore:jax.experimental.shard_map is deprecated:DeprecationWarning")
def test_legacy_shard_map_is_used_when_jax_has_no_top_level_one(mesh, monkeypatch):
    """Older jax has shard_map only in jax.experimental (with check_rep instead of check_vma)."""
    from jax.experimental import shard_map as legacy

    calls, original = [], legacy.shard_map

    def fake(f, mesh, in_specs, out_specs, check_rep=True):
        calls.append(check_rep)
        return original(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_rep)

    monkeypatch.delattr(jax, "shard_map")
    monkeypatch.setattr(legacy, "shard_map", fake)
    op, kw, static = make_inputs("decode_kv", rope=False, seed=5)
    want = single_device(op, kw, static)
    got, hlo, before = run_sharded(sharding.tensor_parallel(op, mesh, "x"), op, mesh, kw, static, head_axis="x")
    assert calls == [False]
    assert_in_place_without_collectives(got, hlo, before)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))
