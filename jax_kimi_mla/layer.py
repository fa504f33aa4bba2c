"""A Kimi-K3 MLA attention layer in plain JAX, built on the library's ops.

Prefill runs MLA in its non-absorbed form: per-head q [T, H, 192], k = [k_nope | k_pe] and
v [T, H, 128], causal attention over the new tokens plus, for a later chunk of a prompt, over the
sequence's cached tokens (read back with ``gather_mla_cache`` and up-projected through
kv_b_proj). The attention runs on cuDNN's flash attention where the GPU has it, else blockwise
(online softmax over tiles of ``config.attention_block`` queries and keys); either way memory grows
with T, not T^2 (``config.attention_impl``, :mod:`jax_kimi_mla.prefill_attention`). Where memory needs
it the heads run in groups, one after another (``config.head_groups``; by default
:func:`prefill_head_groups`'s size rule), so that q, k and v of all heads never exist at once; the GEMMs write the activation dtype (float32 accumulation inside), never a float32
product (docs/PREFILL.md, "Memory"). Decode runs the absorbed form: W_UK
folded into the query (ql_nope [B, H, 512]), ``mla_decode_attention`` of mqa_q [B, (S_q,) H, 576]
over the paged latent cache, W_UV after. Optional: an output gate (Kimi-K3), q projected without
q_lora, a softmax scale other than 1/sqrt(192) (YaRN); see :class:`MLAConfig`.

The cache is paged: token t of a sequence lives in row ``slot = block * block_size + offset`` of
``kv_cache.reshape(-1, width)``, with ``block = block_table[t // block_size]``. Formats:

- ``"bf16"``: [N, bs, 576] in the activation dtype, entries [kv_c_normed | k_pe];
- ``"fp8"``: [N, bs, 576] float8_e4m3fn with per-tensor scales; prefill attention then runs on
  the chunk's fp8 q, k, v (dequantized) and, in chunked prefill, on the cached context's k, v
  up-projected in the activation dtype from the dequantized cache (not quantized again); decode
  runs on an fp8 mqa_q. The ``scale_inv`` values are calibration
  constants of the layer, so they live in ``params["fp8_scale_inv"]`` (as vLLM keeps them on the
  attention layer), not beside the cache, which stays a single donatable array;
- ``"fp8_ds_mla"``: [N, bs, 656] uint8 entries (E4M3 latent, tile scales, bf16 k_pe).

Rows may be padded (``allocate_cache(..., row_width=640)``): the ops read and write the entry in
their first columns.

A stack of layers shares one cache [layers, N, bs, W]: pass ``layer=i`` and the ops address that
layer's rows of the whole stacked buffer, so the donated stack is updated in place with no slice
copied out and back, under :func:`scan_layers` or from a loop unrolled in Python (layers of
different kinds).

Example (a 16-token prompt into blocks 0 and 1 of a 16-token-block cache)::

    >>> config = MLAConfig(hidden_size=256, num_heads=4)
    >>> params = init_params(jax.random.key(0), config)
    >>> kv_cache = allocate_cache(config, num_blocks=8, block_size=16)
    >>> x = jax.random.normal(jax.random.key(1), (16, 256), jnp.bfloat16)
    >>> positions = slot_mapping = jnp.arange(16, dtype=jnp.int32)
    >>> step = jax.jit(functools.partial(prefill, config=config), donate_argnums=4)
    >>> out, kv_cache = step(params, x, positions, slot_mapping, kv_cache)
    >>> out.shape
    (16, 256)
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _checks, ops, prefill_attention
from ._checks import columns
from .formats import CACHE_FORMATS, ENTRY, L, P, R, V, shift_ids
from .numerics import E4M3_MAX, rope

SOFTMAX_SCALE = 1.0 / math.sqrt(P + R)
# The per-tensor fp8 scales are set for |x| up to 8: activations here are O(1) by construction.
FP8_SCALE_INV = E4M3_MAX / 8.0
F32 = jnp.float32


def _explicit_mesh(arrays):
    """The mesh of the first of ``arrays`` sharded over Explicit mesh axes, or None."""
    for array in arrays:
        mesh = getattr(jax.typeof(array).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def _auto_axes_under_explicit_meshes(*outputs: str):
    """The step as written for Auto mesh axes (shardings left to XLA), also on Explicit ones.

    ``jax.make_mesh`` gives Explicit axes by default, where every jnp op must agree on its operands'
    shardings at trace time: weights sharded by heads meet a replicated k_pe in the attention, and
    the einsums refuse. So where an argument is sharded over Explicit axes, the step runs with them
    Auto (``jax.sharding.auto_axes``), and the outputs keep the shardings of the arguments named by
    ``outputs`` (out like x, the cache like the cache): bit for bit what the Auto mesh gives."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def step(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            # Each argument's arrays, found in one walk of its leaves.
            held = {name: [v for v in jax.tree.leaves(value) if isinstance(v, jax.Array)] for name, value in bound.items()}
            mesh = _explicit_mesh(a for values in held.values() for a in values)
            if mesh is None:
                return fn(*args, **kwargs)

            def like(name):
                sharding = jax.typeof(bound[name]).sharding
                return NamedSharding(mesh, sharding.spec if not sharding.mesh.empty else PartitionSpec())

            shardings = tuple(like(name) for name in outputs)
            # auto_axes moves the arrays it is given positionally onto the Auto axes: all of them go
            # so (keyword ones too: scan_layers passes the cache by name); the rest (config, None,
            # Python numbers) stays bound as it was.
            arrays = [name for name, values in held.items() if values]

            def run(*values):
                return fn(**{**bound, **dict(zip(arrays, values))})

            auto = jax.sharding.auto_axes(run, out_sharding=shardings if len(outputs) > 1 else shardings[0])
            return auto(*(bound[name] for name in arrays))

        return step

    return wrap


