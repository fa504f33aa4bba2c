// What the gather_mla_cache kernels share (gather_cache_cuda.cu, and the candidates that
// benchmarks/probes measures against it): the values, a cache group of 8 elements (16 bytes of a
// 16-bit cache, 8 E4M3 codes) converted exactly and stored as an output group, bit for bit what
// the CPU handler's entry_values and store_out8 give; the cache entry of an output row; and the
// table of kernel instances.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "jax_kimi_mla/gather_cache.h"

namespace jax_kimi_mla {

// The value of an E4M3 code as codes_to_f32 gives it, in units of the code's value.
#if JKM_HARDWARE_FP8
constexpr float kCodeUnit = 1.0f;
#else
constexpr float kCodeUnit = 0x1p-8f;
#endif

template <OutType kOut>
__device__ __forceinline__ uint8_t* group_dst(void* out, int64_t r, int group) {
  return static_cast<uint8_t*>(out) + (r * kEntry + 8 * group) * (kOut == OutType::kF32 ? 4 : 2);
}

// Eight float32 values stored as an output group: bf16/f16 rounded to nearest even by the pair
// converters, then NaN made canonical as bf16x2/f16x2 do, unless kNanFree says that no value can
// be a NaN (the patch would have nothing to do); f32 as they are. The store_out8 contract.
template <OutType kOut, bool kNanFree>
__device__ __forceinline__ void store_values(uint8_t* dst, const float v[8]) {
  if constexpr (kOut == OutType::kF32) {
    store16(dst, Raw16{{f32_bits(v[0]), f32_bits(v[1]), f32_bits(v[2]), f32_bits(v[3])}});
    store16(dst + 16, Raw16{{f32_bits(v[4]), f32_bits(v[5]), f32_bits(v[6]), f32_bits(v[7])}});
  } else {
    Raw16 w;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = make_float2(v[2 * i], v[2 * i + 1]);
      if constexpr (!kNanFree) {
        w.w[i] = kOut == OutType::kBF16 ? bf16x2(p.x, p.y) : f16x2(p.x, p.y);
      } else if constexpr (kOut == OutType::kBF16) {
        const __nv_bfloat162 h = __float22bfloat162_rn(p);
        w.w[i] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __half2 h = __float22half2_rn(p);
        w.w[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    store16(dst, w);
  }
}

__device__ __forceinline__ void store_zeros(uint8_t* dst, bool f32) {
  store16(dst, Raw16{});
  if (f32) store16(dst + 16, Raw16{});
}

// ---- 16-bit values (a bf16/f16 cache, ds_mla k_pe) ----

// Whether one of the 8 f16 values is a NaN (magnitude above 0x7C00: adding 0x3FF carries into the
// half's top bit).
__device__ __forceinline__ bool has_nan_f16(const Raw16& raw) {
  const uint32_t any = ((raw.w[0] & 0x7FFF7FFFu) + 0x03FF03FFu) | ((raw.w[1] & 0x7FFF7FFFu) + 0x03FF03FFu) |
                       ((raw.w[2] & 0x7FFF7FFFu) + 0x03FF03FFu) | ((raw.w[3] & 0x7FFF7FFFu) + 0x03FF03FFu);
  return (any & 0x80008000u) != 0;
}

template <ActType kCache16, OutType kOut>
__device__ __forceinline__ void store_16bit(uint8_t* dst, const Raw16& raw) {
  constexpr bool kSameType = kOut == (kCache16 == ActType::kBF16 ? OutType::kBF16 : OutType::kF16);
  if constexpr (kSameType) {
    // Widening is exact and narrowing it back gives the same bits, except NaN (canonical).
    const uint32_t inf = kCache16 == ActType::kBF16 ? 0x7F80u : 0x7C00u;
    const uint32_t nan = kCache16 == ActType::kBF16 ? kBf16NaN : kF16NaN;
    Raw16 w;
#pragma unroll
    for (int i = 0; i < 4; ++i) w.w[i] = canonical_nan_halves(raw.w[i], inf, nan);
    store16(dst, w);
  } else {
    float v[8];
    if constexpr (kCache16 == ActType::kBF16) {
      widen8(ActType::kBF16, raw, v);  // shifts
    } else if (kOut == OutType::kF32 && has_nan_f16(raw)) {
      widen8(ActType::kF16, raw, v);  // the bit path keeps NaN payloads, as the f32 output copies them
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // exact, subnormals included; NaN is made canonical by the store
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw.w[i]));
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
      }
    }
    store_values<kOut, false>(dst, v);
  }
}

