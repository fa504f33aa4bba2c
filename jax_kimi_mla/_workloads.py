"""The op variants that ``python -m jax_kimi_mla``, the benchmark and the notebooks run.

``VARIANTS`` lists every FFI op x cache format x RoPE on/off with its reference. A variant builds
fresh random inputs as one flat list of arrays (keyword arrays last, in ``keywords`` order), says
which of them are donated and which output replaces each on the next call, and counts the bytes a
call must move at the least::

    v = VARIANTS["decode_fp8_rope"]
    args = v.inputs(tokens=64, heads=12)
    step = v.step(v.op)                 # jit, cache donated
    outputs = run(step, args, v.donated)  # args now hold the new cache for the next call
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import ops, reference
from .formats import CACHE_FORMATS, ENTRY, EPILOGUES, Epilogue, L, P, R, V
from .layer import FP8_SCALE_INV, SOFTMAX_SCALE
from .numerics import E4M3_MAX, ds_mla_encode, make_cos_sin_cache, quantize_e4m3

MAX_POSITION = 32768
BLOCK_SIZE = 64  # what FlashMLA's paged cache uses
# Standard deviations of the activations: the latent is RMS-normed, the absorbed query is larger.
SIGMA = dict(q=1.0, k_nope=1.0, k_pe=1.0, kv_c_normed=1.0, v=1.0, ql_nope=4.0, q_pe=1.0)
FP8_RANGE_SIGMAS = 8.0  # per-tensor fp8 scales map 8 sigma to the E4M3 maximum
CACHE_SENTINEL_BYTE = 0x5A  # prior cache contents: finite in every cache dtype, easy to spot


def padding_count(tokens: int) -> int:
    """How many tokens the builder marks as padding (slot -1): a few, none for tiny batches."""
    return min(4, tokens // 8)


@dataclass(frozen=True)
class Variant:
    epilogue: Epilogue
    rope: bool

    @property
    def name(self) -> str:
        return f"{self.epilogue.name}_{'rope' if self.rope else 'nope'}"

    @property
    def phase(self) -> str:  # "prefill" or "decode"
        return self.epilogue.phase

    @property
    def cache_format(self) -> str:  # a name of formats.CACHE_FORMATS
        return self.epilogue.cache_format.name

    @property
    def op(self) -> Callable:
        return getattr(ops, self.epilogue.op)

    @property
    def reference(self) -> Callable:
        return getattr(reference, self.epilogue.op)

    @property
    def _reordered(self) -> bool:
        """The bf16/ds_mla prefill steps return (q, k, kv_cache) or (k, kv_cache): see step()."""
        return self.epilogue.outputs == ("k", "q", "kv_cache")

    @property
    def donated(self) -> dict[int, int]:
        """Donated argument index -> index of the output that takes its place on the next call.

        The cache always; with RoPE the bf16/fp16 prefill ops also update q in place, as they do
        inside a model's jit where q is an intermediate (undonated, XLA would copy q first).
        """
        cache = self.epilogue.cache_input
        if self._reordered:
            return {0: 0, cache: 2} if self.rope else {cache: 1}
        return {cache: self.epilogue.cache_output}

    @property
    def _keyword_scales(self) -> tuple[str, ...]:
        return self.epilogue.scales if self.phase == "decode" else ()

    @property
    def keywords(self) -> tuple[str, ...]:
        """Keyword-only array arguments, passed after the positional ones in this order."""
        return self._keyword_scales + (("positions", "cos_sin_cache") if self.rope else ())

    @property
    def output_scale_args(self) -> tuple[int | None, ...]:
        """Per output: index of the float32 ``*_scale_inv`` argument it was quantized with, or None.

        Output i of an fp8 target was quantized with its scale i (the tables list them so)."""
        outputs = self.epilogue.outputs if not self._reordered or self.rope else ("k", "kv_cache")
        if not self.epilogue.scales:
            return (None,) * len(outputs)
        first = len(self.epilogue.inputs)
        return tuple(first + i for i in range(len(outputs)))

    def positional(self, fn: Callable) -> Callable:
        """``fn`` (the op or its reference) as a function of the flat argument list."""
        static = self.epilogue.static_kwargs
        keywords = self.keywords

        def call(*arrays):
            split = len(arrays) - len(keywords)
            return fn(*arrays[:split], **dict(zip(keywords, arrays[split:])), **static)

        call.__name__ = f"{self.name}_{'ffi' if fn is self.op else 'ref'}"
        return call

    def step(self, fn: Callable) -> Callable:
        """``fn`` jitted on the flat argument list with the donated arguments donated.

        The bf16/ds_mla prefill steps reorder the op's (k, q, kv_cache) as a model's step would see
        them: jax gives a donated argument the first output of its shape, so a donated q must come
        before k [T, H, 192] (else XLA copies q); without RoPE q is returned unchanged and is left
        out (returning an undonated input from a jit makes XLA copy it).
        """
        call = self.positional(fn)
        if self._reordered:
            inner = call

            def call(*arrays):
                k, q, cache = inner(*arrays)
                return (q, k, cache) if self.rope else (k, cache)

            call.__name__ = inner.__name__
        return jax.jit(call, donate_argnums=tuple(self.donated))

    def cache_dtype(self, dtype) -> jnp.dtype:
        return self.epilogue.cache_format.cache_dtype(dtype)

    def cache_entry_bytes(self, dtype=jnp.bfloat16) -> int:
        return self.epilogue.cache_format.entry_bytes(dtype)

    def num_blocks_for(self, cache_bytes: int, dtype=jnp.bfloat16, block_size: int = BLOCK_SIZE) -> int:
        """The number of blocks of a cache of about ``cache_bytes`` bytes."""
        return max(1, cache_bytes // (block_size * self.cache_entry_bytes(dtype)))

    def inputs(self, tokens: int, heads: int, dtype=jnp.bfloat16, *, num_blocks: int | None = None,
               block_size: int = BLOCK_SIZE, seed: int = 0) -> list:
        """Fresh inputs as the flat argument list (``tokens`` is T for prefill, B for decode).

        Normal activations, per-tensor fp8 scales as float32 arrays, a cache filled with a
        sentinel byte, slots a random set of distinct valid rows with ``padding_count`` of them
        -1, positions uniform in the cos/sin table. ``num_blocks`` defaults to twice the rows
        needed (at least 16 blocks).
        """
        dtype = jnp.dtype(dtype)
        if num_blocks is None:
            num_blocks = max(16, math.ceil(2 * tokens / block_size))
        rows = num_blocks * block_size
        if rows < tokens:
            raise ValueError(f"a cache of {rows} rows cannot take {tokens} distinct slots")
        rng = np.random.default_rng(seed)
        slots = rng.choice(rows, size=tokens, replace=False).astype(np.int32)
        slots[rng.choice(tokens, size=padding_count(tokens), replace=False)] = -1
        cache = _sentinel_cache((num_blocks, block_size, self.epilogue.cache_format.width), self.cache_dtype(dtype))
        T, H = tokens, heads
        if self.phase == "decode":
            shapes = dict(ql_nope=(T, H, L), q_pe=(T, H, R), kv_c_normed=(T, L), k_pe=(T, 1, R))
        else:
            shapes = dict(q=(T, H, P + R), k_nope=(T, H, P), k_pe=(T, 1, R), kv_c_normed=(T, L))
            if self.cache_format == "fp8":
                shapes["v"] = (T, H, V)
        x = dict(zip(shapes, _normals(jax.random.key(seed), tuple((SIGMA[n], s) for n, s in shapes.items()), dtype)))

        # The op's inputs in the table's order, then its scales, each set for the spread of the
        # tensor it quantizes.
        named = dict(x, kv_cache=cache, slot_mapping=jnp.asarray(slots))
        quantized = {"q_scale_inv": "ql_nope" if self.phase == "decode" else "q", "k_scale_inv": "k_nope",
                     "v_scale_inv": "v", "cache_scale_inv": "kv_c_normed"}
        args = [named[n] for n in self.epilogue.inputs]
        args += [jnp.float32(E4M3_MAX / (FP8_RANGE_SIGMAS * SIGMA[quantized[n]])) for n in self.epilogue.scales]
        if self.rope:
            args += [jnp.asarray(rng.integers(0, MAX_POSITION, size=tokens, dtype=np.int32)), _cos_sin_cache()]
        return args

    def min_bytes(self, tokens: int, heads: int, dtype=jnp.bfloat16) -> int:
        """The least bytes a call moves: each input read once, each output written once.

        Only the cache rows of valid slots count, once, as written. Without RoPE the bf16/fp16
        prefill ops never touch q (it comes back as is); with RoPE only q[..., 128:] is read and
        written, in place. With RoPE each token reads its position and one cos/sin row.
        """
        a = jnp.dtype(dtype).itemsize
        T, H = tokens, heads
        fp8 = self.cache_format == "fp8"
        if self.phase == "decode":
            read = T * (H * (L + R) + L + R) * a + (8 if fp8 else 0)
            write = T * H * ENTRY * (1 if fp8 else a)
        elif fp8:
            read = T * (H * (P + R + P + V) + L + R) * a + 16
            write = T * H * (P + R + P + R + V)  # q, k, v in fp8
        else:
            read = T * (H * P + L + R) * a
            write = T * H * (P + R) * a
            if self.rope:
                read += T * H * R * a
                write += T * H * R * a
        index = T * 4 + (T * (4 + R * 4) if self.rope else 0)
        cache = (T - padding_count(T)) * self.cache_entry_bytes(dtype)
        return read + write + index + cache


def run(step: Callable, args: list, donated: dict[int, int]):
    """One call of a jitted step; the donated arguments are replaced by the outputs that alias them."""
    outputs = step(*args)
    for arg_index, out_index in donated.items():
        args[arg_index] = outputs[out_index]
    return outputs


def fresh_copy(args: list, donated: dict[int, int]) -> list:
    """The argument list with new buffers for the donated arguments, so that ``args`` survives."""
    return [jnp.array(x, copy=True) if i in donated else x for i, x in enumerate(args)]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normals(key, sigma_shapes: tuple, dtype) -> list:
    """sigma * standard normal arrays of the given shapes, in one compiled program per shape set."""
    keys = jax.random.split(key, len(sigma_shapes))
    return [sigma * jax.random.normal(k, shape, dtype) for k, (sigma, shape) in zip(keys, sigma_shapes)]


@functools.cache
def _cos_sin_cache() -> jax.Array:
    return make_cos_sin_cache(MAX_POSITION)


def _sentinel_cache(shape, dtype) -> jax.Array:
    bits = np.full((), int.from_bytes(bytes([CACHE_SENTINEL_BYTE]) * dtype.itemsize, "little"),
                   np.dtype(f"uint{8 * dtype.itemsize}"))
    return jnp.full(shape, bits.view(dtype), dtype)


VARIANTS: dict[str, Variant] = {
    v.name: v for v in (Variant(e, rope) for e in EPILOGUES.values() for rope in (False, True))
}


# ---- decode attention workloads (the self-check and benchmarks/bench_attention.py) ----

SPARE_BLOCKS = 4  # cache blocks beyond those the tables hold
FILL_CHUNK_BLOCKS = 1024  # a cache is filled this many blocks at a time (bounded scratch memory)


def paging(batch: int, context: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """(block_tables int32 [B, ceil(context / 64)] of distinct random blocks, context_lens int32 [B]
    all ``context``, num_blocks): the blocks the tables hold plus a few, in whole fill chunks."""
    width = math.ceil(context / BLOCK_SIZE)
    needed = batch * width + SPARE_BLOCKS
    chunk = min(needed, FILL_CHUNK_BLOCKS)
    num_blocks = math.ceil(needed / chunk) * chunk
    tables = rng.permutation(num_blocks)[: batch * width].reshape(batch, width).astype(np.int32)
    return tables, np.full(batch, context, np.int32), num_blocks


@functools.partial(jax.jit, static_argnames=("fmt", "num_blocks"))
def random_cache(key, fmt: str, num_blocks: int) -> jax.Array:
    """A paged cache [num_blocks, 64, W] of ``fmt`` (a formats.CACHE_FORMATS name) holding valid
    entries of standard normal latents and k_pe (plain fp8: quantized with the layer's
    FP8_SCALE_INV), made a chunk of blocks at a time so scratch memory stays one chunk's."""
    chunk = min(num_blocks, FILL_CHUNK_BLOCKS)
    rows = chunk * BLOCK_SIZE

    def entries(k):
        k_latent, k_pe = jax.random.split(k)
        latent = jax.random.normal(k_latent, (rows, L), jnp.float32)
        k_pe = jax.random.normal(k_pe, (rows, R), jnp.float32)
        if fmt == "fp8_ds_mla":
            return ds_mla_encode(latent, k_pe.astype(jnp.bfloat16))
        x = jnp.concatenate([latent, k_pe], -1)
        return quantize_e4m3(x, FP8_SCALE_INV) if fmt == "fp8" else x.astype(jnp.bfloat16)

    return jax.lax.map(entries, jax.random.split(key, num_blocks // chunk)).reshape(num_blocks, BLOCK_SIZE, -1)


def attention_inputs(fmt: str, batch: int, context: int, heads: int, q_tokens: int | None = None, *, seed: int = 0) -> list:
    """[mqa_q, kv_cache, block_tables, context_lens, q_scale_inv, cache_scale_inv] of one
    mla_decode_attention call: every sequence at ``context`` tokens, a normal query ([B, H, 576],
    or [B, S_q, H, 576] with ``q_tokens``); plain fp8: an fp8 query and both scales (the layer's
    FP8_SCALE_INV), else None."""
    tables, lens, num_blocks = paging(batch, context, np.random.default_rng(seed))
    k_q, k_cache = jax.random.split(jax.random.key(seed))
    tokens = () if q_tokens is None else (q_tokens,)
    q = jax.random.normal(k_q, (batch, *tokens, heads, ENTRY), jnp.float32)
    if fmt == "fp8":
        scale_inv = jnp.float32(FP8_SCALE_INV)
        q, scales = quantize_e4m3(q, scale_inv), [scale_inv, scale_inv]
    else:
        q, scales = q.astype(jnp.bfloat16), [None, None]
    return [q, random_cache(k_cache, fmt, num_blocks), jnp.asarray(tables), jnp.asarray(lens), *scales]


def gather_inputs(fmt: str, batch: int, context: int, *, seed: int = 0) -> list:
    """[kv_cache, block_tables, context_lens, cache_scale_inv] of one gather_mla_cache call: the
    cache and paging of ``attention_inputs`` (every sequence at ``context`` tokens)."""
    _, cache, tables, lens, _, cache_scale_inv = attention_inputs(fmt, batch, context, 1, seed=seed)
    return [cache, tables, lens, cache_scale_inv]


def attention_step(fn, fmt: str, *, return_lse: bool = False, **launch):
    """``fn`` (mla_decode_attention or its reference) jitted on attention_inputs' list
    [mqa_q, kv_cache, block_tables, context_lens, q_scale_inv, cache_scale_inv]; the split count
    is the op's choice, and ``launch`` its other launch keywords (kernel, programmatic_combine,
    balance_splits)."""
    def call(q, cache, tables, lens, q_scale_inv, cache_scale_inv):
        return fn(q, cache, tables, lens, softmax_scale=SOFTMAX_SCALE, ds_mla=fmt == "fp8_ds_mla",
                  q_scale_inv=q_scale_inv, cache_scale_inv=cache_scale_inv, return_lse=return_lse, **launch)

    return jax.jit(call)


def gather_step(fn, fmt: str):
    """``fn`` (gather_mla_cache or its reference) jitted on [kv_cache, block_tables, context_lens,
    cache_scale_inv]: bfloat16 out, num_tokens the tables' capacity."""
    def call(cache, tables, lens, cache_scale_inv):
        return fn(cache, tables, lens, ds_mla=fmt == "fp8_ds_mla", cache_scale_inv=cache_scale_inv)

    return jax.jit(call)


def attention_bytes(fmt: str, batch: int, context: int, heads: int, q_tokens: int = 1) -> int:
    """The least bytes an mla_decode_attention call moves: every cached entry read once, the query
    read and the output written once."""
    q_rows = batch * q_tokens * heads
    return batch * context * CACHE_FORMATS[fmt].entry_bytes() + q_rows * ENTRY * (1 if fmt == "fp8" else 2) + q_rows * L * 2
