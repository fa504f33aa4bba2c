"""Argument checks shared by the FFI ops and the jnp reference.

Everything here runs on shapes and dtypes only, so errors are raised at trace time, before any
kernel runs. Each message names the argument, what was expected and what was passed. Dtype
problems raise TypeError, shape and combination problems raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .formats import CACHE_FORMATS, ENTRY, CacheFormat, L, P, R, V

ACT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
INDEX_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64))
FP8 = jnp.dtype(jnp.float8_e4m3fn)
UINT8 = jnp.dtype(jnp.uint8)
F32 = jnp.dtype(jnp.float32)


@dataclass(frozen=True)
class Columns:
    """Columns [start, start + width) of the last axis of a wider producer tensor.

    Made by :func:`jax_kimi_mla.columns`. The FFI ops read those columns in place (no slice copy);
    the reference slices.
    """

    array: jax.Array
    start: int

    def sliced(self, width: int):
        return self.array[..., self.start : self.start + width]


# A pytree (the array a leaf, start static): columns(...) may be passed into jax.jit, vmap, scan.
jax.tree_util.register_dataclass(Columns, data_fields=["array"], meta_fields=["start"])


def columns(x, start: int) -> Columns:
    """Marks ``x[..., start:start + width]`` as an op input without slicing it.

    Accepted for ``k_nope``, ``v``, ``k_pe`` and ``q_pe``, e.g. ``k_nope=columns(kv, 0)`` and
    ``v=columns(kv, 128)`` with kv the kv_b_proj output [T, H, 256], ``k_pe=columns(kv_a, 512)``
    with kv_a [T, 576], ``q_pe=columns(q, 128)`` with q [B, H, 192]. ``start`` and the last
    dimension must be multiples of 8 (16-byte rows).
    """
    return Columns(x, int(start))


@dataclass(frozen=True)
class Checked:
    """What the checks learned: token count, head count, activation dtype, RoPE on/off and style."""

    tokens: int
    heads: int
    act: jnp.dtype
    rope: bool
    rope_style: str = "gptj"


ROPE_STYLES = ("gptj", "neox")


def rope_style(x) -> str:
    """The RoPE pairing: "gptj" (elements 2i, 2i + 1) or "neox" (elements i, i + 32)."""
    if not isinstance(x, str) or x not in ROPE_STYLES:
        raise ValueError(f'rope_style must be "gptj" (interleaved pairs) or "neox" (rotate-half), got {x!r}')
    return x


def as_array(name: str, x):
    if x is None:
        raise TypeError(f"{name} is required, got None")
    if isinstance(x, Columns):
        raise ValueError(f"{name} does not accept columns(...): only {', '.join(COLUMN_WIDTHS)} do; pass {name} itself")
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval"):
        if not all(isinstance(d, (int, np.integer)) for d in x.shape):
            raise ValueError(f"{name} has a symbolic shape {tuple(x.shape)}: the ops need concrete shapes (their static "
                             "attributes follow them); export one artifact per bucket of sizes")
        return x
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def cache(x, fmt: CacheFormat, act, why: str = "", stacked: bool = False):
    """Checks kv_cache against its format; ``why`` says how the call chose that format. Rows may
    be wider than the entry (padded) when their size is a multiple of 16 bytes. ``stacked``: a
    stack [..., num_blocks, block_size, W] is taken too (the epilogues: its rows are addressed
    whole, so a stack of layers is written in place without a reshape)."""
    x = as_array("kv_cache", x)
    want = fmt.cache_dtype(act)
    if jnp.dtype(x.dtype) != want:
        raise TypeError(f"kv_cache must have dtype {want} for {fmt.what}{why}, got {x.dtype}")
    shape = tuple(x.shape)
    if (len(shape) < 3 if stacked else len(shape) != 3) or shape[-1] < fmt.width:
        stack = f", or a stack [..., num_blocks, block_size, {fmt.width}]" if stacked else ""
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {fmt.width}]{stack} ({fmt.what}{why}), got shape {shape}")
    padded_row("kv_cache", shape[-1], fmt, want, f"shape {shape}", why)
    return x


def padded_row(name: str, width: int, fmt: CacheFormat, dtype, got: str, why: str = "") -> None:
    """A cache row of ``width`` elements wider than the entry must be a multiple of 16 bytes
    (the kernels move rows in 16-byte pieces)."""
    item = jnp.dtype(dtype).itemsize
    if width > fmt.width and width * item % 16:
        step = 16 // item
        raise ValueError(
            f"{name}: rows wider than the {fmt.width}-element entry ({fmt.what}{why}) must be padded to a multiple"
            f" of 16 bytes, e.g. {-(-width // step) * step} elements; got {got}"
        )


def _names(dtypes) -> str:
    return " or ".join(str(jnp.dtype(d)) for d in dtypes)


def expect_dtype(name: str, x, allowed) -> None:
    if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in allowed):
        raise TypeError(f"{name} must have dtype {_names(allowed)}, got {x.dtype}")


def expect_shape(name: str, x, want: tuple, what: str) -> None:
    """``want`` holds ints, or None for a free dimension; ``what`` spells the expected shape."""
    shape = tuple(x.shape)
    if len(shape) != len(want) or any(w is not None and s != w for s, w in zip(shape, want)):
        raise ValueError(f"{name} must be {what}, got shape {shape}")


class _Checker:
    """Checks one call: the first per-head input fixes the token count (T in prefill, B in decode),
    H and the activation dtype."""

    def __init__(self, first_name: str, first, width: int, t: str = "T"):
        self.t = t  # the token dimension's letter in the op's docs
        x = as_array(first_name, first)
        expect_dtype(first_name, x, ACT_DTYPES)
        expect_shape(first_name, x, (None, None, width), f"[{t}, H, {width}]")
        self.tokens, self.heads = int(x.shape[0]), int(x.shape[1])
        self.act = jnp.dtype(x.dtype)
        self.first_name = first_name
        self.rope_style = "gptj"

    def _tokens_match(self, name: str, x) -> None:
        if x.ndim >= 1 and x.shape[0] != self.tokens:
            raise ValueError(
                f"mismatched {self.t}: {name} has {x.shape[0]} tokens but {self.first_name} has {self.tokens} "
                f"(shape {tuple(x.shape)})"
            )

    def activation(self, name: str, x, tail: tuple, what: str, per_head: bool):
        if isinstance(x, Columns) and name in COLUMN_WIDTHS:
            return self._columns(name, x, tail, what, per_head)
        x = as_array(name, x)
        if jnp.dtype(x.dtype) != self.act:
            raise TypeError(
                f"{name} must have the activation dtype {self.act} (that of {self.first_name}), got {x.dtype}"
            )
        self._tokens_match(name, x)
        if per_head and x.ndim == 3 and x.shape[1] != self.heads:
            raise ValueError(
                f"mismatched H: {name} has {x.shape[1]} heads but {self.first_name} has {self.heads} "
                f"(shape {tuple(x.shape)})"
            )
        expect_shape(name, x, (self.tokens, *tail), what)
        return x

    def _columns(self, name: str, c: Columns, tail: tuple, what: str, per_head: bool):
        """Checks a Columns input: the wider tensor must fit ``what`` but for its last dimension."""
        base = as_array(name, c.array)
        width = tail[-1]
        if base.ndim != len(tail) + 1:
            raise ValueError(f"{name} must be {what} (columns of a wider tensor), got shape {tuple(base.shape)}")
        full = base.shape[-1]
        if c.start < 0 or c.start % 8 or full % 8 or c.start + width > full:
            raise ValueError(
                f"{name}: columns({c.start}) of a tensor with last dimension {full} must start at a multiple "
                f"of 8 and hold {width} columns (last dimension a multiple of 8)"
            )
        where = f"{what}, read as columns [{c.start}, {c.start + width}) of a wider tensor"
        self.activation(name, base, (*tail[:-1], full), where, per_head)
        return Columns(base, c.start)

    def per_head(self, name: str, x, width: int):
        return self.activation(name, x, (self.heads, width), f"[{self.t}, H, {width}] = [{self.tokens}, {self.heads}, {width}]", True)

    def latent(self, name: str, x):
        return self.activation(name, x, (L,), f"[{self.t}, {L}] = [{self.tokens}, {L}]", False)

    def k_pe(self, x):
        x = x if isinstance(x, Columns) else as_array("k_pe", x)
        if (x.array if isinstance(x, Columns) else x).ndim == 3:
            return self.activation("k_pe", x, (1, R), f"[{self.t}, 64] or [{self.t}, 1, 64] with {self.t} = {self.tokens}", False)
        return self.activation("k_pe", x, (R,), f"[{self.t}, 64] or [{self.t}, 1, 64] with {self.t} = {self.tokens}", False)

    def index(self, name: str, x):
        x = as_array(name, x)
        expect_dtype(name, x, INDEX_DTYPES)
        x = _int64_host_indices_as_int32(name, x)
        self._tokens_match(name, x)
        expect_shape(name, x, (self.tokens,), f"[{self.t}] = [{self.tokens}]")
        return x

    def cache(self, x, fmt: CacheFormat, why: str = ""):
        return cache(x, fmt, self.act, why, stacked=True)

    def rope(self, positions, cos_sin_cache, style):
        self.rope_style = rope_style(style)
        if (positions is None) != (cos_sin_cache is None):
            given, missing = ("positions", "cos_sin_cache") if cos_sin_cache is None else ("cos_sin_cache", "positions")
            raise ValueError(f"RoPE needs both positions and cos_sin_cache: {given} was given without {missing}")
        if positions is None:
            return None, None
        positions = self.index("positions", positions)
        cos_sin_cache = as_array("cos_sin_cache", cos_sin_cache)
        expect_dtype("cos_sin_cache", cos_sin_cache, (F32,))
        expect_shape("cos_sin_cache", cos_sin_cache, (None, R), "[max_position, 64]")
        if cos_sin_cache.shape[0] == 0:
            raise ValueError("cos_sin_cache must have at least one row (max_position >= 1), got shape (0, 64)")
        return positions, cos_sin_cache

    def done(self, rope: bool) -> Checked:
        return Checked(self.tokens, self.heads, self.act, rope, self.rope_style)


COLUMN_WIDTHS = {"k_nope": P, "v": V, "k_pe": R, "q_pe": R}  # the inputs that accept columns()


def sliced(args: dict) -> dict:
    """The checked arguments with every Columns input sliced to its exact width (for the reference)."""
    return {n: x.sliced(COLUMN_WIDTHS[n]) if isinstance(x, Columns) else x for n, x in args.items()}


def _int64_host_indices_as_int32(name: str, x):
    """With x64 off, JAX would wrap a host int64 index into int32 (2**32 + 1 -> 1). Map values
    outside int32 to ones with the same meaning instead: a slot or block id -> -1 (skipped or
    masked, as any index out of range), a position or length -> the int32 bound (clamped either
    way)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.int64 or jax.config.jax_enable_x64:
        return x
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if name in ("slot_mapping", "block_tables"):
        return np.where((x >= lo) & (x <= hi), x, -1).astype(np.int32)
    return np.clip(x, lo, hi).astype(np.int32)