// ---- E4M3 codes ----

// Whether one of the 8 codes is a NaN.
__device__ __forceinline__ bool has_nan_code(uint2 c) {
  return ((e4m3_nan_bits(c.x) | e4m3_nan_bits(c.y)) & 0x80808080u) != 0;
}

// Eight codes (the first in the lowest byte) as float32 values, code value * kCodeUnit exactly;
// NaN codes are not handled (their groups take the reference path). sm_89+: the hardware pair
// converter to f16 (exact); otherwise the codes placed as f16 values * 2^-8 (e4m3x2_placed_f16x2).
// f16 to float32 is exact.
__device__ __forceinline__ void codes_to_f32(uint2 c, float x[8]) {
  const uint32_t w[2] = {c.x, c.y};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
#if JKM_HARDWARE_FP8
      const uint32_t h = p == 0 ? e4m3x2_half_to_f16x2<0>(w[k]) : e4m3x2_half_to_f16x2<1>(w[k]);
#else
      // The codes in the halves' high bytes.
      const uint32_t h = e4m3x2_placed_f16x2(__byte_perm(w[k], 0, p == 0 ? 0x1404 : 0x3424));
#endif
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      x[4 * k + 2 * p] = f.x, x[4 * k + 2 * p + 1] = f.y;
    }
  }
}

// The reference path of a group of codes, GatherCache::value's operations: the software decoder,
// then code / cache_scale_inv (a true division) for plain fp8, code * tile scale for ds_mla.
// Rare (NaN codes, odd scales), so out of line: it keeps the hot loop's registers and code small.
template <CacheFormat kFormat, OutType kOut>
__device__ __noinline__ void store_codes_reference(uint8_t* dst, uint2 c, float scale) {
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = e4m3_to_f32(uint8_t((i < 4 ? c.x : c.y) >> (8 * (i % 4))));
    v[i] = kFormat == CacheFormat::kFp8 ? x / scale : mul_rn(x, scale);
  }
  store_values<kOut, false>(dst, v);
}

// Plain fp8: code / s, correctly rounded, without a division. With x = code * kCodeUnit,
// d = s * kCodeUnit and y = RN(1 / d): q0 = RN(x y), r = x - q0 d (exact, by the FMA),
// q = RN(q0 + r y) = RN(x / d) = RN(code / s) (Markstein's theorem; checked against true division
// for all codes and all significands of d). It needs nothing to underflow or overflow: x is 0 or in
// [2^-17, 448], so 2^-100 < |d| < 2^100 (`fast`) is enough; otherwise every group takes the
// reference path. A zero code gives r = +0 and thus q = +0 where q0 = -0: q takes q0's sign (for a
// nonzero quotient they agree already). Where d is a power of two (a scale of 1.0, say), y is exact
// and so is q0 = x y, normal for every code: q = q0, one multiply (`pow2`).
struct Fp8Divisor {
  float s = 1.0f, d = 1.0f, y = 1.0f;
  bool fast = true, pow2 = false;

  __device__ static Fp8Divisor of(float cache_scale_inv) {
    Fp8Divisor div;
    div.s = cache_scale_inv;
    div.d = kCodeUnit == 1.0f ? div.s : __fmul_rn(div.s, kCodeUnit);
    div.y = __frcp_rn(div.d);
    div.fast = fabsf(div.d) > 0x1p-100f && fabsf(div.d) < 0x1p100f;
    div.pow2 = div.fast && (__float_as_uint(div.d) & 0x007FFFFFu) == 0;  // normal: no mantissa bits
    return div;
  }
};

