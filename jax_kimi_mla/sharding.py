"""Running the epilogues on several devices: tensor parallel (heads) and data parallel (tokens).

Under a plain ``jax.jit`` the ops' partitioning rules already keep head-sharded inputs local
(with the cache replicated), but gather token-sharded ones (docs/SHARDING.md). These helpers
wrap an op in ``shard_map``: each device runs the op on its own shard, no collective is inserted,
a donated cache stays aliased per device, and data parallelism with local slots is possible.

Tensor parallel, ``tensor_parallel(op, mesh, "tp")``: the heads are split across the axis, the
latent cache is replicated. Per-head inputs and outputs (``q``, ``k_nope``, ``v``, ``ql_nope``,
``q_pe``; ``k``, ``q``, ``*_fp8``, ``mqa_q``) are sharded on their head axis; ``kv_c_normed``,
``k_pe``, ``slot_mapping``, ``positions``, the RoPE table, the scales and the cache are
replicated. Every device inserts the same latent rows, so every copy of the cache stays
identical (the Kimi-K3 layout: 96 heads, 12 per rank at TP8). H must divide by the axis size.

Data parallel, ``data_parallel(op, mesh, "dp")``: tokens and cache pages are split across the
axis. Device d gets tokens [d*T/D, (d+1)*T/D) and cache blocks [d*N/D, (d+1)*N/D) (its own
[N/D, block_size, width] cache), and reads ``slot_mapping`` in its LOCAL numbering: slot s of
device d is row s of that device's cache shard. Per-token inputs and all outputs, the cache
included, are sharded on their first axis; the RoPE table and the scales are replicated. T and
N must divide by the axis size. :func:`local_slot_mapping` turns global slots into local ones.

Both modes compose (``shard(op, mesh, head_axis="tp", token_axis="dp")`` on a 2-D mesh). Use the
returned function under ``jax.jit`` with the cache donated, and give the inputs the shardings
above (``jax.device_put(x, NamedSharding(mesh, spec))``, see :func:`input_specs`): a cache laid
out otherwise is resharded (copied) before the call instead of being updated in place::

    step = jax.jit(tensor_parallel(fused_mla_decode_q_concat_kv_cache_insert, mesh, "tp"),
                   donate_argnums=(4,))
    mqa_q, kv_cache = step(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ._checks import Columns
from .formats import PER_HEAD_INPUTS

# Inputs with a token axis (axis 0), beside the per-head ones (PER_HEAD_INPUTS: a head axis too);
# arguments not named here (cos_sin_cache, the scales) are replicated, and the cache gets its own rule.
_PER_TOKEN = PER_HEAD_INPUTS | {"k_pe", "kv_c_normed", "slot_mapping", "positions"}
_CACHE = "kv_cache"


def _shard_map(f, mesh, in_specs, out_specs):
    # Replication checking is off: the cache output is provably identical on every device only
    # by the argument above (same latent rows everywhere), not by JAX's type system.
    if hasattr(jax, "shard_map"):  # older jax has only jax.experimental.shard_map
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def input_specs(op, *, head_axis=None, token_axis=None) -> dict[str, PartitionSpec]:
    """The PartitionSpec of each parameter of ``op`` (by name) under :func:`shard`; place the
    inputs with these (``NamedSharding(mesh, spec)``) to avoid a reshard before the call."""
    specs = {}
    for name in inspect.signature(op).parameters:
        if name in PER_HEAD_INPUTS:
            specs[name] = PartitionSpec(token_axis, head_axis)
        elif name in _PER_TOKEN or name == _CACHE:
            specs[name] = PartitionSpec(token_axis)
        else:
            specs[name] = PartitionSpec()
    return specs


def _output_specs(num_outputs: int, head_axis, token_axis):
    # Every op returns its per-head outputs first and the cache last.
    return (PartitionSpec(token_axis, head_axis),) * (num_outputs - 1) + (PartitionSpec(token_axis),)


def _axis_size(mesh, axis) -> int:
    if axis is not None and axis not in mesh.shape:
        raise ValueError(f"mesh axis {axis!r} is not in the mesh, whose axes are {tuple(mesh.shape)}")
    return 1 if axis is None else mesh.shape[axis]


def _check_divisible(what: str, size: int, axis, mesh) -> None:
    n = _axis_size(mesh, axis)
    if size % n:
        raise ValueError(f"{what} = {size} must be a multiple of the size {n} of mesh axis {axis!r}")


def shard(op, mesh, *, head_axis=None, token_axis=None):
    """``op`` (an epilogue op or its reference) run per device under ``shard_map``.

    Args:
      op: one of the four epilogue ops, or the function of the same name in
        :mod:`jax_kimi_mla.reference`.
      mesh: a ``jax.sharding.Mesh``.
      head_axis: mesh axis that splits the heads (tensor parallel), or None.
      token_axis: mesh axis that splits tokens and cache blocks (data parallel), or None; then
        ``slot_mapping`` holds per-shard local slots.

    Returns:
      A function with the signature and outputs of ``op``, taking and returning global arrays.
      Arguments that are None, a Python bool (``ds_mla``) or a string (``rope_style``) stay
      static; ``columns(...)``
      inputs are sharded like the tensor they wrap.
    """
    signature = inspect.signature(op)
    if not (PER_HEAD_INPUTS & set(signature.parameters) and {_CACHE, "slot_mapping"} <= set(signature.parameters)):
        raise TypeError(
            f"sharding.shard takes the four epilogue ops (or their references), got {getattr(getattr(op, 'func', op), '__name__', op)!r}. "
            "The readers (mla_decode_attention, gather_mla_cache) run head- or batch-parallel under a plain jax.jit; "
            "for an exportable multi-device step call them in a jax.shard_map of your own (docs/SHARDING.md, jax.export)"
        )
    specs = input_specs(op, head_axis=head_axis, token_axis=token_axis)
    for axis in (head_axis, token_axis):
        _axis_size(mesh, axis)  # an unknown axis name fails here, before any call

    @functools.wraps(op)
    def sharded(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        names = [n for n, x in arguments.items() if not isinstance(x, (bool, str, type(None)))]
        static = {n: x for n, x in arguments.items() if n not in names}
        starts = {n: arguments[n].start for n in names if isinstance(arguments[n], Columns)}
        arrays = [arguments[n].array if n in starts else arguments[n] for n in names]
        by_name = dict(zip(names, arrays))

        def per_device(*local):
            local = {n: Columns(x, starts[n]) if n in starts else x for n, x in zip(names, local)}
            return tuple(op(**local, **static))  # some ops return a list: out_specs is a tuple

        # Traced on the global shapes first, so argument errors name the shapes the caller passed.
        num_outputs = len(jax.eval_shape(per_device, *arrays))
        per_head = next(by_name[n] for n in signature.parameters if n in PER_HEAD_INPUTS)
        _check_divisible("the head count H", jnp.shape(per_head)[1], head_axis, mesh)
        _check_divisible("the token count T", jnp.shape(by_name["slot_mapping"])[0], token_axis, mesh)
        if token_axis is not None and len(jnp.shape(by_name[_CACHE])) != 3:
            raise ValueError(f"data parallel splits a [num_blocks, block_size, W] cache by its blocks; got kv_cache of shape "
                             f"{tuple(jnp.shape(by_name[_CACHE]))} (a stack of layers: pass each layer's or a flat view)")
        _check_divisible("the cache's num_blocks", jnp.shape(by_name[_CACHE])[0], token_axis, mesh)
        return _shard_map(
            per_device,
            mesh,
            tuple(specs[n] for n in names),
            _output_specs(num_outputs, head_axis, token_axis),
        )(*arrays)

    return sharded


def tensor_parallel(op, mesh, axis):
    """``op`` with its heads split across mesh axis ``axis`` and the cache replicated."""
    return shard(op, mesh, head_axis=axis)


def data_parallel(op, mesh, axis):
    """``op`` with tokens and cache blocks split across mesh axis ``axis`` (local slots)."""
    return shard(op, mesh, token_axis=axis)


def local_slot_mapping(slot_mapping, kv_cache_shape, num_shards: int):
    """Global slots [T] -> the local slots that :func:`data_parallel` expects.

    Token t belongs to shard d = t // (T / num_shards), which owns the global rows
    [d * R, (d + 1) * R) with R = num_blocks / num_shards * block_size. Its local slot is
    ``slot - d * R`` when the row is its shard's, else -1: the write of a token whose page lives
    on another shard is dropped, so schedule each request on the shard that owns its pages.
    Padding (< 0) and out-of-range slots stay skipped.
    """
    num_blocks, block_size = kv_cache_shape[0], kv_cache_shape[1]
    tokens = jnp.shape(slot_mapping)[0]
    if tokens % num_shards or num_blocks % num_shards:
        raise ValueError(f"T = {tokens} and num_blocks = {num_blocks} must be multiples of {num_shards} shards")
    rows = num_blocks // num_shards * block_size
    shard_of_token = jnp.arange(tokens, dtype=slot_mapping.dtype) // max(tokens // num_shards, 1)
    local = slot_mapping - shard_of_token * rows
    owned = (local >= 0) & (local < rows)  # a negative slot stays negative
    return jnp.where(owned, local, -1).astype(slot_mapping.dtype)
