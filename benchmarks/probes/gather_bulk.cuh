// A candidate gather_mla_cache kernel, measured by gather_cache.cu (built with
// -DJKM_GATHER_SOURCE='"gather_bulk.cuh"') against the production one before it may replace it: the
// same contract and the same values (ffi/cuda/gather_common.cuh), but the cache rows reach shared
// memory by bulk copies (TMA) on mbarriers instead of each thread's loads. Why: on the H200 the
// production kernel waits on its loads (Nsight Compute, B 16 x 4096 tokens, bf16: 19.9 warps
// stalled on long scoreboard per issued instruction, issue active 27%, 89% of the copy ceiling in
// isolation; plain fp8: 49% issue active), as if the loads in flight were capped below what 32
// warps ask for; bulk copies keep a stage count of tiles in flight whatever the registers.
// docs/DECODE_ATTENTION.md, "The gather", has the measurements. sm_90 only (the bulk copies).
//
// One CTA per SM (or two): W = 8 warps consume, one more produces. Work: tiles of up to 32 consecutive
// tokens of one sequence in (sequence, tile) order, then tiles of zero rows up to num_tokens; CTA
// c takes tiles c, c + grid, ... For each tile that has rows the producer warp looks its tokens'
// rows up (a lane each, one tile ahead), waits for a free stage, writes the tile's first output
// row, row count and live mask to the stage's descriptor, announces the bytes on the stage's full
// mbarrier and issues one bulk copy per run of consecutive cache rows (every row its own copy
// when rows are padded, so the padding is never read). The consumers wait on the full mbarrier,
// convert the stage's rows (warp w of W: rows w, w + W, ...; lane l: groups l and l + 32 of each,
// and group 64 + l % 8 of row w + W * (l / 8)), store them, and arrive on the stage's empty
// mbarrier. A descriptor with a negative row count ends the loop.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../../ffi/cuda/gather_common.cuh"
#include "../../ffi/cuda/sm90_copy.cuh"

