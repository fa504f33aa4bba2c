// wide_attention_kernel: 64 query rows a CTA on wgmma over a 16-bit cache (decode_attention_cuda.cu, 1c).
#pragma once

#include "decode_attention_common.cuh"

namespace jax_kimi_mla {
namespace {

// ---- Many query rows over a 16-bit cache: 64 rows a CTA on wgmma ----
//
// wide_attention_kernel takes attention_kernel's place for a bf16/f16 cache at S_q = 1 when a
// sequence has many query rows (H >= 64, or H >= 32 from B = 8: DeepSeek's 128 heads without TP
// or 32 at TP 4, Kimi-K3's 96 under data-parallel attention). attention_kernel's 16-row CTAs read
// every tile once per 16 heads and issue 544 mma.sync a tile; here a CTA takes 64 rows, the M of
// wgmma, so a tile is read once per 64 heads and its math is 68 asynchronous wgmma:
// - Two warpgroups, one CTA per SM. The query tile (64 x 576, 72 KB) stays in shared memory for
//   the whole split, in the layout the cache tiles land in (nine 64-column chunks of 64 rows x 128
//   bytes, 128-byte swizzled: the K-major operand layout of wgmma). Two 72 KB stages, landed by
//   issue_swizzled_tile's tensor-map boxes as attention_kernel's; masked rows zeroed.
// - Warpgroup 0: S = Q K^T by 36 wgmma m64n64k16, both operands K-major from shared memory (a
//   k-step is 32 bytes further in the rows of chunk k / 4). The accumulators are the rows' logits
//   (thread: rows 16w + g and + 8 of its warp w, tokens 8j + 2c + {0, 1}); the online softmax runs
//   on them in registers (a row's four lanes are a quad), and P, rounded to the element type, is
//   laid straight into the A fragments of P.V, which it also publishes in shared memory, with the
//   rows' alphas, for warpgroup 1. Warpgroup 1 meanwhile looks the rows of the tile after next up.
// - P.V: warpgroup h takes output columns [256h, 256h + 256), 4 chunks x 4 k-steps of wgmma
//   m64n64k16, A = P from registers, B = the stage's chunk read MN-major (its rows are tokens:
//   16 tokens are 2048 bytes further).
// - Two barriers a tile: (1) P is published; (2) P.V is done, so the stage takes the tile after
//   next at once (one tile in flight while one is computed). A tile with masked rows has a third,
//   after they are zeroed.
// - Measured on the H200 (docs/DECODE_ATTENTION.md, Fourteenth round): B 64 x 8k, H 128, 331 us
//   against attention_kernel's 942 (442 TFLOP/s, 55% of a bf16 matmul). Tried: the logits split
//   between the warpgroups by tokens (m64n32k16 each, the maxima and P exchanged): 354 us, the
//   query tile being read from shared memory twice a tile.
constexpr int kWideRows = 64;            // query rows per CTA: the M of wgmma
// The kernel takes sequences of at least kWideMinRows rows, or of kWideMinRowsBatched in batches of
// kWideMinBatch or more (the same rule: ops.wide_kernel_applies): at 32 heads it is 14-26% faster
// from B = 8 on, and 15% slower at B = 1, context 4096 (docs/DECODE_ATTENTION.md, Fourteenth round).
constexpr int kWideMinRows = 64, kWideMinRowsBatched = 32, kWideMinBatch = 8;
constexpr int kWideThreads = kThreads;   // two warpgroups (issue_swizzled_tile, zero_masked_rows count on 256)
constexpr int kWideGroupChunks = kLatent / 64 / 2;  // P.V: the 64-column output chunks of a warpgroup
static_assert(kWideRows == kTileTokens && kWideThreads == 256, "Q and the tiles share the chunk layout");

struct WideLayout {
  static constexpr int kTileBytes = kEntry / 64 * kChunkBytes;              // 73,728
  static constexpr int kQ = 0;                                             // the query tile
  static constexpr int kStage = kQ + kTileBytes;                           // [2][kTileBytes]
  static constexpr int kP = kStage + 2 * kTileBytes;                       // uint4 [4 warps][k-step][32 lanes]
  static constexpr int kAlphas = kP + 4 * kPvSteps * 32 * 16;             // float [64]: the tile's
  static constexpr int kRowMax = kAlphas + kWideRows * 4;                 // float [64]: at the end
  static constexpr int kRowSum = kRowMax + kWideRows * 4;                 // float [64]: at the end
  static constexpr int kEntries = kRowSum + kWideRows * 4;                // int64 [2][64]
  static constexpr int kZeroRows = kEntries + 2 * kTileTokens * 8;         // uint64 [2]
  static constexpr int kBarriers = kZeroRows + 16;                         // uint64 [2]
  static constexpr int kBytes = kBarriers + 16;
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
  static_assert(2 * kTileBytes >= kWideRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the stages");
};

template <ActType kElem>
__device__ void attend_wide(const DecodeAttention& a, const TileMaps& maps, const CtaPlace& at,
                            const Scales& scales, uint8_t* smem) {
  using L = WideLayout;
  constexpr bool kF16 = kElem == ActType::kF16;
  const int64_t b = at.b, rows = a.rows(), len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(at.row_group) * kWideRows, at.split, len, len, at.share);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  const int warp = uniform_warp_index(), lane = int(threadIdx.x) % 32;
  const int group = warp / 4, gw = warp % 4;  // warpgroup; its warp gw holds rows 16 gw ..
  const int g = lane / 4, c = lane % 4;
  uint8_t* q_tile = smem + L::kQ;
  const auto stage = [&](int s) { return smem + L::kStage + s * L::kTileBytes; };
  uint4* p_frags = reinterpret_cast<uint4*>(smem + L::kP);
  float* alphas = reinterpret_cast<float*>(smem + L::kAlphas);
  float* row_max = reinterpret_cast<float*>(smem + L::kRowMax);
  float* row_sum = reinterpret_cast<float*>(smem + L::kRowSum);
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);   // [tile % 2][token]
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kZeroRows);  // [tile % 2]: its masked tokens
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  const auto issue = [&](int s) {  // the tile whose rows are in slot s, to stage s (warp 0)
    if (warp == 0) issue_swizzled_tile(a, maps, tile_rows + s * kTileTokens, stage(s), stage_full + s, zero_rows + s);
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) mbarrier_init(stage_full + s, 32);
    mbarrier_init_fence();
  }
  if (threadIdx.x < 2 * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  // The query tile: 64 rows x 72 pieces of 16 bytes, all of a thread's loads in flight at once.
  constexpr int kPieces = kEntry / 8, kQPerThread = kWideRows * kPieces / kWideThreads;
  static_assert(kWideRows * kPieces % kWideThreads == 0);
  uint4 q_pieces[kQPerThread];
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) {
    const int p = int(threadIdx.x) + i * kWideThreads, r = p / kPieces;
    q_pieces[i] = make_uint4(0, 0, 0, 0);  // padding rows
    if (w.row0 + r < rows)
      q_pieces[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) +
                                                         (b * rows + w.row0 + r) * kEntry) + (p - r * kPieces));
  }
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  for (int s = 0; s < 2; ++s)
    if (s < w.n_tiles) issue(s);
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) {
    const int p = int(threadIdx.x) + i * kWideThreads, r = p / kPieces;
    *reinterpret_cast<uint4*>(q_tile + swizzled_offset(r, p - r * kPieces)) = q_pieces[i];
  }
  fence_proxy_async();  // the query tile is read by wgmma (the async proxy)
  __syncthreads();

  const uint64_t q_desc = swizzled_descriptor(q_tile);
  float out[kWideGroupChunks][32] = {};  // P.V: output chunk 4 group + ch, the m64n64 accumulators
  float s[32] = {};                       // warpgroup 0: the tile's logits
  float max_run[2] = {-INFINITY, -INFINITY}, sum_run[2] = {0.0f, 0.0f};  // warpgroup 0: rows g, g + 8
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  const int lookup_token = int(threadIdx.x) - 4 * 32;  // warps 4-5 look the rows of tile + 2 up
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  for (int64_t tile = 0; tile < w.n_tiles; ++tile) {
    const int slot = int(tile & 1);
    // The descriptors' bases, opaque to the compiler: else it hoists every operand descriptor of
    // the tile out of the loop.
    uint64_t stage_desc = swizzled_descriptor(stage(slot)), qk_desc = q_desc;
    asm volatile("" : "+l"(stage_desc), "+l"(qk_desc));
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    parity ^= 1u << slot;
    const uint64_t masked = zero_rows[slot];
    if (masked != 0) {  // (uniform)
      zero_masked_rows(masked, stage(slot));
      fence_proxy_async();  // the zeros are read by wgmma
      __syncthreads();
    }
    uint4 frags[kPvSteps];  // P.V's A fragments: rows g | g + 8 x tokens 16k + 2c, + 1 | + 8
    float alpha[2] = {1.0f, 1.0f};
    int64_t row_ahead = -1;
    if (group == 0) {  // S = Q K^T, the online softmax, P
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kQkSteps; ++k) {
        const uint32_t at = uint32_t((k / 4) * kChunkBytes + (k % 4) * 32);
        wgmma_m64n64k16_ss<kF16, 0>(s, qk_desc + (at >> 4), stage_desc + (at >> 4), k > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      // Base-2 logits, -inf for masked tokens (and those past the split).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool live = ((masked >> (8 * j + 2 * c + (e & 1))) & 1) == 0;
          s[4 * j + e] = live ? s[4 * j + e] * scales.logit : -INFINITY;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[4 * j + e]);  // fmaxf skips NaN: it propagates through p
        }
      float offset[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 2));
        const float new_max = fmaxf(max_run[h], tile_max[h]);
        offset[h] = new_max == -INFINITY ? 0.0f : new_max;  // a row that saw nothing yet keeps p = 0
        alpha[h] = exp2f(max_run[h] - offset[h]);
        max_run[h] = new_max;
      }
      float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        s[i] = exp2f(s[i] - offset[(i >> 1) & 1]);
        tile_sum[(i >> 1) & 1] += s[i];  // before rounding, as the lse is
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) sum_run[h] = sum_run[h] * alpha[h] + tile_sum[h];
#pragma unroll
      for (int k = 0; k < kPvSteps; ++k) {
        frags[k] = make_uint4(pack_elems<kElem>(s[8 * k], s[8 * k + 1]), pack_elems<kElem>(s[8 * k + 2], s[8 * k + 3]),
                              pack_elems<kElem>(s[8 * k + 4], s[8 * k + 5]), pack_elems<kElem>(s[8 * k + 6], s[8 * k + 7]));
        p_frags[(gw * kPvSteps + k) * 32 + lane] = frags[k];
      }
      if (c == 0) alphas[16 * gw + g] = alpha[0], alphas[16 * gw + g + 8] = alpha[1];
    } else if (looks_up) {
      row_ahead = tile_token_row(a, w, tile + 2, lookup_token);
    }
    __syncthreads();  // (1) P and the alphas are published; the tile's rows are no longer read
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    if (group == 1) {
#pragma unroll
      for (int k = 0; k < kPvSteps; ++k) frags[k] = p_frags[(gw * kPvSteps + k) * 32 + lane];
      alpha[0] = alphas[16 * gw + g], alpha[1] = alphas[16 * gw + g + 8];
    }
    if (alpha[0] != 1.0f || alpha[1] != 1.0f)  // (a NaN alpha is not 1)
