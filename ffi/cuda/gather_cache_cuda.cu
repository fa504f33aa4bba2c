// CUDA handler of gather_mla_cache: one launch, a block of kThreads threads for each kBlockRows
// consecutive output rows, as many blocks as the rows need (no grid stride).
//
// Why small blocks (H200, docs/DECODE_ATTENTION.md "Eighteenth round"): moving the gather's bytes
// (benchmarks/probes/copy_patterns.cu), a grid of small blocks that each move a contiguous piece
// and exit comes within 0-1% of a cudaMemcpy of the same total (bf16 rows: 90% of the copy ceiling
// at 64k rows, 94% at 128k, 100% at 1M), where one resident wave of blocks looping with a grid
// stride (this kernel's first form, and a bulk-copy pipeline) stays at 82-87%. Of the block shapes
// tried (4-64 rows, 3-18 groups a thread), 8 rows of 6 groups a thread (96 threads) was fastest,
// 8 rows of 9 within 0.3%.
//
// Each block:
// - finds its rows' entries in its first warp, a lane a row (warp_row_entry: the clamped lengths
//   scanned by shuffles, each row's sequence by a ballot, then the block table), with one barrier
//   after it; a block-wide scan through shared memory with three barriers was 1% slower for the
//   1-byte formats (Twentieth round) and bounded the batch by the shared memory;
// - then each thread takes kGroupsPerThread 8-element groups of the block's rows (groups kThreads
//   apart, so a warp's loads and stores cover whole runs of the output), issues all their loads
//   before any conversion, and stores them.
// The conversions are exact and skip the generic software steps where they can: 16-bit values
// are copied or widened by bit operations (a 16-bit cache into its own type is its bits with
// NaN made canonical); E4M3 codes become exact values by the sm_89+ converter, or else by bit
// placement as f16 (value * 2^-8, the factor folded into the scales); plain fp8 divides by
// cache_scale_inv without a division instruction (Markstein, gather_common.cuh). A group with a
// NaN code, an out-of-range ds_mla tile scale, or a cache_scale_inv outside the safe range instead
// takes the reference path: the CPU handler's operations one by one.
// Masked tokens and rows past the last token are zero rows; rows past num_tokens are dropped.
// The kernel is compiled per cache format, 16-bit cache type and output type, so the inner loop
// has no format branches. The conversions, the row lookup and the table of instances live in
// gather_common.cuh; benchmarks/probes/gather_cache.cu runs this kernel alone (bit for bit against
// the CPU handler, timed against a copy) without building the extension.
#include <cuda_runtime.h>

#include <string>

#include "gather_common.cuh"

namespace jax_kimi_mla {
namespace {

#ifndef JKM_GATHER_BLOCK_ROWS  // the probe's builds try other shapes
#define JKM_GATHER_BLOCK_ROWS 8
#define JKM_GATHER_GROUPS_PER_THREAD 6
#endif
constexpr int kBlockRows = JKM_GATHER_BLOCK_ROWS;
constexpr int kGroupsPerThread = JKM_GATHER_GROUPS_PER_THREAD;
constexpr int kRowGroups = kEntry / 8;  // 72 groups of 8 elements a row
constexpr int kThreads = kBlockRows * kRowGroups / kGroupsPerThread;
static_assert(kBlockRows * kRowGroups % kGroupsPerThread == 0 && kThreads % 32 == 0 && kThreads <= 1024,
              "a block's groups are whole warps' worth");

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
__global__ void __launch_bounds__(kThreads) gather_kernel(GatherCache g) {
  __shared__ const uint8_t* entries[kBlockRows];
  const int64_t row0 = int64_t(blockIdx.x) * kBlockRows;
  if (threadIdx.x < 32) {
    const uint8_t* e = warp_row_entry<kBlockRows>(g, row0);
    if (threadIdx.x < kBlockRows) entries[threadIdx.x] = e;
  }
  Fp8Divisor div;
  if constexpr (kFormat == CacheFormat::kFp8) div = Fp8Divisor::of(__ldg(g.cache_scale_inv));
  __syncthreads();

  Raw16 raw[kGroupsPerThread];
  float scale[kGroupsPerThread];  // ds_mla: the tile scale of a latent group
#pragma unroll
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int q = int(threadIdx.x) + kThreads * k, row = q / kRowGroups, group = q % kRowGroups;
    const uint8_t* e = entries[row];
    if (e == nullptr) continue;
    if constexpr (kFormat == CacheFormat::kBf16) {
      raw[k] = load16(e + 16 * group);
    } else if (kFormat == CacheFormat::kFp8DsMla && group >= kLatent / 8) {
      raw[k] = load16(e + kDsMlaPeOffset + 16 * (group - kLatent / 8));  // k_pe, bf16
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(e + 8 * group));
      raw[k].w[0] = v.x, raw[k].w[1] = v.y;
      if constexpr (kFormat == CacheFormat::kFp8DsMla)
        scale[k] = __ldg(reinterpret_cast<const float*>(e + kDsMlaScaleOffset) + group / 16);
    }
  }
#pragma unroll
  for (int k = 0; k < kGroupsPerThread; ++k) {
    const int q = int(threadIdx.x) + kThreads * k, row = q / kRowGroups, group = q % kRowGroups;
    if (row0 + row >= g.num_tokens) break;
    uint8_t* dst = group_dst<kOut>(g.out, row0 + row, group);
    if (entries[row] == nullptr) {
      store_zeros(dst, kOut == OutType::kF32);
    } else if constexpr (kFormat == CacheFormat::kBf16) {
      store_16bit<kCache16, kOut>(dst, raw[k]);
    } else if (kFormat == CacheFormat::kFp8DsMla && group >= kLatent / 8) {
      store_16bit<ActType::kBF16, kOut>(dst, raw[k]);
    } else {
      store_codes<kFormat, kOut>(dst, make_uint2(raw[k].w[0], raw[k].w[1]),
                                 kFormat == CacheFormat::kFp8DsMla ? scale[k] : 0.0f, div);
    }
  }
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
ffi::Error launch(cudaStream_t stream, const GatherCache& g) {
  const int64_t blocks = (g.num_tokens + kBlockRows - 1) / kBlockRows;
  if (blocks > 0x7FFFFFFF)
    return invalid_argument(kGatherTarget, "num_tokens is too large for one launch");
  gather_kernel<kFormat, kCache16, kOut><<<unsigned(blocks), kThreads, 0, stream>>>(g);
  return ffi::Error::Success();
}

ffi::Error handler(cudaStream_t stream, ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                   ffi::AnyBuffer cache_scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GatherCache g;
  if (ffi::Error err = make_gather_cache(cache, tables, lens, cache_scale_inv, *out, g); err.failure())
    return err;
  if (g.num_tokens == 0) return ffi::Error::Success();
  if (reinterpret_cast<uintptr_t>(g.cache) % 16 != 0 || reinterpret_cast<uintptr_t>(g.out) % 16 != 0)
    return invalid_argument(kGatherTarget, "buffers must be 16-byte aligned");
  const ffi::Error err = launch_instance(g, [&](auto format, auto cache16, auto out) {
    return launch<format.value, cache16.value, out.value>(stream, g);
  });
  if (err.failure()) return err;
  const cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? ffi::Error::Success() : internal_error(kGatherTarget, cudaGetErrorString(launched));
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jkm_cuda_gather_mla_cache, jax_kimi_mla::handler,
    JKM_GATHER_CACHE_BINDING(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
