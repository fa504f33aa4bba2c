// fp8_attention_kernel: the plain fp8 cache under an E4M3 query (decode_attention_cuda.cu, 1b).
#pragma once

#include "decode_attention_common.cuh"

namespace jax_kimi_mla {
namespace {

// ---- The plain fp8 cache under an E4M3 query: P.V from the raw tile, no converted tile ----
//
// fp8_attention_kernel takes attention_kernel's place for plain fp8 with an E4M3 mqa_q at S_q = 1
// (every row sees the whole length). The CTA, its 16 rows, the split, QK^T (qk_tile_raw, f16
// elements), the softmax and the output are attention_kernel's; what differs is that no tile is
// ever converted into shared memory:
// - P.V reads the raw codes: lane (g, c) of warp w loads 8 bytes of each of its 4 tokens of a
//   k-step (columns 64w + 8g .. + 7), pairs the tokens' bytes (prmt) and converts the pairs to
//   f16 (cvt.rn.f16x2.e4m3x2, exact, NaN kept): n-block i of the warp is columns 64w + 8g + i,
//   over g. The output store undoes that order (write_rows<true>). The latent is converted twice
//   (by QK^T and by P.V), in registers, instead of written and read back as 16-bit values: a
//   third of the shared-memory traffic, and no converted tile for P.V to wait on.
// - So a stage stays live until P.V of its tile is done: 4 raw stages (147 KB), the next tile
//   issued two tiles ahead, at the top of the iteration (out of the softmax interval).
// - Token order: position kk of a 16-token group holds token fp8_token(kk) = kk ^ ((kk >> 1) & 1),
//   so that the 8 lanes of every 16-byte QK^T load (tokens 0, 1 | 3, 2 | 4, 5 | 7, 6) and the 4
//   tokens of every P.V load split evenly between the two 64-byte halves of a bank row (576-byte
//   rows are 64 mod 128): QK^T's loads are conflict-free, P.V's 2-way (the least 8-byte loads of
//   4 tokens at the same columns allow). A lane's logits of a pair are then tokens (2c, 2c + 1) or
//   (2c + 1, 2c) (write_logits<TokenOrder::kFp8>).
// - P.V of tile i - 1 runs before QK^T of tile i, at the top of the iteration: moved into the
//   softmax interval of tile i (after the softmax, P tiles and alphas by tile parity) it ran
//   220 us against 213 (2026-12-02).
// (mma.sync with E4M3 operands, m16n8k32, is no faster on sm_90: ptxas lowers it to these same
// conversions and two f16 MMAs, and then converts Q again on every tile; measured, 2026-12-02.)
constexpr int kRawStages = 4;
constexpr int kRawPRowBytes = 2 * kTileTokens + 16;      // a P tile's rows, 16-byte skewed
constexpr int kRawPBytes = kTileRows * kRawPRowBytes;    // one P tile

#if !JKM_HARDWARE_FP8
// Without the instruction (numerics.h), the kernels that convert by it still compile but are never
// launched (kFp8KernelBuilt).
template <int kHalf>
__device__ __forceinline__ uint32_t e4m3x2_half_to_f16x2(uint32_t x) {
  __trap();
  return x;
}
#endif

// out[16 x this warp's 64 columns] += P[16 x 64] V[64 x 64], V the codes of a raw tile of
// kEntryBytes rows (the comment above): k-step k, B rows 2c, 2c + 1, 2c + 8, 2c + 9 are tokens
// 16k + ordered_token<kOrder> of those.
template <int kEntryBytes, TokenOrder kOrder>
__device__ __forceinline__ void pv_accumulate_fp8(const Lane& t, const uint32_t (&p)[kPvSteps][4], const uint8_t* raw,
                                                  float (&out)[kOutBlocks][4]) {
  const uint8_t* base = raw + kColsPerWarp * t.warp + 8 * t.g;
  const int kk[4] = {2 * t.c, 2 * t.c + 1, 2 * t.c + 8, 2 * t.c + 9};
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k) {
    uint2 w[4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
      w[x] = *reinterpret_cast<const uint2*>(base + (16 * k + ordered_token<kOrder>(kk[x])) * kEntryBytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // columns 8g + 4h .. + 3: n-blocks 4h .. 4h + 3
      const uint32_t r0 = h ? w[0].y : w[0].x, r1 = h ? w[1].y : w[1].x;
      const uint32_t r2 = h ? w[2].y : w[2].x, r3 = h ? w[3].y : w[3].x;
      // Bytes (r0 i, r1 i, r0 i + 1, r1 i + 1): the B pairs of columns i and i + 1.
      const uint32_t b0[2] = {__byte_perm(r0, r1, 0x5140), __byte_perm(r0, r1, 0x7362)};
      const uint32_t b1[2] = {__byte_perm(r2, r3, 0x5140), __byte_perm(r2, r3, 0x7362)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t v0 = i & 1 ? e4m3x2_half_to_f16x2<1>(b0[i >> 1]) : e4m3x2_half_to_f16x2<0>(b0[i >> 1]);
        const uint32_t v1 = i & 1 ? e4m3x2_half_to_f16x2<1>(b1[i >> 1]) : e4m3x2_half_to_f16x2<0>(b1[i >> 1]);
        mma_16816<ActType::kF16>(out[4 * h + i], p[k], v0, v1);
      }
    }
  }
}

// ---- fp8_attention_kernel's loop ----

// The per-row values: the softmax's, the alphas by tile parity (P.V of tile i - 1 reads its alphas
// while the softmax of tile i writes its own).
struct Fp8Stats {
  RowStats by_parity[2];  // the rows' max and sum at the end in by_parity[0]
};

// Where everything lives in dynamic shared memory: kRawStages raw stages, the logits, the P tiles
// by tile parity, the tiles' rows, the mbarriers, the per-row values, the query tile.
struct Fp8Layout {
  static constexpr int kStageBytes = kTileTokens * kEntry;
  static constexpr int kRaw = 0;                                                  // [kRawStages][64][kEntry]
  static constexpr int kScores = kRaw + kRawStages * kStageBytes;                 // float [half][16][kScoreStride]
  static constexpr int kP = kScores + kColumnHalves * kTileRows * kScoreStride * 4;  // [parity][16][kRawPRowBytes]
  static constexpr int kEntries = kP + 2 * kRawPBytes;                            // int64 [kRawStages][64]
  static constexpr int kBarriers = kEntries + kRawStages * kTileTokens * 8;       // uint64 [kRawStages]
  static constexpr int kStats = kBarriers + 8 * kRawStages;                       // Fp8Stats
  static constexpr int kQ = kStats + (int(sizeof(Fp8Stats)) + 15) / 16 * 16;     // [16][kRowBytes]
  static constexpr int kBytes = kQ + kTileRows * kRowBytes;
  static_assert(kStageBytes % 16 == 0 && kScores % 16 == 0 && kP % 16 == 0 && kEntries % 16 == 0 && kQ % 16 == 0);
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
  static_assert(kThreads >= kRawStages * kTileTokens, "the prologue gives one thread to each token");
  static_assert(kRawStages * kStageBytes >= kTileRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the stages");
};

// One CTA's work: split at.split of sequence at.b at S_q = 1 (attend's CTA). Tile i: P.V of tile i - 1,
// QK^T of tile i | barrier | softmax of tile i | barrier; tile i + 2 issued at the top, into the
// stage of tile i - 2. The P tiles and the rows' alphas are kept by tile parity, so that P.V reads
// tile i - 1's while the softmax writes tile i's.
__device__ void attend_fp8(const DecodeAttention& a, const CtaPlace& at, const Scales& scales, uint8_t* smem) {
  using L = Fp8Layout;
  constexpr CacheFormat kFormat = CacheFormat::kFp8;
  const int64_t b = at.b, len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(at.row_group) * kTileRows, at.split, len, len, at.share);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  Lane t;
  t.warp = int(threadIdx.x) / 32, t.lane = int(threadIdx.x) % 32;
  t.g = t.lane / 4, t.c = t.lane % 4;
  t.half = t.warp / kTokenGroups, t.group = t.warp % kTokenGroups;
  t.visible[0] = t.visible[1] = len;  // S_q = 1: every row sees the whole length

