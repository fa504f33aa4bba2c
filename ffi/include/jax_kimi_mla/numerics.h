// The numerics of the epilogues, written once for host (CPU handlers) and device (CUDA kernels).
//
// Every conversion here is integer bit arithmetic or a single IEEE operation, so the CPU and the
// GPU produce bit-identical results. A NaN that goes through arithmetic or a conversion comes out
// as the canonical quiet NaN of the output format (the GPU's arithmetic does not keep NaN signs
// or payloads, x86's does); values that are only copied keep their bits. On the GPU the
// narrowing conversions are the hardware's pair converters, which round the same way; only
// their NaN codes differ, and those are replaced (bf16x2, f16x2, e4m3x4).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define JKM_HD __host__ __device__ __forceinline__
#else
#define JKM_HD inline
#endif

namespace jax_kimi_mla {

// Fixed Kimi-K3 MLA dimensions (spec: "Fixed dimensions").
inline constexpr int kLatent = 512;       // kv_lora_rank L
inline constexpr int kNope = 128;         // qk_nope_head_dim P
inline constexpr int kRope = 64;          // qk_rope_head_dim R
inline constexpr int kQkHead = kNope + kRope;  // 192
inline constexpr int kVHead = 128;
inline constexpr int kEntry = kLatent + kRope;  // 576: plain cache entry, decode mqa_q row
inline constexpr int kDsMlaEntryBytes = 656;
inline constexpr int kDsMlaTile = 128;              // elements per ds_mla scale tile
inline constexpr int kDsMlaScaleOffset = kLatent;   // 4 float32 scales at byte 512
inline constexpr int kDsMlaPeOffset = kLatent + 16; // 64 bf16 at byte 528
inline constexpr float kE4m3Max = 448.0f;

JKM_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JKM_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Products that must stay rounded products: the compiler may not fuse them into an FMA.
JKM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host code is compiled with -ffp-contract=off
#endif
}

JKM_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// ---- 16-bit floats: exact widening, round-to-nearest-even narrowing, NaN kept quiet ----

JKM_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

inline constexpr uint16_t kBf16NaN = 0x7FC0u, kF16NaN = 0x7E00u;
inline constexpr uint8_t kE4m3NaN = 0x7Fu;

JKM_HD uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return kBf16NaN;
  return uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

JKM_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float32
    float mag = float(mant) * 5.9604644775390625e-8f;
    return f32_from_bits(sign | f32_bits(mag));
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Keeps the low `shift` bits' rounding: round-to-nearest-even of m / 2^shift, 0 < shift < 32.
JKM_HD uint32_t shift_right_rne(uint32_t m, uint32_t shift) {
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

JKM_HD uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kF16NaN;
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                 // normal half (>= 2^-14)
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return uint16_t(sign | ((r >> 13) - (112u << 10)));
  }
  uint32_t shift = 126u - (a >> 23);  // subnormal half: round(mantissa * 2^(e-126))
  if (shift > 24u) return sign;
  return uint16_t(sign | shift_right_rne((a & 0x7FFFFFu) | 0x800000u, shift));
}

// ---- E4M3 (float8_e4m3fn): round-to-nearest-even, saturate to +-448, NaN stays NaN ----

// The reference encoder. Clamping first and rounding second (the spec's order) equals rounding
// first and saturating second, because every value above 448 rounds to 448 or overflows.
JKM_HD uint8_t e4m3_encode_soft(float f) {
  uint32_t x = f32_bits(f);
  uint8_t sign = uint8_t((x >> 24) & 0x80u);
  uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kE4m3NaN;
  if (a >= 0x43E00000u) return uint8_t(sign | 0x7Eu);  // |x| >= 448, inf included
  if (a >= 0x3C800000u) {                              // normal e4m3 (>= 2^-6)
    uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    return uint8_t(sign | ((r >> 20) - (120u << 3)));  // below 448, so at most 0x7E
  }
  uint32_t shift = 141u - (a >> 23);  // subnormal e4m3: round(|x| * 2^9)
  if (shift > 24u) return sign;
  return uint8_t(sign | shift_right_rne((a & 0x7FFFFFu) | 0x800000u, shift));
}