def scale(name: str, x):
    """A per-tensor scale: a float32 array of shape () or (1,), or a Python number (made float32
    here, whatever jax_enable_x64 says: a weak-typed constant, not a float64 array)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.asarray(x, F32)
    x = as_array(name, x)
    expect_dtype(name, x, (F32,))
    if tuple(x.shape) not in ((), (1,)):
        raise ValueError(f"{name} must be a float32 scalar array of shape () or (1,), got shape {tuple(x.shape)}")
    return x


def fp8_prefill_scales(q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv) -> list:
    """The four per-tensor scale inverses of the fp8 prefill op, checked, in operand order."""
    named = (("q_scale_inv", q_scale_inv), ("k_scale_inv", k_scale_inv), ("v_scale_inv", v_scale_inv), ("cache_scale_inv", cache_scale_inv))
    return [scale(n, s) for n, s in named]


def prefill(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, *, cache_format, style, v=None):
    """Checks a prefill call; ``cache_format`` is a name of ``formats.CACHE_FORMATS``."""
    c = _Checker("q", q, P + R)
    args = dict(
        q=as_array("q", q),
        k_nope=c.per_head("k_nope", k_nope, P),
        k_pe=c.k_pe(k_pe),
        kv_c_normed=c.latent("kv_c_normed", kv_c_normed),
    )
    if cache_format == "fp8":
        args["v"] = c.per_head("v", v, V)
    args["kv_cache"] = c.cache(kv_cache, CACHE_FORMATS[cache_format])
    args["slot_mapping"] = c.index("slot_mapping", slot_mapping)
    args["positions"], args["cos_sin_cache"] = c.rope(positions, cos_sin_cache, style)
    return c.done(positions is not None), args


def decode(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, ds_mla, q_scale_inv, cache_scale_inv, positions, cos_sin_cache, style):
    """Checks a decode call and picks its cache format (a name of ``formats.CACHE_FORMATS``)."""
    c = _Checker("ql_nope", ql_nope, L, t="B")
    args = dict(
        ql_nope=as_array("ql_nope", ql_nope),
        q_pe=c.per_head("q_pe", q_pe, R),
        kv_c_normed=c.latent("kv_c_normed", kv_c_normed),
        k_pe=c.k_pe(k_pe),
    )
    if (q_scale_inv is None) != (cache_scale_inv is None):
        given = "q_scale_inv" if cache_scale_inv is None else "cache_scale_inv"
        missing = "cache_scale_inv" if cache_scale_inv is None else "q_scale_inv"
        raise ValueError(f"the plain fp8 cache needs both q_scale_inv and cache_scale_inv: {given} was given without {missing}")
    cache = as_array("kv_cache", kv_cache)
    scales = {"q_scale_inv": q_scale_inv, "cache_scale_inv": cache_scale_inv}
    fmt, why = selected_format(ds_mla, scales, cache, "q_scale_inv and cache_scale_inv; neither was given")
    args["kv_cache"] = c.cache(cache, CACHE_FORMATS[fmt], why)
    if fmt == "fp8":
        args.update((name, scale(name, s)) for name, s in scales.items())
    args["slot_mapping"] = c.index("slot_mapping", slot_mapping)
    args["positions"], args["cos_sin_cache"] = c.rope(positions, cos_sin_cache, style)
    return c.done(positions is not None), fmt, args


@dataclass(frozen=True)
class AttentionCall:
    """A checked mla_decode_attention call: the arrays in FFI form and what they mean."""

    q: jax.Array  # [B, S_q, H, 576]
    kv_cache: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    q_scale_inv: jax.Array | None
    cache_scale_inv: jax.Array | None
    cache_format: str  # "bf16" (the activation dtype), "fp8" or "fp8_ds_mla"
    softmax_scale: float
    num_splits: int | None
    squeeze: bool  # mqa_q was [B, H, 576]: outputs drop the S_q axis
    kernel: str = "auto"
    programmatic_combine: bool = True
    balance_splits: bool = True
    split_by_work: bool = True

    @property
    def out_dtype(self):
        return self.q.dtype if jnp.dtype(self.q.dtype) in ACT_DTYPES else jnp.dtype(jnp.bfloat16)

    @property
    def launch_attributes(self) -> dict:
        """The optional FFI attributes of the CUDA launch, where they differ from their defaults
        (so a default call lowers as before they existed)."""
        attrs = {} if self.kernel == "auto" else {"kernel": self.kernel}
        if not self.programmatic_combine:
            attrs["programmatic_combine"] = False
        if not self.balance_splits:
            attrs["balance_splits"] = False
        return attrs


MAX_QUERY_TOKENS = 4  # S_q of mla_decode_attention
MAX_SPLITS = 1024
DECODE_KERNELS = ("auto", "mma", "wide", "rs", "rs-combine")  # mla_decode_attention(kernel=)


def static_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (a static Python bool), got {x!r}")
    return bool(x)


def reader_cache(kv_cache, fmt: CacheFormat, act, why: str):
    """A cache that a reader (the decode attention, the gather) takes: as :func:`cache`, with
    blocks of at least one token (a reader addresses token t at t // block_size)."""
    cache(kv_cache, fmt, act, why)
    if kv_cache.shape[1] < 1:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {fmt.width}] with block_size >= 1, got shape {tuple(kv_cache.shape)}")