@dataclass(frozen=True)
class MLAConfig:
    """Free dimensions of the layer. The MLA widths are those of the epilogues: kv_lora_rank 512,
    qk_nope 128, qk_rope 64, v_head 128 (``jax_kimi_mla.formats.L, P, R, V``)."""

    hidden_size: int = 1024
    num_heads: int = 8
    q_lora_rank: int | None = 1536  # None: q projected straight from x (q_proj), no q_a / q_b
    cache_format: str = "bf16"
    dtype: Any = jnp.bfloat16
    rms_norm_eps: float = 1e-6
    softmax_scale: float | None = None  # None: 1 / sqrt(192); YaRN models fold in mscale^2
    output_gate: bool = False  # Kimi-K3: attention output * sigmoid(x @ g_proj) before o_proj
    attention_block: int = 512  # the blockwise prefill attention's tiles: this many queries x keys
    rope_style: str = "gptj"  # with a cos/sin table: "gptj" (interleaved pairs) or "neox" (rotate-half)
    # Prefill attention: "cudnn" (cuDNN flash attention; Hopper, cuDNN >= 9.10), "blockwise"
    # (jnp online softmax, any backend) or "auto" (cudnn where it runs, else blockwise).
    attention_impl: str = "auto"
    # Prefill runs its heads in this many groups (a divisor of num_heads), one after another, so
    # that q, k, v of all heads never exist at once; None (the default): all at once where the
    # step's estimated temporaries allow, else the fewest groups that keep them within bounds
    # (:func:`prefill_head_groups`; docs/PREFILL.md, "Memory").
    head_groups: int | None = None

    @property
    def attention_scale(self) -> float:
        return SOFTMAX_SCALE if self.softmax_scale is None else float(self.softmax_scale)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if jnp.dtype(self.dtype) not in _checks.ACT_DTYPES:
            raise TypeError(f"dtype (the activations') must be bfloat16 or float16, as the ops take, got {jnp.dtype(self.dtype)}")
        if self.cache_format not in CACHE_FORMATS:
            raise ValueError(f"cache_format must be one of {tuple(CACHE_FORMATS)}, got {self.cache_format!r}")
        _checks.rope_style(self.rope_style)
        if self.attention_impl not in prefill_attention.IMPLS:
            raise ValueError(f"attention_impl must be one of {prefill_attention.IMPLS}, got {self.attention_impl!r}")
        groups = self.head_groups
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1
                                   or self.num_heads % groups):
            raise ValueError(f"head_groups must be None or a divisor of num_heads={self.num_heads}, got {groups!r}")


def _weight_shapes(config: MLAConfig) -> dict:
    """{name: (shape, fan_in)} of one layer's matrices."""
    d, h, r = config.hidden_size, config.num_heads, config.q_lora_rank
    q_shapes = {"q_proj": ((d, h, P + R), d)} if r is None else {"q_a_proj": ((d, r), d), "q_b_proj": ((r, h, P + R), r)}
    shapes = {
        **q_shapes,
        "kv_a_proj": ((d, ENTRY), d),  # -> [kv_c | k_pe]
        "kv_b_proj": ((L, h, P + V), L),  # -> [k_nope | v]: W_UK, then W_UV
        "o_proj": ((h, V, d), h * V),
    }
    if config.output_gate:
        shapes["g_proj"] = ((d, h, V), d)
    return shapes


