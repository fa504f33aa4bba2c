// CUDA handler of gather_mla_cache: one launch of at most one wave of resident blocks, each
// covering many rows (grid stride), so that the per-block prefix scan is paid once per block.
//
// Every block first scans the clamped lengths into the sequences' first output rows (shared
// memory, a block-wide prefix sum). Then each warp fills batches of kRows consecutive output rows:
// - Lanes 0..kRows-1 find their row's entry (binary search for the sequence, then the block
//   table); the next batch's entries are looked up while the current batch's loads are in flight.
// - All loads of the batch are issued before any conversion (more bytes in flight): lane l takes
//   8-element groups l and l + 32 of every row (16 bytes of a 16-bit cache, 8 E4M3 codes) and
//   group 64 + l % 8 of row l / 8 (+ 4) (ds_mla: the bf16 k_pe), so that each store instruction
//   of a warp writes whole runs of a row.
// - The conversions are exact and skip the generic software steps where they can: 16-bit values
//   are copied or widened by bit operations (a 16-bit cache into its own type is its bits with
//   NaN made canonical); E4M3 codes become exact values by the sm_89+ converter, or else by bit
//   placement as f16 (value * 2^-8, the factor folded into the scales); plain fp8 divides by
//   cache_scale_inv without a division instruction (Markstein, below). A group with a NaN code,
//   an out-of-range ds_mla tile scale, or a cache_scale_inv outside the safe range instead takes
//   the reference path: the CPU handler's operations one by one.
// Masked tokens and rows past the last token are zero rows; rows past num_tokens are dropped.
// The kernel is compiled per cache format, 16-bit cache type and output type, so the inner loop
// has no format branches.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "jax_kimi_mla/gather_cache.h"

