// rs_attention_kernel: the 1-byte caches at S_q = 1 on wgmma with the tokens as M, sm_90a
// (decode_attention_cuda.cu, 1d): fp8_ds_mla with A from registers, plain fp8 under an E4M3 query
// with S^T from shared memory.
#pragma once

#include "decode_attention_common.cuh"

namespace jax_kimi_mla {
namespace {

// ---- rs_attention_kernel (the 1-byte caches at S_q = 1, sm_90a): the tokens as M ----
//
// 384 threads, one CTA per SM, grid and partials as attention_kernel's: two consumer warpgroups and
// a producer warpgroup (FlashAttention 3's layout). The consumers take alternate 64-token tiles of
// the producer's stream from a ring of kRsStages raw stages (position i in stage i % kRsStages, so
// each stage serves one consumer warpgroup), each with its own softmax state, until a stage comes
// marked as the end; the two states merge at the end as two splits would. The producer
// (produce_rs_tiles) streams the split's tiles (or, where the splits are balanced, its first tiles
// and then tail tiles claimed from the sequence's splits), looks up each tile's rows and issues it
// into its stage once the consumer warpgroup has read the stage's previous tile (its empty barrier).
// Setmaxnreg moves registers from the producer to the consumers, which need about 190-226 (226 /
// 220 on 256 threads): with the launch's 168 a thread they would spill. (Until the Twenty-sixth round two warpgroups of 256
// threads looked up and issued the tiles themselves; wgmma being a warpgroup's, a warp busy
// issuing held up its warpgroup's next MMA: docs/DECODE_ATTENTION.md, Twenty-fifth round.)
// Per tile, a warpgroup (warp w, g = lane / 4, c = lane % 4):
// - S^T = K Q^T with wgmma m64n16k16 (M: the 64 tokens, N: the 16 query rows). The latent: 32
//   k-steps of f16, A = the E4M3 codes of a thread's two tokens (rs_token), 16-byte shared loads
//   converted in registers (cvt.rn.f16x2.e4m3x2, exact), one accumulator per 128-column scale
//   tile, its scale applied to the partial logits in float32; k_pe: 4 bf16 k-steps, A = the raw
//   bf16 values. B = the query tile in shared memory (f16 latent with a per-row power-of-two
//   prescale; bf16 k_pe), 128-byte swizzled, its columns permuted to the
//   order in which the A fragments hold them (rs_q_kstep). So Q takes no registers, and no
//   converted K or V tile goes through shared memory (the traffic that bounded an earlier wgmma
//   kernel with converter warps: docs/DECODE_ATTENTION.md, Ninth and Tenth rounds).
// - Softmax against a reference per query row that the warpgroup shares (base 2; p = 2^(logit -
//   ref) in float32): a tile whose logits plus log2 of their token's largest scale all stay within
//   kRsSlack of it needs one named barrier (an OR vote, which also publishes P'); otherwise the
//   warpgroup reduces the tile's largest such value, moves the reference there, rescales out and
//   the sums, and writes P' again (rare after the first tiles). So p s_t <= 2^kRsSlack in f16 for
//   any scale. The sums are each thread's own until the end.
// - P'_t^T = p x s_t (the token's scale of scale tile t) in f16, one 16 x 64 tile per scale tile.
// - O^T += V^T P'_t^T: 8 M-blocks of 64 latent columns (blocks 2t, 2t + 1 inside scale tile t:
//   rs_column) x 4 k-steps of 16 tokens, A = the codes of a thread's 4 tokens x 4 columns
//   (32-bit loads, paired by prmt, converted in registers).
// The tile's rows are read conflict-free: for S^T a quarter-warp's two tokens are 4 rows apart
// (656 = 16 mod 128), for P.V a k-step's four lanes' tokens are 2 rows apart. Inside S^T and
// inside P.V one group stays in flight (wgmma.wait_group 1): group k is converted while k - 1
// runs and issued behind it, so the tensor cores do not drain between groups (nvcc 13.0's ptxas
// keeps these asynchronous: no C751x, SASS WARPGROUP.DEPBAR.LE gsb0, 0x1; earlier builds had
// serialized them, C7513/C7514). A group left in flight across the tile's end still serializes
// every wgmma (C7514/C7515), so each tile ends with wait_group 0.
// Probe: benchmarks/probes/ds_rs_tile_loop.cu (the loop without paging: 1.40 us a tile from HBM
// against attention_kernel's 2.38 on the H200). History: docs/DECODE_ATTENTION.md, Sixteenth round.
//
// The plain fp8 cache under an E4M3 query (kFormat kFp8) differs in S^T and in how a tile lands:
// both S^T operands are E4M3 in shared memory, so S^T is one group of 18 wgmma m64n16k32 k-steps
// with no conversion and no A loads (the loop of the probe's -DJKM_RS_FP8_SS on the H200: 0.835 us a
// tile from L2, 1.178 from HBM, 97% of the copy ceiling, against 1.303 and 1.488 with A from
// registers; docs/DECODE_ATTENTION.md, Twenty-fourth round). For that the tile lands
// by tensor-map boxes (issue_swizzled_tile, fp8_tile_offset: four 128-byte swizzled chunks of 128
// columns, the rope columns a 64-byte swizzled fifth), issued by the producer's warp 0, masked
// tokens' rows zeroed after landing; the query tile holds its
// E4M3 codes in the same layout (no prescale: the codes meet the codes). One accumulator a chunk
// (the tensor cores' E4M3 sums are coarser than float32), added in float32; no scales, so one P
// tile; P.V as fp8_ds_mla's, its A loads at the swizzled places (conflict-free), its tokens in
// natural order (rs_token).
constexpr int kRsGroups = 2;                              // the consumer warpgroups
constexpr int kRsThreads = (kRsGroups + 1) * 128;         // and the producer warpgroup (group 2)
// setmaxnreg: the launch gives every thread kRsLaunchRegisters; the producer warpgroup gives some
// back and the two consumer warpgroups take exactly those (the pool holds only what was given back).
// Plain fp8's producer issues boxes (72 registers without spills), its consumers then have 216;
// fp8_ds_mla's issues bulk copies (40, and its claims spill 60 bytes there), its consumers have 232
// (at 224 ptxas spills in the consumers).
constexpr int kRsLaunchRegisters = 65536 / kRsThreads / 8 * 8;  // 168
template <CacheFormat kFormat>
constexpr int kRsProducerRegisters = kFormat == CacheFormat::kFp8 ? 72 : 40;
template <CacheFormat kFormat>
constexpr int kRsConsumerRegisters = kRsLaunchRegisters + (kRsLaunchRegisters - kRsProducerRegisters<kFormat>) / kRsGroups;
constexpr int kRsConsumerBarrier = 1 + kRsGroups;         // named barrier of the consumers (1, 2: each group's)
constexpr int kRsProducerBarrier = 2 + kRsGroups;         // of the producer's issuing warps
constexpr int kRsStages = 4;
constexpr int kRsMinSplitTiles = 4;  // the default from this many tiles a split (choose_kernel)
constexpr int64_t kRsMaxTokens = int64_t(1) << 30;  // a table's tokens a sequence (choose_kernel): 32-bit positions
constexpr float kRsSlack = 8.0f;  // log2 units: P' values up to 2^8 before the reference moves
constexpr int kScaleTiles = kLatent / kDsMlaTile;  // 4
static_assert(kRsGroups * 128 == kThreads && kScaleTiles == 4 && kTileRows == 16);
constexpr int kFp8QkSteps = kEntry / 32;  // 18 E4M3 k-steps of S^T (plain fp8)

// The query prescale: the latent q meets the codes in f16 MMAs, so each query row is stored times
// a power of two 2^-k that puts its largest latent value in [2^14, 2^15) (exact for every value
// within 2^29 of it), and its logits are multiplied back by 2^k.
struct QPrescale {
  float q_unscale[kTileRows];  // 2^k: the row's latent q was stored times 2^-k
  int q_max_bits[kTileRows];   // the row's largest |latent q| (float bits), for the prescale
};

// Element `half` of a pair of q (f16 or bf16), as a float.
__device__ __forceinline__ float chunk_elem(const DecodeAttention& a, uint32_t word, int half) {
  const uint16_t h = uint16_t(word >> (16 * half));
  return a.q_type == QType::kF16 ? __half2float(__ushort_as_half(h)) : bf16_to_f32(h);
}

// The largest |latent q| of each row among fetch_q's chunks, into stats.q_max_bits (zeroed before).
__device__ __forceinline__ void q_row_max_bits(const DecodeAttention& a, const uint4 (&fetched)[kQChunksPerThread],
                                               QPrescale& stats) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow;
    if (c >= kQChunks) break;
    if (c - r * kChunksPerRow >= kLatent / 8) continue;  // k_pe: no prescale
    const uint32_t words[4] = {fetched[i].x, fetched[i].y, fetched[i].z, fetched[i].w};
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(chunk_elem(a, words[j / 2], j % 2)));  // NaN skipped
    atomicMax(&stats.q_max_bits[r], __float_as_int(m));  // nonnegative floats order as their bits
  }
}