@functools.cache
def _param_shapes(config: MLAConfig) -> dict:
    """The shape of each of one layer's params, as :func:`init_params` makes them for ``config``;
    the weights first, in their order, so a config of other sizes is named by its first weight."""
    abstract = jax.eval_shape(lambda key: init_params(key, config), jax.random.key(0))
    shapes = jax.tree.map(lambda leaf: tuple(leaf.shape), abstract, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    weights = list(_weight_shapes(config))
    return {name: shapes[name] for name in sorted(shapes, key=lambda n: weights.index(n) if n in weights else len(weights))}


def _check_params(params, config: MLAConfig) -> None:
    """One layer's params against the shapes ``config`` implies (init_params' layout)."""
    says = (f"hidden_size={config.hidden_size}, num_heads={config.num_heads}, q_lora_rank={config.q_lora_rank}, "
            f"output_gate={config.output_gate}, cache_format={config.cache_format!r}")
    _checks.layer_params(params, _param_shapes(config), says)
    _checks.layer_weight_dtypes(params, _weight_shapes(config), config.dtype)


@functools.partial(jax.jit, static_argnames=("config", "num_layers"))
def init_params(key, config: MLAConfig, num_layers: int | None = None):
    """Random weights, scaled by 1/sqrt(fan_in) so every activation stays O(1).

    With ``num_layers`` every leaf gets a leading [num_layers] axis (for :func:`scan_layers`).
    """
    if num_layers is not None:
        return jax.vmap(lambda k: init_params(k, config))(jax.random.split(key, num_layers))
    r, dt = config.q_lora_rank, config.dtype
    shapes = _weight_shapes(config)
    # One draw cut into the weights: XLA compiles one random generator instead of five.
    sizes = [math.prod(shape) for shape, _ in shapes.values()]
    draws = jnp.split(jax.random.normal(key, (sum(sizes),), F32), np.cumsum(sizes)[:-1])
    params = {
        name: (z.reshape(shape) / math.sqrt(fan_in)).astype(dt) for (name, (shape, fan_in)), z in zip(shapes.items(), draws)
    }
    params["kv_a_norm"] = jnp.ones((L,), dt)
    if r is not None:
        params["q_a_norm"] = jnp.ones((r,), dt)
    if config.cache_format == "fp8":
        params["fp8_scale_inv"] = {n: jnp.full((), FP8_SCALE_INV, F32) for n in ("q", "k", "v", "cache")}
    return params


def allocate_cache(config: MLAConfig, num_blocks: int, block_size: int, num_layers: int | None = None, *, row_width: int | None = None):
    """A zeroed paged cache [num_blocks, block_size, W] (with [num_layers] in front if given):
    W = 576 in the activation dtype ("bf16"), 576 float8_e4m3fn ("fp8"), 656 uint8 ("fp8_ds_mla").

    ``row_width`` pads each row to W = row_width elements (e.g. 640, as tpu-inference lays out its
    latent cache): at least the entry, and a multiple of 16 bytes when wider. Entries go to the
    first columns of their row; the ops never write the padding.
    """
    fmt = CACHE_FORMATS[config.cache_format]
    dtype = fmt.cache_dtype(config.dtype)
    width = fmt.width if row_width is None else row_width
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < fmt.width:
        raise ValueError(f"row_width must be None or an int >= {fmt.width} (the {config.cache_format} entry), got {row_width!r}")
    _checks.padded_row("row_width", int(width), fmt, dtype, f"row_width={width}")
    lead = () if num_layers is None else (num_layers,)
    return jnp.zeros((*lead, num_blocks, block_size, int(width)), dtype)


def _proj(spec, x, w):
    """x @ w in w's dtype, accumulated in float32 and rounded once.

    On a GPU the GEMM writes w's dtype itself (cuBLAS and XLA's Triton GEMMs accumulate bf16/fp16
    operands in float32): a float32 product cast afterwards would be a temporary twice the size
    of the result, [T, hidden] float32 for o_proj (XLA:GPU does not fold the cast into the GEMM).
    XLA:CPU, though, computes a bf16-output dot by converting both operands (the weights too) to
    float32 first, while it multiplies bf16 into float32 directly: there the float32 product is
    cast. Same values either way."""
    return jax.lax.platform_dependent(
        x, w,
        cpu=lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=F32).astype(w.dtype),
        default=lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=w.dtype),
    )


def _proj_add(spec, x, w, acc):
    """acc + x @ w in acc's dtype: the product accumulated in float32 onto acc and rounded once.

    On a GPU, XLA hands the addition to the GEMM (cuBLAS's C operand, beta = 1, written in
    place): no product tensor beside acc. On the CPU, as in :func:`_proj`, a float32 product."""
    return jax.lax.platform_dependent(
        x, w, acc,
        cpu=lambda x, w, acc: (jnp.einsum(spec, x, w, preferred_element_type=F32) + acc.astype(F32)).astype(acc.dtype),
        default=lambda x, w, acc: jnp.einsum(spec, x, w, preferred_element_type=acc.dtype) + acc,
    )


def _two_products(latent, kv_b):
    """k_nope [T, g, 128] and v [T, g, 128] = latent @ kv_b's two halves, by two GEMMs.

    The attention needs v contiguous, which a slice of one [T, g, 256] product is not: XLA would
    copy both halves out of it. So would XLA's dot merger, which joins two GEMMs of one operand
    (up to some size) into one and slices the product: the barrier hands v's GEMM the latent as a
    value of its own."""
    return (_proj("tl,lhp->thp", latent, kv_b[..., :P]),
            _proj("tl,lhv->thv", jax.lax.optimization_barrier(latent), kv_b[..., P:]))


def _gate_logits(x, g_proj):
    """x @ g_proj [T, H, 128] in float32: the gate's sigmoid sees unrounded logits."""
    return jnp.einsum("td,dhv->thv", x, g_proj, preferred_element_type=F32)


def _rms_norm(x, w, eps):
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
    return (x32 * w.astype(F32)).astype(w.dtype)


