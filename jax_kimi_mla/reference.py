"""The public ops in plain jax.numpy: same signatures, same checks, same returns as the FFI ops.

For tests, notebooks and as a fallback. Jit-able (numpy operands too, closed over or passed); under ``jax.jit(..., donate_argnums=...)`` XLA
updates the cache in place here too (a scatter). Among valid tokens that share a slot, the
LAST token's entry is kept (the CPU handlers do the same; the CUDA kernels leave it undefined).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks
from .formats import CACHE_FORMATS, ENTRY, L, P, R
from .numerics import ds_mla_dequantize, ds_mla_encode, quantize_e4m3, rope


def _concat_bits(parts, broadcast=None):
    """jnp.concatenate(parts, -1) of 16-bit floats (each first broadcast to ``broadcast`` + its
    last dimension, if given) done on their bit patterns: XLA:CPU canonicalizes bf16 NaNs in float
    concatenates and broadcasts (payload and quiet bit lost), and the ops copy them exactly."""
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in parts]
    if broadcast is not None:
        bits = [jnp.broadcast_to(b, (*broadcast, b.shape[-1])) for b in bits]
    return jax.lax.bitcast_convert_type(jnp.concatenate(bits, -1), parts[0].dtype)


def _rotated_k_pe(k_pe, checked, positions, cos_sin_cache):
    """k_pe as float32 [T, 64], RoPE'd when RoPE is on."""
    x = k_pe.reshape(checked.tokens, R).astype(jnp.float32)
    return rope(x, positions, cos_sin_cache, checked.rope_style) if checked.rope else x


def _insert(kv_cache, rows, slot_mapping):
    """Writes entries [T, entry] into the first columns of the rows of the flattened cache that
    valid slots address (a padded row's other columns keep their bits)."""
    if rows.shape[0] == 0:
        return kv_cache
    num_blocks, block_size, width = kv_cache.shape
    num_rows = num_blocks * block_size
    slots = jnp.asarray(slot_mapping)  # numpy may not be indexed by a traced index
    order = jnp.argsort(slots, stable=True)
    ordered = slots[order]
    last_of_run = jnp.concatenate([ordered[1:] != ordered[:-1], jnp.ones((1,), bool)])
    is_last = jnp.zeros(slots.shape, bool).at[order].set(last_of_run)
    keep = (slots >= 0) & (slots < num_rows) & is_last
    target = jnp.where(keep, slots, num_rows)  # out of range: dropped by the scatter
    # Scatter the bits: XLA may compute a float scatter through float32, which would rewrite NaN
    # payloads in rows it does not even address.
    as_bits = {1: jnp.uint8, 2: jnp.uint16}[kv_cache.dtype.itemsize]
    flat = jax.lax.bitcast_convert_type(kv_cache.reshape(num_rows, width), as_bits)
    flat = flat.at[target, : rows.shape[-1]].set(jax.lax.bitcast_convert_type(rows, as_bits), mode="drop")
    return jax.lax.bitcast_convert_type(flat, kv_cache.dtype).reshape(kv_cache.shape)


def _rounded(x32, raw, rope, dtype):
    """x32 rounded to ``dtype``; without RoPE, ``raw``'s own bits when it has that dtype (a copy
    keeps every bit, NaN payloads included)."""
    return raw if not rope and raw.dtype == dtype else x32.astype(dtype)


def _entry(fmt, kv_c_normed, r32, k_pe, rope, cache_scale_inv=None):
    """The cache entries [T, width] of a cache format from the latent, the float32 (RoPE'd) k_pe
    and the input k_pe [T, 64]."""
    if fmt == "fp8_ds_mla":
        return ds_mla_encode(kv_c_normed.astype(jnp.float32), _rounded(r32, k_pe, rope, jnp.bfloat16))
    if fmt == "fp8":
        return quantize_e4m3(jnp.concatenate([kv_c_normed.astype(jnp.float32), r32], -1), cache_scale_inv)
    return _concat_bits([kv_c_normed, _rounded(r32, k_pe, rope, kv_c_normed.dtype)])


def _prefill(fmt, q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style):
    checked, a = _checks.prefill(
        q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, cache_format=fmt, style=rope_style
    )
    a = _checks.sliced(a)
    T, H = checked.tokens, checked.heads
    r32 = _rotated_k_pe(a["k_pe"], checked, a["positions"], a["cos_sin_cache"])
    k_pe = a["k_pe"].reshape(T, R)
    r = _rounded(r32, k_pe, checked.rope, checked.act)
    k = _concat_bits([a["k_nope"], r[:, None, :]], broadcast=(T, H))
    q = a["q"]
    if checked.rope:
        q_pe = rope(q[..., P:].astype(jnp.float32), a["positions"], a["cos_sin_cache"], checked.rope_style)
        q = _concat_bits([q[..., :P], q_pe.astype(checked.act)])
    cache = _insert(a["kv_cache"], _entry(fmt, a["kv_c_normed"], r32, k_pe, checked.rope), a["slot_mapping"])
    return k, q, cache


def fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None, rope_style="gptj"):
    """Reference of :func:`jax_kimi_mla.fused_mla_key_concat_kv_cache_insert`."""
    return _prefill("bf16", q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style)


def fused_mla_key_concat_ds_mla_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, *, positions=None, cos_sin_cache=None, rope_style="gptj"):
    """Reference of :func:`jax_kimi_mla.fused_mla_key_concat_ds_mla_insert`."""
    return _prefill("fp8_ds_mla", q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, rope_style)


def fused_mla_qkv_quant_kv_cache_fp8_insert(
    q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv, *, positions=None, cos_sin_cache=None,
    rope_style="gptj",
):
    """Reference of :func:`jax_kimi_mla.fused_mla_qkv_quant_kv_cache_fp8_insert`."""
    checked, a = _checks.prefill(
        q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions, cos_sin_cache, cache_format="fp8", v=v, style=rope_style
    )
    a = _checks.sliced(a)
    scales = _checks.fp8_prefill_scales(q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv)
    T, H = checked.tokens, checked.heads
    r32 = _rotated_k_pe(a["k_pe"], checked, a["positions"], a["cos_sin_cache"])
    q32 = a["q"].astype(jnp.float32)
    if checked.rope:
        q32 = jnp.concatenate([q32[..., :P], rope(q32[..., P:], a["positions"], a["cos_sin_cache"], checked.rope_style)], -1)
    k32 = jnp.concatenate([a["k_nope"].astype(jnp.float32), jnp.broadcast_to(r32[:, None, :], (T, H, R))], -1)
    q_fp8 = quantize_e4m3(q32, scales[0])
    k_fp8 = quantize_e4m3(k32, scales[1])
    v_fp8 = quantize_e4m3(a["v"].astype(jnp.float32), scales[2])
    cache = _insert(a["kv_cache"], _entry("fp8", a["kv_c_normed"], r32, a["k_pe"].reshape(T, R), checked.rope, scales[3]), a["slot_mapping"])
    return q_fp8, k_fp8, v_fp8, cache


def fused_mla_decode_q_concat_kv_cache_insert(
    ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, *, ds_mla=False, q_scale_inv=None, cache_scale_inv=None, positions=None, cos_sin_cache=None,
    rope_style="gptj",
):
    """Reference of :func:`jax_kimi_mla.fused_mla_decode_q_concat_kv_cache_insert`."""
    checked, fmt, a = _checks.decode(
        ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, ds_mla, q_scale_inv, cache_scale_inv, positions, cos_sin_cache, rope_style
    )
    a = _checks.sliced(a)
    r32 = _rotated_k_pe(a["k_pe"], checked, a["positions"], a["cos_sin_cache"])
    q_pe32 = a["q_pe"].astype(jnp.float32)
    if checked.rope:
        q_pe32 = rope(q_pe32, a["positions"], a["cos_sin_cache"], checked.rope_style)
    if fmt == "fp8":
        mqa_q = quantize_e4m3(jnp.concatenate([a["ql_nope"].astype(jnp.float32), q_pe32], -1), a["q_scale_inv"])
    else:
        mqa_q = _concat_bits([a["ql_nope"], _rounded(q_pe32, a["q_pe"], checked.rope, checked.act)])
    k_pe = a["k_pe"].reshape(checked.tokens, R)
    cache = _insert(a["kv_cache"], _entry(fmt, a["kv_c_normed"], r32, k_pe, checked.rope, a.get("cache_scale_inv")), a["slot_mapping"])
    return mqa_q, cache


def _dequantized_entries(c, rows):
    """The cache entries at flat ``rows`` [...] as float32 [..., 576] (a padded row's first columns)."""
    flat = jnp.asarray(c.kv_cache).reshape(-1, c.kv_cache.shape[-1])
    if flat.shape[0] == 0:  # no blocks: every token is masked out; a zero row keeps the gather legal
        flat = jnp.zeros((1, flat.shape[1]), flat.dtype)
    entries = flat[rows][..., : CACHE_FORMATS[c.cache_format].width]
    if c.cache_format == "fp8_ds_mla":
        latent, k_pe = ds_mla_dequantize(entries)
        return jnp.concatenate([latent, k_pe.astype(jnp.float32)], -1)
    entries = entries.astype(jnp.float32)
    return entries if c.cache_scale_inv is None else entries / jnp.reshape(c.cache_scale_inv, ())