// The exponent field of a nonnegative float (0 for zero and subnormals, 255 for NaN).
__device__ __forceinline__ uint32_t exponent_of(float x) { return (__float_as_uint(x) >> 23) & 0xFFu; }

template <CacheFormat kFormat>
struct RsLayout {
  static constexpr bool kFp8 = kFormat == CacheFormat::kFp8;
  static_assert(kFp8 || kFormat == CacheFormat::kFp8DsMla, "a 1-byte cache");
  // fp8_ds_mla: a raw tile, [64][656]; plain fp8: the boxes' layout (fp8_tile_offset), 36,864.
  static constexpr int kStageBytes = kFp8 ? BoxedTile<kFormat>::kBytes : kTileTokens * kDsMlaEntryBytes;
  static constexpr int kPTiles = kFp8 ? 1 : kScaleTiles;                        // P tiles a warpgroup
  static constexpr int kRaw = 0;                                                // [kRsStages][kStageBytes]
  // The query: fp8_ds_mla 8 x [16][128 B] f16 and [16][128 B] bf16 k_pe, swizzled; plain fp8 its
  // E4M3 codes at fp8_tile_offset (16 rows).
  static constexpr int kQ = kRaw + kRsStages * kStageBytes;
  static constexpr int kQpe = kQ + (kFp8 ? fp8_tile_offset(0, kLatent, kTileRows) : kLatent / 64 * kTileRows * 128);
  static constexpr int kP = kQpe + kTileRows * (kFp8 ? 64 : 128);               // [group][P tile][16][128 B]
  static constexpr int kMax = kP + kRsGroups * kPTiles * kTileRows * 128;       // float [group][warp][16]
  static constexpr int kRef = kMax + kRsGroups * 4 * kTileRows * 4;             // float [group][16]: the end's max
  // fp8_ds_mla: uint32 [stage][2], live tokens; plain fp8: uint64 [stage], masked tokens (zero_rows).
  static constexpr int kMasks = kRef + kRsGroups * kTileRows * 4;
  static constexpr int kBarriers = kMasks + kRsStages * 8;                      // uint64 full[stages], empty[stages]
  static constexpr int kStats = kBarriers + 2 * kRsStages * 8;                  // QPrescale
  static constexpr int kLse = kStats + (int(sizeof(QPrescale)) + 15) / 16 * 16; // float [16]: a cluster's rows
  static constexpr int kEnds = kLse + kTileRows * 4;                            // int [stage]: the stream's end
  static constexpr int kClaimed = kEnds + kRsStages * 4;                        // RsTile [2]: claims for warp 1
  static constexpr int kPlace = kClaimed + 2 * 16;                              // CtaPlace: the producer's
  static constexpr int kRows = kPlace + 32;                                     // int64 [stage][64] (plain fp8)
  static constexpr int kBytes = kRows + (kFp8 ? kRsStages * kTileTokens * 8 : 0);
  // At the end, over the stages: the staged output rows in stage 0, each warpgroup's half of out for
  // the other in stage 2 + group; over the P tiles, a cluster merge's weights.
  static_assert(kStageBytes % 1024 == 0 && kQ % 1024 == 0 && kQpe % 512 == 0 && kP % 1024 == 0 && kRows % 16 == 0);
  static_assert(sizeof(CtaPlace) <= kRows - kPlace);
  static_assert(kTileRows * kStagingStride * 4 <= kStageBytes && 4 * 2 * 128 * 16 <= kStageBytes && kRsStages >= 4);
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
};

// The token of S^T's M row 16w + g + 8h: fp8_ds_mla's A fragments take rows g and g + 1 of a
// quarter-warp 4 tokens apart (conflict-free loads); plain fp8's M rows are the tile's rows.
template <CacheFormat kFormat>
__host__ __device__ constexpr int rs_token(int w, int g, int h) {
  return 16 * w + 8 * h + (kFormat == CacheFormat::kFp8 ? g : (g >> 1) + 4 * (g & 1));
}
// The latent column of P.V's M row 16w + g + 8h of block mb: blocks 2t, 2t + 1 in scale tile t,
// a thread's 4 columns of a scale tile one 32-bit word.
__host__ __device__ constexpr int rs_column(int mb, int w, int g, int h) {
  return 128 * (mb >> 1) + 32 * w + 4 * g + 2 * (mb & 1) + h;
}
// The query row of accumulator element k = 2 (x >> 2) + (x & 1) of lane column c.
__device__ __forceinline__ int rs_row(int k, int c) { return 8 * (k >> 1) + 2 * c + (k & 1); }
// Where the query tile holds latent column col: the A fragments of k-step 4G + j take the codes
// 64G + 16c + 4j + [0, 4) of a token, as (2c, 2c + 1) and (2c + 8, 2c + 9); the k_pe k-step
// 2h + kk takes k_pe columns 32h + 8c + 4kk + [0, 4) as (2c, 2c + 1), (2c + 8, 2c + 9).
__host__ __device__ constexpr int rs_q_kstep(int col) {
  const int G = col / 64, c = col % 64 / 16, j = col % 16 / 4, i = col % 4;
  return 16 * (4 * G + j) + 2 * c + (i & 1) + 8 * (i >> 1);
}
__host__ __device__ constexpr int rs_qpe_kstep(int col) {
  const int h = col / 32, c = col % 32 / 8, kk = col % 8 / 4, f = col % 4 / 2, e = col % 2;
  return 16 * (2 * h + kk) + 2 * c + 8 * f + e;
}