def _latents(params, x, config):
    """What every head shares: q's latent q_c and the weight that makes q from it (x itself and
    q_proj without q_lora, else normed q_a_proj(x) and q_b_proj), kv_a [T, 576] = [kv_c | k_pe]
    and kv_c_normed [T, 512]."""
    if config.q_lora_rank is None:
        q_c, w_q = x, params["q_proj"]
    else:
        q_c = _rms_norm(_proj("td,dr->tr", x, params["q_a_proj"]), params["q_a_norm"], config.rms_norm_eps)
        w_q = params["q_b_proj"]
    kv_a = _proj("td,de->te", x, params["kv_a_proj"])
    kv_c_normed = _rms_norm(kv_a[:, :L], params["kv_a_norm"], config.rms_norm_eps)
    return q_c, w_q, kv_a, kv_c_normed


def _projections(params, x, config):
    """q [T, H, 192], kv_a [T, 576] = [kv_c | k_pe] and kv_c_normed [T, 512]."""
    q_c, w_q, kv_a, kv_c_normed = _latents(params, x, config)
    return _proj("tr,rhc->thc", q_c, w_q), kv_a, kv_c_normed


def _layer_rows(kv_cache, layer):
    """(first row of this layer in the whole cache, rows per layer).

    A stacked cache [layers, N, bs, W] goes whole to the epilogues, which address its rows as one
    [layers * N * bs] range: this layer's slots are offset, so nothing is sliced out of the stack
    and nothing reshapes the donated buffer before an in-place call (XLA copies a donated buffer
    that is reshaped before one). The readers, which only read, take :func:`_flat` of it."""
    rows = kv_cache.shape[-3] * kv_cache.shape[-2]
    return (0 if layer is None else layer * rows), rows


def _flat(cache):
    """The cache as [blocks, bs, W] for the readers (a stack's layers are consecutive blocks)."""
    return cache.reshape(-1, *cache.shape[-2:])


# Prefill's head groups when MLAConfig.head_groups is None: all heads at once if the estimated
# temporaries stay within UNGROUPED_TEMP_FRACTION of what the step holds anyway (its weights, x
# and its output; the cache is left out, so that a large cache does not switch grouping off),
# else the fewest groups of at least MIN_GROUP_HEADS heads within PREFILL_TEMP_FRACTION, or the
# most such groups. Issue 11's target is a peak <= 1.5x (weights + inputs and outputs + cache).
# The grouped estimate is close (H200, H = 96, T = 8192: 4 groups 1.56x estimated, 1.475x
# measured); the ungrouped one runs high where the heads are few, as XLA lays the temporaries out
# in the output's buffer until o_proj writes it (H = 12, T = 8192: 1.44x and, after a cached
# context, 1.71x estimated; 1.33x and 1.43x measured). Groups of 16 heads at least: cuDNN's
# causal grid on fewer heads has a long tail (12 heads: 539 TFLOP/s against 623 on 96), and
# the step after a cached context took 1.255x its parts in 8 groups of 12, 1.22x in 6 of 16
# (peak 1.44x). docs/PREFILL.md has the numbers.
UNGROUPED_TEMP_FRACTION = 0.8
PREFILL_TEMP_FRACTION = 0.5
MIN_GROUP_HEADS = 16


def prefill_temp_bytes(config: MLAConfig, tokens: int, groups: int, *, packed: bool = False, context_tokens: int = 0) -> int:
    """Estimated bytes of the largest set of temporaries a :func:`prefill` step holds at once
    (on cuDNN attention; beyond its arguments and outputs), with its heads in ``groups`` groups.

    Per token, in the activation dtype: one head's q, k (192 each), v and attention output (128
    each, or 192 in the packed layout, where v travels padded) - the epilogue holds as much (q,
    k_nope, v, k); after a cached context of c tokens per token, q, the chunk's output, the
    context's k, v (and k_nope or unpadded v while they are made) and its output. Shared: the
    KV latent (and kv_a) when ungrouped; with groups, q's latent, the KV latent, k_pe, and each
    group's weight slices (the groups add their o_proj products into the step's output). A model for choosing the
    groups, meant to err high (docs/PREFILL.md, "Memory", has its numbers), not a bound.
    """
    T, H, d = tokens, config.num_heads, config.hidden_size
    if groups < 1 or H % groups:
        raise ValueError(f"groups must divide num_heads={H}, got {groups}")
    g, item = H // groups, jnp.dtype(config.dtype).itemsize
    c = context_tokens / max(T, 1)
    width = P + R if packed else V  # v and the output in the attention call
    per_head = 2 * (P + R) + 2 * width
    if context_tokens:
        per_head = max(per_head, (P + R) + 2 * width + c * ((P + R) + P + width))
    per_head *= item
    if config.cache_format == "fp8":
        per_head += 2 * (P + R) + V  # the fp8 codes of q, k, v beside their dequantized values
    if groups == 1:
        shared = (ENTRY + L) * item
        slices = 0
    else:
        q_in = d if config.q_lora_rank is None else config.q_lora_rank
        shared = ((0 if config.q_lora_rank is None else q_in) + L + R) * item
        slices = g * (q_in * (P + R) + L * (P + V) + V * d + (d * V if config.output_gate else 0)) * item
    shared += c * ENTRY * item
    return int(T * (shared + g * per_head) + slices)


def prefill_head_groups(config: MLAConfig, tokens: int, *, packed: bool = False, context_tokens: int = 0) -> int:
    """How many head groups :func:`prefill` runs for a chunk of ``tokens`` tokens: ``config.head_groups``
    if set; else one group if :func:`prefill_temp_bytes` stay within ``UNGROUPED_TEMP_FRACTION`` of
    the weights plus x and the output, or the fewest groups (of at least ``MIN_GROUP_HEADS`` heads
    each) within ``PREFILL_TEMP_FRACTION``; if none does, the most groups allowed (one, below
    ``2 * MIN_GROUP_HEADS`` heads). ``packed``: several sequences in the call;
    ``context_tokens``: rows of the gathered context."""
    if config.head_groups is not None:
        return int(config.head_groups)
    H, item = config.num_heads, jnp.dtype(config.dtype).itemsize
    weights = sum(math.prod(shape) for shape, _ in _weight_shapes(config).values()) * item
    held = weights + 2 * tokens * config.hidden_size * item
    options = [n for n in range(1, H + 1) if H % n == 0 and (n == 1 or H // n >= MIN_GROUP_HEADS)]
    for n in options:
        fraction = UNGROUPED_TEMP_FRACTION if n == 1 else PREFILL_TEMP_FRACTION
        if prefill_temp_bytes(config, tokens, n, packed=packed, context_tokens=context_tokens) <= fraction * held:
            return n
    return options[-1]


def _rope_kwargs(positions, cos_sin_cache, config):
    if cos_sin_cache is None:
        return {}
    return {"positions": positions, "cos_sin_cache": cos_sin_cache, "rope_style": config.rope_style}


def _format_kwargs(params, config, query=True):
    """The keywords that select the cache format in a call of a decode op (``query``: one that
    takes the absorbed query, whose scale comes with the plain fp8 cache's) or of the gather."""
    if config.cache_format == "fp8_ds_mla":
        return {"ds_mla": True}
    if config.cache_format == "fp8":
        s = params["fp8_scale_inv"]
        return {"q_scale_inv": s["q"], "cache_scale_inv": s["cache"]} if query else {"cache_scale_inv": s["cache"]}
    return {}


@_auto_axes_under_explicit_meshes("x", "kv_cache")
def prefill(
    params, x, positions, slot_mapping, kv_cache, *, config, block_table=None, context_len=None, cu_seqlens=None, layer=None, cos_sin_cache=None,
    attention_impl=None, context_tokens=None,
):
    """Prompt chunks through the layer: one sequence's, or several packed (ragged); writes their
    tokens into the cache.

    Args:
      params: from :func:`init_params` (one layer's, also inside :func:`scan_layers`).
      x: [T, hidden] activation dtype, the chunks' hidden states. Padding tokens go at the end.
      positions: [T] int32, the tokens' positions in their sequences (used by RoPE only).
      slot_mapping: [T] int32 cache slots; -1 for padding (not written).
      kv_cache: [N, bs, W], or [layers, N, bs, W] with ``layer``. Donate it.
      block_table, context_len: for chunks after a sequence's first, its block table and the
        number of its tokens already cached; the chunk then also attends to those tokens, read
        back from the cache. One sequence: [max_blocks] int32 and an int32 scalar.
      cu_seqlens: packed sequences: int32 [S + 1], sequence s owns tokens
        [cu_seqlens[s], cu_seqlens[s + 1]) of x (S static; trailing empty sequences are fine, so
        S and T can be bucketed). Then block_table is [S, max_blocks] and context_len [S] (or
        both None: no context). Values outside [0, T] are clipped and a decrease is read as an
        empty sequence (a running max), so no value reaches outside x.
      layer: index (may be traced) of this layer in a stacked cache. A traced index outside
        [0, layers) writes nothing and reads no cached token (a Python int there is an error).
      cos_sin_cache: float32 [max_position, 64] turns RoPE on (``config.rope_style``: GPT-J by
        default, or NeoX); None = NoPE (Kimi-K3).
      attention_impl: "auto", "cudnn" or "blockwise" (static): overrides
        ``config.attention_impl`` for this call. "cudnn" raises ValueError where it cannot run.
      context_tokens: static rows of the gathered context, at least ``sum(context_len)``
        (default: S * max_blocks * block_size, every table full). A server buckets it, as the
        context is up-projected and attended row by row.

    Returns:
      (out [T, hidden] activation dtype, kv_cache). Each token attends to its own sequence only:
      the cached context and the chunk's tokens up to itself, with softmax scale
      ``config.attention_scale``.
    """
    _check_params(params, config)
    _checks.layer_index(layer, kv_cache)
    positions, slot_mapping, cu_seqlens, block_table, context_len = _checks.layer_prefill(
        x, positions, slot_mapping, cu_seqlens, block_table, context_len, context_tokens, config.hidden_size, config.dtype)
    fmt, act = config.cache_format, config.dtype
    base, rows = _layer_rows(kv_cache, layer)
    slots = shift_ids(slot_mapping, rows, base)
    rope_kw = _rope_kwargs(positions, cos_sin_cache, config)
    T, H = x.shape[0], config.num_heads
    if cu_seqlens is None:  # one sequence: S = 1
        cu_seqlens = jnp.array([0, T], jnp.int32)
        block_table = None if block_table is None else block_table[None]
        context_len = None if context_len is None else jnp.reshape(context_len, (1,))
    # Garbage offsets must not reach outside x (cuDNN takes them as addresses): kept within [0, T]
    # and non-decreasing, they describe some valid packing.
    cu = jax.lax.cummax(jnp.clip(jnp.asarray(cu_seqlens, jnp.int32), 0, T))
    lens = jnp.zeros(cu.shape[0] - 1, jnp.int32) if block_table is None else jnp.asarray(context_len, jnp.int32)
    packed = cu.shape[0] > 2
    requested = attention_impl or config.attention_impl
    impl = prefill_attention.choose(requested, packed=packed, context=block_table is not None)
    num_ctx = 0 if block_table is None else context_tokens or block_table.shape[0] * block_table.shape[1] * kv_cache.shape[-2]
    groups = prefill_head_groups(config, T, packed=packed, context_tokens=num_ctx)
    g = H // groups

    q_c, w_q, kv_a, kv_c_normed = _latents(params, x, config)
    # One group reads k_pe in place; with several, only its 64 columns stay alive through the loop.
    k_pe = columns(kv_a, L) if groups == 1 else kv_a[:, L:]

    def heads(w, i):
        """Group i's slice of a per-head weight [.., H, ..] (heads on axis 1)."""
        return w if groups == 1 else jax.lax.dynamic_slice_in_dim(w, i * g, g, axis=1)

    def qkv(i, cache, slots, q_c, kv_c_normed, k_pe):
        """q, k [T, g, 192] and v [T, g, 128] of group i; the epilogue writes the cache at slots."""
        q = _proj("tr,rhc->thc", q_c, heads(w_q, i))
        w = heads(params["kv_b_proj"], i)
        if fmt == "fp8":
            kv = _proj("tl,lhc->thc", kv_c_normed, w)  # [T, g, 256] = [k_nope | v]
            s = params["fp8_scale_inv"]
            q, k, v, cache = ops.fused_mla_qkv_quant_kv_cache_fp8_insert(
                q,
                columns(kv, 0),
                k_pe,
                kv_c_normed,
                columns(kv, P),
                cache,
                slots,
                s["q"], s["k"], s["v"], s["cache"],
                **rope_kw,
            )
            # Attention runs on the values the fp8 q, k, v stand for.
            q, k, v = (q.astype(F32) / s["q"]).astype(act), (k.astype(F32) / s["k"]).astype(act), (v.astype(F32) / s["v"]).astype(act)
            return q, k, v, cache
        k_nope, v = _two_products(kv_c_normed, w)
        insert = ops.fused_mla_key_concat_ds_mla_insert if fmt == "fp8_ds_mla" else ops.fused_mla_key_concat_kv_cache_insert
        k, q, cache = insert(q, k_nope, k_pe, kv_c_normed, cache, slots, **rope_kw)
        return q, k, v, cache

    def context_kv(i, latent, k_pe):
        """k [C, g, 192] = [k_nope from the latent | its k_pe] and v [C, g, 128] of the cached
        tokens, for group i. (Two GEMMs, as above: v comes out contiguous.)"""
        k_nope, v = _two_products(latent, heads(params["kv_b_proj"], i))
        return jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, None], (k_pe.shape[0], g, R))], -1), v

    def attend(i, q, k, v, ctx):
        """Group i's attention output [T, g, 128], gated."""

        def blockwise(q, k, v, ctx):
            ctx_k, ctx_v = (None, None) if ctx is None else context_kv(i, *ctx)
            return prefill_attention.blockwise_attention(
                q, k, v, cu, lens, ctx_k, ctx_v, scale=config.attention_scale, block=config.attention_block).astype(act)

        def cudnn(q, k, v, ctx):
            # The context's k and v are made after the chunk's own attention (ctx_kv), so that
            # they never live beside the chunk's k and v.
            return prefill_attention.cudnn_attention(
                q, k, v, cu, scale=config.attention_scale, ctx_lens=lens, api=impl,
                ctx_kv=None if ctx is None else (functools.partial(context_kv, i), ctx),
            ).astype(act)

        if impl == "blockwise":
            o = blockwise(q, k, v, ctx)
        elif requested == "auto":
            # "auto" chose cuDNN for the default device; a call lowered for another platform (the
            # arrays on CPU devices of a GPU machine) takes the blockwise loop. jax keeps only the
            # lowering platform's branch.
            o = jax.lax.platform_dependent(q, k, v, ctx, cuda=cudnn, default=blockwise)
        else:
            o = cudnn(q, k, v, ctx)
        if not config.output_gate:
            return o
        # The gate's GEMM after the attention: its float32 logits never live beside q, k, v.
        o, x_late = jax.lax.optimization_barrier((o, x))
        return _gated(o, x_late, heads(params["g_proj"], i))

    # Group 0 (all heads when ungrouped) writes the chunk into the cache.
    latents = q_c, kv_c_normed, k_pe
    q, k, v, cache = qkv(0, kv_cache, slots, *latents)
    ctx = None
    if block_table is not None:
        # The sequences' cached contexts, dequantized and packed back to back: [C, 576].
        ctx = ops.gather_mla_cache(
            _flat(cache),
            _layer_tables(block_table, layer, kv_cache.shape[-3]),
            lens,
            num_tokens=num_ctx,
            out_dtype=act,
            **_format_kwargs(params, config, query=False),
        )
        ctx = ctx[:, :L], ctx[:, L:]  # split once: each group reads the latent and k_pe
    o = attend(0, q, k, v, ctx)
    if groups == 1:
        return _proj("thv,hvd->td", o, params["o_proj"]), cache
    # The other groups one after another in a loop: each group's q, k, v and attention output
    # live in its own iteration only. Each group adds its heads' share of o_proj into the output
    # (the GEMM's accumulator, float32, rounded once per group), so that no [T, H, 128] output of
    # all heads is held for one o_proj at the end. The latents pass a barrier with the output, so
    # a group starts after the one before has finished even where XLA inlines the loop (a single
    # iteration) or unrolls it; the addition takes the output straight from the loop, not from
    # the barrier, or XLA would not fold it into the GEMM. The cache is written already: the
    # groups hand the epilogue a one-row stand-in and no valid slot.
    spare = jnp.zeros((1, 1, cache.shape[-1]), cache.dtype)
    no_slots = jnp.full_like(slots, -1)

    def o_proj(i):
        return jax.lax.dynamic_slice_in_dim(params["o_proj"], i * g, g, axis=0)

    def group(i, out):
        _, group_latents = jax.lax.optimization_barrier((out, latents))
        q, k, v, _ = qkv(i, spare, no_slots, *group_latents)
        return _proj_add("thv,hvd->td", attend(i, q, k, v, ctx), o_proj(i), out)

    out = jax.lax.fori_loop(1, groups, group, _proj("thv,hvd->td", o, o_proj(0)))
    return out, cache