namespace jax_kimi_mla {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMinBlocksPerSm = 4;  // at most 64 registers: 32 warps per SM keep the loads flowing
constexpr int kMainGroups = 64;     // groups 0..63 of a row: lanes l and l + 32; ds_mla: the latent
constexpr int64_t kMaxSharedBytes = 227 * 1024;

// Rows per warp batch; the 8 tail groups (64..71) of the 4 rows are one load per lane (group
// 64 + lane % 8 of row lane / 8). A lane has
// 144 bytes of loads in flight per batch with a 16-bit cache (9 loads of 16 bytes), 72 with plain
// fp8 (9 of 8 codes), 112 with ds_mla (8 of codes, their 8 tile scales, one of k_pe). Measured on
// the H200 (benchmarks/bench_attention.py --only gather): 8 rows for plain fp8 was no faster (its
// 64 registers then spill), 8 rows with 128 registers neither.
constexpr int kRows = 4;
static_assert(kRows * 8 == 32, "a batch's tail groups are one per lane");

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
      const uint32_t h = e4m3x2_to_f16x2(uint16_t(w[k] >> (16 * p)));
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

// The entry of output row r, or null for a masked token, a row past the last token or past
// num_tokens. `filled`: the rows that hold tokens.
__device__ __forceinline__ const uint8_t* row_entry(const GatherCache& g, const int64_t* first_row,
                                                    int64_t filled, int64_t r) {
  if (r >= filled) return nullptr;
  int64_t lo = 0, hi = g.batch - 1;  // the last sequence b with first_row[b] <= r
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_row[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int64_t cache_row = g.token_row(lo, r - first_row[lo]);
  return cache_row >= 0 ? g.cache + cache_row * g.row_bytes : nullptr;
}

__device__ __forceinline__ const uint8_t* shfl_entry(const uint8_t* e, int src) {
  return reinterpret_cast<const uint8_t*>(
      __shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(e), src));
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) gather_kernel(GatherCache g) {
  constexpr bool kCodes = kFormat != CacheFormat::kBf16;
  extern __shared__ int64_t first_row[];  // [batch + 1]: the sequences' first output rows
  __shared__ int64_t warp_sums[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // The block-wide prefix sum of the clamped lengths, 256 sequences at a time.
  int64_t carry = 0;
  for (int64_t base = 0; base < g.batch; base += kThreads) {
    const int64_t b = base + threadIdx.x;
    int64_t x = b < g.batch ? g.context_len(b) : 0;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int64_t y = __shfl_up_sync(0xFFFFFFFFu, x, offset);
      if (lane >= offset) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    int64_t before = carry, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_sums[w] : 0;
      total += warp_sums[w];
    }
    if (b < g.batch) first_row[b + 1] = before + x;
    __syncthreads();
    carry += total;
  }
  if (threadIdx.x == 0) first_row[0] = 0;
  __syncthreads();
  const int64_t filled = min(first_row[g.batch], g.num_tokens);

  Fp8Divisor div;
  if constexpr (kFormat == CacheFormat::kFp8) {
    div.s = __ldg(g.cache_scale_inv);
    div.d = kCodeUnit == 1.0f ? div.s : __fmul_rn(div.s, kCodeUnit);
    div.y = __frcp_rn(div.d);
    div.fast = fabsf(div.d) > 0x1p-100f && fabsf(div.d) < 0x1p100f;
    div.pow2 = div.fast && (__float_as_uint(div.d) & 0x007FFFFFu) == 0;  // normal: no mantissa bits
  }

  const int64_t stride = int64_t(gridDim.x) * kWarps;
  int64_t batch = int64_t(blockIdx.x) * kWarps + warp;
  const uint8_t* entry = lane < kRows ? row_entry(g, first_row, filled, batch * kRows + lane) : nullptr;
  for (; batch * kRows < g.num_tokens; batch += stride) {
    const int64_t base = batch * kRows;
    const unsigned live = __ballot_sync(0xFFFFFFFFu, entry != nullptr);  // bit i: row base + i reads
    Raw16 main[2 * kRows], tail;
    float scale[2 * kRows];  // ds_mla: the tile scale of each main group
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const uint8_t* e = shfl_entry(entry, i);
      if (e == nullptr) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int group = lane + 32 * h;
        if constexpr (kCodes) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(e + 8 * group));
          main[2 * i + h].w[0] = v.x, main[2 * i + h].w[1] = v.y;
          if constexpr (kFormat == CacheFormat::kFp8DsMla)
            scale[2 * i + h] = __ldg(reinterpret_cast<const float*>(e + kDsMlaScaleOffset) + group / 16);
        } else {
          main[2 * i + h] = load16(e + 16 * group);
        }
      }
    }
    const int tail_row = lane / 8, tail_group = kMainGroups + lane % 8;
    if (const uint8_t* e = shfl_entry(entry, tail_row); e != nullptr) {
      if constexpr (kFormat == CacheFormat::kFp8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(e + 8 * tail_group));
        tail.w[0] = v.x, tail.w[1] = v.y;
      } else if constexpr (kFormat == CacheFormat::kFp8DsMla) {
        tail = load16(e + kDsMlaPeOffset + 16 * (tail_group - kMainGroups));
      } else {
        tail = load16(e + 16 * tail_group);
      }
    }
    // The next batch's entries, while this batch's loads are in flight.
    entry = lane < kRows ? row_entry(g, first_row, filled, (batch + stride) * kRows + lane) : nullptr;

