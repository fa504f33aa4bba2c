// CUDA handler of gather_mla_cache: one launch. Every block first scans the clamped lengths into
// the sequences' first output rows (shared memory, a block-wide prefix sum), then each warp
// fills output rows: it finds the row's sequence by binary search, reads the token's entry
// (lane l takes 8-element groups l, l + 32, l + 64 of the 72: all loads first, then the
// conversions and 16-byte stores) and writes zeros for masked tokens and for rows past the last
// token. The kernel is compiled per cache format, 16-bit cache type and output type, so the
// inner loop has no format branches.
#include <cuda_runtime.h>

#include <string>

#include "jax_kimi_mla/gather_cache.h"

namespace jax_kimi_mla {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kGroups = kEntry / 8;                   // 72 groups of 8 elements per row
constexpr int kGroupsPerLane = (kGroups + 31) / 32;  // 3
constexpr int64_t kMaxSharedBytes = 227 * 1024;

// The 8 values of group g of the entry at `entry` (not null), dequantized to float32.
template <CacheFormat kFormat, ActType kCache16>
__device__ __forceinline__ void load_group(const uint8_t* entry, int g, float inv_scale, Raw16& raw,
                                           float& tile_scale) {
  if constexpr (kFormat == CacheFormat::kBf16) {
    raw = load16(entry + 16 * g);
  } else if constexpr (kFormat == CacheFormat::kFp8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(entry + 8 * g));
    raw.w[0] = v.x, raw.w[1] = v.y;
    tile_scale = inv_scale;
  } else if (g < kLatent / 8) {  // ds_mla latent codes and their tile's scale
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(entry + 8 * g));
    raw.w[0] = v.x, raw.w[1] = v.y;
    tile_scale = __ldg(reinterpret_cast<const float*>(entry + kDsMlaScaleOffset) + g / 16);
  } else {  // ds_mla k_pe, bf16
    raw = load16(entry + kDsMlaPeOffset + 16 * (g - kLatent / 8));
  }
}

template <CacheFormat kFormat, ActType kCache16>
__device__ __forceinline__ void widen_group(const Raw16& raw, float tile_scale, int g, float v[8]) {
  const bool codes = kFormat == CacheFormat::kFp8 || (kFormat == CacheFormat::kFp8DsMla && g < kLatent / 8);
  if (codes) {
    for (int i = 0; i < 8; ++i) {
      const float x = e4m3_to_f32(uint8_t(raw.w[i / 4] >> (8 * (i % 4))));
      // Plain fp8: code / cache_scale_inv (tile_scale holds cache_scale_inv); ds_mla: code * scale.
      v[i] = kFormat == CacheFormat::kFp8 ? x / tile_scale : x * tile_scale;
    }
  } else {
    widen8(kFormat == CacheFormat::kBf16 ? kCache16 : ActType::kBF16, raw, v);
  }
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherCache g) {
  extern __shared__ int64_t first_row[];  // [batch + 1]: the sequences' first output rows
  __shared__ int64_t warp_sums[kWarps];
  g.out_type = kOut;
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
  const int64_t filled = first_row[g.batch];
  const float inv_scale = kFormat == CacheFormat::kFp8 ? __ldg(g.cache_scale_inv) : 1.0f;

  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + k * kWarps + warp;
    if (r >= g.num_tokens) return;
    const uint8_t* entry = nullptr;
    if (r < filled) {  // the last sequence b with first_row[b] <= r
      int64_t lo = 0, hi = g.batch - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first_row[mid] <= r) lo = mid; else hi = mid - 1;
      }
      const int64_t cache_row = g.token_row(lo, r - first_row[lo]);
      if (cache_row >= 0) entry = g.cache + cache_row * g.row_bytes;
    }
    Raw16 raw[kGroupsPerLane] = {};
    float tile_scale[kGroupsPerLane] = {};
#pragma unroll
    for (int i = 0; i < kGroupsPerLane; ++i) {
      const int group = lane + 32 * i;
      if (group < kGroups && entry != nullptr)
        load_group<kFormat, kCache16>(entry, group, inv_scale, raw[i], tile_scale[i]);
    }
#pragma unroll
    for (int i = 0; i < kGroupsPerLane; ++i) {
      const int group = lane + 32 * i;
      if (group >= kGroups) continue;
      float v[8] = {};
      if (entry != nullptr) widen_group<kFormat, kCache16>(raw[i], tile_scale[i], group, v);
      store_out8(g, r, group, v);
    }
  }
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
ffi::Error launch(cudaStream_t stream, const GatherCache& g) {
  const size_t shared = size_t(g.batch + 1) * sizeof(int64_t);
  if (int64_t(shared) > kMaxSharedBytes)
    return ffi::Error::InvalidArgument("jax_kimi_mla gather_mla_cache: too many sequences for one launch");
  auto* kernel = gather_kernel<kFormat, kCache16, kOut>;
  // Per device, as the attribute is; it queues no work, so a CUDA graph capture is unaffected.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_kimi_mla gather_mla_cache: ") + cudaGetErrorString(err));
  const int64_t blocks = (g.num_tokens + kRowsPerBlock - 1) / kRowsPerBlock;
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
