// Checks, on an sm_90 GPU, the wgmma operand layouts that the next decode-attention round plans
// (docs/DECODE_ATTENTION.md, "The next round's plan"), against float sums on the host:
//
//   1. S^T = K Q^T, bf16: A = the 64-token K tile as the kernel's TMA boxes land it (nine
//      64-column chunks of 64 rows x 128 bytes, 128-byte swizzled: K-major), B = the 16-row query
//      tile in the same swizzled layout (K-major), m64n16k16, 36 k-steps.
//   2. O^T = V^T P^T, bf16: A = V^T read from the same tile (the tile's columns are M, its tokens K:
//      an MN-major operand, tnspA = 1), B = the 16 x 64 P tile (K-major), m64n16k16, 8 M-blocks x
//      4 k-steps.
//   3. S^T = K Q^T, E4M3 x E4M3 (m64n16k32): 128-byte chunks of fp8 rows, 128-byte swizzled, and
//      how far the tensor cores' fp8 accumulation is from exact float sums over 576 columns.
//
// Each check prints PASS or FAIL with its largest error; on a failure it also says where a few
// accumulator registers' values are found in the reference (to read the real fragment layout off).
// H200, 2026-12-01: all three pass. The MN-major V^T operand takes the 8-token step (1024 bytes)
// as its stride byte offset (its leading byte offset is unused at M = 64; swapping the two fails),
// and E4M3 sums over 576 columns were within 6e-4 of the largest |S| (fp8 accumulation).
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_layouts \
//       benchmarks/probes/wgmma_layouts.cu && /tmp/wgmma_layouts
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "wgmma.cuh"

using namespace probe_util;

namespace {

constexpr int kEntry = 576, kLatent = 512, kTokens = 64, kRows = 16;

// The assumed accumulator layout of m64nNk*: thread t (warp w = t / 32, g = lane / 4, c = lane % 4)
// holds d[4j + 2h + e] = D[16w + g + 8h][8j + 2c + e].
__device__ void store_accumulator(const float (&d)[8], float* out, int m0, int ld) {
  const int t = threadIdx.x, w = t / 32, g = t % 32 / 4, c = t % 4;
  for (int j = 0; j < 2; ++j)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) out[(m0 + 16 * w + g + 8 * h) * ld + 8 * j + 2 * c + e] = d[4 * j + 2 * h + e];
}

struct Raw {  // every register of every thread, for a failed check
  float qk[128][8], pv[128][8], fp8[128][8];
};