def _output(params, x, o, config):
    """o_proj of the attention output o [T, H, 128], gated by sigmoid(x @ g_proj) first (in
    float32) when the config has an output gate."""
    if config.output_gate:
        o = _gated(o, x, params["g_proj"])
    return _proj("thv,hvd->td", o, params["o_proj"])


def _gated(o, x, g_proj):
    """o * sigmoid(x @ g_proj), in float32, rounded to o's dtype."""
    return (o.astype(F32) * jax.nn.sigmoid(_gate_logits(x, g_proj))).astype(o.dtype)


def _layer_tables(block_tables, layer, num_blocks):
    """Block ids of this layer in the stacked view [layers * N, bs, W]."""
    return block_tables if layer is None else shift_ids(block_tables, num_blocks, layer * num_blocks)


@_auto_axes_under_explicit_meshes("x", "kv_cache")
def decode(params, x, positions, slot_mapping, block_tables, context_lens, kv_cache, *, config, layer=None, cos_sin_cache=None):
    """New tokens for each sequence of a batch: absorbed MLA over the paged cache.

    Args:
      x: [B, hidden] activation dtype, one new token per sequence, or [B, S_q, hidden] for
        S_q = 1..4 new tokens per sequence (speculative decoding). positions: [B] / [B, S_q] int32
        (used by RoPE only: None without a cos/sin table).
      slot_mapping: [B] / [B, S_q] int32 slot of each new token; -1 for padding.
      block_tables: [B, max_blocks] int32. context_lens: [B] int32, the tokens of each sequence,
        counting the ones written in this step (0 for padding rows: their output is 0). New
        token j of S_q attends to tokens 0 .. context_len - S_q + j, so a row with fewer than
        S_q new tokens pads at the front (slot -1 for the first ones), or counts its padding
        tokens at the end in context_len; counting only the real ones with the padding at the
        end shifts every query's window.
      kv_cache, layer, cos_sin_cache: as in :func:`prefill`.

    Returns:
      (out [B, (S_q,) hidden] activation dtype, kv_cache).
    """
    _check_params(params, config)
    _checks.layer_index(layer, kv_cache)
    positions, slot_mapping, block_tables, context_lens = _checks.layer_decode(
        x, positions, slot_mapping, block_tables, context_lens, config.hidden_size, config.dtype)
    one_token = x.ndim == 2
    B, S = x.shape[0], 1 if one_token else x.shape[1]
    q, kv_a, kv_c_normed = _projections(params, x.reshape(B * S, -1), config)
    w_uk, w_uv = params["kv_b_proj"][..., :P], params["kv_b_proj"][..., P:]
    ql_nope = _proj("bhp,lhp->bhl", q[..., :P], w_uk)
    kw = _rope_kwargs(None if positions is None else positions.reshape(B * S), cos_sin_cache, config)
    cache_format = _format_kwargs(params, config)
    base, rows = _layer_rows(kv_cache, layer)
    mqa_q, cache = ops.fused_mla_decode_q_concat_kv_cache_insert(
        ql_nope,
        columns(q, P),
        kv_c_normed,
        columns(kv_a, L),
        kv_cache,
        shift_ids(slot_mapping.reshape(B * S), rows, base),
        **kw,
        **cache_format,
    )
    latent = ops.mla_decode_attention(
        mqa_q if one_token else mqa_q.reshape(B, S, *mqa_q.shape[1:]),
        _flat(cache),
        _layer_tables(block_tables, layer, kv_cache.shape[-3]),
        context_lens,
        softmax_scale=config.attention_scale,
        **cache_format,
    ).reshape(B * S, -1, L)  # [B * S_q, H, 512]
    o = _proj("thl,lhv->thv", latent.astype(config.dtype), w_uv)
    out = _output(params, x.reshape(B * S, -1), o, config)
    return out.reshape(x.shape[:-1] + out.shape[-1:]), cache