def decode_attention(mqa_q, kv_cache, block_tables, context_lens, softmax_scale, ds_mla, q_scale_inv, cache_scale_inv, num_splits,
                     return_lse, kernel="auto", programmatic_combine=True, balance_splits=True, split_by_work=True) -> AttentionCall:
    """Checks an mla_decode_attention call and picks its cache format."""
    q = as_array("mqa_q", mqa_q)
    expect_dtype("mqa_q", q, (*ACT_DTYPES, FP8))
    if q.ndim not in (3, 4) or q.shape[-1] != ENTRY or (q.ndim == 4 and not 1 <= q.shape[1] <= MAX_QUERY_TOKENS):
        raise ValueError(f"mqa_q must be [B, H, {ENTRY}] or [B, S_q, H, {ENTRY}] with 1 <= S_q <= {MAX_QUERY_TOKENS}, got shape {tuple(q.shape)}")
    squeeze = q.ndim == 3
    if squeeze:
        q = q.reshape(q.shape[0], 1, *q.shape[1:])
    B = int(q.shape[0])
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"softmax_scale must be a Python float (a static attribute of the call), got {type(softmax_scale).__name__}")
    ds_mla = static_bool("ds_mla", ds_mla)
    static_bool("return_lse", return_lse)
    if not isinstance(kernel, str) or kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, DECODE_KERNELS))}, got {kernel!r}")
    static_bool("programmatic_combine", programmatic_combine)
    static_bool("balance_splits", balance_splits)
    static_bool("split_by_work", split_by_work)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None (chosen from the sizes) or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    kv_cache = as_array("kv_cache", kv_cache)
    q_fp8 = jnp.dtype(q.dtype) == FP8
    if not ds_mla and cache_scale_inv is None and (q_scale_inv is not None or q_fp8):
        raise ValueError("an fp8 mqa_q (with q_scale_inv) reads only the plain fp8 cache, which needs cache_scale_inv")
    # From here q_scale_inv comes with cache_scale_inv, or with ds_mla=True (which refuses both).
    fmt, why = selected_format(ds_mla, {"q_scale_inv": q_scale_inv, "cache_scale_inv": cache_scale_inv}, kv_cache)
    if fmt == "fp8_ds_mla" and q_fp8:
        raise TypeError("mqa_q is float8_e4m3fn, which only the plain fp8 cache takes; with ds_mla=True pass a bfloat16 or float16 mqa_q")
    reader_cache(kv_cache, CACHE_FORMATS[fmt], q.dtype, why or " of mqa_q")
    if q_fp8 != (q_scale_inv is not None):
        raise ValueError("q_scale_inv goes with an fp8 (float8_e4m3fn) mqa_q: " + ("it is missing" if q_fp8 else f"mqa_q is {q.dtype}"))
    tables, lens = paged_tables(block_tables, context_lens, B)
    return AttentionCall(
        q=q,
        kv_cache=kv_cache,
        block_tables=tables,
        context_lens=lens,
        q_scale_inv=None if q_scale_inv is None else scale("q_scale_inv", q_scale_inv),
        cache_scale_inv=None if cache_scale_inv is None else scale("cache_scale_inv", cache_scale_inv),
        cache_format=fmt,
        softmax_scale=float(softmax_scale),
        num_splits=None if num_splits is None else int(num_splits),
        squeeze=squeeze,
        kernel=kernel,
        programmatic_combine=bool(programmatic_combine),
        balance_splits=bool(balance_splits),
        split_by_work=bool(split_by_work),
    )