// The query tile from fetch_q's chunks: latent as f16 times the row's prescale, k_pe as bf16.
__device__ __forceinline__ void rs_store_q(const DecodeAttention& a, const uint4 (&fetched)[kQChunksPerThread],
                                           const QPrescale& stats, uint8_t* q_tile, uint8_t* qpe_tile) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow, chunk = c - r * kChunksPerRow;
    if (c >= kQChunks) break;
    const uint32_t words[4] = {fetched[i].x, fetched[i].y, fetched[i].z, fetched[i].w};
    if (chunk < kLatent / 8) {
      const float prescale = 1.0f / stats.q_unscale[r];  // a power of two: exact
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = rs_q_kstep(8 * chunk + 2 * j);
        *reinterpret_cast<uint32_t*>(q_tile + swizzled_piece(r, k / 8, kTileRows) + 2 * (k % 8)) =
            pack_elems<ActType::kF16>(chunk_elem(a, words[j], 0) * prescale, chunk_elem(a, words[j], 1) * prescale);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = rs_qpe_kstep(8 * (chunk - kLatent / 8) + 2 * j);
        *reinterpret_cast<uint32_t*>(qpe_tile + swizzled_piece(r, k / 8, kTileRows) + 2 * (k % 8)) =
            a.q_type == QType::kF16 ? pack_elems<ActType::kBF16>(chunk_elem(a, words[j], 0), chunk_elem(a, words[j], 1))
                                    : words[j];
      }
    }
  }
}

// Plain fp8: the query tile from fetch_q's chunks, its E4M3 codes as they are (8 a chunk, inside one
// 16-byte piece of fp8_tile_offset's layout).
__device__ __forceinline__ void rs_store_q_codes(const uint4 (&fetched)[kQChunksPerThread], uint8_t* q_tile) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow, chunk = c - r * kChunksPerRow;
    if (c >= kQChunks) break;
    *reinterpret_cast<uint2*>(q_tile + fp8_tile_offset(r, 8 * chunk, kTileRows)) = make_uint2(fetched[i].x, fetched[i].y);
  }
}

// One warpgroup's softmax state and out^T (o[mb][x]: M row 16w + g + 8 ((x >> 1) & 1) of block
// mb, query row rs_row(k, c), k = 2 (x >> 2) + (x & 1)).
struct RsState {
  float o[8][8];
  float ref[4], sum[4];  // per query row k: the reference max (log2 units), this thread's sum
};

// The splits of a sequence launched as one thread block cluster (rank = split) merge there instead
// of in combine_kernel. Each CTA has staged its split's rows (normalized, float32, kStagingStride
// apart) and their lse (-inf: empty or not a live split, rows of zeros). CTA k then merges output
// pieces k, k + n, ... of every row over the cluster's n CTAs, with combine_kernel's weights
// (exp(lse_s - max lse) over the non-empty splits; a NaN lse makes the row NaN), and writes them;
// rank 0 writes the lse. weights: [kTileRows][kMaxClusterSplits] floats of this CTA's. Run by the
// consumer warpgroups (the producer's threads take part in the two cluster barriers only).
constexpr int kMaxClusterSplits = 8;  // a portable cluster size

__device__ void merge_cluster_splits(const DecodeAttention& a, int64_t b, int64_t row0, const float* staging,
                                     const float* row_lse, float* weights) {
  const int n = int(cluster_size()), me = int(cluster_rank()), tid = int(threadIdx.x);
  const int rows = int(min64(a.rows() - row0, kTileRows));
  cluster_sync();  // every split's rows and lse are staged
  if (tid < rows) {
    float lse[kMaxClusterSplits], m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      lse[j] = j < n ? cluster_load(cluster_addr(row_lse + tid, j)) : -INFINITY;
      m = fmaxf(m, lse[j]);  // skips NaN: a NaN lse propagates through its weight
    }
    float weight[kMaxClusterSplits], sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      weight[j] = lse[j] == -INFINITY ? 0.0f : expf(lse[j] - m);
      sum += weight[j];
    }
    const bool empty = sum == 0.0f;  // no split saw a token (a NaN sum is not empty)
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) weights[tid * kMaxClusterSplits + j] = empty ? 0.0f : weight[j] / sum;
    if (me == 0) a.lse[b * a.rows() + row0 + tid] = empty ? -INFINITY : m + logf(sum);
  }
  named_barrier_sync(kRsConsumerBarrier, kThreads);
  constexpr int kPieces = kLatent / 8;
  const int mine = (kPieces - me + n - 1) / n;
  for (int i = tid; i < rows * mine; i += kThreads) {
    const int row = i / mine, col = 8 * (me + n * (i % mine));
    float v[8] = {};
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j >= n) break;
      const float w = weights[row * kMaxClusterSplits + j];
      const uint32_t src = cluster_addr(staging + row * kStagingStride + col, j);
      const float4 lo = cluster_load4(src), hi = cluster_load4(src + 16);
      const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = fmaf(w, x[e], v[e]);
    }
    store_out8(a, b, row0 + row, col, v);
  }
  cluster_sync();  // the other CTAs are done reading this one's rows
}

// ---- Splits balanced at run time (DecodeAttention::claims) ----
//
// The CTAs of one sequence's splits stream the same number of tiles, yet on the GPU their loops
// differ by up to a fifth (H100, plain fp8, B 16 x 16k: 40-50 us for 31 tiles), and the call ends
// with the slowest. So, where the splits merge in combine_kernel (whose merge takes any split of
// any tiles), the last quarter of each split's tiles is shared out: the CTA streams its first
// tiles as cut, then claims tail tiles one at a time, its own first (SplitClaim record, opened once
// its stages are filled), then, once its own claim fails (it closes its record), those of the
// sequence's other splits, the one with the most left first. A CTA's partial thus covers a set of
// tiles that depends on timing, so the float rounding does too (balance_splits=False keeps the
// cut). The ends even out, but the loops get slower (the splits share the HBM either way): plain
// fp8 gains only with long splits (docs/DECODE_ATTENTION.md, Thirtieth round).

// The tile whose first token is `start`, of a split whose loads end at `end`; start < 0: the end
// of the CTA's stream. 32-bit: choose_kernel takes this kernel only for tables of at most
// kRsMaxTokens tokens a sequence (the producer has 40 registers a thread).
struct RsTile {
  int start, end;
};