template <CacheFormat kFormat, OutType kOut>
__device__ __forceinline__ void store_codes(uint8_t* dst, uint2 c, float tile_scale, const Fp8Divisor& div) {
  float x[8];
  if constexpr (kFormat == CacheFormat::kFp8) {
    if (!div.fast || has_nan_code(c)) return store_codes_reference<kFormat, kOut>(dst, c, div.s);
    codes_to_f32(c, x);
    if (div.pow2) {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(x[i], div.y);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float q0 = __fmul_rn(x[i], div.y);
        const float q = __fmaf_rn(__fmaf_rn(-q0, div.d, x[i]), div.y, q0);
        x[i] = __uint_as_float(__float_as_uint(q) | (__float_as_uint(q0) & 0x80000000u));
      }
    }
  } else {
    // code * tile_scale = x * (tile_scale / kCodeUnit): the same exact product, one rounding, when
    // tile_scale / kCodeUnit is finite; |tile_scale| < 2^120 also keeps the result NaN-free.
    if (has_nan_code(c) || !(fabsf(tile_scale) < 0x1p120f))
      return store_codes_reference<kFormat, kOut>(dst, c, tile_scale);
    codes_to_f32(c, x);
    const float m = kCodeUnit == 1.0f ? tile_scale : __fmul_rn(tile_scale, 1.0f / kCodeUnit);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(x[i], m);
  }
  store_values<kOut, true>(dst, x);
}

// ---- rows ----

// Lane i < kRows of a warp: the cache entry of output row row0 + i, or null for a masked token, a
// row past the last token or past num_tokens (the other lanes get null). The clamped lengths are
// scanned 32 sequences at a time in registers: a shuffle scan gives each sequence's end row, and a
// row's sequence is the count of sequences that end at or before it (a ballot). No shared memory
// and no barrier, so any batch size fits. Every lane of the warp calls it.
template <int kRows>
__device__ __forceinline__ const uint8_t* warp_row_entry(const GatherCache& g, int64_t row0) {
  static_assert(kRows <= 32, "a lane a row");
  const int lane = int(threadIdx.x) % 32;
  int64_t carry = 0, seq = -1, start = 0;  // carry: the rows of the chunks before
  for (int64_t base = 0; base < g.batch && carry < row0 + kRows; base += 32) {
    const int64_t b = base + lane;
    int64_t end = b < g.batch ? g.context_len(b) : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t y = __shfl_up_sync(0xFFFFFFFFu, end, offset);
      if (lane >= offset) end += y;
    }
    end += carry;
    int before = 0;  // for lane i: this chunk's sequences that end at or before row row0 + i
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const unsigned ended = __ballot_sync(0xFFFFFFFFu, b < g.batch && end <= row0 + i);
      if (lane == i) before = __popc(ended);
    }
    const int64_t previous_end = __shfl_sync(0xFFFFFFFFu, end, before > 0 ? before - 1 : 0);
    const int64_t chunk = g.batch - base < 32 ? g.batch - base : 32;
    if (seq < 0 && before < chunk) seq = base + before, start = before > 0 ? previous_end : carry;
    carry = __shfl_sync(0xFFFFFFFFu, end, 31);
  }
  const int64_t row = row0 + lane;
  if (lane >= kRows || seq < 0 || row >= g.num_tokens) return nullptr;
  const int64_t cache_row = g.token_row(seq, row - start);
  return cache_row >= 0 ? g.cache + cache_row * g.row_bytes : nullptr;
}

// ---- the kernel instance of a call ----

template <auto kValue>
using Tag = std::integral_constant<decltype(kValue), kValue>;

// launch(format, 16-bit cache type, output type), each a Tag, for g's: the instances a gather
// kernel is compiled for (the 16-bit cache type is bf16 for the 1-byte formats).
template <typename Launch>
ffi::Error launch_instance(const GatherCache& g, Launch&& launch) {
  const auto with_out = [&](auto format, auto cache16) {
    switch (g.out_type) {
      case OutType::kBF16: return launch(format, cache16, Tag<OutType::kBF16>{});
      case OutType::kF16: return launch(format, cache16, Tag<OutType::kF16>{});
      case OutType::kF32: return launch(format, cache16, Tag<OutType::kF32>{});
    }
    return internal_error(kGatherTarget, "unknown output type");
  };
  switch (g.cache_format) {
    case CacheFormat::kBf16:
      return g.cache16 == ActType::kBF16 ? with_out(Tag<CacheFormat::kBf16>{}, Tag<ActType::kBF16>{})
                                         : with_out(Tag<CacheFormat::kBf16>{}, Tag<ActType::kF16>{});
    case CacheFormat::kFp8: return with_out(Tag<CacheFormat::kFp8>{}, Tag<ActType::kBF16>{});
    case CacheFormat::kFp8DsMla: return with_out(Tag<CacheFormat::kFp8DsMla>{}, Tag<ActType::kBF16>{});
  }
  return internal_error(kGatherTarget, "unknown cache format");
}

}  // namespace jax_kimi_mla