// One warpgroup. k_tile: 64 x 576 bf16 (nine swizzled 64-row chunks), q_tile: 16 x 576 bf16 (nine
// 16-row chunks), p_tile: 16 x 64 bf16 (one 16-row chunk), k8: 64 x 576 E4M3 (4.5 chunks of 128
// columns: the last 64 columns as a half chunk of 64-byte rows padded to 128), q8 likewise.
__global__ void __launch_bounds__(128) probe(const uint8_t* k_tile_g, const uint8_t* q_tile_g, const uint8_t* p_tile_g,
                                             const uint8_t* k8_g, const uint8_t* q8_g, float* s_t, float* o_t,
                                             float* s8_t, Raw* raw) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kKBytes = 9 * kTokens * 128, kQBytes = 9 * kRows * 128, kPBytes = kRows * 128;
  constexpr int kK8Bytes = 5 * kTokens * 128, kQ8Bytes = 5 * kRows * 128;
  uint8_t* k_tile = smem;
  uint8_t* q_tile = k_tile + kKBytes;
  uint8_t* p_tile = q_tile + kQBytes;
  uint8_t* k8 = p_tile + kPBytes;  // 1024-aligned: every size above is a multiple of 1024
  uint8_t* q8 = k8 + kK8Bytes;
  const uint8_t* src[5] = {k_tile_g, q_tile_g, p_tile_g, k8_g, q8_g};
  uint8_t* dst[5] = {k_tile, q_tile, p_tile, k8, q8};
  const int bytes[5] = {kKBytes, kQBytes, kPBytes, kK8Bytes, kQ8Bytes};
  for (int m = 0; m < 5; ++m)
    for (int i = threadIdx.x * 16; i < bytes[m]; i += 128 * 16)
      *reinterpret_cast<uint4*>(dst[m] + i) = *reinterpret_cast<const uint4*>(src[m] + i);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  // 1. S^T = K Q^T: k-step s reads 32 bytes at 32 (s % 4) of the 128-byte rows of chunk s / 4.
  float d[8] = {};
  wgmma_fence();
  for (int s = 0; s < kEntry / 16; ++s) {
    const int chunk = s / 4, at = 32 * (s % 4);
    wgmma_bf16<0>(d, descriptor(k_tile + chunk * kTokens * 128 + at, 16, 1024),
                  descriptor(q_tile + chunk * kRows * 128 + at, 16, 1024), s > 0);
  }
  wgmma_commit_and_wait();
  store_accumulator(d, s_t, 0, kRows);
  for (int i = 0; i < 8; ++i) raw->qk[threadIdx.x][i] = d[i];

  // 2. O^T = V^T P^T: M-block mb = chunk mb (64 latent columns); k-step s = tokens [16s, 16s + 16),
  // 2048 bytes further in the chunk (16 rows of 128 bytes). MN-major, 128-byte swizzle: the stride
  // byte offset is the step between 8-token groups; the leading one (between 64-column atoms)
  // is unused at M = 64.
  for (int mb = 0; mb < kLatent / 64; ++mb) {
    float o[8] = {};
    wgmma_fence();
    for (int s = 0; s < kTokens / 16; ++s)
      wgmma_bf16<1>(o, descriptor(k_tile + mb * kTokens * 128 + s * 16 * 128, 16, 1024),
                    descriptor(p_tile + 32 * s, 16, 1024), s > 0);
    wgmma_commit_and_wait();
    store_accumulator(o, o_t, 64 * mb, kRows);
    if (mb == 0)
      for (int i = 0; i < 8; ++i) raw->pv[threadIdx.x][i] = o[i];
  }

  // 3. fp8 S^T: k-step s (32 columns) reads 32 bytes at 32 (s % 4) of chunk s / 4's rows.
  float e[8] = {};
  wgmma_fence();
  for (int s = 0; s < kEntry / 32; ++s) {
    const int chunk = s / 4, at = 32 * (s % 4);
    wgmma_e4m3(e, descriptor(k8 + chunk * kTokens * 128 + at, 16, 1024), descriptor(q8 + chunk * kRows * 128 + at, 16, 1024),
               s > 0);
  }
  wgmma_commit_and_wait();
  store_accumulator(e, s8_t, 0, kRows);
  for (int i = 0; i < 8; ++i) raw->fp8[threadIdx.x][i] = e[i];
}