// The tail tiles of a split of `tiles`: shared out.
__device__ __forceinline__ int rs_tail_tiles(int tiles) { return tiles / 4; }
// The shortest splits that share out their tails (H100, B 16, H 12 and 16, the call's time against
// fixed splits: fp8_ds_mla 0.5-2.5% faster at 32-64 tiles a split, 0-4% at 16; plain fp8 about 1.4%
// slower at 32 tiles a split, 1.5-2% faster at 64: docs/DECODE_ATTENTION.md, Thirtieth round).
#ifndef JKM_RS_FP8_BALANCED_MIN_TILES  // benchmarks/probes/decode_attention.cu may set it
#define JKM_RS_FP8_BALANCED_MIN_TILES 64
#endif
template <CacheFormat kFormat>
constexpr int kRsBalancedMinTiles = kFormat == CacheFormat::kFp8 ? JKM_RS_FP8_BALANCED_MIN_TILES : kRsMinSplitTiles;

// Split j of a sequence of len tokens (per = split_tokens(len, share), j < splits_of(len, per)) as
// split_work cuts it: its tile count and its tile i.
__device__ __forceinline__ int rs_split_tiles(int per, int len, int j) {
  const int first = j * per;
  return (min(first + per, len) - first + kTileTokens - 1) / kTileTokens;
}
__device__ __forceinline__ RsTile rs_split_tile(int per, int len, int j, int i) {
  const int first = j * per;
  return RsTile{first + i * kTileTokens, min(first + per, len)};
}

// The claim record of split j of sequence b, the CTA's query rows. By count, the sequence and the
// rows are the block index's, read again each time rather than held in a register through the
// producer's loop (b is then unused); by work, b is the work list's.
template <bool kByWork>
__device__ __forceinline__ SplitClaim* rs_record(const DecodeAttention& a, int64_t b, int j) {
  return a.claim_record(j, kByWork ? b : int64_t(blockIdx.y), int64_t(blockIdx.x) * kTileRows);
}

// The owner's record opened: claimed = 0 made visible before the tag that lets others claim.
__device__ __forceinline__ void open_claims(SplitClaim* record) {
  record->claimed = 0;
  __threadfence();
  *reinterpret_cast<volatile unsigned long long*>(&record->open) = kClaimOpen;
}

// The CTA's next claimed tile (split me of the CTA's sequence, the CTA's query rows), or
// the end; run by the producer's warp 0, the result the same in every lane. own_open: this split's
// own record may still have tiles; then lane 0's `ahead` is a claim on it already made (an atomic
// add's result, first used here), and the next one is made before returning, so that no atomic's
// latency sits between a freed stage and its next tile.
template <bool kByWork>
__device__ __forceinline__ RsTile rs_claim(const DecodeAttention& a, int64_t b, int me, int len, int per,
                                           bool& own_open, unsigned& ahead) {
  const int lane = int(threadIdx.x) % 32, live = DecodeAttention::splits_of(len, per);
  if (own_open) {
    const int tiles = rs_split_tiles(per, len, me), tail = rs_tail_tiles(tiles);
    SplitClaim* mine = rs_record<kByWork>(a, b, me);
    const unsigned got = __shfl_sync(0xFFFFFFFFu, ahead, 0);
    if (got < unsigned(tail)) {
      if (lane == 0) ahead = atomicAdd(&mine->claimed, 1u);
      return rs_split_tile(per, len, me, tiles - tail + int(got));
    }
    own_open = false;
    if (lane == 0) atomicExch(&mine->open, 0ull);  // closed before the kernel ends: the next call's scratch
  }
  for (;;) {
    // Lane k looks at split me + 1 + k's record (the next 32 splits: enough to even out the
    // splits' ends); the warp picks the one with the most tiles left (key: left << 10 | split, 0
    // for none; kMaxSplits = 1024).
    int key = 0;
    if (lane < live - 1) {
      const int j = (me + 1 + lane) % live, tail = rs_tail_tiles(rs_split_tiles(per, len, j));
      const SplitClaim* record = rs_record<kByWork>(a, b, j);
      const unsigned long long open = *reinterpret_cast<const volatile unsigned long long*>(&record->open);
      const int left = tail - int(*reinterpret_cast<const volatile unsigned*>(&record->claimed));
      if (open == kClaimOpen && tail > 0 && left > 0) key = min(left, (1 << 21) - 1) << 10 | j;
    }
    key = __reduce_max_sync(0xFFFFFFFFu, key);
    if (key == 0) return RsTile{-1, 0};
    const int j = key & 1023;
    unsigned got = 0;
    if (lane == 0) {
      __threadfence();  // after seeing the tag: the owner's claimed = 0 comes first
      got = atomicAdd(&rs_record<kByWork>(a, b, j)->claimed, 1u);
    }
    got = __shfl_sync(0xFFFFFFFFu, got, 0);
    const int tiles = rs_split_tiles(per, len, j), tail = rs_tail_tiles(tiles);
    if (got < unsigned(tail)) return rs_split_tile(per, len, j, tiles - tail + int(got));
  }
}

