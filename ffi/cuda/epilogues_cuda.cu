// CUDA handlers: one launch per call. A lane is one 8-element chunk of one row; a token's lanes
// are laid out as [72 cache-entry lanes | heads x head-row lanes | pad to 16], so the 16 lanes of a
// ds_mla scale tile always share a half warp and reduce their amax by shuffles. Each thread owns
// kLanesPerThread lanes and issues all their loads before its stores. The grid is (lane tiles of
// a token) x (tokens, split over y and z): no division by T.
#include <cuda_runtime.h>

#include <algorithm>

#include "jax_kimi_mla/ffi_plan.h"

namespace jax_kimi_mla {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kLanesPerThread = 2;  // two chunks in flight per thread
constexpr int64_t kMaxGridY = 65535;

// A chunk ready to be stored: computed first, stored after all of a thread's loads are issued.
struct PendingChunk {
  void* dst = nullptr;  // null: nothing to store (padding lane, skipped slot, done in place)
  Raw16 data;
  bool e4m3 = false;
};

// The latent lanes of a ds_mla entry: the 16 lanes of a tile (a half warp) share their amax by
// shuffles and store directly. Lanes of a skipped slot still take part (uniform per token).
__device__ void ds_mla_latent_lane(const Epilogue& e, int64_t t, int64_t row, int lane) {
  float v[kChunk];
  chunk_values(e, e.cache, t, 0, lane, v);
  float amax = 0.0f;
  for (float x : v) amax = amax_fold(amax, x);
  const unsigned tile_mask = 0xFFFFu << (threadIdx.x & 16);
  for (int offset = kTileChunks / 2; offset > 0; offset /= 2)
    amax = amax_fold(amax, __shfl_xor_sync(tile_mask, amax, offset, kTileChunks));
  if (row < 0) return;
  const float s = ds_mla_tile_scale(amax);
  uint8_t* entry = ds_mla_entry(e, row);
  store_ds_mla_latent(entry, lane, v, s);
  if (lane % kTileChunks == 0) store_ds_mla_scale(entry, lane / kTileChunks, s);
}

// Lane `lane` of token t: its chunk and destination. Inputs are read before the slot is known
// to be valid, so the slot_mapping load and the input loads are in flight together.
__device__ PendingChunk prepare_lane(const Epilogue& e, int64_t t, int lane) {
  PendingChunk p;
  if (lane < kCacheChunks) {
    const int64_t row = e.cache_row(t);
    if (e.cache_format == CacheFormat::kDsMla) {
      if (lane < kLatent / kChunk) {
        ds_mla_latent_lane(e, t, row, lane);
      } else {
        p.data = make_ds_mla_pe(e, t, lane - kLatent / kChunk);
        if (row >= 0) p.dst = ds_mla_pe_dst(ds_mla_entry(e, row), lane - kLatent / kChunk);
      }
      return p;
    }
    p.data = make_chunk(e, e.cache, t, 0, lane);
    p.e4m3 = e.cache.scale_inv != nullptr;
    if (row >= 0) p.dst = chunk_dst(e.cache, row * e.cache.out_t, lane);
    return p;
  }
  const int head_chunks = e.head_chunks();
  const int head_lane = lane - kCacheChunks;  // < lanes_per_token: 32-bit division suffices
  if (head_chunks == 0 || head_lane >= e.heads * head_chunks) return p;
  const int h = head_lane / head_chunks;
  int c = head_lane - h * head_chunks;
  for (int r = 0; r < e.num_head_rows; ++r) {
    const RowSpec& spec = e.head_rows[r];
    if (c < spec.chunks()) {
      p.data = make_chunk(e, spec, t, h, c);
      p.e4m3 = spec.scale_inv != nullptr;
      p.dst = chunk_dst(spec, t * spec.out_t + h * spec.out_h, c);
      return p;
    }
    c -= spec.chunks();
  }
  return p;
}

// Block (x, y, z) covers lanes [x * kLanesPerThread * blockDim.x, ...) of token y + z * gridDim.y;
// thread i takes lanes i, i + blockDim.x, ... of that range.
__global__ void __launch_bounds__(kMaxThreads) epilogue_kernel(const Epilogue e, int lanes_per_token) {
  const int64_t t = int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
  if (t >= e.tokens) return;
  const int first = blockIdx.x * blockDim.x * kLanesPerThread + threadIdx.x;
  PendingChunk pending[kLanesPerThread];
#pragma unroll
  for (int k = 0; k < kLanesPerThread; ++k) {
    const int lane = first + k * blockDim.x;
    if (lane < lanes_per_token) pending[k] = prepare_lane(e, t, lane);
  }
#pragma unroll
  for (int k = 0; k < kLanesPerThread; ++k)
    if (pending[k].dst != nullptr) store_chunk(pending[k].dst, pending[k].data, pending[k].e4m3);
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_kimi_mla: ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error run(cudaStream_t stream, const Plan& plan) {
  for (int i = 0; i < plan.num_copies; ++i) {
    const Copy& c = plan.copies[i];
    cudaError_t err = cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return cuda_error("copying an un-aliased output", err);
  }
  const Epilogue& e = plan.e;
  if (e.tokens > 0) {
    const int64_t lanes = plan.lanes_per_token();
    // At least 64 threads, so a ds_mla entry's 64 latent lanes are all first lanes of block 0.
    const int64_t per_thread = (lanes + kLanesPerThread - 1) / kLanesPerThread;
    const int threads = int(std::clamp<int64_t>((per_thread + 31) / 32 * 32, 64, kMaxThreads));
    const int64_t tiles = (lanes + threads * kLanesPerThread - 1) / (threads * kLanesPerThread);
    const int64_t grid_y = std::min(e.tokens, kMaxGridY);
    const int64_t grid_z = (e.tokens + grid_y - 1) / grid_y;
    if (lanes > INT32_MAX || grid_z > kMaxGridY)
      return ffi::Error::InvalidArgument("jax_kimi_mla: problem too large for one launch");
    epilogue_kernel<<<dim3(unsigned(tiles), unsigned(grid_y), unsigned(grid_z)), threads, 0, stream>>>(
        e, int(lanes));
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("kernel launch", err);
}

template <Op op>
ffi::Error handler(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  Plan plan;
  if (ffi::Error err = make_plan(op, args, rets, attrs, plan); err.failure()) return err;
  return run(stream, plan);
}

}  // namespace
}  // namespace jax_kimi_mla

#define JKM_CUDA_HANDLER(name)                                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      jkm_cuda_##name, jax_kimi_mla::handler<jax_kimi_mla::Op::name>,                        \
      xla::ffi::Ffi::Bind()                                                                  \
          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                     \
          .RemainingArgs()                                                                   \
          .RemainingRets()                                                                   \
          .Attrs(),                                                                  \
      {xla::ffi::Traits::kCmdBufferCompatible});
JKM_FOR_EACH_OP(JKM_CUDA_HANDLER)