// Compares got [m][16] with want; on a failure, locates a few of thread 0-3's registers.
bool check(const char* what, const std::vector<float>& got, const std::vector<double>& want, int m,
           const float (*raw)[8], double tol) {
  double worst = 0, scale = 0;
  for (int i = 0; i < m * kRows; ++i) {
    worst = std::fmax(worst, std::fabs(got[i] - want[i]));
    scale = std::fmax(scale, std::fabs(want[i]));
  }
  const bool ok = worst <= tol * scale;
  std::printf("%-40s %s: max |error| %.3g, max |value| %.3g (relative %.2e, tolerance %.0e)\n", what,
              ok ? "PASS" : "FAIL", worst, scale, worst / scale, tol);
  if (!ok)
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < 8; ++r) {
        int best = -1;
        double err = 1e30;
        for (int i = 0; i < m * kRows; ++i)
          if (std::fabs(raw[t][r] - want[i]) < err) err = std::fabs(raw[t][r] - want[i]), best = i;
        std::printf("  thread %d d[%d] = %.4g: nearest reference D[%d][%d] (off by %.2g)\n", t, r, raw[t][r],
                    best / kRows, best % kRows, err);
      }
  return ok;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Values exactly representable in bf16 (and, for the fp8 check, E4M3 codes).
  std::vector<float> k(kTokens * kEntry), q(kRows * kEntry), p(kRows * kTokens);
  for (auto& x : k) x = bf16_value(to_bf16(normal(rng)));
  for (auto& x : q) x = bf16_value(to_bf16(normal(rng)));
  for (auto& x : p) x = bf16_value(to_bf16(std::fabs(normal(rng)) * 0.1f));
  std::vector<uint8_t> k8c(kTokens * kEntry), q8c(kRows * kEntry);
  std::vector<float> k8(kTokens * kEntry), q8(kRows * kEntry);
  for (int i = 0; i < kTokens * kEntry; ++i) {
    const __nv_fp8_e4m3 c(normal(rng) * 8.0f);
    k8c[i] = c.__x, k8[i] = float(c);
  }
  for (int i = 0; i < kRows * kEntry; ++i) {
    const __nv_fp8_e4m3 c(normal(rng) * 8.0f);
    q8c[i] = c.__x, q8[i] = float(c);
  }

  // The swizzled device layouts.
  std::vector<uint8_t> k_tile(9 * kTokens * 128), q_tile(9 * kRows * 128), p_tile(kRows * 128);
  std::vector<uint8_t> k8_tile(5 * kTokens * 128, 0), q8_tile(5 * kRows * 128, 0);
  auto put16 = [](std::vector<uint8_t>& tile, int off, float v) {
    const uint16_t h = to_bf16(v);
    std::memcpy(&tile[off], &h, 2);
  };
  for (int t = 0; t < kTokens; ++t)
    for (int c = 0; c < kEntry; ++c) put16(k_tile, swizzled(t, c / 8, kTokens) + 2 * (c % 8), k[t * kEntry + c]);
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kEntry; ++c) put16(q_tile, swizzled(r, c / 8, kRows) + 2 * (c % 8), q[r * kEntry + c]);
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTokens; ++t) put16(p_tile, swizzled(r, t / 8, kRows) + 2 * (t % 8), p[r * kTokens + t]);
  for (int t = 0; t < kTokens; ++t)
    for (int c = 0; c < kEntry; ++c) k8_tile[swizzled(t, c / 16, kTokens) + c % 16] = k8c[t * kEntry + c];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kEntry; ++c) q8_tile[swizzled(r, c / 16, kRows) + c % 16] = q8c[r * kEntry + c];

  // Float references, transposed as the kernel computes them.
  std::vector<double> s_ref(kTokens * kRows), o_ref(kLatent * kRows), s8_ref(kTokens * kRows);
  for (int t = 0; t < kTokens; ++t)
    for (int r = 0; r < kRows; ++r) {
      double s = 0, s8 = 0;
      for (int c = 0; c < kEntry; ++c) s += double(k[t * kEntry + c]) * q[r * kEntry + c];
      for (int c = 0; c < kEntry; ++c) s8 += double(k8[t * kEntry + c]) * q8[r * kEntry + c];
      s_ref[t * kRows + r] = s, s8_ref[t * kRows + r] = s8;
    }
  for (int col = 0; col < kLatent; ++col)
    for (int r = 0; r < kRows; ++r) {
      double o = 0;
      for (int t = 0; t < kTokens; ++t) o += double(k[t * kEntry + col]) * p[r * kTokens + t];
      o_ref[col * kRows + r] = o;
    }

  uint8_t* dev[5];
  const std::vector<uint8_t>* host[5] = {&k_tile, &q_tile, &p_tile, &k8_tile, &q8_tile};
  for (int i = 0; i < 5; ++i) {
    cudaMalloc(&dev[i], host[i]->size());
    cudaMemcpy(dev[i], host[i]->data(), host[i]->size(), cudaMemcpyHostToDevice);
  }
  float *s_t, *o_t, *s8_t;
  Raw* raw;
  cudaMalloc(&s_t, s_ref.size() * 4), cudaMalloc(&o_t, o_ref.size() * 4), cudaMalloc(&s8_t, s8_ref.size() * 4);
  cudaMalloc(&raw, sizeof(Raw));
  const int smem = int(k_tile.size() + q_tile.size() + p_tile.size() + k8_tile.size() + q8_tile.size());
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);

  probe<<<1, 128, smem>>>(dev[0], dev[1], dev[2], dev[3], dev[4], s_t, o_t, s8_t, raw);
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::vector<float> s(s_ref.size()), o(o_ref.size()), s8(s8_ref.size());
  Raw r;
  cudaMemcpy(s.data(), s_t, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), o_t, o.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(s8.data(), s8_t, s8.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(&r, raw, sizeof(Raw), cudaMemcpyDeviceToHost);
  bool all = check("S^T = K Q^T (bf16, K-major)", s, s_ref, kTokens, r.qk, 1e-4);
  all &= check("O^T = V^T P^T (bf16, MN-major A)", o, o_ref, kLatent, r.pv, 1e-4);
  // The layout is right if the error is small; its size is the fp8 accumulation's precision.
  all &= check("S^T = K Q^T (E4M3, K-major)", s8, s8_ref, kTokens, r.fp8, 1e-2);
  std::printf("%s\n", all ? "all layouts as planned" : "some layout is not as planned");
  return all ? 0 : 1;
}