GATHER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), F32)


@dataclass(frozen=True)
class GatherCall:
    """A checked gather_mla_cache call."""

    kv_cache: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    cache_scale_inv: jax.Array | None
    cache_format: str
    num_tokens: int
    out_dtype: jnp.dtype


def selected_format(ds_mla, scales: dict, kv_cache, fp8_needs: str = "cache_scale_inv; it was not given") -> tuple[str, str]:
    """The cache format a call selects, by the one rule of every op that reads or writes several:
    ds_mla=True selects fp8_ds_mla, which stores its own scales (so none of ``scales`` may be
    given); else the plain fp8 cache's ``scales`` (the caller has checked that they come together)
    select it; else the 16-bit cache, which a uint8 or float8_e4m3fn kv_cache is not (``fp8_needs``:
    what the plain fp8 cache would need here). Returns the format's name and how the cache's
    errors say why it is that format ("" for the 16-bit cache)."""
    given = [name for name, s in scales.items() if s is not None]
    if static_bool("ds_mla", ds_mla):
        if given:
            raise ValueError(f"ds_mla=True stores its own per-tile scales: {' and '.join(given)} must be None")
        return "fp8_ds_mla", " of ds_mla=True"
    if given:
        return "fp8", f", as {' and '.join(given)} {'were' if len(given) > 1 else 'was'} given"
    if jnp.dtype(kv_cache.dtype) == UINT8:
        raise TypeError("kv_cache is uint8 (an fp8_ds_mla cache?) but ds_mla=False; pass ds_mla=True")
    if jnp.dtype(kv_cache.dtype) == FP8:
        raise TypeError(f"kv_cache is float8_e4m3fn (the plain fp8 cache), which needs {fp8_needs}")
    return "bf16", ""


