// combine_kernel: the splits of each query row merged (decode_attention_cuda.cu, 2).
#pragma once

#include "decode_attention_common.cuh"

namespace jax_kimi_mla {
namespace {

// One CTA per (query row, sequence, column part): out = sum_s w_s o_s / sum_s w_s,
// w_s = exp(lse_s - max lse) over the live splits whose lse is not -inf; lse = max + log(sum w_s).
// At B = 1 the combine is on the critical path of a call, so its loads are few rounds of latency:
// warp w merges splits w, w + kCombineWarps, ... in rounds of kCombineRound splits whose lse and
// outputs are all loaded at once (lane: columns 4 lane + 128 k of the CTA's part), with its own
// running max; the warps' sums then meet, rescaled to the common max, in a fixed order. With few
// rows, a row's 512 columns are split over kColumnParts CTAs, so that more SMs share its loads
// (each part computes the same weights; part 0 writes the lse). An empty (-inf) split is skipped
// and its outputs never enter the sums; a NaN lse makes the row NaN. By work, a batch of more
// sequences than a warp's lanes takes the share that the attention kernel found (stored_share,
// read after the wait) instead of searching it again in every CTA, the lengths read anew at every
// step (H100, B 128 ragged: the call 2-4% faster; docs/DECODE_ATTENTION.md, Thirty-eighth round);
// up to 32 sequences the search runs on the lengths in registers, before the wait.
constexpr int kCombineRound = 4;
constexpr int64_t kCombineSearchBatch = 32;

template <int kCombineWarps, int kColumnParts>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const DecodeAttention a) {
  constexpr int kPartColumns = kLatent / kColumnParts;
  constexpr int kLaneChunks = kPartColumns / 128;  // float4 of a lane per split
  static_assert(kLaneChunks >= 1, "a part holds whole 128-column chunks");
  __shared__ __align__(16) float warp_acc[kCombineWarps][kPartColumns];
  __shared__ float warp_weight[kCombineWarps], warp_max[kCombineWarps], warp_factor[kCombineWarps], row_stats[2];
  static_assert(kCombineWarps <= 32, "warp 0 rescales the warps' sums, a lane each");
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t rows = a.rows(), r = blockIdx.x;
  const int first_column = int(blockIdx.z) * kPartColumns;
  // The lengths are the call's inputs: read before the wait, which the partials' loads follow
  // at once (under the programmatic launch, while the attention kernel still runs).
  const bool stored = a.stored_share != nullptr && a.batch > kCombineSearchBatch;
  int64_t share = stored ? 0 : batch_split_share(a);
  int64_t b = blockIdx.y, len = b < a.batch ? a.context_len(b) : 0;
  wait_for_prior_grid();  // the partials (and the stored share) are the attention kernel's
  if (stored) share = int64_t(__ldcg(a.stored_share)) * kTileTokens;
  for (; b < a.batch; b += gridDim.y, len = b < a.batch ? a.context_len(b) : 0) {
    const int live = a.live_splits(len, share);
    float4 acc[kLaneChunks] = {};
    float weight_sum = 0.0f, max_lse = -INFINITY;  // this warp's sums, relative to max_lse
    // A round's loads all go out before its first use.
    for (int first = warp; first < live; first += kCombineWarps * kCombineRound) {
      float4 o[kCombineRound][kLaneChunks];
      float lse[kCombineRound];
#pragma unroll
      for (int i = 0; i < kCombineRound; ++i) {
        const int s = first + i * kCombineWarps;
        const bool exists = s < live;  // uniform: no load for a dead split or a slot past the last
        lse[i] = exists ? *a.partial_lse(s, b, r) : -INFINITY;
        const float4* part = reinterpret_cast<const float4*>(a.partial(exists ? s : 0, b, r) + first_column);
#pragma unroll
        for (int k = 0; k < kLaneChunks; ++k) o[i][k] = exists ? part[32 * k + lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int i = 0; i < kCombineRound; ++i) {
        if (lse[i] == -INFINITY) continue;  // dead, empty, or no such split
        const float new_max = fmaxf(max_lse, lse[i]);  // skips NaN: a NaN lse propagates through its weight
        const float rescale = max_lse == -INFINITY ? 1.0f : expf(max_lse - new_max);
        const float weight = expf(lse[i] - (new_max == -INFINITY ? 0.0f : new_max));
        max_lse = new_max;
        weight_sum = fmaf(weight_sum, rescale, weight);
#pragma unroll
        for (int k = 0; k < kLaneChunks; ++k) {
          acc[k].x = fmaf(weight, o[i][k].x, acc[k].x * rescale);
          acc[k].y = fmaf(weight, o[i][k].y, acc[k].y * rescale);
          acc[k].z = fmaf(weight, o[i][k].z, acc[k].z * rescale);
          acc[k].w = fmaf(weight, o[i][k].w, acc[k].w * rescale);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kLaneChunks; ++k) reinterpret_cast<float4*>(warp_acc[warp])[32 * k + lane] = acc[k];
    if (lane == 0) warp_weight[warp] = weight_sum, warp_max[warp] = max_lse;
    __syncthreads();

    if (warp == 0) {  // each warp's factor to the row's max, once: lane w < kCombineWarps for warp w
      const float m = lane < kCombineWarps ? warp_max[lane] : -INFINITY;
      float row_max = m;
#pragma unroll
      for (int k = 16; k > 0; k /= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xFFFFFFFFu, row_max, k));
      // A warp that merged no split has zero sums (NaN ones after a NaN lse): any finite factor
      // keeps them so.
      const float factor = m == -INFINITY ? 1.0f : expf(m - row_max);
      float weight = lane < kCombineWarps ? factor * warp_weight[lane] : 0.0f;
      for (int k = 1; k < 32; k *= 2) weight += __shfl_xor_sync(0xFFFFFFFFu, weight, k);  // fixed order
      if (lane < kCombineWarps) warp_factor[lane] = factor;
      if (lane == 0) row_stats[0] = row_max, row_stats[1] = weight;
    }
    __syncthreads();
    const float row_max = row_stats[0], total_weight = row_stats[1];
    const bool empty = total_weight == 0.0f;  // no live split saw a token (NaN is not empty)
    for (int col = 2 * int(threadIdx.x); col < kPartColumns; col += 64 * kCombineWarps) {
      float2 total = make_float2(0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < kCombineWarps; ++w) {
        const float2 pair = *reinterpret_cast<const float2*>(&warp_acc[w][col]);
        total.x = fmaf(warp_factor[w], pair.x, total.x), total.y = fmaf(warp_factor[w], pair.y, total.y);
      }
      const float x0 = empty ? 0.0f : total.x / total_weight, x1 = empty ? 0.0f : total.y / total_weight;
      reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.out) + (b * rows + r) * kLatent)[(first_column + col) / 2] =
          a.act == ActType::kBF16 ? bf16x2(x0, x1) : f16x2(x0, x1);
    }
    if (threadIdx.x == 0 && blockIdx.z == 0)
      a.lse[b * rows + r] = empty ? -INFINITY : (row_max == -INFINITY ? 0.0f : row_max) + logf(total_weight);
    __syncthreads();  // the next sequence's sums go where these were read
  }
}

}  // namespace
}  // namespace jax_kimi_mla
