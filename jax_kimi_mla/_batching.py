"""``jax.vmap`` over the ops as one FFI call: the batch folded into the tokens and the cache stacked.

Under ``jax.vmap`` an FFI call first asks its fold (``_ffi.call``'s ``fold=``) for one call that
does the whole batch; where there is none (``None``), the batch runs as a loop of calls. The
batch axis is at the front of every batched operand (jax's custom_vmap puts it there).

- **Epilogues.** Batch element v's tokens follow element v - 1's, and the caches are one stack
  [V, ..., num_blocks, block_size, W], which the epilogues write in place (its rows addressed as
  one range): a valid slot s of element v (0 <= s < rows, the rows of one element's cache)
  becomes s + v * rows, any other slot -1 (skipped, as it was). An unbatched cache is broadcast
  first (each element updates its own copy, as vmap means).
- **mla_decode_attention.** Element v's sequences follow element v - 1's. A batched cache is read
  as one of V * num_blocks blocks (a free reshape), and element v's block ids in [0, num_blocks)
  are offset by v * num_blocks, any other id -1 (masked, as it was).

A batched cos/sin table or per-tensor scale is not one call's operand, so those batches loop, as
does ``gather_mla_cache`` (its output packs the sequences of all elements back to back), and any
fold whose offsets would not fit the index dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .formats import Epilogue


def _lead(x, batched: bool, size: int):
    """x with the batch at the front: as it is where batched, else broadcast."""
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


def _flat(x):
    """[V, n, ...] -> [V * n, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _offset_ids(ids, count: int, size: int):
    """Ids [V, ...] of one element's ``count`` items (slots or block ids): a valid id of element v
    moved past the items of elements 0..v - 1, any other id -1; None where the offsets would not
    fit the dtype."""
    if size * count > jnp.iinfo(ids.dtype).max:
        if not jax.config.jax_enable_x64:
            return None
        ids = ids.astype(jnp.int64)
    offsets = (count * jnp.arange(size, dtype=ids.dtype)).reshape((size,) + (1,) * (ids.ndim - 1))
    return jnp.where((ids >= 0) & (ids < count), ids + offsets, -1)


def _unfold(size: int, keep=()):
    """Results [V * n, ...] -> [V, n, ...], except those at the indices ``keep`` (already
    batched) and scratch results (None)."""

    def unfold(outs):
        return tuple(
            o if o is None or j in keep else o.reshape(size, o.shape[0] // size, *o.shape[1:])
            for j, o in enumerate(outs)
        )

    return unfold


def _scaled(result_shapes, size: int, keep=()):
    """The folded call's result shapes: the first dimension times V (the cache at ``keep``: V in
    front)."""
    return [
        jax.ShapeDtypeStruct((size, *r.shape) if j in keep else (size * r.shape[0], *r.shape[1:]), r.dtype)
        for j, r in enumerate(result_shapes)
    ]


def epilogue(e: Epilogue):
    """The fold of an epilogue target. Its operands: ``e.inputs`` (the cache among them), positions,
    cos_sin_cache, the scales; every input but the cache, and positions, is per token."""
    n_inputs, cache, slots = len(e.inputs), e.cache_input, e.inputs.index("slot_mapping")
    per_token = [i for i in range(n_inputs + 1) if i not in (cache, slots)]

    def fold(size, batched, operands, result_shapes, attrs):
        if any(batched[n_inputs + 1 :]):  # tables or scales that differ by element
            return None
        stack = _lead(operands[cache], batched[cache], size)
        slot_ids = _offset_ids(_lead(operands[slots], batched[slots], size), math.prod(stack.shape[1:-1]), size)
        if slot_ids is None:
            return None
        folded = list(operands)
        folded[cache], folded[slots] = stack, slot_ids.reshape(-1)
        for i in per_token:  # stand-ins of no elements ([0]) stay of none
            folded[i] = _flat(_lead(operands[i], batched[i], size))
        keep = (e.cache_output,)
        return folded, _scaled(result_shapes, size, keep), attrs, _unfold(size, keep)

    return fold


def decode_attention(size, batched, operands, result_shapes, attrs):
    """The fold of mla_decode_attention. Operands: q [B * S_q, H, 576], kv_cache [N, bs, W],
    block_tables [B, m], context_lens [B], q_scale_inv, cache_scale_inv; results: out, lse and the
    split partials (scratch, sized by B)."""
    q, cache, tables, lens = operands[:4]
    if batched[4] or batched[5]:
        return None
    tables = _lead(tables, batched[2], size)
    if batched[1]:
        tables = _offset_ids(tables, cache.shape[1], size)
        if tables is None:
            return None
        cache = _flat(cache)
    folded = [_flat(_lead(q, batched[0], size)), cache, _flat(tables), _flat(_lead(lens, batched[3], size)), *operands[4:]]
    return folded, _scaled(result_shapes, size), attrs, _unfold(size)