namespace jax_kimi_mla {
namespace {

// 8 consumer warps (2 per scheduler) and one CTA per SM by default; the probe also builds 16
// warps (-DJKM_GATHER_BULK_WARPS=16), in case converting and storing a stage is what then bounds
// it, and two CTAs per SM with half the stages each (-DJKM_GATHER_BULK_CTAS=2), in case one
// producer's lookups are.
#ifndef JKM_GATHER_BULK_WARPS
#define JKM_GATHER_BULK_WARPS 8
#endif
#ifndef JKM_GATHER_BULK_CTAS
#define JKM_GATHER_BULK_CTAS 1
#endif
constexpr int kConsumerWarps = JKM_GATHER_BULK_WARPS;
constexpr int kCtasPerSm = JKM_GATHER_BULK_CTAS;
static_assert(kConsumerWarps % 4 == 0 && kConsumerWarps <= 16 && (kCtasPerSm == 1 || kCtasPerSm == 2));
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kTileRows = 32;              // a lane of the producer warp per token
constexpr int kMainGroups = 64;            // groups 0..63 of a row: lanes l and l + 32
constexpr int kStageBudget = 176 * 1024 / kCtasPerSm;  // the stages' share of shared memory
constexpr int64_t kMaxSharedBytes = 227 * 1024 / kCtasPerSm;

// The sequences' first output rows: first_row[b] = the clamped lengths of the sequences before b,
// for b = 0..batch, by a block-wide prefix sum over kWarps warps (warp_sums: kWarps entries of
// shared memory), kWarps * 32 sequences at a time. Every thread of the block calls it; it ends
// with a barrier.
template <int kWarps>
__device__ void first_rows(const GatherCache& g, int64_t* first_row, int64_t* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t carry = 0;
  for (int64_t base = 0; base < g.batch; base += 32 * kWarps) {
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
}

template <CacheFormat kFormat>
struct BulkLayout {
  static constexpr int kEntryBytes =
      kFormat == CacheFormat::kFp8DsMla ? kDsMlaEntryBytes : kFormat == CacheFormat::kFp8 ? kEntry : 2 * kEntry;
  static constexpr int kStageBytes = kTileRows * kEntryBytes;  // rows at i * kEntryBytes
  static constexpr int kStages = kStageBudget / kStageBytes;  // one CTA per SM: bf16 4, fp8 9, ds_mla 8
  // Shared memory: the stages, their descriptors and mbarriers, then first_row [batch + 1].
  static constexpr int kDescOffset = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kDescOffset + kStages * 16;
  static constexpr int kFirstRowOffset = kBarrierOffset + 2 * kStages * 8;
  static_assert(kStageBytes % 128 == 0 && kStages >= 2 && kStages <= 32);
};

struct TileDesc {
  int64_t r0;     // output row of the tile's first row
  int32_t n;      // rows; < 0: no more tiles
  uint32_t live;  // bit i: row i was copied (else a zero row)
};

// The producer's walk over the tiles: tile (b, tile) is tokens tile * 32.. of sequence b, or for
// b >= batch the ((b - batch) * tiles + tile)-th tile of zero rows; steps of the grid's CTA count.
struct TileCursor {
  int64_t b, tile;
  int64_t tiles, end_b;  // tiles per sequence; b past the last tile
  int64_t step_b, step_tile;

  __device__ void advance() {
    b += step_b, tile += step_tile;
    if (tile >= tiles) tile -= tiles, ++b;
  }
};

// The producer's view of one tile: rows [r0, r0 + n) of the output, lane i's cache row (or -1).
struct ProducerTile {
  int64_t r0 = 0;
  int n = -1;  // -1: no tiles left
  int64_t row = -1;
};

// The cursor's first tile with rows, its rows looked up (lane i: the tile's token i); the cursor
// moves past it.
__device__ ProducerTile next_tile(const GatherCache& g, const int64_t* first_row, int64_t filled, TileCursor& c,
                                  int lane) {
  ProducerTile p;
  for (; c.b < c.end_b; c.advance()) {
    int64_t n;
    if (c.b < g.batch) {
      p.r0 = first_row[c.b] + c.tile * kTileRows;
      n = min(min(first_row[c.b + 1] - p.r0, g.num_tokens - p.r0), int64_t(kTileRows));
      if (lane < n) p.row = g.token_row(c.b, c.tile * kTileRows + lane);
    } else {
      p.r0 = filled + ((c.b - g.batch) * c.tiles + c.tile) * kTileRows;
      n = min(g.num_tokens - p.r0, int64_t(kTileRows));
    }
    if (n > 0) {
      p.n = int(n);
      c.advance();
      return p;
    }
  }
  return p;
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) gather_bulk_kernel(GatherCache g) {
  using L = BulkLayout<kFormat>;
  extern __shared__ __align__(128) uint8_t smem[];
  TileDesc* desc = reinterpret_cast<TileDesc*>(smem + L::kDescOffset);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarrierOffset);
  uint64_t* empty = full + L::kStages;
  int64_t* first_row = reinterpret_cast<int64_t*>(smem + L::kFirstRowOffset);
  __shared__ int64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) mbarrier_init(full + s, 1), mbarrier_init(empty + s, kConsumers);
    mbarrier_init_fence();
  }
  first_rows<kThreads / 32>(g, first_row, warp_sums);  // and the mbarriers are ready
  const int64_t filled = min(first_row[g.batch], g.num_tokens);

  if (warp == kConsumerWarps) {  // the producer
    TileCursor c;
    c.tiles = max((g.max_len() + kTileRows - 1) / kTileRows, int64_t(1));
    c.end_b = g.batch + (g.num_tokens - filled + kTileRows * c.tiles - 1) / (kTileRows * c.tiles);
    c.step_b = gridDim.x / c.tiles, c.step_tile = gridDim.x % c.tiles;
    c.b = blockIdx.x / c.tiles, c.tile = blockIdx.x % c.tiles;
    const bool packed = g.row_bytes == L::kEntryBytes;  // consecutive rows are consecutive bytes
    ProducerTile cur = next_tile(g, first_row, filled, c, lane);
    for (uint32_t used = 0;; ++used) {
      // The next tile's lookups are in flight while this one is issued.
      const ProducerTile nxt = cur.n < 0 ? cur : next_tile(g, first_row, filled, c, lane);
      const int s = int(used % L::kStages);
      if (used >= uint32_t(L::kStages)) mbarrier_wait(empty + s, ((used / L::kStages) - 1) & 1);
      const uint32_t live = __ballot_sync(0xFFFFFFFFu, cur.row >= 0);
      if (lane == 0) {
        desc[s] = TileDesc{cur.r0, cur.n, live};
        mbarrier_arrive_expect_bytes(full + s, uint32_t(__popc(live)) * L::kEntryBytes);
      }
      if (cur.n < 0) break;
      __syncwarp();
      // Runs of consecutive cache rows: lane i heads one unless it continues lane i - 1's.
      const int64_t prev = __shfl_up_sync(0xFFFFFFFFu, cur.row, 1);
      const bool head = cur.row >= 0 && !(packed && lane > 0 && prev >= 0 && prev + 1 == cur.row);
      const uint32_t stops = __ballot_sync(0xFFFFFFFFu, head) | ~live;
      if (head) {
        const uint32_t after = stops & uint32_t(~((uint64_t(2) << lane) - 1));
        const int end = after ? __ffs(after) - 1 : kTileRows;
        bulk_copy(smem + s * L::kStageBytes + lane * L::kEntryBytes, g.cache + cur.row * g.row_bytes,
                  uint32_t(end - lane) * L::kEntryBytes, full + s);
      }
      cur = nxt;
    }
    return;
  }