def scan_layers(step, params, x, kv_cache, *args, **kwargs):
    """Runs ``step`` (:func:`prefill` or :func:`decode`, with ``config`` bound) through a stack of
    layers, residual around each: ``x = x + step(layer i)(x)``.

    ``params``: stacked (``init_params(..., num_layers=n)``), run in a ``jax.lax.scan``; or a list
    of the n layers' own params (``init_params(key, config)`` each, or :func:`unstack_layers` of a
    stack), run in a Python loop. The loop compiles the layer n times, but each layer's GEMMs read
    its weights where they lie, where the scan copies every layer's weights out of the stack in
    each iteration (on an H100, a 4-layer Kimi-K3 TP8 decode step of 32 sequences: 894 us from the
    list, 1145 from the stack; docs/DECODE_ATTENTION.md, Thirty-second round). Serve from the list;
    the stack compiles faster. ``kv_cache`` is [n, N, bs, W]; ``args`` / ``kwargs`` are the step's
    other arguments, shared by all layers. Returns (x, kv_cache). Under ``jax.jit`` with the cache
    donated the stack is updated in place.

    Example::

        step = jax.jit(lambda p, x, c, *a: scan_layers(functools.partial(decode, config=config), p, x, c, *a),
                       donate_argnums=2)
    """
    layers = _checks.layer_stack(params, kv_cache)
    if isinstance(params, (list, tuple)):
        for i, p in enumerate(params):
            out, kv_cache = step(p, x, *args, kv_cache=kv_cache, layer=i, **kwargs)
            x = x + out
        return x, kv_cache

    def body(carry, layer_params_and_index):
        h, cache = carry
        p, i = layer_params_and_index
        out, cache = step(p, h, *args, kv_cache=cache, layer=i, **kwargs)
        return (h + out, cache), None

    # The loop carries the stack as it is: the epilogues write it whole, and XLA copies a buffer
    # that is reshaped before an in-place custom call.
    (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (params, jnp.arange(layers)))
    return x, kv_cache


