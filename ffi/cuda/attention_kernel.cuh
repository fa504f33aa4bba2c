// attention_kernel: 16 query rows a CTA on mma.sync, any cache format (decode_attention_cuda.cu, 1).
#pragma once

#include "decode_attention_common.cuh"

namespace jax_kimi_mla {
namespace {

// One CTA's work: split at.split of sequence at.b. Block-uniform control flow throughout (barriers
// inside).
template <CacheFormat kFormat, ActType kElem>
__device__ void attend(const DecodeAttention& a, const TileMaps& maps, const CtaPlace& at, const Scales& scales,
                       uint8_t* smem) {
  const int64_t b = at.b;
  using L = Layout<kFormat>;
  using V = VTile<L::kSwizzled, L::kVRowBytes>;
  const int64_t rows = a.rows(), len = a.context_len(b);
  // Rows are (query token, head): the first row of the CTA sees the fewest tokens, its last real
  // row the most; no row sees tokens past seen_by_any, so those are not loaded.
  const int64_t row0 = int64_t(at.row_group) * kTileRows;
  const int64_t last_row = min64(row0 + kTileRows, rows) - 1;
  const int64_t seen_by_all = a.row_visible_len(len, row0);
  const int64_t seen_by_any = a.row_visible_len(len, last_row);
  const Work w = split_work(a, b, row0, at.split, len, seen_by_any, at.share);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  Lane t;
  t.warp = int(threadIdx.x) / 32, t.lane = int(threadIdx.x) % 32;
  t.g = t.lane / 4, t.c = t.lane % 4;
  t.half = t.warp / kTokenGroups, t.group = t.warp % kTokenGroups;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // padding rows see as much as the last real row
    const int64_t r = w.row0 + t.g + 8 * h;
    t.visible[h] = r < rows ? a.row_visible_len(len, r) : seen_by_any;
  }

