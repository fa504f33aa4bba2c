"""Partitioning rules: the FFI calls under a plain ``jax.jit`` on sharded inputs.

Each FFI call is wrapped in ``jax.experimental.custom_partitioning`` with a Shardy sharding rule
(and, for the GSPMD partitioner, the same decision as callbacks). What may stay sharded:

- the **head** axis of the per-head operands and results (tensor parallel: the epilogues and
  ``mla_decode_attention``): each device runs the op on its heads;
- the **batch** axis of ``mla_decode_attention``'s query, block tables and context lengths (and
  of its results), with the cache replicated: each device attends for its sequences.

Everything else is replicated: the latent cache, the tokens of the epilogues (a token-sharded
insert into a replicated cache would let the copies diverge; token / page sharding with local
slots is :mod:`jax_kimi_mla.sharding`'s ``data_parallel``, under ``shard_map``), and every
operand of ``gather_mla_cache`` (its output rows are packed across the batch). An operand laid
out otherwise is resharded by XLA before the call: correct, but it communicates.

With one device, or under ``shard_map`` (all mesh axes manual), the wrapper lowers to the plain
FFI call: single-device ``jax.export`` artifacts are unchanged. A program partitioned this way
over several devices cannot be exported (its partitioner is a Python callback); export a
``shard_map`` program (:mod:`jax_kimi_mla.sharding`) instead.
"""

from __future__ import annotations

import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from .formats import EPILOGUES, PER_HEAD_INPUTS, PER_HEAD_OUTPUTS

HEADS, BATCH, ROWS = "h", "b", "(b s)"  # ROWS: the query rows of a batch, S_q per sequence
_PER_HEAD = PER_HEAD_INPUTS | PER_HEAD_OUTPUTS


class Rule:
    """The shardable dimensions of one FFI target, from its operand and result shapes: for each
    operand and each result a tuple with one entry per dimension (HEADS, BATCH, ROWS or None),
    or None for a scratch result (sized like the query, not returned by the op)."""

    def __init__(self, operands, results):
        self.operands, self.results = operands, results


def _epilogue_rule(e) -> Rule:
    def dims(names, shapes):
        # Per-head arrays are [T, H, width], or [V, T, H, width] (prefill's q under jax.vmap).
        return [(None,) * (len(s) - 2) + (HEADS, None) if n in _PER_HEAD and len(s) >= 3 else (None,) * len(s) for n, s in zip(names, shapes)]

    operands = (*e.inputs, "positions", "cos_sin_cache", *e.scales)
    return Rule(lambda shapes: dims(operands, shapes), lambda shapes: dims(e.outputs, shapes))


# Operands: q [B*S, H, 576], kv_cache, block_tables [B, m], context_lens [B], two scales.
# Results: out [B*S, H, 512], lse [B*S, H], the split-KV partials (scratch).
_ATTENTION = Rule(
    lambda shapes: [(ROWS, HEADS, None), (None,) * len(shapes[1]), (BATCH, None), (BATCH,), (None,), (None,)],
    lambda shapes: [(ROWS, HEADS, None), (ROWS, HEADS), None],
)

RULES = {e.target: _epilogue_rule(e) for e in EPILOGUES.values()} | {"mla_decode_attention": _ATTENTION}


def _sdy_rule(operand_dims, result_dims, aliases):
    """The Shardy rule: HEADS, BATCH and ROWS are the shared factors; every other dimension is a
    factor of its own that needs replication (an aliased result shares its operand's)."""
    replicated = []

    def spec(dims, key):
        out = []
        for i, d in enumerate(dims):
            if d is None:
                d = f"{key}_{i}"
                if d not in replicated:
                    replicated.append(d)
            out.append(d)
        return " ".join(out)

    ops = [spec(d, f"i{i}") for i, d in enumerate(operand_dims)]
    inverse = {o: i for i, o in aliases.items()}
    res = [spec(d, f"i{inverse[j]}" if j in inverse else f"o{j}") for j, d in enumerate(result_dims)]
    return f"{', '.join(ops)} -> {', '.join(res)}", tuple(replicated)