def unstack_layers(params) -> list:
    """The per-layer params of stacked ones (``init_params(..., num_layers=n)``): a list of n, the
    form in which :func:`scan_layers` reads each layer's weights in place."""
    layers = jnp.shape(jax.tree.leaves(params)[0])[0]
    return [jax.tree.map(lambda a, i=i: a[i], params) for i in range(layers)]


@_auto_axes_under_explicit_meshes("x")
def reference_attention(params, x, positions, *, config, cos_sin_cache=None):
    """Naive MLA for a whole sequence from scratch, in float32: causal attention of x [S, hidden]
    with k and v materialised for every token from the unquantized latent (no cache, no
    absorption, no fp8). Row t is what prefill or decode must give for token t. -> [S, hidden] f32.
    """
    p32 = jax.tree.map(lambda a: a.astype(F32), params)
    x = x.astype(F32)
    if config.q_lora_rank is None:
        q = jnp.einsum("td,dhc->thc", x, p32["q_proj"])
    else:
        q_c = _rms_norm(x @ p32["q_a_proj"], p32["q_a_norm"], config.rms_norm_eps)
        q = jnp.einsum("tr,rhc->thc", q_c, p32["q_b_proj"])
    kv_a = x @ p32["kv_a_proj"]
    kv = jnp.einsum("tl,lhc->thc", _rms_norm(kv_a[:, :L], p32["kv_a_norm"], config.rms_norm_eps), p32["kv_b_proj"])
    q_pe, k_pe = q[..., P:], kv_a[:, L:]
    if cos_sin_cache is not None:
        style = config.rope_style
        q_pe, k_pe = rope(q_pe, positions, cos_sin_cache, style), rope(k_pe, positions, cos_sin_cache, style)
    S, H = x.shape[0], q.shape[1]
    q = jnp.concatenate([q[..., :P], q_pe], -1)
    k = jnp.concatenate([kv[..., :P], jnp.broadcast_to(k_pe[:, None, :], (S, H, R))], -1)
    scores = jnp.einsum("thc,shc->hts", q, k) * config.attention_scale
    attn = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -jnp.inf), axis=-1)
    o = jnp.einsum("hts,shv->thv", attn, kv[..., P:])
    if config.output_gate:
        o = o * jax.nn.sigmoid(jnp.einsum("td,dhv->thv", x, p32["g_proj"]))
    return jnp.einsum("thv,hvd->td", o, p32["o_proj"])