// ---- Pairs and quads: narrowed values packed into one word, the first value lowest ----

// The 16-bit halves of w that hold a NaN (magnitude above `inf`, the format's infinity) become
// `nan`. SIMD within the word: adding 0x7FFF - inf to a half's low 15 bits carries into its top
// bit exactly when the half is a NaN.
JKM_HD uint32_t canonical_nan_halves(uint32_t w, uint32_t inf, uint32_t nan) {
  const uint32_t top = ((w & 0x7FFF7FFFu) + (0x7FFFu - inf) * 0x10001u) & 0x80008000u;
  const uint32_t mask = (top >> 15) * 0xFFFFu;
  return (w & ~mask) | (nan * 0x10001u & mask);
}

JKM_HD uint32_t bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 p = __float22bfloat162_rn(make_float2(lo, hi));  // RNE; NaN -> 0x7FFF
  return canonical_nan_halves(*reinterpret_cast<const uint32_t*>(&p), 0x7F80u, kBf16NaN);
#else
  return f32_to_bf16(lo) | uint32_t(f32_to_bf16(hi)) << 16;
#endif
}

JKM_HD uint32_t f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __half2 p = __float22half2_rn(make_float2(lo, hi));  // RNE, overflow to inf; NaN -> 0x7FFF
  return canonical_nan_halves(*reinterpret_cast<const uint32_t*>(&p), 0x7C00u, kF16NaN);
#else
  return f32_to_f16(lo) | uint32_t(f32_to_f16(hi)) << 16;
#endif
}

// The sm_89+ fp8 conversion instructions, unless the build forces the portable bit arithmetic
// (JAX_KIMI_MLA_SOFTWARE_FP8=ON, which defines JKM_SOFTWARE_FP8: both must give the same bits).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(JKM_SOFTWARE_FP8)
#define JKM_HARDWARE_FP8 1
#else
#define JKM_HARDWARE_FP8 0
#endif

// Bit 7 of byte i is set where E4M3 code i of the word is a NaN (its low 7 bits all ones: adding
// 1 carries into bit 7); the other bits are noise, so that several words can be or-ed and then
// tested with & 0x80808080.
JKM_HD uint32_t e4m3_nan_bits(uint32_t codes4) { return (codes4 & 0x7F7F7F7Fu) + 0x01010101u; }
JKM_HD bool e4m3_has_nan(uint32_t codes4) { return (e4m3_nan_bits(codes4) & 0x80808080u) != 0; }

// ---- E4M3 codes read back as exact 16-bit values (the GPU readers) ----

// Two codes, each in the high byte of a 16-bit half of h, as the f16 pair of value * 2^-8: the
// code's sign at the f16 sign bit, eeee.mmm at the top of its exponent and mantissa fields; exact,
// subnormal codes included. NaN codes come out as +-480 * 2^-8.
JKM_HD uint32_t e4m3x2_placed_f16x2(uint32_t h) { return (h & 0x80008000u) | ((h >> 1) & 0x3F803F80u); }

#if JKM_HARDWARE_FP8
// sm_89+: the two codes of the low (kHalf 0) or high (1) 16 bits of x (the first in the lower
// byte) as their exact f16 pair, NaN kept, one instruction. The half is taken by a vector move,
// so that ptxas reads the high one in place (F2FP ... .H1) instead of shifting it down first.
template <int kHalf>
__device__ __forceinline__ uint32_t e4m3x2_half_to_f16x2(uint32_t x) {
  static_assert(kHalf == 0 || kHalf == 1);
  uint32_t d;
  if constexpr (kHalf == 0)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(d) : "r"(x));
  else
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(d) : "r"(x));
  return d;
}
#endif

