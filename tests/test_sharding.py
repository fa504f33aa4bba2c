"""The ops under jax_kimi_mla.sharding on a mesh of several devices: 8 host CPU devices, and every
GPU when there are at least 2. Bit-equal to the single-device run (on the first device of the same
platform), no collectives in the compiled program, and the donated cache updated in place on
every device."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import ACT, FORMATS, Case, bits, cache_shape_dtype, make_case, sentinel
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_kimi_mla as jkm
from jax_kimi_mla import sharding
from jax_kimi_mla.formats import EPILOGUES

BS = 4
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")

def _round_up(x: int, d: int) -> int:
    return -(-x // d) * d


@dataclass(frozen=True)
class DeviceSet:
    """The devices of one platform that a test shards over, and the problem sizes derived from
    their number D: at least 16 tokens and one cache block per device more than that, each a
    multiple of D, of BS rows, and 2 heads per device (on 8 CPUs: 2 tokens, 2 heads, 3 cache
    blocks = 12 rows per device)."""

    devices: tuple

    @property
    def D(self) -> int:
        return len(self.devices)

    @property
    def T(self) -> int:
        return _round_up(16, self.D)

    @property
    def H(self) -> int:
        # Two heads per device: a device's mqa_q [T, H/D, 576] then never has the cache's
        # per-device shape [N, BS, 576], which would let jax pair the donated cache with mqa_q.
        return 2 * self.D

    @property
    def N(self) -> int:
        # One block per device more than tokens: a device's cache shard [N/D, BS, 576] then never
        # has the shape of its mqa_q under data parallelism [T/D, H, 576], whatever H and BS.
        return _round_up(16, self.D) + self.D

    @property
    def rows_per_shard(self) -> int:
        return self.N // self.D * BS

    def mesh(self, shape=None, axes=("x",)) -> Mesh:
        return Mesh(np.array(self.devices).reshape(shape or (self.D,)), axes)


def _cpu8() -> tuple:
    cpus = jax.devices("cpu")
    if len(cpus) < 8:  # the conftest asks for 8; a run that gets fewer must not pass on a smaller mesh
        pytest.fail(f"needs 8 host CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), got {len(cpus)}")
    return tuple(cpus[:8])


def _gpus() -> tuple:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:  # no GPU platform in this process
        pytest.skip(f"no GPU: jax.devices('gpu') raised RuntimeError: {str(e).splitlines()[0]}")
    if len(gpus) < 2:
        pytest.skip(f"needs at least 2 GPUs for a GPU mesh, found {len(gpus)}")
    if not jkm.HAS_CUDA_MODULE:
        pytest.skip("GPUs found, but jax_kimi_mla was built without its CUDA module")
    return tuple(gpus)


@pytest.fixture(scope="module", params=["cpu8", "gpu"])
def devs(request) -> DeviceSet:
    """Each test that takes this runs once on 8 host CPU devices and once on all the GPUs."""
    return DeviceSet({"cpu8": _cpu8, "gpu": _gpus}[request.param]())


def global_slots(devs, rng):
    """Distinct slots, each in the cache shard of the device that gets its token under data
    parallelism, plus one padding token and one slot past the end of the cache."""
    T, D, rows = devs.T, devs.D, devs.rows_per_shard
    slots = np.concatenate([d * rows + rng.permutation(rows)[: T // D] for d in range(D)])
    slots[rng.integers(0, T // 2)] = -1
    slots[rng.integers(T // 2, T)] = devs.N * BS + 3
    return slots.astype(np.int32)


def make_inputs(devs, fmt, rope, seed=0):
    """(op, keyword arguments, static argnames): the shared random inputs of ``fmt`` at the sizes
    of ``devs``, with an [N, BS] sentinel cache and slots laid out for data parallelism."""
    act = "fp16" if fmt == "prefill_bf16" else "bf16"
    case = Case(fmt, tokens=devs.T, heads=devs.H, act=act, rope=rope, block_size=BS, seed=seed)
    kw = make_case(case)
    rng = np.random.default_rng(seed + 1000)
    kw["kv_cache"] = sentinel(rng, *cache_shape_dtype(fmt, ACT[case.act], devs.N, BS))
    kw["slot_mapping"] = global_slots(devs, rng)
    e = EPILOGUES[fmt]
    return getattr(jkm, e.op), kw | e.static_kwargs, tuple(e.static_kwargs)


def single_device(devs, op, kw, static):
    """The unsharded run on the first device of the same platform: what the mesh must reproduce."""
    placed = {n: x if n in static else jax.device_put(x, devs.devices[0]) for n, x in kw.items()}
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


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("name", FORMATS)
def test_tensor_parallel_matches_single_device(devs, name, rope):
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, name, rope)
    want = single_device(devs, op, kw, static)
    got, hlo, before = run_sharded(sharding.tensor_parallel(op, mesh, "x"), op, mesh, kw, static, head_axis="x")
    assert_in_place_without_collectives(got, hlo, before)
    assert len(got) == len(want)
    for g, w in zip(got[:-1], want[:-1]):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "x")), g.ndim)
        np.testing.assert_array_equal(bits(g), bits(w))
    # The cache is replicated: every device's copy equals the single-device cache.
    assert len(got[-1].addressable_shards) == devs.D
    for s in got[-1].addressable_shards:
        np.testing.assert_array_equal(bits(s.data), bits(want[-1]))


@pytest.mark.parametrize("rope", [False, True], ids=["nope", "rope"])
@pytest.mark.parametrize("name", FORMATS)
def test_data_parallel_matches_single_device(devs, name, rope):
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, name, rope)
    want = single_device(devs, op, kw, static)
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, devs.D))
    got, hlo, before = run_sharded(sharding.data_parallel(op, mesh, "x"), op, mesh, local, static, token_axis="x")
    assert_in_place_without_collectives(got, hlo, before)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("x")), g.ndim)
        np.testing.assert_array_equal(bits(g), bits(w))


def test_data_parallel_refuses_a_stacked_cache(devs):
    """Data parallelism splits a cache by its blocks; a stack of layers (which the epilogues take
    whole) would be split by its layers, so it is refused by name."""
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, "decode_bf16", rope=False)
    stacked = kw["kv_cache"].reshape(1, *kw["kv_cache"].shape)
    with pytest.raises(ValueError, match=r"data parallel splits a \[num_blocks, block_size, W\] cache by its blocks"):
        sharding.data_parallel(op, mesh, "x")(**dict(kw, kv_cache=stacked))


def test_two_dimensional_mesh_matches_single_device(devs):
    dp = 2 if devs.D % 2 == 0 else 1  # 8 CPUs: 2 x 4; 2 GPUs: 2 x 1
    mesh = devs.mesh((dp, devs.D // dp), ("dp", "tp"))
    op, kw, static = make_inputs(devs, "prefill_fp8", rope=True, seed=1)
    tokens_per_shard, rows = devs.T // dp, devs.N // dp * BS
    # Slots in the dp-way cache split: token t writes into the part of the cache of its dp shard.
    slots = np.arange(devs.T) // tokens_per_shard * rows + np.random.default_rng(2).permutation(rows)[: devs.T]
    kw["slot_mapping"] = slots.astype(np.int32)
    want = single_device(devs, op, kw, static)
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, dp))
    fn = sharding.shard(op, mesh, head_axis="tp", token_axis="dp")
    got, hlo, before = run_sharded(fn, op, mesh, local, static, head_axis="tp", token_axis="dp")
    assert_in_place_without_collectives(got, hlo, before)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_columns_inputs_are_sharded_like_their_tensor(devs):
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, "prefill_fp8", rope=False, seed=3)
    kv = np.concatenate([kw.pop("k_nope"), kw.pop("v")], axis=-1)  # kv_b_proj's [T, H, 256]
    want = single_device(devs, op, dict(kw, k_nope=kv[..., :128], v=kv[..., 128:]), static)
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


def test_local_slots_keep_other_shards_rows_untouched(devs):
    """A token whose page another device owns writes nothing, on any device."""
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, "decode_bf16", rope=False, seed=4)
    kw["slot_mapping"] = np.roll(kw["slot_mapping"], devs.T // devs.D)  # every token's row now lives elsewhere
    local = dict(kw, slot_mapping=sharding.local_slot_mapping(kw["slot_mapping"], kw["kv_cache"].shape, devs.D))
    assert (np.asarray(local["slot_mapping"]) == -1).all()
    got, _, _ = run_sharded(sharding.data_parallel(op, mesh, "x"), op, mesh, local, static, token_axis="x")
    np.testing.assert_array_equal(bits(got[-1]), bits(kw["kv_cache"]))


def test_heads_not_divisible_by_the_axis_is_a_clear_error(devs):
    op, kw, static = make_inputs(devs, "decode_bf16", rope=False)
    heads = devs.H - 1  # H is a multiple of D >= 2, so H - 1 is not
    kw.update(ql_nope=kw["ql_nope"][:, :heads], q_pe=kw["q_pe"][:, :heads])
    message = f"head count H = {heads} must be a multiple of the size {devs.D} of mesh axis 'x'"
    with pytest.raises(ValueError, match=message):
        sharding.tensor_parallel(op, devs.mesh(), "x")(**kw)


@pytest.mark.filterwarnings("ignore:jax.experimental.shard_map is deprecated:DeprecationWarning")
def test_legacy_shard_map_is_used_when_jax_has_no_top_level_one(devs, monkeypatch):
    """Older jax has shard_map only in jax.experimental (with check_rep instead of check_vma)."""
    from jax.experimental import shard_map as legacy

    calls, original = [], legacy.shard_map

    def fake(f, mesh, in_specs, out_specs, check_rep=True):
        calls.append(check_rep)
        return original(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_rep)

    monkeypatch.delattr(jax, "shard_map")
    monkeypatch.setattr(legacy, "shard_map", fake)
    mesh = devs.mesh()
    op, kw, static = make_inputs(devs, "decode_bf16", rope=False, seed=5)
    want = single_device(devs, op, kw, static)
    got, hlo, before = run_sharded(sharding.tensor_parallel(op, mesh, "x"), op, mesh, kw, static, head_axis="x")
    assert calls == [False]
    assert_in_place_without_collectives(got, hlo, before)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))
