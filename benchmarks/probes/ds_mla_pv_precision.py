"""How precise would fp8_ds_mla's P.V be in f16 with the tile scale folded into P? (CPU, numpy.)

The plain fp8 kernel's P.V converts the raw E4M3 codes to f16 in registers (exact). fp8_ds_mla's
values are code x scale, one scale per token and 128-column tile; a warp's 64 output columns lie in
one tile, so the scale can go into P instead: out = sum_t R p_t (s_t / R) code_t, with
P' = f16(p_t s_t / R) and R a power of two per 64-token tile. This compares, against the exact
float32 P.V of the dequantized values, today's kernel (bf16 p times bf16 code x scale) and that
f16 scheme, with R = the tile's largest scale, and with R = the tile's largest p_t s_t per row
(a P' of 1 for the largest term), over data whose per-token magnitudes spread more and more, and
an adversarial case: one token a tile far larger than the others but with p near 0.

    python benchmarks/probes/ds_mla_pv_precision.py

The tests' out tolerance for a bf16 output is 2^-6 (1 + |ref|) (tests/test_decode_attention.py).
"""

import ml_dtypes
import numpy as np

TILE, COLUMNS, ROWS, TOKENS = 64, 128, 12, 4096
TOLERANCE = 2.0**-6


def rounded(x, dtype):
    return x.astype(dtype).astype(np.float32)


def writer_scale(amax):
    """The epilogues' ds_mla tile scale: amax / 448, rounded up to a power of two."""
    return 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0))


def errors(latent, logits):
    """Largest |out - exact| / (1 + |exact|) of (today's bf16 P.V, f16 with R = max s, f16 with R = max p s)."""
    scale = writer_scale(np.abs(latent).max(axis=1)).astype(np.float32)
    codes = rounded(latent / scale[:, None], ml_dtypes.float8_e4m3fn)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    norm = p.sum(axis=1, keepdims=True)
    exact = p @ (codes * scale[:, None]) / norm
    today = rounded(p, ml_dtypes.bfloat16) @ rounded(codes * scale[:, None], ml_dtypes.bfloat16) / norm
    by_scale, by_term = np.zeros_like(exact), np.zeros_like(exact)
    for t in range(0, latent.shape[0], TILE):
        ps, c = p[:, t : t + TILE] * scale[t : t + TILE], codes[t : t + TILE]
        r = scale[t : t + TILE].max()
        by_scale += r * (rounded(ps / r, np.float16) @ c)
        r_row = writer_scale(448.0 * ps.max(axis=1, keepdims=True))  # a power of two >= each row's largest term
        by_term += r_row * (rounded(ps / r_row, np.float16) @ c)
    worst = lambda out: float(np.max(np.abs(out - exact) / (1 + np.abs(exact))))  # noqa: E731
    return worst(today), worst(by_scale / norm), worst(by_term / norm)


def main():
    rng = np.random.default_rng(0)
    print(f"tolerance {TOLERANCE:.2e}; columns: today (bf16 P), f16 P' with R = max s, f16 P' with R = max p s")
    for spread in (0, 6, 12, 20, 30):
        latent = rng.standard_normal((TOKENS, COLUMNS)).astype(np.float32)
        latent *= (2.0 ** rng.uniform(-spread / 2, spread / 2, (TOKENS, 1))).astype(np.float32)
        logits = 2 * rng.standard_normal((ROWS, TOKENS)).astype(np.float32)
        print(f"per-token magnitudes spread over 2^{spread:<2d}: " + ", ".join(f"{e:.2e}" for e in errors(latent, logits)))
    for k in (8, 14, 18, 24, 30):
        latent = rng.standard_normal((TOKENS, COLUMNS)).astype(np.float32)
        logits = rng.standard_normal((ROWS, TOKENS)).astype(np.float32)
        big = np.arange(0, TOKENS, TILE)
        latent[big] *= 2.0**k
        logits[:, big] = -60.0 - 0.7 * k  # its p x 2^k stays far below the other terms
        print(f"one token a tile 2^{k:<2d} larger, p ~ 0:      " + ", ".join(f"{e:.2e}" for e in errors(latent, logits)))


if __name__ == "__main__":
    main()