// The producer warpgroup (threads kThreads.. of the CTA): the CTA's stream of tiles (its split's,
// or with `balanced` its first ones, then claimed ones: rs_claim), position t into stage
// t % kRsStages once the consumer warpgroup that read the stage's position t - kRsStages has
// arrived on its empty barrier, and each warpgroup's second position once its first has landed (so
// every CTA's first tiles come before anyone's second ones). After the last tile, the next two
// positions (one a warpgroup) complete with ends[stage] set and no bytes. fp8_ds_mla: warps 0-1, a
// token a thread, each run of consecutive rows one bulk copy, and the tile's live-token masks;
// plain fp8: warp 0, the tile's boxes (issue_swizzled_tile) from its rows in tile_rows. The next
// tile is known (claimed) and its rows looked up while the current one's stage is waited for. The
// consumers neither look up nor issue: wgmma is a warpgroup's, so a warp busy issuing held up its
// warpgroup's next MMA (docs/DECODE_ATTENTION.md, Twenty-fifth round).
// Its place is worked out here again (by count from the block index, by work read from L::kPlace),
// its split in 32-bit: values kept from before the branch must fit the producer's registers too,
// and ptxas spilled them, the consumers' copies also.
template <CacheFormat kFormat, bool kByWork>
__device__ void produce_rs_tiles(const DecodeAttention& a, const TileMaps& maps, uint8_t* smem, bool balanced) {
  using L = RsLayout<kFormat>;
  constexpr bool kFp8 = L::kFp8;
  constexpr int kIssuers = kFp8 ? 32 : kTileTokens;
  const int thread = int(threadIdx.x) - kThreads, lane = thread % 32;
  if (thread >= kIssuers) return;  // whole warps
  uint8_t* raw = smem + L::kRaw;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kRsStages;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + L::kMasks);     // fp8_ds_mla: [stage][2]
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kMasks);  // plain fp8: [stage]
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kRows);     // plain fp8: [stage][64]
  int* ends = reinterpret_cast<int*>(smem + L::kEnds);
  RsTile* handed = reinterpret_cast<RsTile*>(smem + L::kClaimed);       // [claim % 2]: warp 0's, for warp 1
  const CtaPlace at = kByWork ? *reinterpret_cast<const CtaPlace*>(smem + L::kPlace) : cta_place_in_one_wave();
  const int64_t b = at.b;
  const int len = int(a.context_len(b)), per = int(a.split_tokens(len, at.share)), me = at.split;
  balanced = balanced && per >= kRsBalancedMinTiles<kFormat> * kTileTokens;
  const int tiles = int64_t(me) * per < len ? rs_split_tiles(per, len, me) : 0;
  const int own = balanced ? tiles - rs_tail_tiles(tiles) : tiles;
  bool own_open = own < tiles;  // (warp 0's)
  int claims = 0;
  unsigned ahead = 0;  // thread 0's claim made a position ahead (rs_claim)
  // The tile at position t of the stream, the same in every issuing thread.
  const auto tile_at = [&](int t) {
    if (t < own) {
      if (t + 1 == own && own_open && thread == 0)  // the first claim, a position ahead (opened by now)
        ahead = atomicAdd(&rs_record<kByWork>(a, b, me)->claimed, 1u);
      return rs_split_tile(per, len, me, t);
    }
    if (!balanced) return RsTile{-1, 0};
    RsTile got{-1, 0};
    if (thread < 32) got = rs_claim<kByWork>(a, b, me, len, per, own_open, ahead);
    if constexpr (!kFp8) {  // warp 0 claims for both warps
      RsTile* slot = handed + (claims & 1);  // two slots: warp 1 has read one before warp 0 refills it
      if (thread == 0) *slot = got;
      named_barrier_sync(kRsProducerBarrier, kIssuers);
      got = *slot;
    }
    ++claims;
    return got;
  };
  // This thread's rows of a tile: plain fp8 tokens lane and lane + 32, fp8_ds_mla token `thread`.
  const auto look_up = [&](const RsTile& tile, int64_t (&rows)[2]) {
    const auto row = [&](int token) { return tile.start + token < tile.end ? a.token_row(b, tile.start + token) : -1; };
    rows[0] = row(kFp8 ? lane : thread);
    rows[1] = kFp8 ? row(lane + 32) : -1;
  };
  const auto wait_for_stage = [&](int t) {
    const int s = t % kRsStages;
    if (t >= kRsStages) mbarrier_wait(empty + s, uint32_t(t / kRsStages - 1) & 1);
    else if (t >= kRsGroups) mbarrier_wait(full + s - kRsGroups, 0);  // the warpgroup's first tile landed
  };
  JKM_START_AT(0);
  RsTile tile = tile_at(0);
  int64_t rows[2] = {-1, -1};
  if (tile.start >= 0) look_up(tile, rows);
  for (int t = 0;; ++t) {
    if (tile.start < 0) {  // positions t and t + 1: each consumer warpgroup finds the end
#pragma unroll
      for (int e = 0; e < kRsGroups; ++e) {
        wait_for_stage(t + e);
        const int s = (t + e) % kRsStages;
        if (thread == 0) ends[s] = 1;
        mbarrier_arrive(full + s);
      }
      return;
    }
    const RsTile following = tile_at(t + 1);
    int64_t next[2] = {-1, -1};
    if (following.start >= 0) look_up(following, next);
    wait_for_stage(t);
    const int s = t % kRsStages;
    uint8_t* stage = raw + s * L::kStageBytes;
    if constexpr (kFp8) {
      tile_rows[s * kTileTokens + lane] = rows[0], tile_rows[s * kTileTokens + lane + 32] = rows[1];
      __syncwarp();
      issue_swizzled_tile<kFormat>(a, maps, tile_rows + s * kTileTokens, stage, full + s, zero_rows + s);
    } else {
      const uint32_t live = __ballot_sync(0xFFFFFFFFu, rows[0] >= 0);
      if (lane == 0) masks[2 * s + thread / 32] = live;
      issue_raw_tile<CacheFormat::kFp8DsMla>(a, rows[0], stage, full + s, thread);
    }
    if (t < 4) JKM_START_AT(1 + t);
    // The record opened once the stages are filled, so that its fence (which waits for this
    // thread's loads) is off the first tiles' path, and before this CTA's first claim
    // (tile_at(own - 1), at t = own - 2).
    if (t == min(kRsStages - 1, own - 3) && own_open && thread == 0)
      open_claims(rs_record<kByWork>(a, b, me));
    tile = following, rows[0] = next[0], rows[1] = next[1];
  }
}

template <CacheFormat kFormat, bool kByWork>
__device__ __forceinline__ void attend_rs(const DecodeAttention& a, const CtaPlace& at, const Scales& scales,
                                          const TileMaps& maps, uint8_t* smem) {
  using L = RsLayout<kFormat>;
  constexpr bool kFp8 = L::kFp8;
  constexpr int kEntryBytes = kDsMlaEntryBytes;  // fp8_ds_mla's raw rows
  const int64_t b = at.b, len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(at.row_group) * kTileRows, at.split, len, len, at.share);
  // A split past the length: the combine skips it; in a cluster it stages empty rows for the merge.
  const bool in_cluster = cluster_size() > 1;
  if (a.num_splits > 1 && w.first >= len && !in_cluster) return;

  uint8_t* raw = smem + L::kRaw;
  uint8_t* q_tile = smem + L::kQ;
  uint8_t* qpe_tile = smem + L::kQpe;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + L::kMasks);
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kMasks);  // plain fp8
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kRsStages;
  QPrescale& stats = *reinterpret_cast<QPrescale*>(smem + L::kStats);
  volatile int* ends = reinterpret_cast<int*>(smem + L::kEnds);
  const auto stage = [&](int s) { return raw + s * L::kStageBytes; };
  const int tid = int(threadIdx.x);

  if (tid == 0) {
    for (int s = 0; s < kRsStages; ++s) mbarrier_init(full + s, kFp8 ? 32 : kTileTokens), mbarrier_init(empty + s, 128);
    mbarrier_init_fence();
  }
  if (tid < kTileRows) stats.q_max_bits[tid] = 0;
  if (tid < kRsStages) ends[tid] = 0;
  __syncthreads();  // the mbarriers, the zeroed maxima and ends are ready
  JKM_PHASE_AT(1);
  if (uniform_warp_index() / 4 == kRsGroups) {  // the producer: every tile of the split, then the cluster's barriers
    set_max_registers<kRsProducerRegisters<kFormat>, false>();
    produce_rs_tiles<kFormat, kByWork>(a, maps, smem, a.claims != nullptr && !in_cluster);
    if (in_cluster) cluster_sync(), cluster_sync();  // merge_cluster_splits's
    return;
  }
  set_max_registers<kRsConsumerRegisters<kFormat>, true>();
  // The consumers' places, worked out after the branch: kept from before it, ptxas spilled some
  // (they would have to fit the producer's registers too).
  const int warp = uniform_warp_index(), lane = tid % 32;
  const int group = warp / 4, wq = warp % 4, g = lane / 4, c = lane % 4, gtid = tid % 128;
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<ActType::kF16>(a, b, w.row0, q_fetched);
  if constexpr (kFp8) {
    rs_store_q_codes(q_fetched, q_tile);
    JKM_START_AT(5);
  } else {
    q_row_max_bits(a, q_fetched, stats);
    JKM_START_AT(5);
    named_barrier_sync(kRsConsumerBarrier, kThreads);
    if (tid < kTileRows) {  // the prescale 2^-k puts the row's largest latent value in [2^14, 2^15)
      const uint32_t e = exponent_of(__int_as_float(stats.q_max_bits[tid]));
      stats.q_unscale[tid] = e == 0 || e == 0xFF ? 1.0f : ldexpf(1.0f, max(int(e) - 127 - 14, -126));
    }
    named_barrier_sync(kRsConsumerBarrier, kThreads);
    rs_store_q(a, q_fetched, stats, q_tile, qpe_tile);
  }
  fence_proxy_async();  // the query tile is read by wgmma
  named_barrier_sync(kRsConsumerBarrier, kThreads);

  uint8_t* p_mine = smem + L::kP + group * L::kPTiles * kTileRows * 128;
  float* max_mine = reinterpret_cast<float*>(smem + L::kMax) + group * 4 * kTileRows;
  const int bar_id = 1 + group;
  const int tok0 = rs_token<kFormat>(wq, g, 0), tok1 = rs_token<kFormat>(wq, g, 1);
  float unscale[4];  // each query row's logit scale (fp8_ds_mla: its prescale undone too)
