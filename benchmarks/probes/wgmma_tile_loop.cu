// The next decode-attention round's tile loop (docs/DECODE_ATTENTION.md, "The next round's plan"),
// alone on an sm_90 GPU: how long one 64-token bf16 tile takes with wgmma and the tokens as M,
// and whether that loop keeps up with HBM. Checked against a float reference on the host.
//
// One CTA per SM: a producer warp lands each tile by one bulk copy into one of two 72 KB stages
// (the tiles are stored in global memory already in the shared layout of the kernel's TMA boxes:
// nine 64-column chunks of 64 rows x 128 bytes, 128-byte swizzled), on a full/empty mbarrier pair
// per stage. One consumer warpgroup per tile:
//   S^T = K Q^T        36 x wgmma m64n16k16 (A = the tile, K-major; B = the 16-row query tile)
//   online softmax     over the tokens (M): a row's max crosses the 4 warps through shared memory
//                      (one named barrier); each thread keeps its own partial sums, rescaled with
//                      the row max, and they are added once at the end
//   P^T to shared      bf16, the 16 x 64 P tile in the swizzled K-major layout (B of the next GEMM)
//   O^T += V^T P^T     8 M-blocks (64 latent columns each) x 4 k-steps, A = the same tile read
//                      MN-major (tnspA = 1), 64 accumulator registers a thread
// and the stage goes back to the producer. The layouts are the ones wgmma_layouts.cu checks.
//
// Prints PASS/FAIL for the output against the reference, then per-tile times: every CTA walking
// the same 16 tiles (L2-resident: the loop's own speed) and every CTA walking its own 64 tiles
// from HBM (against the copy ceiling of this GPU, about 4.3 TB/s on an H200). H200, 2026-12-01:
// PASS (max |error| 0.0014 of 2.41); L2 1.35 us a tile (2393 cycles); HBM 2.24 us a tile, 4345
// GB/s of tiles read (docs/DECODE_ATTENTION.md, "Eighth round").
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_tile_loop \
//       benchmarks/probes/wgmma_tile_loop.cu && /tmp/wgmma_tile_loop
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "probe_common.cuh"
#include "wgmma.cuh"

using namespace probe_util;
using probe_common::ok;

namespace {

constexpr int kEntry = 576, kLatent = 512, kTokens = 64, kRows = 16;
constexpr int kChunks = kEntry / 64;                      // 9 column chunks of 64 bf16 (128 bytes)
constexpr int kTileBytes = kChunks * kTokens * 128;       // 73,728
constexpr int kQBytes = kChunks * kRows * 128;            // 18,432
constexpr int kPBytes = kRows * 128;                      // 2,048: 16 rows of 64 bf16
constexpr int kStages = 2;
constexpr int kConsumers = 128;                           // one warpgroup
constexpr int kThreads = kConsumers + 32;                 // + the producer warp
constexpr int kSmemBytes = kStages * kTileBytes + kQBytes + kPBytes + 2 * 4 * kRows * 4 + 4 * 8;
constexpr float kLog2e = 1.4426950408889634f;

// The consumer warpgroup's own barrier (the producer warp never waits on it).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory"); }

// Thread t of the warpgroup (warp w, g = lane / 4, c = lane % 4) holds accumulator element
// d[4j + 2h + e] = D[16w + g + 8h][8j + 2c + e]: for S^T and O^T, M is a token or a latent column
// and N a query row, so a thread's rows are 2c, 2c + 1, 2c + 8, 2c + 9 (row(k) below, k = 2j + e).
__device__ __forceinline__ int row_of(int k, int c) { return 8 * (k >> 1) + 2 * c + (k & 1); }

// CTA b walks num_tiles tiles: tile i is tiles[b * cta_stride + i % distinct]. q: the 16 x 576
// query tile, swizzled; out: [512][16] O^T of CTA 0, normalized; cycles: CTA 0's tile loop.
__global__ void __launch_bounds__(kThreads, 1)
    tile_loop(const uint8_t* tiles, int64_t cta_stride, int distinct, int num_tiles, const uint8_t* q, float scale,
              float* out, long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* stage = smem;
  uint8_t* q_tile = stage + kStages * kTileBytes;
  uint8_t* p_tile = q_tile + kQBytes;
  float* row_max = reinterpret_cast<float*>(p_tile + kPBytes);  // [2 parities][4 warps][16 rows]
  uint64_t* full = reinterpret_cast<uint64_t*>(row_max + 2 * 4 * kRows);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x, warp = warp_index(), lane = tid % 32;
  const uint8_t* mine = tiles + blockIdx.x * cta_stride * kTileBytes;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(full + s, 1), mbarrier_init(empty + s, kConsumers);
    mbarrier_init_fence();
  }
  for (int i = tid * 16; i < kQBytes; i += kThreads * 16)
    *reinterpret_cast<uint4*>(q_tile + i) = *reinterpret_cast<const uint4*>(q + i);
  fence_proxy_async();  // q is read by wgmma
  __syncthreads();

