"""``jax.vmap`` over the ops as one FFI call: the batch folded into the tokens and the cache stacked.

Under ``jax.vmap`` an FFI call first asks its fold (``_ffi.call``'s ``fold=``) for one call that
does the whole batch; where there is none (``None``), the batch runs as a loop of calls. The
batch axis is at the front of every batched operand (jax's custom_vmap puts it there).

- **Epilogues.** Batch element v's tokens follow element v - 1's, and the caches are one stack
  [V, ..., num_blocks, block_size, W], which the epilogues write in place (its rows addressed as
  one range): a valid slot s of element v (0 <= s < rows, the rows of one element's cache)
  becomes s + v * rows, any other slot -1 (skipped, as it was). An unbatched cache is broadcast
  first (each element updates its own copy, as vmap means). Prefill's q, rotated in place with
  RoPE, is passed as [V, T, H, 192] (not reshaped, so not copied).
- **mla_decode_attention.** Element v's sequences follow element v - 1's. A batched cache is read
  as one of V * num_blocks blocks (a free reshape), and element v's block ids in [0, num_blocks)
  are offset by v * num_blocks, any other id -1 (masked, as it was).
- **gather_mla_cache.** Element v's sequences follow element v - 1's, and its num_tokens rows
  are rows [v * num_tokens, (v + 1) * num_tokens) of one output: its lengths are cut where its
  rows end (the rows the call would drop), and a sequence of masked tokens (zero rows, as the call
  writes past its total) fills the rest. A batched cache is read as for the attention.

A batched cos/sin table or per-tensor scale is not one call's operand, so those batches loop, as
does any fold whose offsets would not fit the index dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .formats import Epilogue, shift_ids


def _lead(x, batched: bool, size: int):
    """x with the batch at the front: as it is where batched, else broadcast."""
    return x if batched else jnp.broadcast_to(x, (size, *x.shape))


def _flat(x):
    """[V, n, ...] -> [V * n, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _holding(x, largest: int):
    """Index array x in a dtype that holds ``largest``: as it is, int64 where x64 is on, else None
    (the fold does not fit: the batch loops)."""
    if largest <= jnp.iinfo(x.dtype).max:
        return x
    return x.astype(jnp.int64) if jax.config.jax_enable_x64 else None


def _offset_ids(ids, count: int, size: int):
    """Ids [V, ...] of one element's ``count`` items (slots or block ids): a valid id of element v
    moved past the items of elements 0..v - 1, any other id -1; None where the offsets would not
    fit the dtype."""
    ids = _holding(ids, size * count)
    if ids is None:
        return None
    return shift_ids(ids, count, (count * jnp.arange(size, dtype=ids.dtype)).reshape((size,) + (1,) * (ids.ndim - 1)))


def _unfold(size: int, result_shapes, keep=()):
    """The folded call's results -> [V, ...] of each one call's result, except those at the
    indices ``keep`` (already batched in front) and scratch results (None)."""

    def unfold(outs):
        return tuple(
            o if o is None or j in keep else o.reshape(size, *r.shape) for j, (o, r) in enumerate(zip(outs, result_shapes))
        )

    return unfold


def _scaled(result_shapes, size: int, keep=()):
    """The folded call's result shapes: the first dimension times V (those at ``keep``: V in
    front)."""
    return [
        jax.ShapeDtypeStruct((size, *r.shape) if j in keep else (size * r.shape[0], *r.shape[1:]), r.dtype)
        for j, r in enumerate(result_shapes)
    ]


def epilogue(e: Epilogue):
    """The fold of an epilogue target. Its operands: ``e.inputs``, positions, cos_sin_cache, the
    scales. What the call updates in place (the cache, and prefill's q where RoPE rotates it) keeps
    the batch in front: a reshaped operand would be copied before an in-place call (the handler
    takes a stacked cache, and a per-head q by its element count). The other inputs, and positions,
    are per token: flattened."""
    n_inputs, slots = len(e.inputs), e.inputs.index("slot_mapping")
    in_place = [name for name in e.outputs if name in e.inputs]
    front = [e.inputs.index(name) for name in in_place]
    keep = [e.outputs.index(name) for name in in_place]
    per_token = [i for i in range(n_inputs + 1) if i not in front and i != slots]

    def fold(size, batched, operands, result_shapes, attrs):
        if any(batched[n_inputs + 1 :]):  # tables or scales that differ by element
            return None
        folded = list(operands)
        for i in front:
            folded[i] = _lead(operands[i], batched[i], size)
        cache = folded[e.cache_input]
        slot_ids = _offset_ids(_lead(operands[slots], batched[slots], size), math.prod(cache.shape[1:-1]), size)
        if slot_ids is None:
            return None
        folded[slots] = slot_ids.reshape(-1)
        for i in per_token:  # stand-ins of no elements ([0]) stay of none
            folded[i] = _flat(_lead(operands[i], batched[i], size))
        return folded, _scaled(result_shapes, size, keep), attrs, _unfold(size, result_shapes, keep)

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
    return folded, _scaled(result_shapes, size), attrs, _unfold(size, result_shapes)


def gather_cache(size, batched, operands, result_shapes, attrs):
    """The fold of gather_mla_cache. Operands: kv_cache [N, bs, W], block_tables [B, m],
    context_lens [B], cache_scale_inv; result: [num_tokens, 576]."""
    cache, tables, lens = operands[:3]
    if batched[3]:
        return None
    n, block_size = result_shapes[0].shape[0], cache.shape[-2]
    tables, lens = _lead(tables, batched[1], size), _lead(lens, batched[2], size)
    if batched[0]:
        tables = _offset_ids(tables, cache.shape[1], size)
        if tables is None:
            return None
        cache = _flat(cache)
    # Each element fills exactly its n rows: lengths clamped (as the call does) and cut at n ...
    longest = min(tables.shape[-1] * block_size, n)
    lens = _holding(lens, tables.shape[1] * longest)  # their running sums must not wrap
    if lens is None:
        return None
    lens = jnp.clip(lens, 0, longest)
    starts = jnp.cumsum(lens, axis=1) - lens
    lens = jnp.clip(n - starts, 0, lens)
    # ... then one sequence of masked tokens (ids -1: zero rows) of the rows left.
    width = max(tables.shape[-1], -(-n // block_size))
    tables = jnp.pad(tables, ((0, 0), (0, 1), (0, width - tables.shape[-1])), constant_values=-1)
    lens = jnp.concatenate([lens, (n - lens.sum(axis=1, keepdims=True)).astype(lens.dtype)], axis=1)
    folded = [cache, _flat(tables), _flat(lens), *operands[3:]]
    return folded, _scaled(result_shapes, size), attrs, _unfold(size, result_shapes)