#pragma unroll
  for (int k = 0; k < 4; ++k) unscale[k] = kFp8 ? scales.logit : stats.q_unscale[rs_row(k, c)] * scales.logit;
  RsState st;
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int x = 0; x < 8; ++x) st.o[mb][x] = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) st.ref[k] = -INFINITY, st.sum[k] = 0.0f;
  JKM_PHASE_AT(2);

  for (int64_t i = group;; i += kRsGroups) {  // position i of the producer's stream, to its end
    const int s = int(i % kRsStages);
    const uint8_t* tile = stage(s);
    mbarrier_wait(full + s, uint32_t(i / kRsStages) & 1);
    if (ends[s]) break;
    JKM_TILE_AT(i);
    bool live0, live1;
    float acc[kFp8 ? kLatent / 128 + 1 : kScaleTiles][8], acc_pe[8];
    if constexpr (kFp8) {
      const uint64_t masked = zero_rows[s];
      live0 = !((masked >> tok0) & 1), live1 = !((masked >> tok1) & 1);
      if (masked != 0) {  // rare (uniform over the warpgroup): zeroed before S^T and P.V read them
        zero_masked_rows<kFormat>(masked, const_cast<uint8_t*>(tile), gtid, 128);
        named_barrier_sync(bar_id, 128);
      }
      // S^T: k-step `step` takes the 32 codes at 32 (step % 4) of chunk step / 4, one accumulator a
      // chunk (the tensor cores' E4M3 sums are coarser than float32: added in float32 below).
      wgmma_fence_after(acc);
#pragma unroll
      for (int step = 0; step < kFp8QkSteps; ++step) {
        const int chunk = step / 4, at = 32 * (step % 4);
        const uint8_t* k_at = tile + fp8_tile_offset(0, 128 * chunk, kTileTokens) + at;
        const uint8_t* q_at = q_tile + fp8_tile_offset(0, 128 * chunk, kTileRows) + at;
        const bool rope = 128 * chunk >= kLatent;
        wgmma_m64n16k32_e4m3_ss(acc[chunk], rope ? swizzled_descriptor_64(k_at) : swizzled_descriptor(k_at),
                                rope ? swizzled_descriptor_64(q_at) : swizzled_descriptor(q_at), step % 4 != 0);
      }
      wgmma_commit();
    } else {
      const uint8_t* row0 = tile + tok0 * kEntryBytes;
      const uint8_t* row1 = tile + tok1 * kEntryBytes;
      const uint32_t live = masks[2 * s + wq / 2];
      live0 = (live >> (tok0 % 32)) & 1, live1 = (live >> (tok1 % 32)) & 1;
      // S^T, latent: group G = columns 64G .. 64G + 63, k-steps 4G .. 4G + 3, scale tile G / 2.
      uint32_t frag[2][16];
      uint4 next0 = *reinterpret_cast<const uint4*>(row0 + 16 * c);
      uint4 next1 = *reinterpret_cast<const uint4*>(row1 + 16 * c);
#pragma unroll
      for (int G = 0; G < kLatent / 64; ++G) {
        const uint32_t w0[4] = {next0.x, next0.y, next0.z, next0.w}, w1[4] = {next1.x, next1.y, next1.z, next1.w};
        if (G + 1 < kLatent / 64) {
          next0 = *reinterpret_cast<const uint4*>(row0 + 64 * (G + 1) + 16 * c);
          next1 = *reinterpret_cast<const uint4*>(row1 + 64 * (G + 1) + 16 * c);
        }
        if (G >= 2) wgmma_wait<1>();  // group G - 2 done (frag[G & 1] was its); G - 1 may still run
        uint32_t(&f)[16] = frag[G & 1];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          f[4 * j + 0] = e4m3x2_half_to_f16x2<0>(w0[j]);
          f[4 * j + 1] = e4m3x2_half_to_f16x2<0>(w1[j]);
          f[4 * j + 2] = e4m3x2_half_to_f16x2<1>(w0[j]);
          f[4 * j + 3] = e4m3x2_half_to_f16x2<1>(w1[j]);
        }
        if (G % 2 == 0) wgmma_fence_after(acc[G / 2]);
        else wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int step = 4 * G + j;
          wgmma_m64n16k16_rs<true>(acc[G / 2], f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3],
                                   swizzled_descriptor(q_tile + step / 4 * kTileRows * 128 + 32 * (step % 4)),
                                   (G & 1) || j);
        }
        wgmma_commit();
      }
      // k_pe: 16-byte piece 4h + c of a token's k_pe holds the bf16 pairs of k-steps 2h, 2h + 1
      uint4 pe[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        pe[0][h] = *reinterpret_cast<const uint4*>(row0 + kLatent + 16 + 16 * (4 * h + c));
        pe[1][h] = *reinterpret_cast<const uint4*>(row1 + kLatent + 16 + 16 * (4 * h + c));
      }
      wgmma_fence_after(acc_pe);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wgmma_m64n16k16_rs<false>(acc_pe, pe[0][h].x, pe[1][h].x, pe[0][h].y, pe[1][h].y,
                                  swizzled_descriptor(qpe_tile + 32 * (2 * h)), h);
        wgmma_m64n16k16_rs<false>(acc_pe, pe[0][h].z, pe[1][h].z, pe[0][h].w, pe[1][h].w,
                                  swizzled_descriptor(qpe_tile + 32 * (2 * h + 1)), 1);
      }
      wgmma_commit();
    }
    // fp8_ds_mla: each token's tile scales; plain fp8: none (its one scale is in scales).
    float tile_scale[2][kScaleTiles];
    if constexpr (kFp8) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < kScaleTiles; ++t) tile_scale[h][t] = 1.0f;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 sc = *reinterpret_cast<const float4*>(tile + (h ? tok1 : tok0) * kEntryBytes + kLatent);
        tile_scale[h][0] = sc.x, tile_scale[h][1] = sc.y, tile_scale[h][2] = sc.z, tile_scale[h][3] = sc.w;
      }
    }
    wgmma_wait<0>();

    // Logits (log2 units; -inf for a masked token or one past the length) and the vote.
    // fp8_ds_mla: the reference covers logit + log2(the token's largest scale), so that p s_t <=
    // 2^kRsSlack fits f16 whatever the scales (floored: a zero scale must not hide the token's k_pe
    // logit).
    float top_scale[2] = {0.0f, 0.0f};
    if constexpr (!kFp8)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        top_scale[h] = __log2f(fmaxf(fmaxf(fmaxf(tile_scale[h][0], tile_scale[h][1]),
                                           fmaxf(tile_scale[h][2], tile_scale[h][3])), 1e-30f));
    float logit[8], reach[8];  // reach: logit + top_scale, what the reference must cover
    bool over = false;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
      float v = 0.0f;
      if constexpr (kFp8) {
#pragma unroll
        for (int chunk = 0; chunk < kLatent / 128 + 1; ++chunk) v += acc[chunk][x];
        v *= unscale[k];
      } else {
#pragma unroll
        for (int t = 0; t < kScaleTiles; ++t) v = fmaf(tile_scale[h][t], acc[t][x], v);
        v = fmaf(v, unscale[k], acc_pe[x] * scales.logit);
      }
      logit[x] = (h ? live1 : live0) ? v : -INFINITY;
      reach[x] = logit[x] + top_scale[h];
      over |= reach[x] > st.ref[k] + kRsSlack;
    }
    // P'_t^T: (query row n, token m) of P tile t at swizzled_piece(n, m / 8) + 2 (m % 8).
    float p[8];
    const auto write_p = [&]() {
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1), m = h ? tok1 : tok0;
        // While the reference is still -inf, p is 0, or NaN for a NaN logit (it must reach out and
        // lse). Both arms are computed and selected, the NaN one by bits: as nested ternaries, ptxas
        // branched around each of the eight powers (their MUFU latencies in a row, a reconvergence
        // point each); so the loop is straight from S^T to P.V, as the probe's.
        const float power = exp2f(logit[x] - st.ref[k]);
        const uint32_t bits = __float_as_uint(logit[x]);
        const float nan_or_zero = __uint_as_float(bits & (0u - uint32_t((bits & 0x7FFFFFFFu) > 0x7F800000u)));
        p[x] = st.ref[k] != -INFINITY ? power : nan_or_zero;
