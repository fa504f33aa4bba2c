// CUDA handlers: one launch per call. A lane is one 8-element chunk of one output row; a token's
// lanes are [72 cache-entry lanes | head row 0 of every head | head row 1 of every head | ...].
// A block covers lanes of one token, so its slot, position and cos/sin row are block-wide. The
// kernel is compiled per op, RoPE off / GPT-J / NeoX and activation dtype, so each lane's place
// is constant arithmetic. With NeoX, pe lane j < 4 of a row owns pe chunks j and j + 4 (its
// pairs' two halves: it loads both, then stores both, so a row rotated in place is never read
// after another thread wrote it); lanes j >= 4 are idle. Each thread owns kLanesPerThread lanes
// and runs in three phases: all loads, then the cos/sin row into shared memory, then the
// arithmetic and stores, so no load waits on another lane's work. The 16 lanes of a ds_mla
// scale tile are one half warp (threads 0..63 of a token's first block) and reduce their amax
// by shuffles.
#include <cuda_runtime.h>

#include <algorithm>

#include "jax_kimi_mla/ffi_plan.h"

namespace jax_kimi_mla {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kLanesPerThread = 2;
constexpr int64_t kMaxGridY = 65535;

// Where one lane reads and writes. dst is null when nothing is stored (a skipped slot); for a
// ds_mla cache lane it is the entry itself.
struct Lane {
  const uint16_t* src = nullptr;  // null: no lane here
  void* dst = nullptr;
  bool in_cache = false;  // a lane of the cache entry, not of a head row
  int chunk = 0;  // the chunk within its row
  int pe = -1;    // the pe chunk index (0..7), or -1 for a nope chunk
  const float* scale_inv = nullptr;  // set when the row is stored as E4M3
  // NeoX RoPE: the lane's second chunk, pe chunk pe + 4 of the same row, and where it goes.
  const uint16_t* partner = nullptr;
  void* partner_dst = nullptr;
};

// NeoX RoPE: pe lane j < 4 takes pe chunk j + 4 too (a row's pe chunks are contiguous in its
// source and in its output: `byte_dst` says whether the output holds 1-byte elements); lane
// j >= 4 has nothing left to do.
template <bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ void locate_partner(Lane& l, bool byte_dst) {
  if constexpr (kRopeOn && kStyle == RopeStyle::kNeox) {
    if (l.pe < 0) return;
    if (l.pe >= kNeoxPartnerChunk) {
      l.src = nullptr, l.dst = nullptr;
      return;
    }
    constexpr int kAhead = kNeoxPartnerChunk * kChunk;  // elements
    l.partner = l.src + kAhead;
    if (l.dst != nullptr)
      l.partner_dst = byte_dst ? static_cast<void*>(static_cast<uint8_t*>(l.dst) + kAhead)
                               : static_cast<void*>(static_cast<uint16_t*>(l.dst) + kAhead);
  }
}

// Lane `rest` of head rows r, r + 1, ...: row r holds heads x chunks lanes. Recursion over r
// keeps each row's shape a compile-time constant.
template <Op op, bool kRopeOn, RopeStyle kStyle, int r>
__device__ __forceinline__ void locate_in_head_row(const Epilogue& e, int64_t t, int rest, Lane& l) {
  if constexpr (r < op_shape(op, kRopeOn).num_rows) {
    constexpr RowShape shape = op_shape(op, kRopeOn).rows[r];
    const int row_lanes = int(e.heads) * shape.chunks();
    if (rest >= row_lanes)
      return locate_in_head_row<op, kRopeOn, kStyle, r + 1>(e, t, rest - row_lanes, l);
    const RowSpec& spec = e.head_rows[r];
    const int h = rest / shape.chunks(), c = rest - h * shape.chunks();
    l.chunk = c;
    l.pe = c - shape.nope_chunks;
    // chunk_src and chunk_dst, with the nope/pe split and the output width known at compile time.
    l.src = l.pe < 0 ? spec.nope + chunk_elem(t, spec.nope_t, h, spec.nope_h, c)
                     : spec.pe + chunk_elem(t, spec.pe_t, h, spec.pe_h, l.pe);
    const int64_t out = chunk_elem(t, spec.out_t, h, spec.out_h, c);
    l.dst = shape.fp8 ? static_cast<void*>(static_cast<uint8_t*>(spec.out) + out)
                      : static_cast<void*>(static_cast<uint16_t*>(spec.out) + out);
    if (shape.fp8) l.scale_inv = spec.scale_inv;
    locate_partner<kRopeOn, kStyle>(l, shape.fp8);
  }
}

template <Op op, bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ Lane locate(const Epilogue& e, int64_t t, int64_t slot_row, int lane) {
  constexpr OpShape shape = op_shape(op, kRopeOn);
  Lane l;
  if (lane < kCacheChunks) {
    l.in_cache = true;
    l.chunk = lane;
    l.src = chunk_src(e.cache, t, 0, lane);
    l.pe = lane - kLatent / kChunk;
    if (shape.cache == CacheFormat::kFp8) l.scale_inv = e.cache.scale_inv;
    if (slot_row >= 0)
      l.dst = shape.cache == CacheFormat::kFp8DsMla ? static_cast<void*>(ds_mla_entry(e, slot_row))
                                                 : chunk_dst(e.cache, slot_row, 0, lane);
    // A ds_mla lane's dst is its entry: the second pe chunk's place follows from it.
    locate_partner<kRopeOn, kStyle>(l, shape.cache == CacheFormat::kFp8);
    return l;
  }
  locate_in_head_row<op, kRopeOn, kStyle, 0>(e, t, lane - kCacheChunks, l);
  return l;
}

// Block (x, y, z) covers lanes [x * kLanesPerThread * blockDim.x, ...) of token y + z * gridDim.y;
// thread i takes lanes i, i + blockDim.x, ... of that range.
template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct>
__global__ void __launch_bounds__(kMaxThreads) epilogue_kernel(const Epilogue e, int lanes_per_token) {
  constexpr OpShape shape = op_shape(op, kRopeOn);
  const int64_t t = int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
  if (t >= e.tokens) return;
  const int first = blockIdx.x * blockDim.x * kLanesPerThread + threadIdx.x;

  // Phase 1: every load. The position is read first (the cos/sin row waits on it), the slot
  // alongside the inputs it addresses.
  const float* rope_src = nullptr;
  if constexpr (kRopeOn)
    if (threadIdx.x < kRope / 4) rope_src = e.rope_row(t);
  const int64_t slot_row = blockIdx.x == 0 ? e.cache_row(t) : -1;
  Lane lanes[kLanesPerThread];
  Raw16 raw[kLanesPerThread];
  Raw16 partner[kLanesPerThread];  // NeoX only
  float mult[kLanesPerThread] = {};
#pragma unroll
  for (int k = 0; k < kLanesPerThread; ++k) {
    const int lane = first + k * int(blockDim.x);
    if (lane < lanes_per_token) lanes[k] = locate<op, kRopeOn, kStyle>(e, t, slot_row, lane);
    if (lanes[k].src == nullptr) continue;
    raw[k] = load16(lanes[k].src);
    if constexpr (kRopeOn && kStyle == RopeStyle::kNeox)
      if (lanes[k].partner != nullptr) partner[k] = load16(lanes[k].partner);
    if (lanes[k].scale_inv != nullptr) mult[k] = __ldg(lanes[k].scale_inv);
  }

  // Phase 2: the token's cos/sin row, once per block.
  __shared__ float4 rope_row4[kRope / 4];
  const float* rope_row = reinterpret_cast<const float*>(rope_row4);
  if constexpr (kRopeOn) {
    if (rope_src != nullptr)
      rope_row4[threadIdx.x] = __ldg(reinterpret_cast<const float4*>(rope_src) + threadIdx.x);
    __syncthreads();
  }

  // Phase 3: arithmetic and stores.
#pragma unroll
  for (int k = 0; k < kLanesPerThread; ++k) {
    const Lane& l = lanes[k];
    if (l.src == nullptr) continue;
    const float* rotate_by = kRopeOn && l.pe >= 0 ? rope_row : nullptr;
    constexpr bool kPairs = kRopeOn && kStyle == RopeStyle::kNeox;  // pe lanes own two chunks
    if (shape.cache == CacheFormat::kFp8DsMla && l.in_cache) {
      auto* entry = static_cast<uint8_t*>(l.dst);
      if (l.pe >= 0) {
        const Raw16 out = finish_ds_mla_pe(kAct, raw[k], rotate_by, kStyle, partner[k], l.pe);
        if (entry != nullptr) store16(ds_mla_pe_dst(entry, l.pe), out);
        if constexpr (kPairs) {
          const Raw16 out2 = finish_ds_mla_pe(kAct, partner[k], rotate_by, kStyle, raw[k],
                                              l.pe + kNeoxPartnerChunk);
          if (entry != nullptr) store16(ds_mla_pe_dst(entry, l.pe + kNeoxPartnerChunk), out2);
        }
        continue;
      }
      // Latent lanes 0..63 are threads 0..63 of block x = 0 at k = 0: whole half warps.
      float v[kChunk];
      widen8(kAct, raw[k], v);
      float amax = 0.0f;
      for (float x : v) amax = amax_fold(amax, x);
      const unsigned tile_mask = 0xFFFFu << (threadIdx.x & 16);
      for (int offset = kTileChunks / 2; offset > 0; offset /= 2)
        amax = amax_fold(amax, __shfl_xor_sync(tile_mask, amax, offset, kTileChunks));
      if (entry == nullptr) continue;
      const float s = ds_mla_tile_scale(amax);
      store_ds_mla_latent(entry, l.chunk, v, s);
      if (l.chunk % kTileChunks == 0) store_ds_mla_scale(entry, l.chunk / kTileChunks, s);
      continue;
    }
    const bool fp8 = l.scale_inv != nullptr;
    const Raw16 out = finish_chunk(kAct, raw[k], rotate_by, kStyle, partner[k], l.pe, fp8, mult[k]);
    if (l.dst != nullptr) store_chunk(l.dst, out, fp8);
    if constexpr (kPairs) {
      if (l.partner == nullptr) continue;
      const Raw16 out2 = finish_chunk(kAct, partner[k], rotate_by, kStyle, raw[k],
                                      l.pe + kNeoxPartnerChunk, fp8, mult[k]);
      if (l.partner_dst != nullptr) store_chunk(l.partner_dst, out2, fp8);
    }
  }
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_kimi_mla: ") + what + ": " + cudaGetErrorString(err));
}

template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct>
ffi::Error launch(cudaStream_t stream, const Epilogue& e) {
  const int64_t lanes = kCacheChunks + e.heads * op_shape(op, kRopeOn).head_chunks();
  // At least 64 threads, so a ds_mla entry's 64 latent lanes are all first lanes of block 0.
  const int64_t per_thread = (lanes + kLanesPerThread - 1) / kLanesPerThread;
  const int threads = int(std::clamp<int64_t>((per_thread + 31) / 32 * 32, 64, kMaxThreads));
  const int64_t tiles = (lanes + threads * kLanesPerThread - 1) / (threads * kLanesPerThread);
  const int64_t grid_y = std::min(e.tokens, kMaxGridY);
  const int64_t grid_z = (e.tokens + grid_y - 1) / grid_y;
  bool too_large = lanes > INT32_MAX || grid_z > kMaxGridY;
  for (int r = 0; r < e.num_head_rows; ++r) {  // TokenOffset is 32-bit on the GPU
    const RowSpec& spec = e.head_rows[r];
    for (int64_t stride : {spec.nope_h, spec.pe_h, spec.out_h})
      too_large |= stride < 0 || e.heads * (stride + kEntry) > INT32_MAX;
  }
  if (too_large)
    return ffi::Error::InvalidArgument("jax_kimi_mla: problem too large for one launch");
  if (reinterpret_cast<uintptr_t>(e.cos_sin) % 16 != 0)  // read as float4 rows
    return ffi::Error::InvalidArgument("jax_kimi_mla: cos_sin_cache is not 16-byte aligned");
  epilogue_kernel<op, kRopeOn, kStyle, kAct>
      <<<dim3(unsigned(tiles), unsigned(grid_y), unsigned(grid_z)), threads, 0, stream>>>(e, int(lanes));
  return ffi::Error::Success();
}

// The kernel of a call: RoPE off, GPT-J or NeoX, by activation dtype.
template <Op op, bool kRopeOn, RopeStyle kStyle>
ffi::Error launch_act(cudaStream_t stream, const Epilogue& e) {
  return e.act == ActType::kBF16 ? launch<op, kRopeOn, kStyle, ActType::kBF16>(stream, e)
                                 : launch<op, kRopeOn, kStyle, ActType::kF16>(stream, e);
}

template <Op op>
ffi::Error run(cudaStream_t stream, const Plan& plan) {
  for (int i = 0; i < plan.num_copies; ++i) {
    const Copy& c = plan.copies[i];
    cudaError_t err = cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return cuda_error("copying an un-aliased output", err);
  }
  const Epilogue& e = plan.e;
  if (e.tokens > 0) {
    ffi::Error err = e.cos_sin == nullptr ? launch_act<op, false, RopeStyle::kGptj>(stream, e)
                     : e.rope_style == RopeStyle::kNeox ? launch_act<op, true, RopeStyle::kNeox>(stream, e)
                                                        : launch_act<op, true, RopeStyle::kGptj>(stream, e);
    if (err.failure()) return err;
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("kernel launch", err);
}

template <Op op>
ffi::Error handler(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  Plan plan;
  if (ffi::Error err = make_plan(op, args, rets, attrs, plan); err.failure()) return err;
  return run<op>(stream, plan);
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