  uint8_t* raw = smem + L::kRaw;
  uint8_t* q_tile = smem + L::kQ;
  float* scores = reinterpret_cast<float*>(smem + L::kScores);
  uint8_t* p_tiles = smem + L::kP;
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);  // [tile % kRawStages][token]
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  Fp8Stats& stats = *reinterpret_cast<Fp8Stats*>(smem + L::kStats);
  const auto stage = [&](int s) { return raw + s * L::kStageBytes; };
  const auto issue = [&](int s) {  // threads 0-63: the tile whose rows are in slot s, to stage s
    if (threadIdx.x < kTileTokens)
      issue_raw_tile<kFormat>(a, tile_rows[s * kTileTokens + threadIdx.x], stage(s), stage_full + s);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kRawStages; ++s) mbarrier_init(stage_full + s, kTileTokens);
    mbarrier_init_fence();
  }
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<ActType::kF16>(a, b, w.row0, q_fetched);
  if (threadIdx.x < kRawStages * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  JKM_PHASE_AT(1);
#pragma unroll
  for (int s = 0; s < kRawStages; ++s)
    if (s < w.n_tiles) issue(s);
  store_q<kFormat, ActType::kF16>(a, q_fetched, q_tile);
  __syncthreads();  // the query tile is complete
  using QL = Layout<kFormat>;  // its column halves and Q fragments are attention_kernel's
  constexpr int kHalfBlock = QL::kHalfStep / 4;
  uint32_t q[QL::kQSteps][4];
  if (t.half == 0)
    load_q_fragments<0, QL::kHalfStep>(t, q_tile, q);
  else
    load_q_fragments<QL::kHalfStep, kQkSteps - QL::kHalfStep>(t, q_tile, q);
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  JKM_PHASE_AT(2);

  float out[kOutBlocks][4] = {};
  RowState state;  // of row softmax_row(t)
  const int lookup_token = int(threadIdx.x) - kTileTokens;  // warps 2-3 look the rows of later tiles up
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  int slot = 0;  // tile % kRawStages
  bool rescale = false;  // some row's alpha of the last tile is not 1 (a NaN one is not 1)
  // out += P V of tile `done` (in stage `done_slot`), after out *= its rows' alphas unless all are 1.
  const auto pv = [&](int64_t done, int done_slot) {
    const int done_parity = int(done & 1);
    if (rescale) {
      const float* alphas = stats.by_parity[done_parity].alpha;
      const float alpha[2] = {alphas[t.g], alphas[t.g + 8]};
#pragma unroll
      for (int n = 0; n < kOutBlocks; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[n][i] *= alpha[i >> 1];
    }
    uint32_t p[kPvSteps][4];
    load_p_fragments<kRawPRowBytes>(t, p_tiles + done_parity * kRawPBytes, p);
    pv_accumulate_fp8<kEntry, TokenOrder::kFp8>(t, p, stage(done_slot), out);
  };
  for (int64_t tile = 0;; ++tile) {
    const int prev = (slot + kRawStages - 1) % kRawStages, before = (slot + kRawStages - 2) % kRawStages;
    // Tile + 2 goes to the stage of tile - 2, whose P.V ended before the last barrier.
    if (tile >= 2 && tile + 2 < w.n_tiles) issue(before);
    if (tile > 0) pv(tile - 1, prev);
    if (tile == w.n_tiles) break;
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    JKM_TILE_AT(tile);
    parity ^= 1u << slot;
    const int64_t row_ahead = looks_up ? tile_token_row(a, w, tile + kRawStages, lookup_token) : -1;
    float logits[2][2][4] = {};
    bool nan[2];  // unused: the f16 conversion keeps NaN
    if (t.half == 0)
      qk_tile_raw<kFormat, ActType::kF16, 0, kHalfBlock, QL::kQSteps, true>(t, q, stage(slot), nullptr, logits, nan);
    else
      qk_tile_raw<kFormat, ActType::kF16, kHalfBlock, kEntry / 64 - kHalfBlock, QL::kQSteps, true>(
          t, q, stage(slot), nullptr, logits, nan);
    const uint32_t no_nan[2] = {0, 0};  // the f16 conversion keeps NaN
    write_logits<TokenOrder::kFp8>(t, logits, no_nan, tile_rows + slot * kTileTokens, w.first + tile * kTileTokens,
                                   scales.logit, scores + t.half * kTileRows * kScoreStride);
    __syncthreads();  // the logits are complete
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    const int p_parity = int(tile & 1);
    const bool changed = softmax_rows<ActType::kF16, kRawPRowBytes, false>(
                             t, scores, p_tiles + p_parity * kRawPBytes, state, stats.by_parity[p_parity]) != 1.0f;
    rescale = __syncthreads_or(changed);  // the P tile and the rows' alphas are complete
    slot = slot + 1 == kRawStages ? 0 : slot + 1;
  }
  JKM_PHASE_AT(4);
  publish_row_state(t, state, stats.by_parity[0]);
  __syncthreads();
  JKM_PHASE_AT(5);
  write_rows<true>(a, w, t, scales, stats.by_parity[0], out, reinterpret_cast<float*>(raw));
}

__global__ void __launch_bounds__(kThreads, 1) fp8_attention_kernel(const DecodeAttention a) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  const CtaPlace at = cta_place(a);
  if (at.b < a.batch) attend_fp8(a, at, load_scales<CacheFormat::kFp8>(a), smem);
  JKM_PHASE_AT(6);
}

}  // namespace
}  // namespace jax_kimi_mla
