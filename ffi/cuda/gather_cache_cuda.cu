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
// has no format branches. The conversions, the prefix scan and the table of instances live in
// gather_common.cuh; benchmarks/probes/gather_cache.cu runs this kernel alone (bit for bit against
// the CPU handler, timed against a copy) without building the extension.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "gather_common.cuh"

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

  first_rows<kWarps>(g, first_row, warp_sums);
  const int64_t filled = min(first_row[g.batch], g.num_tokens);

  Fp8Divisor div;
  if constexpr (kFormat == CacheFormat::kFp8) div = Fp8Divisor::of(__ldg(g.cache_scale_inv));

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

ffi::Error handler(cudaStream_t stream, ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                   ffi::AnyBuffer cache_scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GatherCache g;
  if (ffi::Error err = make_gather_cache(cache, tables, lens, cache_scale_inv, *out, g); err.failure())
    return err;
  if (g.num_tokens == 0) return ffi::Error::Success();
  if (reinterpret_cast<uintptr_t>(g.cache) % 16 != 0 || reinterpret_cast<uintptr_t>(g.out) % 16 != 0)
    return ffi::Error::InvalidArgument("jax_kimi_mla gather_mla_cache: buffers must be 16-byte aligned");
  const ffi::Error err = launch_instance(g, [&](auto format, auto cache16, auto out) {
    return launch<format.value, cache16.value, out.value>(stream, g);
  });
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