  if (warp == kConsumers / 32) {  // the producer
    if (lane == 0)
      for (int i = 0; i < num_tiles; ++i) {
        const int s = i % kStages;
        if (i >= kStages) mbarrier_wait(empty + s, (i / kStages - 1) & 1);
        bulk_copy(stage + s * kTileBytes, mine + int64_t(i % distinct) * kTileBytes, kTileBytes, full + s);
      }
    return;
  }

  const int g = lane / 4, c = lane % 4;
  float o[8][8] = {};
  float m_run[4], l_part[4];  // per row(k): the running max (log2 units), this thread's sum
  for (int k = 0; k < 4; ++k) m_run[k] = -INFINITY, l_part[k] = 0.0f;
  const float scale_log2 = scale * kLog2e;
  const long long start = clock64();

  for (int i = 0; i < num_tiles; ++i) {
    const int s = i % kStages;
    uint8_t* tile = stage + s * kTileBytes;
    mbarrier_wait(full + s, (i / kStages) & 1);

    float d[8] = {};
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kEntry / 16; ++step) {
      const int chunk = step / 4, at = 32 * (step % 4);
      wgmma_bf16<0>(d, descriptor(tile + chunk * kTokens * 128 + at, 16, 1024),
                    descriptor(q_tile + chunk * kRows * 128 + at, 16, 1024), step > 0);
    }
    wgmma_commit_and_wait();

    // Row maxima of the tile: over this thread's two tokens (h), the 8 g-lanes, then the 4 warps.
    float mx[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int j = k >> 1, e = k & 1;
      float v = fmaxf(d[4 * j + e], d[4 * j + 2 + e]) * scale_log2;
      v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
      v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 8));
      v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 16));
      mx[k] = v;
    }
    float* slot = row_max + (i & 1) * 4 * kRows;
    if (g == 0)
#pragma unroll
      for (int k = 0; k < 4; ++k) slot[warp * kRows + row_of(k, c)] = mx[k];
    consumer_sync();
    float alpha[4], m_new[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = row_of(k, c);
      const float t = fmaxf(fmaxf(slot[r], slot[kRows + r]), fmaxf(slot[2 * kRows + r], slot[3 * kRows + r]));
      m_new[k] = fmaxf(m_run[k], t);
      alpha[k] = m_new[k] == -INFINITY ? 1.0f : exp2f(m_run[k] - m_new[k]);
      m_run[k] = m_new[k];
    }

    // P^T into the P tile (row r, token m at swizzled(r, m / 8) + 2 (m % 8)), and this thread's sums.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int j = k >> 1, e = k & 1, r = row_of(k, c);
      float sum = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = 16 * warp + g + 8 * h;
        const float p = m_new[k] == -INFINITY ? 0.0f : exp2f(d[4 * j + 2 * h + e] * scale_log2 - m_new[k]);
        const __nv_bfloat16 pb = __float2bfloat16(p);
        sum += __bfloat162float(pb);  // the sum of what P.V multiplies
        *reinterpret_cast<__nv_bfloat16*>(p_tile + swizzled(r, m / 8, kRows) + 2 * (m % 8)) = pb;
      }
      l_part[k] = l_part[k] * alpha[k] + sum;
    }
    fence_proxy_async();
    consumer_sync();

