"""Opt-in checks of index values, for callers who want an error instead of the defined behaviour.

The ops never fail on index values: a slot < 0 (padding) or >= num_blocks * block_size skips
that token's cache write, a position outside the cos/sin table is clamped into it, and among
valid tokens that share a slot only one token's entry is kept. :func:`check_inputs` reports each
of these, and a ``block_size`` that does not match the cache.

Eagerly (concrete arrays) it raises ``ValueError`` listing every offending token::

    check_inputs(kv_cache, slot_mapping, positions=positions, cos_sin_cache=cos_sin_cache, block_size=block_size)

Under ``jax.jit`` the values are unknown at trace time, so the checks are staged with
``jax.experimental.checkify``: wrap the jitted function with ``checkify.checkify`` and throw
the returned error (a ``checkify.JaxRuntimeError``, which is a ``ValueError``)::

    from jax.experimental import checkify

    def step(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping):
        check_inputs(kv_cache, slot_mapping, block_size=block_size)  # the block size the server allocated
        return fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)

    err, (mqa_q, kv_cache) = jax.jit(checkify.checkify(step), donate_argnums=(4,))(
        ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping)
    err.throw()  # reports the first offending token of the first failed check

Called under ``jax.jit`` without ``checkify.checkify``, tracing fails with JAX's "Cannot
abstractly evaluate a checkify.check which was not functionalized". Shape and dtype problems
(and a ``block_size`` mismatch) raise at trace time in every mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from . import _checks
from .formats import R

_SHOWN = 8  # offending tokens listed per problem in an eager error


def check_inputs(kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None, block_size=None, allow_padding=True):
    """Raises where the ops would silently skip a slot, clamp a position or drop a token's entry.

    Args:
      kv_cache: [num_blocks, block_size, width], any cache format, or a stack of such caches
        [..., num_blocks, block_size, width] whose rows the slots address as one range, as the
        epilogues do (only its shape is read).
      slot_mapping: [T] int32 or int64.
      positions: optional [T] int32 or int64; needs ``cos_sin_cache``.
      cos_sin_cache: optional [max_position, 64] (only its shape is read).
      block_size: the block size the caller believes the cache has; compared to kv_cache.shape[-2].
      allow_padding: whether negative slots (padding) are allowed. Slots past the cache's rows
        are always reported.

    Raises:
      ValueError: eagerly, listing out-of-range slots and positions, duplicate valid slots; a
        block_size mismatch or positions without cos_sin_cache, in every mode.
      TypeError: a dtype that the ops reject (same messages as the ops).
    """
    kv_cache = _checks.as_array("kv_cache", kv_cache)
    shape = tuple(kv_cache.shape)
    if len(shape) < 3:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, width] or a stack [..., num_blocks, block_size, width], "
            f"got shape {shape}"
        )
    if block_size is not None and block_size != shape[-2]:
        raise ValueError(
            f"block_size={block_size} does not match the cache: kv_cache has shape {shape}, "
            f"so its block size (kv_cache.shape[-2]) is {shape[-2]}"
        )
    slots = _index("slot_mapping", slot_mapping, None)
    num_rows = int(np.prod(shape[:-1]))
    # A stack's slots address all its rows (the epilogues' rule), so the bound is named for what it counts.
    rows = "num_blocks * block_size" if len(shape) == 3 else "the stack's rows, prod(kv_cache.shape[:-1])"
    if (positions is None) != (cos_sin_cache is None):
        given, missing = ("positions", "cos_sin_cache") if cos_sin_cache is None else ("cos_sin_cache", "positions")
        raise ValueError(
            f"positions are checked against max_position = cos_sin_cache.shape[0]: pass both or neither, "
            f"{given} was given without {missing}"
        )
    if positions is not None:
        positions = _index("positions", positions, slots.shape[0])
        cos_sin_cache = _checks.as_array("cos_sin_cache", cos_sin_cache)
        _checks.expect_shape("cos_sin_cache", cos_sin_cache, (None, R), "[max_position, 64]")
    max_position = None if positions is None else cos_sin_cache.shape[0]
    if any(isinstance(x, jax.core.Tracer) for x in (slots, positions)):
        _staged(slots, positions, num_rows, rows, max_position, allow_padding)
        return
    positions = None if positions is None else np.asarray(positions)
    problems = _problems(np.asarray(slots), positions, num_rows, rows, max_position, allow_padding)
    if problems:
        raise ValueError("; ".join(problems))


def _index(name: str, x, tokens):
    x = _checks.as_array(name, x)
    _checks.expect_dtype(name, x, _checks.INDEX_DTYPES)
    want = "[T]" if tokens is None else f"[T] = [{tokens}] (as slot_mapping)"
    _checks.expect_shape(name, x, (tokens,), want)
    return x


def _listing(tokens, values) -> str:
    shown = ", ".join(f"token {t} -> {v}" for t, v in zip(tokens[:_SHOWN], values[:_SHOWN]))
    return shown + (f", ... ({len(tokens)} in all)" if len(tokens) > _SHOWN else "")


def _problems(slots, positions, num_rows, rows, max_position, allow_padding) -> list:
    """Eager checks in numpy: every offending token, by problem."""
    slots = slots.astype(np.int64)
    problems = []
    too_large = np.flatnonzero(slots >= num_rows)
    if too_large.size:
        problems.append(
            f"slot_mapping has {too_large.size} slot(s) >= {rows} = {num_rows} "
            f"(the ops skip them): {_listing(too_large, slots[too_large])}"
        )
    negative = np.flatnonzero(slots < 0)
    if negative.size and not allow_padding:
        problems.append(
            f"slot_mapping has {negative.size} negative (padding) slot(s) and allow_padding=False: "
            f"{_listing(negative, slots[negative])}"
        )
    valid = slots[(slots >= 0) & (slots < num_rows)]
    values, counts = np.unique(valid, return_counts=True)
    if (counts > 1).any():
        groups = [f"slot {s} <- tokens {np.flatnonzero(slots == s).tolist()}" for s in values[counts > 1][:_SHOWN]]
        problems.append(
            f"slot_mapping has {int((counts > 1).sum())} duplicate valid slot(s) (the ops keep one "
            f"token's entry): {', '.join(groups)}"
        )
    if positions is not None:
        positions = positions.astype(np.int64)
        outside = np.flatnonzero((positions < 0) | (positions >= max_position))
        if outside.size:
            problems.append(
                f"positions has {outside.size} value(s) outside [0, max_position) = [0, {max_position}) "
                f"(the ops clamp them): {_listing(outside, positions[outside])}"
            )
    return problems


def _staged(slots, positions, num_rows, rows, max_position, allow_padding) -> None:
    """The same checks as checkify.check calls; each reports its first offending token."""
    if slots.shape[0] == 0:
        return
    if allow_padding:
        bad, what = slots >= num_rows, f">= {rows} = {num_rows}"
    else:
        bad = (slots < 0) | (slots >= num_rows)
        what = f"outside [0, {rows}) = [0, {num_rows}) and allow_padding=False"
    t = jnp.argmax(bad)
    checkify.check(~jnp.any(bad), f"slot_mapping[{{t}}] = {{slot}} is {what}", t=t, slot=slots[t])
    if slots.shape[0] > 1:
        valid = (slots >= 0) & (slots < num_rows)
        # Invalid slots get distinct keys above every valid one, so only valid slots can collide.
        key = jnp.where(valid, slots, num_rows + jnp.arange(slots.shape[0], dtype=slots.dtype))
        order = jnp.argsort(key, stable=True)
        same = key[order][1:] == key[order][:-1]
        i = jnp.argmax(same)
        checkify.check(
            ~jnp.any(same),
            "slot_mapping has duplicate valid slots: tokens {first} and {second} both write slot {slot}",
            first=order[i],
            second=order[i + 1],
            slot=slots[order[i]],
        )
    if positions is not None:
        outside = (positions < 0) | (positions >= max_position)
        t = jnp.argmax(outside)
        checkify.check(
            ~jnp.any(outside),
            f"positions[{{t}}] = {{position}} is outside [0, max_position) = [0, {max_position})",
            t=t,
            position=positions[t],
        )