def _axes(arg_shapes, operand_dims, factors, size, taken=()):
    """The mesh axes that shard one of ``factors`` in the first operand that has it, if they
    divide ``size`` and none of them is ``taken``; else () (replicated)."""
    for x, dims in zip(arg_shapes, operand_dims):
        factor = next((f for f in factors if f in dims), None)
        if factor is not None and isinstance(x.sharding, NamedSharding):
            entry = PartitionSpec(*x.sharding.spec, *(None,) * len(dims))[dims.index(factor)]
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            n = math.prod(x.sharding.mesh.shape[a] for a in axes)
            return axes if axes and not set(axes) & set(taken) and size % n == 0 else ()
    return ()


def call(target: str, make_target, inputs, result_shapes, aliases: dict[int, int], attrs: dict):
    """``make_target(result_shapes)(*inputs, **attrs)`` under ``target``'s partitioning rule; returns
    the results, a scratch result as None."""
    rule = RULES.get(target)
    if rule is None:
        return tuple(make_target(result_shapes)(*inputs, **attrs))
    operand_dims = rule.operands([x.shape for x in inputs])
    result_dims = rule.results([r.shape for r in result_shapes])
    kept = [j for j, d in enumerate(result_dims) if d is not None]
    q_elems = math.prod(inputs[0].shape)
    sizes = {}  # the global size of each shared factor
    for x, dims in zip(inputs, operand_dims):
        for s, d in zip(x.shape, dims):
            sizes.setdefault(d, s)

    def run(results, *args):
        out = make_target(results)(*args, **attrs)
        return tuple(out[j] for j in kept)

    def decide(arg_shapes):
        heads = _axes(arg_shapes, operand_dims, (HEADS,), sizes.get(HEADS, 1))
        # Query rows split where sequences do: the batch size must divide by the axes.
        batch = _axes(arg_shapes, operand_dims, (BATCH, ROWS), sizes.get(BATCH, 1), taken=heads)
        return {HEADS: heads, BATCH: batch, ROWS: batch}

    def sharding(mesh, dims, axes):
        return NamedSharding(mesh, PartitionSpec(*((axes[d] or None) if d else None for d in dims)))

    def local_results(mesh, axes, local_q_elems):
        shapes = []
        for r, dims in zip(result_shapes, result_dims):
            if dims is None:  # scratch: as many elements per query element as globally
                shapes.append(jax.ShapeDtypeStruct((math.prod(r.shape) * local_q_elems // q_elems if q_elems else 0,), r.dtype))
            else:
                local = (s // math.prod(mesh.shape[a] for a in axes[d]) if d else s for s, d in zip(r.shape, dims))
                shapes.append(jax.ShapeDtypeStruct(tuple(local), r.dtype))
        return shapes

    def partition(mesh, arg_shapes, result_shape):
        axes = decide(arg_shapes)

        def lower_fn(*local):
            return run(local_results(mesh, axes, math.prod(local[0].shape)), *local)

        return (
            mesh,
            lower_fn,
            tuple(sharding(mesh, result_dims[j], axes) for j in kept),
            tuple(sharding(mesh, d, axes) for d in operand_dims),
        )

    def infer(mesh, arg_shapes, result_shape):
        axes = decide(arg_shapes)
        return tuple(sharding(mesh, result_dims[j], axes) for j in kept)

    partitioned = custom_partitioning(lambda *args: run(result_shapes, *args))
    rule, replicated = _sdy_rule(operand_dims, [result_dims[j] for j in kept], {i: kept.index(o) for i, o in aliases.items()})
    factor_sizes = {}
    if ROWS in rule:  # S_q query rows per sequence; one is just the batch factor
        q_tokens = int(attrs["q_tokens"])
        rule, factor_sizes = (rule.replace(ROWS, BATCH), {}) if q_tokens == 1 else (rule, {"s": q_tokens})
    partitioned.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, need_replication_factors=replicated, **factor_sizes)
    out = iter(partitioned(*inputs))
    return tuple(next(out) if d is not None else None for d in result_dims)