#pragma unroll
      for (int ch = 0; ch < kWideGroupChunks; ++ch)
#pragma unroll
        for (int i = 0; i < 32; ++i) out[ch][i] *= alpha[(i >> 1) & 1];
    wgmma_fence_after(out);
#pragma unroll
    for (int k = 0; k < kPvSteps; ++k) {
      const uint32_t pa[4] = {frags[k].x, frags[k].y, frags[k].z, frags[k].w};
#pragma unroll
      for (int ch = 0; ch < kWideGroupChunks; ++ch) {
        const uint32_t at = uint32_t((kWideGroupChunks * group + ch) * kChunkBytes + k * 16 * 128);
        wgmma_m64n64k16_rs<kF16, 1>(out[ch], pa, stage_desc + (at >> 4), 1);
      }
    }
    wgmma_commit();
    // Retired here, not across the loop's back edge, where ptxas would serialize every wgmma
    // (C7515: the accumulators' moves at the edge).
    wgmma_wait<0>();
    __syncthreads();  // (2) both warpgroups are done with the stage: it takes tile + 2
    if (tile + 2 < w.n_tiles) issue(slot);
  }
  if (group == 0) {  // the rows' sums: the quad's
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = sum_run[h];
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      if (c == 0) row_sum[16 * gw + g + 8 * h] = sum, row_max[16 * gw + g + 8 * h] = max_run[h];
    }
  }
  __syncthreads();  // the stages are free: the rows are staged over them
  float* staging = reinterpret_cast<float*>(smem + L::kStage);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * gw + g + 8 * h;
    const float sum = row_sum[row];
    const bool empty = sum == 0.0f;  // saw no unmasked token; a NaN sum is not empty
    const float norm = empty ? 0.0f : scales.out / sum;
    float* dst = staging + row * kStagingStride + 256 * group + 2 * c;
#pragma unroll
    for (int ch = 0; ch < kWideGroupChunks; ++ch)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(dst + 64 * ch + 8 * j) =
            make_float2(out[ch][4 * j + 2 * h] * norm, out[ch][4 * j + 2 * h + 1] * norm);
    const int64_t r = w.row0 + row;
    if (group == 0 && c == 0 && r < rows) {
      const float lse = empty ? -INFINITY : (row_max[row] + log2f(sum)) * kLn2;
      store_lse(a, w, r, lse);
    }
  }
  __syncthreads();
  store_staged_rows<kWideRows, kWideThreads>(a, w, rows, staging, int(threadIdx.x));
}

template <ActType kElem>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_attention_kernel(const DecodeAttention a, const __grid_constant__ TileMaps maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  let_dependent_launch_start();
  prefetch_tile_maps(maps);
  const CtaPlace at = cta_place(a);
  if (at.b < a.batch) attend_wide<kElem>(a, maps, at, load_scales<CacheFormat::kBf16>(a), smem);
}

}  // namespace
}  // namespace jax_kimi_mla