#pragma unroll
        for (int t = 0; t < L::kPTiles; ++t)
          *reinterpret_cast<__half*>(p_mine + t * kTileRows * 128 + swizzled_piece(rs_row(k, c), m / 8, kTileRows) +
                                     2 * (m % 8)) = __float2half_rn(p[x] * tile_scale[h][t]);
      }
      fence_proxy_async();  // P is read by wgmma
    };
    write_p();
    if (named_barrier_or(bar_id, 128, over)) {  // rare: the reference moves to the tile's max
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float v = fmaxf(reach[4 * (k >> 1) + (k & 1)], reach[4 * (k >> 1) + 2 + (k & 1)]);
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 8));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 16));
        if (g == 0) max_mine[wq * kTileRows + rs_row(k, c)] = v;
      }
      named_barrier_sync(bar_id, 128);
      float alpha[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = rs_row(k, c);
        const float m = fmaxf(fmaxf(max_mine[n], max_mine[kTileRows + n]),
                              fmaxf(max_mine[2 * kTileRows + n], max_mine[3 * kTileRows + n]));
        const float ref = fmaxf(st.ref[k], m);
        alpha[k] = ref == -INFINITY ? 1.0f : exp2f(st.ref[k] - ref);
        st.ref[k] = ref;
        st.sum[k] *= alpha[k];
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int x = 0; x < 8; ++x) st.o[mb][x] *= alpha[2 * (x >> 2) + (x & 1)];
      write_p();
      named_barrier_sync(bar_id, 128);  // P is complete; the maxima may be written again
    }
#pragma unroll
    for (int x = 0; x < 8; ++x) st.sum[2 * (x >> 2) + (x & 1)] += p[x];

    // O^T += V^T P'^T: k-step ks takes tokens 16 ks + 2c + e + 8f; a thread's column word of
    // column tile t is at 128t + 32w + 4g (byte 2v + h: block 2t + v, row half h). Plain fp8: a
    // token's row % 8 is 2c + e, so its swizzled place is v_base[e] plus immediates.
    const uint8_t* v_base[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) v_base[e] = tile + (kFp8 ? fp8_tile_offset(2 * c + e, 32 * wq + 4 * g, kTileTokens)
                                                        : (2 * c + e) * kEntryBytes + 32 * wq + 4 * g);
    uint32_t vfrag[2][8][4];
#pragma unroll
    for (int ks = 0; ks < kTileTokens / 16; ++ks) {
      uint32_t v[kScaleTiles][2][2];  // [column tile][e][f]
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const uint8_t* row = v_base[e] + (16 * ks + 8 * f) * (kFp8 ? 128 : kEntryBytes);
#pragma unroll
          for (int t = 0; t < kScaleTiles; ++t)
            v[t][e][f] = *reinterpret_cast<const uint32_t*>(row + t * (kFp8 ? kChunkBytes : 128));
        }
      if (ks >= 2) wgmma_wait<1>();  // group ks - 2 done (vfrag[ks & 1] was its); ks - 1 may still run
      uint32_t(&f)[8][4] = vfrag[ks & 1];
#pragma unroll
      for (int t = 0; t < kScaleTiles; ++t)
#pragma unroll
        for (int hv = 0; hv < 2; ++hv) {
          const uint32_t sel = hv ? 0x7362u : 0x5140u;  // bytes 2hv, 2hv + 1 of the e = 0 and e = 1 tokens
          const uint32_t lo = __byte_perm(v[t][0][0], v[t][1][0], sel), hi = __byte_perm(v[t][0][1], v[t][1][1], sel);
          f[2 * t + hv][0] = e4m3x2_half_to_f16x2<0>(lo);
          f[2 * t + hv][1] = e4m3x2_half_to_f16x2<1>(lo);
          f[2 * t + hv][2] = e4m3x2_half_to_f16x2<0>(hi);
          f[2 * t + hv][3] = e4m3x2_half_to_f16x2<1>(hi);
        }
      if (ks == 0) wgmma_fence_after(st.o);
      else wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
        wgmma_m64n16k16_rs<true>(st.o[mb], f[mb][0], f[mb][1], f[mb][2], f[mb][3],
                                 swizzled_descriptor(p_mine + (kFp8 ? 0 : mb / 2) * kTileRows * 128 + 32 * ks), 1);
      wgmma_commit();
    }
    mbarrier_arrive(empty + s);  // the stage is read (into registers): the producer may fill it again
    // Waiting for P.V's last group at the next tile's top instead makes ptxas serialize the wgmmas (C7515).
    wgmma_wait<0>();
  }
  wgmma_wait<0>();
  JKM_PHASE_AT(4);

  // The warpgroups' states meet, each warpgroup merging half of out (blocks 4 group .. 4 group + 3)
  // into the staged rows or the split's partial slot: each publishes its sums per row and its
  // reference, and hands the other half of its out to the other warpgroup through a stage of its
  // own (stage 2 + group: its tiles were in stages group and 2 + group, all read by now, while the
  // other warpgroup may still read its last tile; the staged rows go to stage 0 after the
  // barrier). Each row's weights are worked out once, by lane row % 16 of every warp, and shuffled
  // to the lanes that hold the row: done per thread for four rows by one warpgroup, this merge was
  // about 1000 dependent instructions, the 3.8 us after the loop (docs/DECODE_ATTENTION.md,
  // Twenty-ninth round).
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v = st.sum[k];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
    if (g == 0) max_mine[wq * kTileRows + rs_row(k, c)] = v;  // now the warps' sums
    if (wq == 0 && g == 0) reinterpret_cast<float*>(smem + L::kRef)[group * kTileRows + rs_row(k, c)] = st.ref[k];
  }
  const int other = 1 - group;
  float4* handed = reinterpret_cast<float4*>(stage(2 + group));  // [block j][half][128 threads]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float o[8];  // block 4 other + j, selected: registers take constant indices only