def mla_decode_attention(
    mqa_q, kv_cache, block_tables, context_lens, *, softmax_scale, ds_mla=False, q_scale_inv=None, cache_scale_inv=None, return_lse=False, num_splits=None,
    kernel="auto", programmatic_combine=True, balance_splits=True, split_by_work=True,
):
    """Reference of :func:`jax_kimi_mla.mla_decode_attention`: every table slot's entry gathered
    as float32 [B, max_blocks * block_size, 576], then two einsums (``num_splits``, ``kernel``,
    ``programmatic_combine``, ``balance_splits`` and ``split_by_work``, which choose how the CUDA
    kernel runs, are checked and ignored).

    A token that a query does not see (past its visible length, or with a block id outside
    [0, num_blocks)) is zeroed before that query's einsums, so garbage and NaN there never reach
    its result.
    """
    c = _checks.decode_attention(
        mqa_q, kv_cache, block_tables, context_lens, softmax_scale, ds_mla, q_scale_inv, cache_scale_inv, num_splits, return_lse, kernel,
        programmatic_combine, balance_splits, split_by_work)
    B, S = c.q.shape[:2]
    num_blocks, block_size = c.kv_cache.shape[:2]
    q = c.q.astype(jnp.float32)
    if c.q_scale_inv is not None:
        q = q / jnp.reshape(c.q_scale_inv, ())
    t = jnp.arange(c.block_tables.shape[1] * block_size)
    blocks = jnp.asarray(c.block_tables)[:, t // block_size]  # [B, tokens]
    in_cache = (blocks >= 0) & (blocks < num_blocks)
    lens = jnp.clip(jnp.asarray(c.context_lens), 0, t.shape[0])
    readable = in_cache & (t < lens[:, None])
    entries = _dequantized_entries(c, jnp.where(readable, blocks * block_size + t % block_size, 0))
    entries = jnp.where(readable[..., None], entries, 0.0)
    visible = lens[:, None] - S + 1 + jnp.arange(S)  # [B, S_q]: query j sees tokens < visible
    mask = in_cache[:, None, None, :] & (t < visible[:, :, None, None])  # [B, S_q, 1, tokens]
    scores = jnp.where(mask, jnp.einsum("bshc,btc->bsht", q, entries) * jnp.float32(c.softmax_scale), -jnp.inf)
    m = jnp.max(scores, -1, keepdims=True, initial=-jnp.inf)  # initial: a table with no columns
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(p, -1, keepdims=True)
    lse = (jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(total))[..., 0]
    p = p / jnp.where(total > 0, total, 1.0)
    latent = entries[..., : L]
    if S == 1:
        out = jnp.einsum("bsht,btl->bshl", p, latent)
    else:  # the newest tokens are visible to some queries only: 0 * NaN must not reach the others
        out = jnp.einsum("bsht,bstl->bshl", p, jnp.where(mask[:, :, 0, :, None], latent[:, None], 0.0))
    out = out.astype(c.out_dtype)
    if c.squeeze:
        out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


def gather_mla_cache(kv_cache, block_tables, context_lens, *, num_tokens=None, ds_mla=False, cache_scale_inv=None, out_dtype=jnp.bfloat16):
    """Reference of :func:`jax_kimi_mla.gather_mla_cache`: every table slot's entry gathered and
    dequantized as float32, then scattered to its packed row."""
    c = _checks.gather_cache(kv_cache, block_tables, context_lens, num_tokens, ds_mla, cache_scale_inv, out_dtype)
    num_blocks, block_size = c.kv_cache.shape[:2]
    B, max_blocks = c.block_tables.shape
    t = jnp.arange(max_blocks * block_size)
    blocks = jnp.asarray(c.block_tables)[:, t // block_size]  # [B, tokens]
    lens = jnp.clip(jnp.asarray(c.context_lens), 0, t.shape[0])
    in_cache = (blocks >= 0) & (blocks < num_blocks)
    entries = _dequantized_entries(c, jnp.where(in_cache, blocks * block_size + t % block_size, 0))
    entries = jnp.where(in_cache[..., None], entries, 0.0).astype(c.out_dtype)
    first = jnp.cumsum(lens) - lens  # each sequence's first output row
    rows = jnp.where(t < lens[:, None], first[:, None] + t, c.num_tokens)  # past the length: dropped
    out = jnp.zeros((c.num_tokens, ENTRY), c.out_dtype)
    return out.at[rows.reshape(-1)].set(entries.reshape(-1, ENTRY), mode="drop")