def paged_tables(block_tables, context_lens, batch: int | None = None):
    """Checks block_tables [B, max_blocks] (B = ``batch`` when given: mqa_q's) and context_lens
    [B]; returns them (host int64 indices made int32)."""
    tables = as_array("block_tables", block_tables)
    expect_dtype("block_tables", tables, INDEX_DTYPES)
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got shape {tuple(tables.shape)}")
    if batch is not None and tables.shape[0] != batch:
        raise ValueError(f"mismatched B: block_tables has {tables.shape[0]} rows but mqa_q has {batch} sequences")
    lens = as_array("context_lens", context_lens)
    expect_dtype("context_lens", lens, INDEX_DTYPES)
    B = int(tables.shape[0])
    expect_shape("context_lens", lens, (B,), f"[B] = [{B}]")
    return _int64_host_indices_as_int32("block_tables", tables), _int64_host_indices_as_int32("context_lens", lens)


def gather_cache(kv_cache, block_tables, context_lens, num_tokens, ds_mla, cache_scale_inv, out_dtype) -> GatherCall:
    """Checks a gather_mla_cache call and picks its cache format."""
    kv_cache = as_array("kv_cache", kv_cache)
    fmt, why = selected_format(ds_mla, {"cache_scale_inv": cache_scale_inv}, kv_cache)
    if fmt == "bf16":
        expect_dtype("kv_cache", kv_cache, ACT_DTYPES)
    reader_cache(kv_cache, CACHE_FORMATS[fmt], kv_cache.dtype if fmt == "bf16" else None, why)
    tables, lens = paged_tables(block_tables, context_lens)
    out = None if out_dtype is None else jnp.dtype(out_dtype)  # jnp.dtype(None) is float64
    if out not in GATHER_DTYPES:
        raise TypeError(f"out_dtype must be {_names(GATHER_DTYPES)}, got {out}")
    capacity = int(tables.shape[0] * tables.shape[1] * kv_cache.shape[1])
    if num_tokens is None:
        num_tokens = capacity
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise ValueError(f"num_tokens must be None (every table slot: B * max_blocks * block_size) or a static int >= 0 (it sizes the output), got {num_tokens!r}")
    return GatherCall(
        kv_cache=kv_cache,
        block_tables=tables,
        context_lens=lens,
        cache_scale_inv=None if cache_scale_inv is None else scale("cache_scale_inv", cache_scale_inv),
        cache_format=fmt,
        num_tokens=int(num_tokens),
        out_dtype=out,
    )


