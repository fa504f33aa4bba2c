// CUDA handlers: one launch per call. Each thread owns one 8-element chunk of one row; a token's
// chunks are laid out as [72 cache-entry lanes | heads x head-row lanes | pad to 16], so the 16
// lanes of a ds_mla scale tile always share a half warp and reduce their amax by shuffles.
// The grid is (chunk tiles of a token) x (tokens, split over y and z): no division by T.
#include <cuda_runtime.h>

#include <algorithm>

#include "jax_kimi_mla/ffi_plan.h"

namespace jax_kimi_mla {
namespace {

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// Every lane reads its inputs before it knows whether its token's slot is valid: the input loads
// and the slot_mapping load are then in flight together (a skipped row costs a wasted read only).
__device__ void ds_mla_lane(const Epilogue& e, int64_t t, int64_t row, int lane, const float* rope_row) {
  if (lane >= kLatent / kChunk) {
    const int j = lane - kLatent / kChunk;
    const Raw16 pe = make_ds_mla_pe(e, t, j, rope_row);
    if (row >= 0) store_ds_mla_pe(ds_mla_entry(e, row), j, pe);
    return;
  }
  float v[kChunk];
  chunk_values(e, e.cache, t, 0, lane, nullptr, v);
  float amax = 0.0f;
  for (float x : v) amax = amax_fold(amax, x);
  const unsigned tile_mask = 0xFFFFu << (threadIdx.x & 16);  // the 16 lanes of this tile
  for (int offset = kTileChunks / 2; offset > 0; offset /= 2)
    amax = amax_fold(amax, __shfl_xor_sync(tile_mask, amax, offset, kTileChunks));
  if (row < 0) return;  // uniform over the token, so after the shuffles
  const float s = ds_mla_tile_scale(amax);
  uint8_t* entry = ds_mla_entry(e, row);
  store_ds_mla_latent(entry, lane, v, s);
  if (lane % kTileChunks == 0) store_ds_mla_scale(entry, lane / kTileChunks, s);
}

__global__ void __launch_bounds__(kMaxThreads) epilogue_kernel(const Epilogue e, int lanes_per_token) {
  const int64_t t = int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
  const int lane = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= e.tokens || lane >= lanes_per_token) return;
  const float* rope_row = e.rope_row(t);
  if (lane < kCacheChunks) {
    const int64_t row = e.cache_row(t);
    if (e.cache_format == CacheFormat::kDsMla) {
      ds_mla_lane(e, t, row, lane, rope_row);
    } else {
      const Raw16 chunk = make_chunk(e, e.cache, t, 0, lane, rope_row);
      if (row >= 0) store_chunk(e.cache, row * e.cache.out_t, lane, chunk);
    }
    return;
  }
  const int head_chunks = e.head_chunks();
  const int head_lane = lane - kCacheChunks;  // < lanes_per_token: 32-bit division suffices
  if (head_chunks == 0 || head_lane >= e.heads * head_chunks) return;
  const int h = head_lane / head_chunks;
  int c = head_lane - h * head_chunks;
  for (int r = 0; r < e.num_head_rows; ++r) {
    const RowSpec& spec = e.head_rows[r];
    if (c < spec.chunks()) {
      store_chunk(spec, t * spec.out_t + h * spec.out_h, c, make_chunk(e, spec, t, h, c, rope_row));
      return;
    }
    c -= spec.chunks();
  }
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
    const int threads = int(std::min<int64_t>(kMaxThreads, (lanes + 31) / 32 * 32));
    const int64_t tiles = (lanes + threads - 1) / threads;
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
