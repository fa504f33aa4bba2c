"""The prefill attention of the MLA layer: which implementation runs it, and both implementations.

Prefill attends per head with q, k [.., 192] and v [.., 128] (MLA's non-absorbed form), causally
within each packed sequence, after that sequence's cached context. Two implementations:

- ``"blockwise"``: an online-softmax loop over (query tile, key tile) pairs in jnp
  (:func:`blockwise_attention`), on every backend; memory O(T x block).
- ``"cudnn"``: cuDNN's flash attention through jax, on a Hopper-or-later GPU with cuDNN >= 9.10
  (what cuDNN needs for a v head dim that differs from q's). ``"auto"`` picks it where the default device runs it
  (and the layer then keeps the blockwise loop for a step lowered for the CPU) and the blockwise
  loop elsewhere.

The cuDNN path calls jax's cuDNN module (``jax._src.cudnn.fused_attention_stablehlo``) directly:
unlike ``jax.nn.dot_product_attention`` it takes v's 128 columns as they are and packed sequences
(``q_offsets`` / ``q_seqlen``). It is private, so it is used only on the jax versions it was
checked on (:data:`TESTED_JAX`) and only when its signature is the one this file calls; otherwise
the public ``jax.nn.dot_product_attention(implementation="cudnn")`` runs instead, with v padded to
192 columns, which covers one sequence without cached context. docs/PREFILL.md has the measurements
behind the choice.

Cached context: jax's cuDNN causal mask is top-left aligned (query i sees keys 0..i), so a chunk
that follows c cached tokens cannot be masked in one call. Two calls run instead: the chunk over its
context with no mask, and the chunk over itself, causal; their outputs are merged by their
log-sum-exps (as vLLM's MLA chunked prefill does). Nothing the size of T x S is materialised.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from . import _device

IMPLS = ("auto", "cudnn", "blockwise")
MIN_CUDNN_VERSION = 91000  # cuDNN 9.10: MLA head dims (v != q) in flash attention
MIN_COMPUTE_CAPABILITY = (9, 0)  # Hopper; also what cuDNN needs for the packed layout
# (major, minor) jax versions whose private cuDNN module this file was checked against: 0.11 by the
# GPU tests on the H200; 0.10 and 0.12 by what the module hands XLA, the same cuDNN custom calls as
# 0.11's (scripts/cudnn_lowering.py, tests/data/cudnn_prefill_lowering.txt).
TESTED_JAX = ((0, 10), (0, 11), (0, 12))
_PRIVATE_PARAMS = frozenset({"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout", "return_residual"})
F32 = jnp.float32


@functools.cache
def private_api():
    """jax's cuDNN attention module, or None where this jax is not a checked version
    (:data:`TESTED_JAX`) or the module lacks the arguments used here (:func:`private_module`)."""
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    return private_module() if version in TESTED_JAX else None


def private_module():
    """jax's cuDNN attention module if its ``dot_product_attention`` takes the arguments and mask
    types used here, whatever the jax version; else None."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as module
    except ImportError:
        return None
    try:
        params = set(inspect.signature(module.dot_product_attention).parameters)
    except (AttributeError, TypeError, ValueError):
        return None
    masks = {"NO_MASK", "PADDING", "CAUSAL", "PADDING_CAUSAL"}
    if not _PRIVATE_PARAMS <= params or not masks <= set(getattr(module, "MaskType", {}).__members__):
        return None
    return module


@functools.cache
def device_problem() -> str | None:
    """Why the default device cannot run cuDNN's MLA attention, or None if it can."""
    device = jax.devices()[0]
    if device.platform != "gpu" or "cuda" not in getattr(device.client, "platform_version", "cuda").lower():
        return f"the default device is {device.platform} ({device.device_kind}), not a CUDA GPU"
    capability = _device.gpu_compute_capability() or (0, 0)
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"{device.device_kind} has compute capability {capability}, below {MIN_COMPUTE_CAPABILITY} (Hopper)"
    try:
        from jax._src.lib import cuda_versions

        cudnn = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except (ImportError, AttributeError, RuntimeError):
        cudnn = None
    if cudnn is None:
        return "no cuDNN was found"
    if cudnn < MIN_CUDNN_VERSION:
        return f"cuDNN {cudnn} is older than {MIN_CUDNN_VERSION} (9.10)"
    return None