# ---- the layer's step arguments (jax_kimi_mla.layer) -----------------------------------------


def _index_argument(name: str, x, shape: tuple, what: str):
    """An int32/int64 index argument of the layer, of exactly ``shape`` (spelled ``what``)."""
    x = as_array(name, x)
    expect_dtype(name, x, INDEX_DTYPES)
    expect_shape(name, x, shape, what)
    return x


def layer_params(params, expected: dict, config_says: str) -> None:
    """Checks one layer's params against the shapes its config implies (``expected``: {name: shape,
    or a dict of them}); ``config_says``: the config fields that set them, for the message."""
    if not isinstance(params, dict):
        raise TypeError(f"params must be the dict of one layer's weights from init_params, got {type(params).__name__}")
    for name, want in expected.items():
        if name not in params:
            raise ValueError(f"params has no {name!r}, which the config ({config_says}) needs: make params with "
                             "init_params(key, config) for this config")
        if isinstance(want, dict):
            layer_params(params[name], want, config_says)
            continue
        got = tuple(jnp.shape(params[name]))
        if got != want:
            raise ValueError(f"params[{name!r}] has shape {got}, but the config ({config_says}) needs {want}: make params "
                             "with init_params(key, config) for this config (inside scan_layers: one layer's slice)")
    for name in ("q_proj", "q_a_proj", "g_proj"):
        if name in params and name not in expected:
            raise ValueError(f"params has {name!r}, which the config ({config_says}) does not use: params and config "
                             "must match")