#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = base + i;
      if (r >= g.num_tokens) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint8_t* dst = group_dst<kOut>(g.out, r, lane + 32 * h);
        if (!(live >> i & 1u)) {
          store_zeros(dst, kOut == OutType::kF32);
        } else if constexpr (kCodes) {
          store_codes<kFormat, kOut>(dst, make_uint2(main[2 * i + h].w[0], main[2 * i + h].w[1]),
                                     kFormat == CacheFormat::kFp8DsMla ? scale[2 * i + h] : 0.0f, div);
        } else {
          store_16bit<kCache16, kOut>(dst, main[2 * i + h]);
        }
      }
    }
    if (base + tail_row < g.num_tokens) {
      uint8_t* dst = group_dst<kOut>(g.out, base + tail_row, tail_group);
      if (!(live >> tail_row & 1u))
        store_zeros(dst, kOut == OutType::kF32);
      else if constexpr (kFormat == CacheFormat::kFp8)
        store_codes<kFormat, kOut>(dst, make_uint2(tail.w[0], tail.w[1]), 0.0f, div);
      else  // ds_mla k_pe is bf16
        store_16bit<kFormat == CacheFormat::kBf16 ? kCache16 : ActType::kBF16, kOut>(dst, tail);
    }
  }
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
ffi::Error launch(cudaStream_t stream, const GatherCache& g) {
  const auto cuda_error = [](cudaError_t err) {
    return ffi::Error::Internal(std::string("jax_kimi_mla gather_mla_cache: ") + cudaGetErrorString(err));
  };
  const size_t shared = size_t(g.batch + 1) * sizeof(int64_t);
  if (int64_t(shared) > kMaxSharedBytes)
    return ffi::Error::InvalidArgument("jax_kimi_mla gather_mla_cache: too many sequences for one launch");
  auto* kernel = gather_kernel<kFormat, kCache16, kOut>;
  // Per device, as the attribute is; it queues no work, so a CUDA graph capture is unaffected.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  // One wave: the blocks that fit on the GPU at once, each taking every stride-th batch.
  int device = 0, sms = 0, per_sm = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared);
  if (err != cudaSuccess) return cuda_error(err);
  const int64_t batches = (g.num_tokens + kRows - 1) / kRows;
  const int64_t wave = int64_t(sms) * (per_sm > 0 ? per_sm : 1);
  const int64_t blocks = std::min((batches + kWarps - 1) / kWarps, wave);
  kernel<<<unsigned(blocks), kThreads, shared, stream>>>(g);
  return ffi::Error::Success();
}

template <CacheFormat kFormat, ActType kCache16>
ffi::Error launch_out(cudaStream_t stream, const GatherCache& g) {
  switch (g.out_type) {
    case OutType::kBF16: return launch<kFormat, kCache16, OutType::kBF16>(stream, g);
    case OutType::kF16: return launch<kFormat, kCache16, OutType::kF16>(stream, g);
    case OutType::kF32: return launch<kFormat, kCache16, OutType::kF32>(stream, g);
  }
  return ffi::Error::Internal("jax_kimi_mla gather_mla_cache: unknown output type");
}

ffi::Error handler(cudaStream_t stream, ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                   ffi::AnyBuffer cache_scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GatherCache g;
  if (ffi::Error err = make_gather_cache(cache, tables, lens, cache_scale_inv, *out, g); err.failure())
    return err;
  if (g.num_tokens == 0) return ffi::Error::Success();
  if (reinterpret_cast<uintptr_t>(g.cache) % 16 != 0 || reinterpret_cast<uintptr_t>(g.out) % 16 != 0)
    return ffi::Error::InvalidArgument("jax_kimi_mla gather_mla_cache: buffers must be 16-byte aligned");
  ffi::Error err = ffi::Error::Success();
  switch (g.cache_format) {
    case CacheFormat::kBf16:
      err = g.cache16 == ActType::kBF16 ? launch_out<CacheFormat::kBf16, ActType::kBF16>(stream, g)
                                        : launch_out<CacheFormat::kBf16, ActType::kF16>(stream, g);
      break;
    case CacheFormat::kFp8: err = launch_out<CacheFormat::kFp8, ActType::kBF16>(stream, g); break;
    case CacheFormat::kFp8DsMla: err = launch_out<CacheFormat::kFp8DsMla, ActType::kBF16>(stream, g); break;
  }
  if (err.failure()) return err;
  const cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess
             ? ffi::Error::Success()
             : ffi::Error::Internal(std::string("jax_kimi_mla gather_mla_cache: ") + cudaGetErrorString(launched));
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jkm_cuda_gather_mla_cache, jax_kimi_mla::handler,
    JKM_GATHER_CACHE_BINDING(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