def choose(impl: str, *, packed: bool, context: bool) -> str:
    """The implementation that runs: "blockwise", "cudnn" (jax's cuDNN module) or "cudnn-public"
    (``jax.nn.dot_product_attention``). ``packed``: several sequences in the call; ``context``:
    the chunks follow cached tokens. "cudnn" that cannot run raises ValueError saying why."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "blockwise":
        return "blockwise"
    problem = device_problem()
    api = "cudnn" if private_api() is not None else "cudnn-public"
    if problem is None and api == "cudnn-public" and (packed or context):
        problem = (
            f"jax {jax.__version__} is not a version whose private cuDNN module was checked {TESTED_JAX}, and the public "
            "jax.nn.dot_product_attention takes neither packed sequences nor a cached context"
        )
    if problem is None:
        return api
    if impl == "cudnn":
        raise ValueError(f"attention_impl='cudnn' cannot run: {problem}; use 'blockwise' or 'auto'")
    return "blockwise"


def segments(cu, num_tokens):
    """(sequence of each token [T], its index in its sequence [T]); padding tokens (past cu[-1])
    get sequence S."""
    i = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], i, side="right").astype(jnp.int32)
    return seq, i - cu[seq]


def _call(api, q, k, v, *, scale, causal, q_lens=None, kv_lens=None, q_starts=None, kv_starts=None, lse=False):
    """One call of jax's cuDNN module on [T, H, D] arrays (a batch of one).

    Without starts: one sequence; ``kv_lens`` ([1]) masks keys past it (then every query row is
    live). With starts ([S] each, -1 for a segment left out): packed sequences, segment s of q at
    rows [q_starts[s], + q_lens[s]) and of k/v at [kv_starts[s], + kv_lens[s]). Returns
    (out [T, H, Dv], stats) with stats [segments or 1, H, T] float32 when ``lse``."""
    mask = api.MaskType
    kw = {}
    if q_starts is not None:
        end = jnp.full((1,), -1, jnp.int32)
        kw = dict(q_seqlen=q_lens[None], kv_seqlen=kv_lens[None], q_offsets=jnp.concatenate([q_starts, end])[None],
                  kv_offsets=jnp.concatenate([kv_starts, end])[None])
        mask_type = mask.PADDING_CAUSAL if causal else mask.PADDING
    elif kv_lens is not None:
        kw = dict(q_seqlen=jnp.full((1,), q.shape[0], jnp.int32), kv_seqlen=kv_lens)
        mask_type = mask.PADDING_CAUSAL if causal else mask.PADDING
    else:
        mask_type = mask.CAUSAL if causal else mask.NO_MASK
    result = api.dot_product_attention(q[None], k[None], v[None], scale=scale, mask_type=mask_type, qkv_layout="BTNH",
                                       return_residual=lse, **kw)
    if lse:
        out, stats = result
        return out[0], stats
    return result[0], None


def _merge(o1, lse1, o2, lse2):
    """Attention over keys A + B from its parts over A and over B (out [T, H, Dv] f32, natural
    log-sum-exp [T, H]); a part with lse -inf contributes nothing, whatever its out."""
    m = jnp.maximum(lse1, lse2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = w1 + w2
    o1 = jnp.where((w1 > 0)[..., None], o1, 0.0)
    o2 = jnp.where((w2 > 0)[..., None], o2, 0.0)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]


def blockwise_attention(q, k, v, cu, lens, ctx_k=None, ctx_v=None, *, scale, block):
    """Prefill attention in jnp, on any backend (float32; memory O(H x block^2)): q, k [T, H, 192],
    v [T, H, 128], cu int32 [S + 1], lens int32 [S] the cached tokens of each sequence, with their
    ctx_k [C, H, 192], ctx_v [C, H, 128] packed back to back (or None). Token i of the chunk is
    token lens[s] + (i - cu[s]) of its sequence s and sees that sequence's context and its chunk
    up to itself; padding (i >= cu[S]) is a sequence of its own, S, which no real token sees.
    -> [T, H, 128] float32."""
    T = q.shape[0]
    q_seq, local = segments(cu, T)
    q_pos = jnp.concatenate([lens, jnp.zeros(1, jnp.int32)])[q_seq] + local
    q, k, v = q.astype(F32), k.astype(F32), v.astype(F32)
    k_seq, k_pos, k_valid = q_seq, q_pos, jnp.ones((T,), bool)
    if ctx_k is not None:
        k = jnp.concatenate([ctx_k.astype(F32), k])
        v = jnp.concatenate([ctx_v.astype(F32), v])
        r = jnp.arange(ctx_k.shape[0], dtype=jnp.int32)
        ends = jnp.cumsum(lens)
        ctx_seq = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)
        ctx_pos = r - jnp.concatenate([jnp.zeros(1, jnp.int32), ends])[ctx_seq]
        k_seq, k_pos = jnp.concatenate([ctx_seq, k_seq]), jnp.concatenate([ctx_pos, k_pos])
        k_valid = jnp.concatenate([r < ends[-1], k_valid])
    return _online_softmax(q, k, v, q_seq, q_pos, k_seq, k_pos, k_valid, scale, block)


def _online_softmax(q, k, v, q_seq, q_pos, k_seq, k_pos, k_valid, scale, block):
    """softmax(q k^T * scale) v where key j is seen by query i when ``k_valid[j]``, both belong to
    one sequence (``k_seq[j] == q_seq[i]``) and ``k_pos[j] <= q_pos[i]``, computed one (query
    block, key block) tile at a time with an online softmax: memory O(H x block^2), never the
    [H, T, S] score matrix. A query that sees no key gets zeros.

    q [T, H, D], k [S, H, D], v [S, H, Dv] (float32); sequence ids and positions int32 [T] / [S];
    -> [T, H, Dv].
    """
    T, H, _ = q.shape
    S, Dv = k.shape[0], v.shape[-1]

    def blocks(x, n, fill):  # [n, ...] -> [ceil(n / block), block, ...], padded with fill
        pad = -n % block
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(-1, block, *x.shape[1:])

    kb, vb = blocks(k, S, 0.0), blocks(v, S, 0.0)
    kseq, kpos, kval = blocks(k_seq, S, -1), blocks(k_pos, S, 0), blocks(k_valid, S, False)

    def query_block(args):
        qi, qseq, qpos = args  # [block, H, D], [block], [block]

        def key_block(carry, keys):
            m, total, acc = carry  # [H, block], [H, block], [H, block, Dv]
            kj, vj, ks, kp, kv = keys
            s = jnp.einsum("qhd,khd->hqk", qi, kj) * scale
            seen = kv[None, :] & (ks[None, :] == qseq[:, None]) & (kp[None, :] <= qpos[:, None])
            s = jnp.where(seen[None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, -1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all masked so far: no -inf - -inf
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            total = total * alpha + jnp.sum(p, -1)
            acc = acc * alpha[..., None] + jnp.einsum("hqk,khv->hqv", p, vj)
            return (m_new, total, acc), None

        init = (jnp.full((H, block), -jnp.inf), jnp.zeros((H, block)), jnp.zeros((H, block, Dv)))
        (_, total, acc), _ = jax.lax.scan(key_block, init, (kb, vb, kseq, kpos, kval))
        return (acc / jnp.where(total > 0, total, 1.0)[..., None]).transpose(1, 0, 2)

    out = jax.lax.map(query_block, (blocks(q, T, 0.0), blocks(q_seq, T, -2), blocks(q_pos, T, -1)))
    return out.reshape(-1, H, Dv)[:T]


def cudnn_attention(q, k, v, cu, *, scale, ctx_k=None, ctx_v=None, ctx_lens=None, api="cudnn", ctx_kv=None):
    """Prefill attention on cuDNN.

    q, k [T, H, 192], v [T, H, 128] in bf16/fp16; cu int32 [S + 1] (S static; tokens past cu[S]
    are padding and get zeros when S > 1). With a cached context: ctx_k [C, H, 192],
    ctx_v [C, H, 128], sequences packed back to back (sequence s at rows sum(ctx_lens[:s]) ...),
    ctx_lens int32 [S]. Token j of a sequence's chunk sees all its context and chunk tokens
    0..j. Returns [T, H, 128] in q's dtype; a token that sees nothing gets zeros.

    ``ctx_kv=(fn, args)`` instead of ctx_k and ctx_v: ``ctx_k, ctx_v = fn(*args)``, made only
    after the chunk's own attention has run (args pass an optimization barrier with its output),
    so that the chunk's k and v are freed before the context's exist.

    ``api="cudnn-public"`` (one sequence, no context) calls jax.nn.dot_product_attention with v
    padded to 192 columns.
    """
    T, H, dv = q.shape[0], q.shape[1], v.shape[-1]
    S = cu.shape[0] - 1
    if ctx_kv is not None and ctx_k is not None:
        raise ValueError("pass ctx_k and ctx_v, or ctx_kv, not both")
    context = ctx_k is not None or ctx_kv is not None
    if api == "cudnn-public":
        if S != 1 or context:
            raise ValueError("the public jax.nn.dot_product_attention path takes one sequence without cached context")
        v192 = jnp.pad(v, ((0, 0), (0, 0), (0, q.shape[-1] - dv)))
        out = jax.nn.dot_product_attention(q[None], k[None], v192[None], scale=scale, is_causal=True, implementation="cudnn")
        return out[0, ..., :dv]
    module = private_api()
    if module is None:
        raise ValueError(f"jax {jax.__version__}: its private cuDNN attention module is not usable here")
    call = functools.partial(_call, module, scale=scale, lse=context)
    packed = S > 1
    seq, local = segments(cu, T)
    if packed:
        # Packed segments: the layout's ragged offsets count v (and out) in q's head width, so v
        # travels padded to 192 columns (docs/PREFILL.md); empty segments are left out (-1).
        def pad(x):
            return jnp.pad(x, ((0, 0), (0, 0), (0, q.shape[-1] - dv)))

        lens = cu[1:] - cu[:-1]
        live = lens > 0
        out, stats = call(q, k, pad(v), causal=True, q_lens=jnp.where(live, lens, -1), kv_lens=jnp.where(live, lens, -1),
                          q_starts=jnp.where(live, cu[:-1], -1), kv_starts=jnp.where(live, cu[:-1], -1))
        out = out[..., :dv]
        real = (seq < S)[:, None, None]
        out = jnp.where(real, out, 0)
    else:
        out, stats = call(q, k, v, causal=True)
    if not context:
        return out
    if ctx_kv is not None:
        fn, args = ctx_kv
        out, stats, args = jax.lax.optimization_barrier((out, stats, tuple(args)))
        ctx_k, ctx_v = fn(*args)
    lse_chunk = _lse_rows(stats, seq, local, live if packed else None)
    # The chunks over their contexts, no mask.
    cap = ctx_k.shape[0]
    ctx_lens = jnp.clip(ctx_lens.astype(jnp.int32), 0, cap)
    ctx_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(ctx_lens)[:-1]])
    if packed:
        lens = cu[1:] - cu[:-1]
        both = (lens > 0) & (ctx_lens > 0) & (ctx_starts < cap)
        kv_lens = jnp.minimum(ctx_lens, cap - jnp.minimum(ctx_starts, cap))
        ctx_out, ctx_stats = call(q, ctx_k, pad(ctx_v), causal=False, q_lens=jnp.where(both, lens, -1),
                                  kv_lens=jnp.where(both, kv_lens, -1), q_starts=jnp.where(both, cu[:-1], -1),
                                  kv_starts=jnp.where(both, ctx_starts, -1))
        ctx_out = ctx_out[..., :dv]
        lse_ctx = _lse_rows(ctx_stats, seq, local, both)
    else:
        both = ctx_lens > 0
        ctx_out, ctx_stats = call(q, ctx_k, ctx_v, causal=False, kv_lens=ctx_lens[:1])
        lse_ctx = _lse_rows(ctx_stats, seq, local, None)
    seen = jnp.concatenate([both, jnp.zeros(1, bool)])[seq]  # padding tokens: no context
    lse_ctx = jnp.where(seen[:, None], lse_ctx, -jnp.inf)
    merged = _merge(ctx_out.astype(F32), lse_ctx, out.astype(F32), lse_chunk)
    return merged.astype(q.dtype).reshape(T, H, dv)


def _lse_rows(stats, seq, local, live):
    """[T, H] log-sum-exp per token from cuDNN's softmax stats: [1, H, T] for one sequence;
    [segments, H, T] for packed ones, segment j (the j-th live one) at rows 0..len - 1."""
    if live is None:
        return stats[0].T
    rank = jnp.cumsum(live.astype(jnp.int32)) - 1  # index of each live segment among the live ones
    seg = jnp.concatenate([rank, jnp.zeros(1, jnp.int32)])[seq]
    ok = jnp.concatenate([live, jnp.zeros(1, bool)])[seq]
    rows = stats[jnp.clip(seg, 0, stats.shape[0] - 1)[:, None], jnp.arange(stats.shape[1])[None, :],
                 jnp.clip(local, 0, stats.shape[2] - 1)[:, None]]
    return jnp.where(ok[:, None], rows, -jnp.inf)