def layer_weight_dtypes(params, names, dtype) -> None:
    """The layer's matrices are in the activation dtype (the GEMMs' operands; init_params makes
    them so), not cast silently."""
    for name in names:
        got = jnp.result_type(params[name])
        if got != dtype:
            raise TypeError(f"params[{name!r}] has dtype {got}, but the config's activation dtype (MLAConfig.dtype) is "
                            f"{jnp.dtype(dtype)}: the weights must be in it, as init_params makes them")


def layer_stack(params, kv_cache) -> int:
    """scan_layers' stacks: a [layers, N, bs, W] cache and params with as many layers (the leading
    axis of every leaf, as init_params(..., num_layers=layers) makes them, or a list of that many
    layers' params, which the step checks). Returns layers."""
    shape = tuple(jnp.shape(kv_cache))
    if len(shape) != 4:
        raise ValueError(f"scan_layers needs a stacked kv_cache [layers, num_blocks, block_size, W], got shape {shape}")
    if isinstance(params, (list, tuple)):
        if len(params) != shape[0]:
            raise ValueError(f"params is a list of {len(params)} layers' params, but kv_cache holds {shape[0]} layers (shape {shape})")
        return shape[0]
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if jnp.shape(leaf)[:1] != shape[:1]:
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(leaf))}, but scan_layers needs the "
                             f"leading axis of every leaf to be the {shape[0]} layers of kv_cache (shape {shape}): make params "
                             f"with init_params(key, config, num_layers={shape[0]})")
    return shape[0]