// Four E4M3 codes of values already multiplied by the scale inverse. On the GPU the hardware
// pair converter (cvt.rn.satfinite.e4m3x2.f32) rounds and saturates as the reference encoder
// does, but keeps a NaN's sign: a code is a NaN exactly when its low 7 bits are all ones (adding
// 1 to them carries into the sign bit), and its sign is cleared to give 0x7F.
JKM_HD uint32_t e4m3x4(float a, float b, float c, float d) {
#if JKM_HARDWARE_FP8
  const uint32_t w = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3) |
                     uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3)) << 16;
  return w & ~(e4m3_nan_bits(w) & 0x80808080u);
#else
  return e4m3_encode_soft(a) | uint32_t(e4m3_encode_soft(b)) << 8 |
         uint32_t(e4m3_encode_soft(c)) << 16 | uint32_t(e4m3_encode_soft(d)) << 24;
#endif
}

// ---- RoPE: pair (x0, x1) rotated by (c, s) ----
// One fixed sequence of float32 operations (an FMA over a rounded product) on both sides.
JKM_HD void rope_pair(float x0, float x1, float c, float s, float& y0, float& y1) {
  y0 = fma_rn(x0, c, -mul_rn(x1, s));
  y1 = fma_rn(x0, s, mul_rn(x1, c));
}

// Which elements of the 64-wide rope part form pair i (0..31), turned by (c, s) = (row[i],
// row[32 + i]) of the cos/sin table whatever the style: GPT-J (interleaved) pairs elements 2i and
// 2i + 1, NeoX (rotate-half) pairs elements i and i + 32.
enum class RopeStyle : uint8_t { kGptj, kNeox };

JKM_HD bool rope_is_first(RopeStyle style, int k) {  // k is x0 of its pair (else x1)
  return style == RopeStyle::kGptj ? k % 2 == 0 : k < kRope / 2;
}

// Element k of the rotated rope part from x[k], its partner x[k ^ 1] (GPT-J) or x[k ^ 32] (NeoX),
// and its pair's (c, s) = (row[i], row[32 + i]), i = k / 2 (GPT-J) or k % 32 (NeoX): y0 or y1 of
// rope_pair, the same operations as rotating the whole pair.
JKM_HD float rope_element(RopeStyle style, int k, float xk, float x_partner, float c, float s) {
  float y0, y1;
  if (rope_is_first(style, k)) {
    rope_pair(xk, x_partner, c, s, y0, y1);
    return y0;
  }
  rope_pair(x_partner, xk, c, s, y0, y1);
  return y1;
}

// ---- fp8_ds_mla tile scale: the smallest power of two >= max(amax / 448, 1e-4) ----
// Rounded up from the float32 bits (no log2f), so the quotient (x / s) is exact.
JKM_HD float ds_mla_tile_scale(float amax) {
  float r = amax / kE4m3Max;
  r = r > 1e-4f ? r : 1e-4f;
  uint32_t b = f32_bits(r);
  if ((b & 0x7FFFFFu) != 0 && b < 0x7F800000u) b = (b & 0xFF800000u) + 0x800000u;
  return f32_from_bits(b);
}

// |x| folded into a running maximum. NaN is ignored: a comparison with NaN is false. (fmaxf is
// not used: for a signalling NaN, IEEE maxNum and some libms return NaN.)
JKM_HD float amax_fold(float amax, float x) {
  const float a = fabsf(x);
  return a > amax ? a : amax;
}

// ---- Bounds: what an index may address ----

// A cache row is written only for 0 <= slot < num_rows (negative = padding, too large = skip).
JKM_HD bool slot_is_valid(int64_t slot, int64_t num_rows) { return slot >= 0 && slot < num_rows; }

// Positions are clamped into [0, max_position), as a JAX gather clamps.
JKM_HD int64_t clamp_position(int64_t pos, int64_t max_position) {
  return pos < 0 ? 0 : (pos >= max_position ? max_position - 1 : pos);
}

// slot_mapping and positions may be int32 or int64.
JKM_HD int64_t load_index(const void* base, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(base)[i]
                  : int64_t(static_cast<const int32_t*>(base)[i]);
}

}  // namespace jax_kimi_mla