#pragma unroll
    for (int x = 0; x < 8; ++x) o[x] = group == 0 ? st.o[4 + j][x] : st.o[j][x];
    handed[(2 * j) * 128 + gtid] = make_float4(o[0], o[1], o[2], o[3]);
    handed[(2 * j + 1) * 128 + gtid] = make_float4(o[4], o[5], o[6], o[7]);
  }
  named_barrier_sync(kRsConsumerBarrier, kThreads);
  float* staging = reinterpret_cast<float*>(raw);
  const int64_t rows = a.rows();
  float mine_factor[4], other_factor[4], norm[4];
  {
    const int n = lane % kTileRows;
    const float* sums = reinterpret_cast<const float*>(smem + L::kMax);
    const float* refs = reinterpret_cast<const float*>(smem + L::kRef);
    const float m0 = refs[n], m1 = refs[kTileRows + n], m = fmaxf(m0, m1);
    const float f0 = m0 == -INFINITY ? 0.0f : exp2f(m0 - m), f1 = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
    float l[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float* s = sums + q * 4 * kTileRows;
      l[q] = s[n] + s[kTileRows + n] + s[2 * kTileRows + n] + s[3 * kTileRows + n];
    }
    const float sum = f0 * l[0] + f1 * l[1];
    const bool empty_row = sum == 0.0f;  // saw no visible unmasked token; a NaN sum is not empty
    const float row_norm = empty_row ? 0.0f : scales.out / sum;
    const int64_t r = w.row0 + n;
    if (group == 0 && wq == 0 && lane < kTileRows && r < rows) {
      const float lse = empty_row ? -INFINITY : (m + log2f(sum)) * kLn2;
      if (in_cluster) reinterpret_cast<float*>(smem + L::kLse)[n] = lse;
      else store_lse(a, w, r, lse);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = rs_row(k, c);
      const float g0 = __shfl_sync(0xFFFFFFFFu, f0, row), g1 = __shfl_sync(0xFFFFFFFFu, f1, row);
      mine_factor[k] = group == 0 ? g0 : g1, other_factor[k] = group == 0 ? g1 : g0;
      norm[k] = __shfl_sync(0xFFFFFFFFu, row_norm, row);
    }
  }
  const float4* theirs = reinterpret_cast<const float4*>(stage(2 + other));
  // A split's partial goes from the registers to its slot, two columns of a row a store; out (one
  // split, 16-bit) and a cluster's merge take the staged rows.
  const bool to_slot = !in_cluster && w.slot >= 0;
  float* slot_rows = to_slot ? a.partial(w.slot, w.b, w.row0) : nullptr;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int mb = 4 * group + j;
    const float4 lo = theirs[(2 * j) * 128 + gtid], hi = theirs[(2 * j + 1) * 128 + gtid];
    const float o_other[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    // Elements x and x + 2 are columns h = 0, 1 of one row: one 8-byte store.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int x = (i & 1) + 4 * (i >> 1), k = 2 * (x >> 2) + (x & 1);
      float v[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float o_mine = group == 0 ? st.o[j][x + 2 * h] : st.o[4 + j][x + 2 * h];
        v[h] = norm[k] == 0.0f ? 0.0f : (mine_factor[k] * o_mine + other_factor[k] * o_other[x + 2 * h]) * norm[k];
      }
      const int row = rs_row(k, c), col = rs_column(mb, wq, g, 0);
      if (!to_slot) *reinterpret_cast<float2*>(staging + row * kStagingStride + col) = make_float2(v[0], v[1]);
      else if (w.row0 + row < rows) *reinterpret_cast<float2*>(slot_rows + row * kLatent + col) = make_float2(v[0], v[1]);
    }
  }
  if (to_slot) {
    JKM_PHASE_AT(5);
    return;
  }
  named_barrier_sync(kRsConsumerBarrier, kThreads);
  JKM_PHASE_AT(5);
  if (in_cluster) {
    merge_cluster_splits(a, w.b, w.row0, staging, reinterpret_cast<const float*>(smem + L::kLse),
                         reinterpret_cast<float*>(smem + L::kP));
    return;
  }
  store_staged_rows<kTileRows, kThreads>(a, w, rows, staging, tid);
}

// One split of a sequence a CTA: grid (row groups, B <= 65535, splits) by count
// (cta_place_in_one_wave), (row groups, B, work_splits) by work (work_place; its own instance, so
// that the calls by count keep their registers: by count the place is the block index, which
// ptxas reads again where needed). The tensor maps are plain fp8's (zero for fp8_ds_mla).
template <CacheFormat kFormat, bool kByWork>
__global__ void __launch_bounds__(kRsThreads, 1)
    rs_attention_kernel(const DecodeAttention a, const __grid_constant__ TileMaps maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  if constexpr (kFormat == CacheFormat::kFp8) prefetch_tile_maps<kFormat>(maps);
  if constexpr (kByWork) {
    // Warp 0 finds the place (a search over the batch's lengths, which all 12 warps had run side
    // by side) and hands it on through shared memory, where the producer reads it again later.
    CtaPlace* place = reinterpret_cast<CtaPlace*>(smem + RsLayout<kFormat>::kPlace);
    if (threadIdx.x < 32) {
      const CtaPlace found = work_place(a);
      if (threadIdx.x == 0) *place = found;
    }
    __syncthreads();
    const CtaPlace at = *place;
    if (at.b < a.batch) attend_rs<kFormat, true>(a, at, load_scales<kFormat>(a), maps, smem);
  } else {
    attend_rs<kFormat, false>(a, cta_place_in_one_wave(), load_scales<kFormat>(a), maps, smem);
  }
  JKM_PHASE_AT(6);
}

}  // namespace
}  // namespace jax_kimi_mla