def layer_index(layer, kv_cache):
    """Checks the layer index against the cache: None with a [N, bs, W] cache, or an int (Python
    int in [0, layers), or an int32/int64 scalar array, which may be traced) with a stacked
    [layers, N, bs, W] one. A traced index outside [0, layers) writes and reads nothing."""
    ndim = len(jnp.shape(kv_cache))
    if ndim not in (3, 4):
        raise ValueError(f"kv_cache must be [num_blocks, block_size, W] or a stack of layers [layers, num_blocks, block_size, W], "
                         f"got shape {tuple(jnp.shape(kv_cache))}")
    if layer is None:
        if ndim == 4:
            raise ValueError(f"kv_cache is a stack of layers {tuple(jnp.shape(kv_cache))}: pass layer= (this layer's index)")
        return
    if ndim != 4:
        raise ValueError(f"layer={layer!r} needs a stacked kv_cache [layers, num_blocks, block_size, W], got shape "
                         f"{tuple(jnp.shape(kv_cache))}")
    layers = int(jnp.shape(kv_cache)[0])
    if isinstance(layer, (bool, np.bool_)):
        raise TypeError(f"layer must be an int, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < layers:
            raise ValueError(f"layer must be in [0, {layers}) (kv_cache holds {layers} layers), got {layer}")
        return
    _index_argument("layer", layer, (), "a scalar")


def _layer_x(x, ranks: tuple, what: str, hidden: int, dtype):
    """The layer's x: of a rank in ``ranks`` (``what`` spells them), hidden = config.hidden_size
    wide, in the config's activation dtype (the weights' too: nothing is cast silently)."""
    x = as_array("x", x)
    if x.ndim not in ranks:
        raise ValueError(f"x must be {what}, got shape {tuple(x.shape)}")
    if x.shape[-1] != hidden:
        raise ValueError(f"x must be {what} with hidden = config.hidden_size = {hidden}, got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"x must have the config's activation dtype {jnp.dtype(dtype)} (MLAConfig.dtype), got {x.dtype}")
    return x


def layer_prefill(x, positions, slot_mapping, cu_seqlens, block_table, context_len, context_tokens, hidden: int, dtype):
    """Checks layer.prefill's token and sequence arguments: x [T, hidden] (config.hidden_size, in
    the config's dtype), positions (or None) and slot_mapping [T], cu_seqlens [S + 1] (or None:
    one sequence), block_table / context_len both or neither ([max_blocks] and a scalar for one
    sequence, [S, max_blocks] and [S] packed), and context_tokens (None or a static int).
    cu_seqlens's values are traced: the layer clips them (layer.prefill)."""
    x = _layer_x(x, (2,), "[T, hidden]", hidden, dtype)
    if context_tokens is not None and (isinstance(context_tokens, bool) or not isinstance(context_tokens, (int, np.integer))
                                       or context_tokens < 0):
        raise ValueError(f"context_tokens must be None or a static int >= 0 (it sizes the gathered context), got {context_tokens!r}")
    T = int(x.shape[0])
    if positions is not None:
        positions = _index_argument("positions", positions, (T,), f"[T] = [{T}] (x has {T} tokens)")
    slot_mapping = _index_argument("slot_mapping", slot_mapping, (T,), f"[T] = [{T}] (x has {T} tokens)")
    if (block_table is None) != (context_len is None):
        given, missing = ("block_table", "context_len") if context_len is None else ("context_len", "block_table")
        raise ValueError(f"a chunk after cached tokens needs both block_table and context_len: {given} was given without "
                         f"{missing}")
    if cu_seqlens is None:
        if block_table is not None:
            block_table = _index_argument("block_table", block_table, (None,), "[max_blocks] for one sequence (cu_seqlens not given)")
            shape = () if jnp.ndim(context_len) == 0 else (1,)
            context_len = _index_argument("context_len", context_len, shape, "a scalar (or [1]) for one sequence (cu_seqlens not given)")
        return positions, slot_mapping, None, block_table, context_len
    cu = as_array("cu_seqlens", cu_seqlens)
    expect_dtype("cu_seqlens", cu, INDEX_DTYPES)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [S + 1] with S >= 1 (sequence s owns tokens cu_seqlens[s]:cu_seqlens[s + 1]), "
                         f"got shape {tuple(cu.shape)}")
    if block_table is not None:
        S = int(cu.shape[0]) - 1
        block_table = _index_argument("block_table", block_table, (S, None), f"[S, max_blocks] with S = {S} (cu_seqlens has S + 1 = {S + 1} entries)")
        context_len = _index_argument("context_len", context_len, (S,), f"[S] = [{S}] (cu_seqlens has S + 1 = {S + 1} entries)")
    return positions, slot_mapping, cu, block_table, context_len


def layer_decode(x, positions, slot_mapping, block_tables, context_lens, hidden: int, dtype):
    """Checks layer.decode's token arguments: x [B, hidden] or [B, S_q, hidden] (as prefill's x);
    positions (or None) and slot_mapping [B] / [B, S_q]; block_tables and context_lens made arrays
    (their shapes are mla_decode_attention's to check)."""
    x = _layer_x(x, (2, 3), "[B, hidden] or [B, S_q, hidden]", hidden, dtype)
    tokens = tuple(int(d) for d in x.shape[:-1])
    what = f"{'[B]' if len(tokens) == 1 else '[B, S_q]'} = {list(tokens)} (x is {tuple(x.shape)})"
    if positions is not None:
        positions = _index_argument("positions", positions, tokens, what)
    slot_mapping = _index_argument("slot_mapping", slot_mapping, tokens, what)
    return positions, slot_mapping, as_array("block_tables", block_tables), as_array("context_lens", context_lens)