#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int x = 0; x < 8; ++x) o[mb][x] *= alpha[2 * (x >> 2) + (x & 1)];
    wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int step = 0; step < kTokens / 16; ++step)
        wgmma_bf16<1>(o[mb], descriptor(tile + mb * kTokens * 128 + step * 16 * 128, 16, 1024),
                      descriptor(p_tile + 32 * step, 16, 1024), 1);
    wgmma_commit_and_wait();
    mbarrier_arrive(empty + s);
  }
  if (tid == 0 && blockIdx.x == 0) *cycles = clock64() - start;

  // The rows' sums: this thread's partial sums over the g-lanes, then over the warps.
  float* sums = row_max;  // reused: [4 warps][16 rows]
  consumer_sync();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v = l_part[k];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
    if (g == 0) sums[warp * kRows + row_of(k, c)] = v;
  }
  consumer_sync();
  if (blockIdx.x != 0) return;
  float inv[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int r = row_of(k, c);
    inv[k] = 1.0f / (sums[r] + sums[kRows + r] + sums[2 * kRows + r] + sums[3 * kRows + r]);
  }
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
      out[(64 * mb + 16 * warp + g + 8 * h) * kRows + row_of(k, c)] = o[mb][x] * inv[k];
    }
}

}  // namespace

int main() {
  constexpr int kCheckTiles = 16;  // 1024 tokens
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(kCheckTiles * kTokens * kEntry), q(kRows * kEntry);
  for (auto& x : k) x = bf16_value(to_bf16(normal(rng)));
  for (auto& x : q) x = bf16_value(to_bf16(0.15f * normal(rng)));  // logits of spread ~3.6: a peaked softmax
  const float scale = 1.0f;

  std::vector<uint8_t> tiles(size_t(kCheckTiles) * kTileBytes), q_tile(kQBytes);
  auto put16 = [](uint8_t* at, float v) {
    const uint16_t h = to_bf16(v);
    std::memcpy(at, &h, 2);
  };
  for (int t = 0; t < kCheckTiles * kTokens; ++t)
    for (int col = 0; col < kEntry; ++col)
      put16(&tiles[size_t(t / kTokens) * kTileBytes + swizzled(t % kTokens, col / 8, kTokens) + 2 * (col % 8)],
            k[size_t(t) * kEntry + col]);
  for (int r = 0; r < kRows; ++r)
    for (int col = 0; col < kEntry; ++col) put16(&q_tile[swizzled(r, col / 8, kRows) + 2 * (col % 8)], q[r * kEntry + col]);

  // The reference: softmax over the 1024 tokens of each row, then the weighted latents.
  std::vector<double> want(kLatent * kRows);
  const int n = kCheckTiles * kTokens;
  for (int r = 0; r < kRows; ++r) {
    std::vector<double> s(n);
    double mx = -1e300, total = 0;
    for (int t = 0; t < n; ++t) {
      double v = 0;
      for (int col = 0; col < kEntry; ++col) v += double(k[size_t(t) * kEntry + col]) * q[r * kEntry + col];
      s[t] = v * scale, mx = std::fmax(mx, s[t]);
    }
    for (int t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx), total += s[t];
    for (int col = 0; col < kLatent; ++col) {
      double v = 0;
      for (int t = 0; t < n; ++t) v += s[t] * k[size_t(t) * kEntry + col];
      want[col * kRows + r] = v / total;
    }
  }

  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int kHbmTiles = 64;  // per CTA, each CTA its own: 132 x 64 x 72 KB = 623 MB on an H200
  uint8_t *d_tiles, *d_big, *d_q;
  float* d_out;
  long long* d_cycles;
  if (!ok(cudaMalloc(&d_tiles, tiles.size()), "cudaMalloc") ||
      !ok(cudaMalloc(&d_big, size_t(sms) * kHbmTiles * kTileBytes), "cudaMalloc") ||
      !ok(cudaMalloc(&d_q, kQBytes), "cudaMalloc") || !ok(cudaMalloc(&d_out, want.size() * 4), "cudaMalloc") ||
      !ok(cudaMalloc(&d_cycles, 8), "cudaMalloc"))
    return 2;
  cudaMemcpy(d_tiles, tiles.data(), tiles.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_q, q_tile.data(), kQBytes, cudaMemcpyHostToDevice);
  for (int b = 0; b < sms * kHbmTiles / kCheckTiles; ++b)
    cudaMemcpy(d_big + size_t(b) * tiles.size(), d_tiles, tiles.size(), cudaMemcpyDeviceToDevice);
  cudaMemset(d_out, 0xFF, want.size() * 4);  // NaN until written
  cudaFuncSetAttribute(tile_loop, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);

  tile_loop<<<1, kThreads, kSmemBytes>>>(d_tiles, 0, kCheckTiles, kCheckTiles, d_q, scale, d_out, d_cycles);
  if (!ok(cudaDeviceSynchronize(), "tile_loop")) return 2;
  std::vector<float> got(want.size());
  cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost);
  double worst = 0, size = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::isnan(got[i]) ? INFINITY : std::fmax(worst, std::fabs(got[i] - want[i]));
    size = std::fmax(size, std::fabs(want[i]));
  }
  // P is rounded to bf16 (2^-9 relative) before P.V, as in the kernel: the output is a weighted
  // mean, off by about that fraction of the values' spread.
  const bool pass = worst <= 1e-2 * size;
  std::printf("tile loop, %d tokens, output vs float reference: %s (max |error| %.3g, max |value| %.3g)\n", n,
              pass ? "PASS" : "FAIL", worst, size);

  cudaEvent_t t0, t1;
  cudaEventCreate(&t0), cudaEventCreate(&t1);
  long long cycles = 0;
  for (int hbm = 0; hbm < 2; ++hbm) {
    // L2: every CTA walks the same 16 tiles, 256 times one after another (the loop's own speed);
    // HBM: each CTA its own 64 tiles.
    const int num_tiles = hbm ? kHbmTiles : 256, distinct = hbm ? kHbmTiles : kCheckTiles;
    const uint8_t* src = hbm ? d_big : d_tiles;
    const int64_t stride = hbm ? kHbmTiles : 0;
    constexpr int kReps = 10;
    for (int r = -1; r < kReps; ++r) {  // one call to warm up
      if (r == 0) cudaEventRecord(t0);
      tile_loop<<<sms, kThreads, kSmemBytes>>>(src, stride, distinct, num_tiles, d_q, scale, d_out, d_cycles);
    }
    cudaEventRecord(t1);
    if (!ok(cudaEventSynchronize(t1), "timing")) return 2;
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    cudaMemcpy(&cycles, d_cycles, 8, cudaMemcpyDeviceToHost);
    const double us = 1e3 * ms / kReps;
    std::printf("%s: %d CTAs x %d tiles, %.1f us a call, %.3f us a tile (CTA 0's loop: %.0f cycles a tile)",
                hbm ? "HBM, a CTA's own tiles" : "L2, the same 16 tiles", sms, num_tiles, us, us / num_tiles,
                double(cycles) / num_tiles);
    if (hbm) std::printf(", %.0f GB/s of tiles", double(sms) * num_tiles * kTileBytes / (us * 1e3));
    std::printf("\n");
  }
  return pass ? 0 : 1;
}
