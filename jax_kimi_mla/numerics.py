"""The epilogue numerics in jax.numpy: RoPE, E4M3 quantization, the fp8_ds_mla entry.

The reference ops are built from these; ``make_cos_sin_cache`` and ``ds_mla_dequantize`` are
public. The C++/CUDA side has the same functions in ``ffi/include/jax_kimi_mla/numerics.h``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .formats import DS_MLA_ENTRY_BYTES, L, R

E4M3_MAX = 448.0
DS_MLA_TILE = 128
DS_MLA_MIN_SCALE_RATIO = 1e-4


def make_cos_sin_cache(max_position: int, *, base: float = 10000.0, rope_dim: int = R) -> jax.Array:
    """float32 [max_position, rope_dim]: cos of pairs 0..rope_dim/2-1, then their sin.

    Pair i of position p turns by angle ``p * base ** (-2 i / rope_dim)``.

    >>> make_cos_sin_cache(4096).shape
    (4096, 64)
    """
    for name, value in (("max_position", max_position), ("rope_dim", rope_dim)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if max_position < 1 or rope_dim % 2:
        raise ValueError(f"need max_position >= 1 and an even rope_dim, got max_position={max_position}, rope_dim={rope_dim}")
    inv_freq = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32))


def rope(x, positions, cos_sin_cache, style: str = "gptj"):
    """RoPE of float32 x [T, ..., 64] at positions [T] (clamped into the table).

    Pair i turns by (cos, sin) = columns (i, 32 + i) of the position's table row. ``style``
    "gptj" pairs elements (2i, 2i + 1), "neox" (rotate-half) pairs elements (i, i + 32).
    """
    rows = jnp.asarray(cos_sin_cache)[jnp.clip(jnp.asarray(positions), 0, cos_sin_cache.shape[0] - 1)]
    extra = (1,) * (x.ndim - 2)
    cos = rows[:, : R // 2].reshape(x.shape[0], *extra, R // 2)
    sin = rows[:, R // 2 :].reshape(x.shape[0], *extra, R // 2)
    if style == "neox":
        x0, x1 = x[..., : R // 2], x[..., R // 2 :]
        return jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)


def quantize_e4m3(x, scale_inv):
    """float32 x -> float8_e4m3fn codes of clamp(x * scale_inv, -448, 448); NaN stays NaN."""
    return jnp.clip(x * jnp.reshape(scale_inv, ()), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def ds_mla_tile_scale(amax):
    """Smallest power of two >= max(amax / 448, 1e-4), rounded up from the float32 bits."""
    ratio = jnp.maximum(amax / jnp.float32(E4M3_MAX), jnp.float32(DS_MLA_MIN_SCALE_RATIO))
    bits = jax.lax.bitcast_convert_type(ratio, jnp.uint32)
    inexact = ((bits & 0x7FFFFF) != 0) & (bits < 0x7F800000)
    bits = jnp.where(inexact, (bits & jnp.uint32(0xFF800000)) + jnp.uint32(0x800000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bytes(x):
    """The little-endian bytes of x [T, n] as uint8 [T, n * itemsize]."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], x.shape[-1] * b.shape[-1]) if b.ndim > x.ndim else b


def ds_mla_encode(latent, pe_bf16):
    """fp8_ds_mla entries uint8 [T, 656] from latent float32 [T, 512] and k_pe bfloat16 [T, 64]."""
    tiles = latent.reshape(latent.shape[0], L // DS_MLA_TILE, DS_MLA_TILE)
    amax = jnp.max(jnp.where(jnp.isnan(tiles), 0.0, jnp.abs(tiles)), axis=-1)
    scale = ds_mla_tile_scale(amax)
    codes = jnp.clip(tiles / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return jnp.concatenate(
        [_bytes(codes.reshape(latent.shape[0], L)), _bytes(scale), _bytes(pe_bf16)], axis=-1
    )


def ds_mla_dequantize(entries):
    """Reads fp8_ds_mla entries: uint8 [..., 656] -> (latent float32 [..., 512], k_pe bfloat16 [..., 64]).

    Padded rows (uint8 [..., W], W > 656 a multiple of 16) are read from their first 656 bytes.

    >>> kv_cache = jnp.zeros((4, 16, 656), jnp.uint8)  # an fp8_ds_mla cache [num_blocks, block_size, 656]
    >>> latent, k_pe = ds_mla_dequantize(kv_cache)
    >>> latent.shape, latent.dtype, k_pe.shape, k_pe.dtype
    ((4, 16, 512), dtype('float32'), (4, 16, 64), dtype(bfloat16))
    """
    entries = jnp.asarray(entries)
    width = entries.shape[-1] if entries.ndim else 0
    if entries.dtype != jnp.uint8 or width < DS_MLA_ENTRY_BYTES or (width > DS_MLA_ENTRY_BYTES and width % 16):
        raise ValueError(
            f"entries must be uint8 [..., 656] (or rows padded to a multiple of 16 bytes), got {entries.dtype} {tuple(entries.shape)}"
        )
    entries = entries[..., :DS_MLA_ENTRY_BYTES]
    lead = entries.shape[:-1]
    codes = jax.lax.bitcast_convert_type(entries[..., :L], jnp.float8_e4m3fn).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(entries[..., L : L + 16].reshape(*lead, 4, 4), jnp.float32)
    latent = (codes.reshape(*lead, 4, DS_MLA_TILE) * scale[..., None]).reshape(*lead, L)
    k_pe = jax.lax.bitcast_convert_type(entries[..., L + 16 :].reshape(*lead, R, 2), jnp.bfloat16)
    return latent, k_pe