  constexpr int kStages = L::kStages;
  uint8_t* q_tile = smem + L::kQ;
  float* scores = reinterpret_cast<float*>(smem + L::kScores);
  uint8_t* p_tile = smem + L::kP;
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);  // [tile % kStages][token]
  uint8_t* raw = smem + L::kRaw;
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kZeroRows);   // [kStages] (16-bit)
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);  // [kStages]
  // The tile whose rows are in slot s goes to stage s: warp 0 issues a swizzled tile, threads 0-63
  // a raw one; they are the arrivals the stage's mbarrier counts.
  const auto issue = [&](int s) {
    uint8_t* stage = raw + s * L::kRawTileBytes;
    if constexpr (L::kSwizzled) {
      if (t.warp == 0) issue_swizzled_tile(a, maps, tile_rows + s * kTileTokens, stage, stage_full + s, zero_rows + s);
    } else {
      if (threadIdx.x < kTileTokens)
        issue_raw_tile<kFormat>(a, tile_rows[s * kTileTokens + threadIdx.x], stage, stage_full + s);
    }
  };
  // The V tile of P.V for the tile in slot s: the stage itself (16-bit), or the converted tile
  // that QK^T of that tile wrote (1-byte; two, by tile parity).
  const auto v_tile = [&](int64_t tile, int s) {
    return L::kConverts ? smem + L::kVTile + int(tile & 1) * L::kVTileBytes : raw + s * L::kRawTileBytes;
  };

  // The prologue: the query's loads in flight with the lookups, the first copies issued before
  // the query tile is written (they land elsewhere).
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(stage_full + s, L::kSwizzled ? 32 : kTileTokens);
    mbarrier_init_fence();
  }
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<kElem>(a, b, w.row0, q_fetched);
  if (threadIdx.x < kStages * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  JKM_PHASE_AT(1);
  // In flight before the loop: every stage when pipelined, else all but the one Q lies in.
  constexpr int kFirstIssued = L::kPipelined ? kStages : kStages - 1;
#pragma unroll
  for (int s = 0; s < kFirstIssued; ++s)
    if (s < w.n_tiles) issue(s);
  store_q<kFormat, kElem>(a, q_fetched, q_tile);
  if constexpr (L::kSwizzled) fence_proxy_async();  // Q lies in the last stage, where a tile lands later
  __syncthreads();  // the query tile is complete
  // Column half 0 takes k-steps [0, kHalfStep), half 1 the rest (warp-uniform branches).
  constexpr int kHalfStep = L::kHalfStep, kHalfBlock = kHalfStep / 4;
  uint32_t q[L::kQSteps][4];
  if (t.half == 0)
    load_q_fragments<0, kHalfStep>(t, q_tile, q);
  else
    load_q_fragments<kHalfStep, kQkSteps - kHalfStep>(t, q_tile, q);
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  JKM_PHASE_AT(2);

  float out[kOutBlocks][4] = {};
  RowState state;  // of row softmax_row(t)
  RowStats& stats = *reinterpret_cast<RowStats*>(smem + L::kStats);
  // out += P V of tile `tile` (slot s), after its softmax: rescale by its alphas, then the MMAs.
  const auto accumulate_pv = [&](int64_t tile, int s) {
#pragma unroll
    for (int n = 0; n < kOutBlocks; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[n][i] *= stats.alpha[t.g + 8 * (i >> 1)];
    uint32_t p[kPvSteps][4];
    load_p_fragments<L::kPRowBytes>(t, p_tile, p);
    uint8_t* kv = v_tile(tile, s);
    const int64_t tile_first = w.first + tile * kTileTokens;
    const int64_t partly_lo = max64(seen_by_all, tile_first);
    const int64_t partly_hi = min64(seen_by_any, tile_first + kTileTokens);
    if (partly_lo < partly_hi)
      add_partly_seen<kElem, L::kPRowBytes, V>(t, int(partly_lo - tile_first), int(partly_hi - tile_first),
                                               tile_first, p_tile, kv, out);
    pv_accumulate<kElem, V>(t, p, kv, out);
  };

  // Warps 2-3 look the rows of later tiles up (thread 64 + i: token i), warps 0-1 issue the tiles:
  // both are per-tile extras on the critical path of whichever warps carry them, so they are
  // spread, and (pipelined) kept out of the softmax interval, which every warp spends alike.
  const int lookup_token = int(threadIdx.x) - kTileTokens;
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  // Tile i: [P.V of tile i - 1] QK^T of tile i | barrier | softmax of tile i | barrier. Not
  // pipelined, a barrier also separates P.V of tile i - 1 from QK^T of tile i.
  int slot = 0;  // tile % kStages: its stage and its entries
  for (int64_t tile = 0;; ++tile) {
    const int prev = slot == 0 ? kStages - 1 : slot - 1;  // the slot of tile - 1
    // Pipelined, tile - 1 + kStages goes to the stage of tile - 1, which QK^T has converted.
    if constexpr (L::kPipelined)
      if (tile > 0 && tile - 1 + kStages < w.n_tiles) issue(prev);
    if (tile > 0) accumulate_pv(tile - 1, prev);
    if (tile == w.n_tiles) break;
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    JKM_TILE_AT(tile);
    parity ^= 1u << slot;
    uint8_t* stage = raw + slot * L::kRawTileBytes;
    if constexpr (!L::kPipelined) {  // the 16-bit cache
      zero_masked_rows(zero_rows[slot], stage);
      __syncthreads();  // tile has landed, and every warp is done with tile - 1 (its stage, P)
      // Tile + kStages - 1 goes to the stage of tile - 1.
      if (tile + kStages - 1 < w.n_tiles) issue(prev);
    }
    // The rows of tile + kStages, looked up now so that their latency hides behind this tile's
    // math.
    const int64_t row_ahead = looks_up ? tile_token_row(a, w, tile + kStages, lookup_token) : -1;
    float acc[2][2][4] = {};
    uint32_t nan_lanes[2] = {0, 0};
    if constexpr (L::kConverts) {
      static_assert(kHalfStep % 4 == 0, "1-byte halves split at a 64-column block");
      uint8_t* kv = v_tile(tile, slot);
      bool nan[2];
      if (t.half == 0)
        qk_tile_raw<kFormat, kElem, 0, kHalfBlock>(t, q, stage, kv, acc, nan);
      else
        qk_tile_raw<kFormat, kElem, kHalfBlock, kEntry / 64 - kHalfBlock>(t, q, stage, kv, acc, nan);
      nan_lanes[0] = __ballot_sync(0xFFFFFFFFu, nan[0]);
      nan_lanes[1] = __ballot_sync(0xFFFFFFFFu, nan[1]);
    } else {
      if (t.half == 0)
        qk_tile<kElem, 0, kHalfStep>(t, q, stage, acc);
      else
        qk_tile<kElem, kHalfStep, kQkSteps - kHalfStep>(t, q, stage, acc);
    }
    write_logits(t, acc, nan_lanes, tile_rows + slot * kTileTokens, w.first + tile * kTileTokens, scales.logit,
                 scores + t.half * kTileRows * kScoreStride);
    // The 16 x 64 logits (and a 1-byte format's V tile) are complete; every warp is done with
    // P.V of tile - 1 and with this tile's raw stage and rows.
    __syncthreads();
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    softmax_rows<kElem, L::kPRowBytes>(t, scores, p_tile, state, stats);
    __syncthreads();  // the P tile and the rows' alphas are complete
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  JKM_PHASE_AT(4);
  publish_row_state(t, state, stats);
  __syncthreads();
  JKM_PHASE_AT(5);
  static_assert(L::kStages * L::kRawTileBytes >= kTileRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the tiles' stages");
  write_rows(a, w, t, scales, stats, out, reinterpret_cast<float*>(smem + L::kRaw));
}

template <CacheFormat kFormat, ActType kElem>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    attention_kernel(const DecodeAttention a, const __grid_constant__ TileMaps maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  if constexpr (Layout<kFormat>::kSwizzled) prefetch_tile_maps(maps);
  const CtaPlace at = cta_place(a);
  if (at.b < a.batch) attend<kFormat, kElem>(a, maps, at, load_scales<kFormat>(a), smem);
  JKM_PHASE_AT(6);
}

}  // namespace
}  // namespace jax_kimi_mla