  // The consumers.
  Fp8Divisor div;
  if constexpr (kFormat == CacheFormat::kFp8) div = Fp8Divisor::of(__ldg(g.cache_scale_inv));
  const int tail_row = warp + kConsumerWarps * (lane / 8), tail_group = kMainGroups + lane % 8;
  for (uint32_t used = 0;; ++used) {
    const int s = int(used % L::kStages);
    mbarrier_wait(full + s, (used / L::kStages) & 1);
    const TileDesc d = desc[s];
    if (d.n < 0) break;
    const uint8_t* stage = smem + s * L::kStageBytes;
#pragma unroll
    for (int q = 0; q < kTileRows / kConsumerWarps; ++q) {
      const int i = warp + kConsumerWarps * q;
      if (i >= d.n) break;
      const uint8_t* e = stage + i * L::kEntryBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int group = lane + 32 * h;
        uint8_t* dst = group_dst<kOut>(g.out, d.r0 + i, group);
        if (!(d.live >> i & 1u)) {
          store_zeros(dst, kOut == OutType::kF32);
        } else if constexpr (kFormat == CacheFormat::kBf16) {
          store_16bit<kCache16, kOut>(dst, *reinterpret_cast<const Raw16*>(e + 16 * group));
        } else {
          const uint2 codes = *reinterpret_cast<const uint2*>(e + 8 * group);
          const float* tile_scales = reinterpret_cast<const float*>(e + kDsMlaScaleOffset);
          const float tile_scale = kFormat == CacheFormat::kFp8DsMla ? tile_scales[group / 16] : 0.0f;
          store_codes<kFormat, kOut>(dst, codes, tile_scale, div);
        }
      }
    }
    if (tail_row < d.n) {
      const uint8_t* e = stage + tail_row * L::kEntryBytes;
      uint8_t* dst = group_dst<kOut>(g.out, d.r0 + tail_row, tail_group);
      if (!(d.live >> tail_row & 1u))
        store_zeros(dst, kOut == OutType::kF32);
      else if constexpr (kFormat == CacheFormat::kFp8)
        store_codes<kFormat, kOut>(dst, *reinterpret_cast<const uint2*>(e + 8 * tail_group), 0.0f, div);
      else if constexpr (kFormat == CacheFormat::kFp8DsMla)  // k_pe is bf16
        store_16bit<ActType::kBF16, kOut>(dst, *reinterpret_cast<const Raw16*>(e + kDsMlaPeOffset + 16 * (lane % 8)));
      else
        store_16bit<kCache16, kOut>(dst, *reinterpret_cast<const Raw16*>(e + 16 * tail_group));
    }
    mbarrier_arrive(empty + s);
  }
}

template <CacheFormat kFormat, ActType kCache16, OutType kOut>
ffi::Error launch(cudaStream_t stream, const GatherCache& g) {
  using L = BulkLayout<kFormat>;
  const auto cuda_error = [](cudaError_t err) {
    return ffi::Error::Internal(std::string("jax_kimi_mla gather_mla_cache: ") + cudaGetErrorString(err));
  };
  const size_t shared = size_t(L::kFirstRowOffset) + size_t(g.batch + 1) * sizeof(int64_t);
  if (int64_t(shared) > kMaxSharedBytes)
    return ffi::Error::InvalidArgument("jax_kimi_mla gather_mla_cache: too many sequences for one launch");
  auto* kernel = gather_bulk_kernel<kFormat, kCache16, kOut>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  int device = 0, sms = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return cuda_error(err);
  const int64_t tiles = std::max<int64_t>((g.max_len() + kTileRows - 1) / kTileRows, 1);
  const int64_t work = g.batch * tiles + (g.num_tokens + kTileRows - 1) / kTileRows;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(work, int64_t(sms) * kCtasPerSm));
  kernel<<<unsigned(blocks), kThreads, shared, stream>>>(g);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla
