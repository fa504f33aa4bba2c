// A candidate tile loop for the 1-byte caches (docs/DECODE_ATTENTION.md, "Sixteenth round"),
// alone on an sm_90a GPU, for fp8_ds_mla: the tokens as M of wgmma with the A operand in
// registers. Each consumer thread converts the E4M3 codes it feeds the tensor cores itself
// (cvt.rn.f16x2.e4m3x2), so no converted tile goes through shared memory (the ninth round's
// converter warps, and the shared-memory traffic the tenth round counted, are gone), and the
// MMAs are asynchronous (the issuing warp does not wait on each, as with mma.sync).
//
// One CTA per SM, 256 threads: two warpgroups take alternate 64-token tiles (64 entries of 656
// bytes as the cache holds them, one bulk copy each) from a ring of 4 stages, each with its own
// online-softmax state (merged at the end as two splits are); a warpgroup's first thread issues
// the copy of tile i + 4 once its warpgroup has read tile i.
// Per tile, a consumer warpgroup (warp w, g = lane / 4, c = lane % 4):
//   S^T = K Q^T  latent: 32 x wgmma m64n16k16 f16, A = codes of 2 tokens a thread (16-byte loads,
//                converted in registers), one accumulator per 128-column tile (its scale applied
//                to the partial logits); k_pe: 4 x bf16 wgmma, A = the raw bf16 values
//   softmax      over the tokens (M) against a reference max per query row shared by the
//                warpgroup, moved (a warpgroup reduction, O and sums rescaled) only where a logit
//                exceeds it by 2^8: the common tile needs one named barrier, an OR vote
//   P'^T         one 16 x 64 f16 tile per 128-column tile j: p x scale_j (the V scale folded in)
//   O^T += V^T P'^T  8 M-blocks (64 latent columns, each inside one column tile) x 4 k-steps of
//                tokens, A = codes of 4 tokens x 4 columns a thread (32-bit loads paired by
//                prmt, converted in registers), B = P'^T of the block's column tile
// Q sits in shared memory as the B operand (its columns permuted to match the A fragments'
// order), so no registers hold it. The rows of a tile are read conflict-free: for S^T a thread's
// two tokens lie 4 rows apart (656 = 16 mod 128), for P.V the four tokens of a k-step lane are
// 2 rows apart.
//
// Prints PASS/FAIL for the output against a float64 reference of the dequantized cache, then
// per-tile times: every CTA walking the same 16 tiles (L2-resident: the loop's own speed) and its
// own 64 tiles from HBM (against the copy ceiling, about 4.27 TB/s on an H200; the production
// kernel reads B 64 x 16k, H 12 at 2.38 us a tile, and 85% of the ceiling is 1.52 us a tile).
//
// H200, 2026-12-03: PASS (max |error| 0.0019 of 13); L2 1.142 us a tile (1994 cycles), HBM 1.403
// us a tile, 3949 GB/s of tiles (one warpgroup, -DJKM_RS_GROUPS=1: 1.675 and 1.825 us). The
// plain fp8 variant (-DJKM_RS_FP8, below), 2026-12-03 later: PASS (max |error| 0.0039 of 13), L2
// 1.306 us a tile (2285 cycles), HBM 1.482 us, 3283 GB/s of tiles (77% of the ceiling: slower a
// tile than fp8_ds_mla's with fewer bytes, so no faster than fp8_attention_kernel's 72%).
//
// -DJKM_RS_FP8_SS (plain fp8 under an E4M3 query, docs/DECODE_ATTENTION.md, "Twenty-third
// round"): S^T from shared memory on both sides, E4M3 x E4M3 (wgmma m64n16k32, 18 k-steps in one
// group, no conversion, no A loads), the tile laid out as tensor-map boxes would land it (columns
// 0-511 in four 128-byte-swizzled chunks, 512-575 in one 64-byte-swizzled chunk; -DJKM_RS_PE_SW128
// pads that chunk to 128-byte rows, the layout wgmma_layouts.cu checks); P.V as the fp8 variant's,
// its loads at the swizzled places (conflict-free). `bash benchmarks/h200.sh rs-probe` runs them all.
// H200, 2026-12-05: both S^T layouts PASS (max |error| 0.0057 of 13, the 64-byte swizzle's
// descriptor included); L2 0.835 us a tile (64-byte rope rows) and 0.788 (128-byte), against 1.303
// for the register-A fp8 loop; HBM 1.178 us a tile, 4133 GB/s of tiles (97% of the copy ceiling;
// 128-byte rows 1.299, 4161 GB/s of their 40 KB tiles). On an H100 (80 GB HBM3) every build streams
// at that GPU's bandwidth from HBM (2.85-2.91 TB/s), L2 as on the H200. rs_attention_kernel's plain
// fp8 path is this loop (64-byte layout), paged.
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I ffi/include -o /tmp/ds_rs \
//       benchmarks/probes/ds_rs_tile_loop.cu && /tmp/ds_rs
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "jax_kimi_mla/numerics.h"
#include "probe_common.cuh"
#include "wgmma.cuh"

using namespace probe_util;
using probe_common::ok;

namespace {

// -DJKM_RS_FP8: the plain fp8 cache instead (576 E4M3 codes a token, the rope columns too, no
// scales): one accumulator chain of 36 k-steps, one P tile, S^T's two tokens of a quarter-warp
// adjacent (576 = 64 mod 128); P.V's loads are then 2-way conflicted (tokens 2 apart share banks).
#if defined(JKM_RS_FP8_SS) && !defined(JKM_RS_FP8)
#define JKM_RS_FP8
#endif
#ifdef JKM_RS_FP8
constexpr bool kFp8 = true;
#else
constexpr bool kFp8 = false;
#endif
#ifdef JKM_RS_FP8_SS
constexpr bool kSs = true;
#else
constexpr bool kSs = false;
#endif
#ifdef JKM_RS_PE_SW128
constexpr int kPeRowBytes = 128;  // the rope chunk's rows padded to 128 bytes, 128-byte swizzled
#else
constexpr int kPeRowBytes = 64;   // 64-byte rows, 64-byte swizzled
#endif
constexpr int kLatent = 512, kPe = 64, kTokens = 64, kRows = 16, kEntry = kFp8 ? 576 : 656;
constexpr int kScaleAt = 512, kPeAt = 528;               // bytes into an entry (fp8_ds_mla)
constexpr int kCodeGroups = kFp8 ? 9 : 8;                // 64-code groups of S^T
constexpr int kPTiles = kFp8 ? 1 : 4;                    // P'_j tiles (one per scale tile)
// kSs: the layout of a tile (kTokens rows) or of the query (kRows rows) in 16-byte pieces.
__host__ __device__ constexpr int ss_offset(int rows, int row, int col) {
  if (col < 512) return (col >> 7) * rows * 128 + row * 128 + ((((col & 127) >> 4) ^ (row & 7)) << 4) + (col & 15);
  const int swizzle = kPeRowBytes == 128 ? (row & 7) : ((row >> 1) & 3);
  return 4 * rows * 128 + row * kPeRowBytes + ((((col - 512) >> 4) ^ swizzle) << 4) + (col & 15);
}
constexpr int kTileBytes = kSs ? ss_offset(kTokens, 0, 512) + kTokens * kPeRowBytes
                               : kTokens * kEntry;       // 41,984 = 41 x 1024 (fp8: 36 x 1024)
constexpr int kStages = 4;
constexpr int kQBytes = kSs ? ss_offset(kRows, 0, 512) + kRows * kPeRowBytes  // E4M3 codes
                            : kCodeGroups * kRows * 128;  // 16,384: 8 chunks of 16 rows x 64 f16 (fp8: 9)
constexpr int kQpeBytes = kRows * 128;                   // 2,048
constexpr int kPBytes = kRows * 128;                     // 2,048: 16 rows x 64 tokens, f16
#ifndef JKM_RS_GROUPS
#define JKM_RS_GROUPS 2
#endif
constexpr int kGroups = JKM_RS_GROUPS;                   // consumer warpgroups
constexpr int kThreads = kGroups * 128;                  // no producer warp: 9 warps would cap a thread at 168 registers
constexpr int kSmemBytes =
    kStages * kTileBytes + kQBytes + kQpeBytes + kGroups * 4 * kPBytes + kGroups * 4 * kRows * 4 + 2 * kStages * 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kSlack = 8.0f;  // log2 units: P values up to 2^8 before the reference moves

// Two E4M3 codes (the low or high 16 bits of x) as their exact f16 pair: numerics.h's converter,
// which exists in the device pass only.
template <int kHalf>
__device__ __forceinline__ uint32_t e4m3x2_half_to_f16x2(uint32_t x) {
#if JKM_HARDWARE_FP8
  return jax_kimi_mla::e4m3x2_half_to_f16x2<kHalf>(x);
#else
  return x;  // host pass
#endif
}

__device__ __forceinline__ void wgmma_rs(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t b, int accumulate, bool f16) {
#define JKM_RS(type)                                                                                       \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"                                              \
               " wgmma.mma_async.sync.aligned.m64n16k16.f32." type "." type                                \
               " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"              \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(accumulate))
  if (f16) JKM_RS("f16");
  else JKM_RS("bf16");
#undef JKM_RS
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
template <int kN>
__device__ __forceinline__ void pin(float (&x)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

// The warpgroup's barrier (id 1 + group), with an OR of `flag` over its 128 threads.
__device__ __forceinline__ bool group_sync_or(int group, bool flag) {
  uint32_t any;
  asm volatile("{\n .reg .pred q, r;\n setp.ne.u32 q, %1, 0;\n bar.red.or.pred r, %2, 128, q;\n selp.u32 %0, 1, 0, r;\n}\n"
               : "=r"(any)
               : "r"(uint32_t(flag)), "r"(1 + group)
               : "memory");
  return any != 0;
}
__device__ __forceinline__ void group_sync(int group) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + group) : "memory");
}

// Accumulator element x of a thread: M row 16w + g + 8 ((x >> 1) & 1), query row (N) 8 (x >> 2)
// + 2c + (x & 1); k = 2 (x >> 2) + (x & 1) indexes the thread's four query rows.
__device__ __forceinline__ int head_of(int k, int c) { return 8 * (k >> 1) + 2 * c + (k & 1); }
// The token of S^T's M row 16w + g + 8h: rows g and g + 1 of a quarter-warp 4 tokens apart.
__host__ __device__ constexpr int qk_token(int w, int g, int h) {
  return 16 * w + 8 * h + (kFp8 ? g : (g >> 1) + 4 * (g & 1));
}
// The latent column of P.V's M row 16w + g + 8h of block mb: blocks 2j, 2j + 1 in column tile j.
__host__ __device__ constexpr int pv_column(int mb, int w, int g, int h) {
  return 128 * (mb >> 1) + 32 * w + 4 * g + 2 * (mb & 1) + h;
}

struct Tile {  // one warpgroup's state
  float o[8][8];
  float m_ref[4], l_part[4];
};

__global__ void __launch_bounds__(kThreads, 1)
    tile_loop(const uint8_t* tiles, int64_t cta_stride, int distinct, int num_tiles, const uint8_t* q,
              const uint8_t* q_pe, float softmax_scale, float* out, float* lse, long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* stage = smem;
  uint8_t* q_tile = stage + kStages * kTileBytes;
  uint8_t* qpe_tile = q_tile + kQBytes;
  uint8_t* p_tiles = qpe_tile + kQpeBytes;
  float* red = reinterpret_cast<float*>(p_tiles + kGroups * 4 * kPBytes);  // [group][warp][16]
  uint64_t* full = reinterpret_cast<uint64_t*>(red + kGroups * 4 * kRows);
  uint64_t* empty = full + kStages;
  const int tid = threadIdx.x, warp = warp_index(), lane = tid % 32;
  const uint8_t* mine = tiles + blockIdx.x * cta_stride * kTileBytes;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(full + s, 1), mbarrier_init(empty + s, 128);
    mbarrier_init_fence();
  }
  for (int i = tid * 16; i < kQBytes; i += kThreads * 16)
    *reinterpret_cast<uint4*>(q_tile + i) = *reinterpret_cast<const uint4*>(q + i);
  for (int i = tid * 16; i < kQpeBytes; i += kThreads * 16)
    *reinterpret_cast<uint4*>(qpe_tile + i) = *reinterpret_cast<const uint4*>(q_pe + i);
  fence_proxy_async();
  __syncthreads();

  if (tid == 0)
    for (int i = 0; i < kStages && i < num_tiles; ++i)
      bulk_copy(stage + i * kTileBytes, mine + int64_t(i % distinct) * kTileBytes, kTileBytes, full + i);

  const int group = warp / 4, w = warp % 4, g = lane / 4, c = lane % 4;
  uint8_t* p_mine = p_tiles + group * 4 * kPBytes;
  float* red_mine = red + group * 4 * kRows;
  const float scale_log2 = softmax_scale * kLog2e;
  const int tok0 = qk_token(w, g, 0), tok1 = qk_token(w, g, 1);
  Tile st;
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int x = 0; x < 8; ++x) st.o[mb][x] = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) st.m_ref[k] = -INFINITY, st.l_part[k] = 0.0f;
  const long long start = clock64();

  for (int i = group; i < num_tiles; i += kGroups) {
    const int s = i % kStages;
    const uint8_t* tile = stage + s * kTileBytes;
    mbarrier_wait(full + s, (i / kStages) & 1);
    const uint8_t* row0 = tile + tok0 * kEntry;
    const uint8_t* row1 = tile + tok1 * kEntry;

    // S^T: the latent, group G = columns 64G .. 64G + 63 (k-steps 4G .. 4G + 3, column tile G / 2).
    float acc[(kCodeGroups + 1) / 2][8], acc_pe[8];
    if constexpr (kSs) {
      // k-step s: 32 codes at 32 (s % 4) of chunk s / 4's rows. One accumulator a chunk: the
      // tensor cores' fp8 sums keep about 2^-11 of their largest term (wgmma_layouts.cu), so the
      // chunks are added in float32 below.
#pragma unroll
      for (int j = 0; j < 5; ++j) pin(acc[j]);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 18; ++step) {
        const int chunk = step / 4, at = 32 * (step % 4), sw = chunk < 4 ? 128 : kPeRowBytes;
        wgmma_e4m3(acc[chunk], descriptor(tile + ss_offset(kTokens, 0, 128 * chunk) + at, 16, 8 * sw, sw),
                   descriptor(q_tile + ss_offset(kRows, 0, 128 * chunk) + at, 16, 8 * sw, sw), step % 4 != 0);
      }
      wgmma_commit();
    }
    uint32_t a[2][16];
    uint4 r0 = make_uint4(0, 0, 0, 0), r1 = r0;
    if constexpr (!kSs) {
      r0 = *reinterpret_cast<const uint4*>(row0 + 16 * c);
      r1 = *reinterpret_cast<const uint4*>(row1 + 16 * c);
    }
#pragma unroll
    for (int G = 0; G < (kSs ? 0 : kCodeGroups); ++G) {
      const uint4 x0 = r0, x1 = r1;
      if (G + 1 < kCodeGroups) {
        r0 = *reinterpret_cast<const uint4*>(row0 + 64 * (G + 1) + 16 * c);
        r1 = *reinterpret_cast<const uint4*>(row1 + 64 * (G + 1) + 16 * c);
      }
      uint32_t(&f)[16] = a[G & 1];
      const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[4 * j + 0] = e4m3x2_half_to_f16x2<0>(w0[j]);
        f[4 * j + 1] = e4m3x2_half_to_f16x2<0>(w1[j]);
        f[4 * j + 2] = e4m3x2_half_to_f16x2<1>(w0[j]);
        f[4 * j + 3] = e4m3x2_half_to_f16x2<1>(w1[j]);
      }
      // Group G - 1 done: a[G & 1] was group G - 2's, and ptxas pipelines no deeper without serializing.
      if (G >= 1) wgmma_wait<0>();
      if (G % 2 == 0) pin(acc[G / 2]);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int step = 4 * G + j;
        wgmma_rs(acc[G / 2], f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3],
                 descriptor(q_tile + (step / 4) * kRows * 128 + 32 * (step % 4), 16, 1024), (G & 1) || j, true);
      }
      wgmma_commit();
    }
    // k_pe: 16-byte piece 4h + c of a row holds the bf16 pairs of k-steps 2h, 2h + 1.
    if constexpr (kFp8) {
#pragma unroll
      for (int x = 0; x < 8; ++x) acc_pe[x] = 0.0f;
    } else {
      uint4 pe[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        pe[0][h] = *reinterpret_cast<const uint4*>(row0 + kPeAt + 16 * (4 * h + c));
        pe[1][h] = *reinterpret_cast<const uint4*>(row1 + kPeAt + 16 * (4 * h + c));
      }
      pin(acc_pe);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wgmma_rs(acc_pe, pe[0][h].x, pe[1][h].x, pe[0][h].y, pe[1][h].y,
                 descriptor(qpe_tile + 32 * (2 * h), 16, 1024), h, false);
        wgmma_rs(acc_pe, pe[0][h].z, pe[1][h].z, pe[0][h].w, pe[1][h].w,
                 descriptor(qpe_tile + 32 * (2 * h + 1), 16, 1024), 1, false);
      }
      wgmma_commit();
    }
    const float4 sc0 = kFp8 ? make_float4(1, 1, 1, 1) : *reinterpret_cast<const float4*>(row0 + kScaleAt);
    const float4 sc1 = kFp8 ? make_float4(1, 1, 1, 1) : *reinterpret_cast<const float4*>(row1 + kScaleAt);
    wgmma_wait<0>();

    // Logits (log2 units) and the vote.
    const float scales[2][4] = {{sc0.x, sc0.y, sc0.z, sc0.w}, {sc1.x, sc1.y, sc1.z, sc1.w}};
    float sl[8];
    bool over = false;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
      float v = acc_pe[x];
#pragma unroll
      for (int j = 0; j < (kCodeGroups + 1) / 2; ++j) v = kFp8 ? v + acc[j][x] : fmaf(scales[h][j], acc[j][x], v);
      sl[x] = v * scale_log2;
      over |= sl[x] > st.m_ref[k] + kSlack;
    }
    // P'^T: element (query row n, token t) of column tile j's tile at swizzled(n, t / 8) + 2 (t % 8).
    auto write_p = [&](float (&p)[8]) {
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const int h = (x >> 1) & 1, n = head_of(2 * (x >> 2) + (x & 1), c), t = h ? tok1 : tok0;
#pragma unroll
        for (int j = 0; j < kPTiles; ++j)
          *reinterpret_cast<__half*>(p_mine + j * kPBytes + swizzled(n, t / 8, kRows) + 2 * (t % 8)) =
              __float2half_rn(p[x] * scales[h][j]);
      }
      fence_proxy_async();
    };
    float p[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) p[x] = exp2f(sl[x] - st.m_ref[2 * (x >> 2) + (x & 1)]);
    write_p(p);
    if (group_sync_or(group, over)) {  // rare: the reference moves to the tile's max
      float mx[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float v = fmaxf(sl[4 * (k >> 1) + (k & 1)], sl[4 * (k >> 1) + 2 + (k & 1)]);
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 8));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 16));
        mx[k] = v;
      }
      if (g == 0)
#pragma unroll
        for (int k = 0; k < 4; ++k) red_mine[w * kRows + head_of(k, c)] = mx[k];
      group_sync(group);
      float alpha[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = head_of(k, c);
        const float t = fmaxf(fmaxf(red_mine[n], red_mine[kRows + n]), fmaxf(red_mine[2 * kRows + n], red_mine[3 * kRows + n]));
        const float m_new = fmaxf(st.m_ref[k], t);
        alpha[k] = m_new == -INFINITY ? 1.0f : exp2f(st.m_ref[k] - m_new);
        st.m_ref[k] = m_new;
        st.l_part[k] *= alpha[k];
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int x = 0; x < 8; ++x) st.o[mb][x] *= alpha[2 * (x >> 2) + (x & 1)];
#pragma unroll
      for (int x = 0; x < 8; ++x)
        p[x] = st.m_ref[2 * (x >> 2) + (x & 1)] == -INFINITY ? 0.0f
                                                            : exp2f(sl[x] - st.m_ref[2 * (x >> 2) + (x & 1)]);
      write_p(p);
      group_sync(group);
    }
#pragma unroll
    for (int x = 0; x < 8; ++x) st.l_part[2 * (x >> 2) + (x & 1)] += p[x];

    // O^T += V^T P'^T: k-step ks takes tokens 16 ks + 2c + e + 8f; a thread's column word of
    // tile j is at 128 j + 32 w + 4 g (byte b: block 2j + (b >> 1), row half b & 1).
    uint32_t va[2][8][4];
    const uint8_t* ss_mine[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) ss_mine[e] = tile + ss_offset(kTokens, 2 * c + e, 32 * w + 4 * g);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t v[4][2][2];  // [column tile][e][f]
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int ff = 0; ff < 2; ++ff) {
          const int token = 16 * ks + 2 * c + e + 8 * ff;
          // kSs: the token's row & 7 is 2c + e, so its swizzled place is ss_mine[e] + the
          // offsets of ks, ff and j (immediates).
          const uint8_t* row = kSs ? ss_mine[e] + (16 * ks + 8 * ff) * 128 : tile + token * kEntry + 32 * w + 4 * g;
#pragma unroll
          for (int j = 0; j < 4; ++j)
            v[j][e][ff] = *reinterpret_cast<const uint32_t*>(row + (kSs ? j * kTokens * 128 : 128 * j));
        }
      uint32_t(&f)[8][4] = va[ks & 1];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hv = 0; hv < 2; ++hv) {
          const uint32_t sel = hv ? 0x7362u : 0x5140u;  // bytes 2hv, 2hv + 1 of the e = 0 and e = 1 tokens
          const uint32_t lo = __byte_perm(v[j][0][0], v[j][1][0], sel), hi = __byte_perm(v[j][0][1], v[j][1][1], sel);
          f[2 * j + hv][0] = e4m3x2_half_to_f16x2<0>(lo);
          f[2 * j + hv][1] = e4m3x2_half_to_f16x2<1>(lo);
          f[2 * j + hv][2] = e4m3x2_half_to_f16x2<0>(hi);
          f[2 * j + hv][3] = e4m3x2_half_to_f16x2<1>(hi);
        }
      if (ks == 3) {  // every read of the stage has landed in registers: tile i + 4 may come
        mbarrier_arrive(empty + s);
        if (w == 0 && lane == 0 && i + kStages < num_tiles) {
          mbarrier_wait(empty + s, (i / kStages) & 1);
          bulk_copy(stage + s * kTileBytes, mine + int64_t((i + kStages) % distinct) * kTileBytes, kTileBytes,
                    full + s);
        }
      }
      if (ks >= 1) wgmma_wait<0>();
      if (ks == 0)
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) pin(st.o[mb]);
      wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
        wgmma_rs(st.o[mb], f[mb][0], f[mb][1], f[mb][2], f[mb][3],
                 descriptor(p_mine + (kFp8 ? 0 : mb / 2) * kPBytes + 32 * ks, 16, 1024), 1, true);
      wgmma_commit();
    }
  }
  wgmma_wait<0>();
  if (tid == 0 && blockIdx.x == 0) *cycles = clock64() - start;

  // This warpgroup's partial: O^T normalized by its sums, and its lse (log2 units).
  float* sums = red_mine;
  group_sync(group);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v = st.l_part[k];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
    if (g == 0) sums[w * kRows + head_of(k, c)] = v;
  }
  group_sync(group);
  if (blockIdx.x != 0) return;
  float inv[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int n = head_of(k, c);
    const float l = sums[n] + sums[kRows + n] + sums[2 * kRows + n] + sums[3 * kRows + n];
    inv[k] = 1.0f / l;
    if (w == 0 && g == 0) lse[group * kRows + n] = st.m_ref[k] + log2f(l);
  }
  float* out_mine = out + group * kLatent * kRows;
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
      out_mine[pv_column(mb, w, g, h) * kRows + head_of(k, c)] = st.o[mb][x] * inv[k];
    }
}

float e4m3_value(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(h));
}

}  // namespace

int main() {
  constexpr int kCheckTiles = 16;  // 1024 tokens
  const int n = kCheckTiles * kTokens;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  // The cache: latents of per-token magnitude spread over 2^-2 .. 2^2, quantized per 128-column
  // tile as the epilogue does (power-of-two scale over amax / 448), k_pe in bf16.
  std::vector<uint8_t> tiles(size_t(n) * kEntry);
  std::vector<float> latent(size_t(n) * kLatent), k_pe(size_t(n) * kPe);
  std::uniform_real_distribution<float> spread(-2.0f, 2.0f);
  for (int t = 0; t < n; ++t) {
    uint8_t* entry = &tiles[size_t(t) * kEntry];
    const float mag = std::exp2(spread(rng));
    for (int j = 0; j < 4; ++j) {
      float v[128], amax = 0.0f;
      for (int i = 0; i < 128; ++i) v[i] = mag * normal(rng), amax = std::fmax(amax, std::fabs(v[i]));
      const float scale = kFp8 ? 1.0f : std::exp2(std::ceil(std::log2(std::fmax(amax / 448.0f, 1e-4f))));
      if (!kFp8) std::memcpy(entry + kScaleAt + 4 * j, &scale, 4);
      for (int i = 0; i < 128; ++i) {
        const uint8_t code = __nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
        entry[128 * j + i] = code;
        latent[size_t(t) * kLatent + 128 * j + i] = e4m3_value(code) * scale;
      }
    }
    for (int i = 0; i < kPe; ++i) {
      if (kFp8) {  // E4M3 codes after the latent's
        const uint8_t code = __nv_cvt_float_to_fp8(normal(rng), __NV_SATFINITE, __NV_E4M3);
        entry[kLatent + i] = code;
        k_pe[size_t(t) * kPe + i] = e4m3_value(code);
        continue;
      }
      const uint16_t h = to_bf16(normal(rng));
      std::memcpy(entry + kPeAt + 2 * i, &h, 2);
      k_pe[size_t(t) * kPe + i] = bf16_value(h);
    }
  }
  // The query: bf16 values (f16-exact), spread so that the logits' spread is about 2.5 (kSs: E4M3
  // codes, their values).
  std::vector<float> q(kRows * kLatent), qp(kRows * kPe);
  std::vector<uint8_t> q_codes(kRows * kEntry);
  for (int i = 0; i < kRows * (kLatent + kPe); ++i) {
    float& x = i < kRows * kLatent ? q[i] : qp[i - kRows * kLatent];
    x = bf16_value(to_bf16(2.5f * normal(rng)));
    if (!kSs) continue;
    const int r = i < kRows * kLatent ? i / kLatent : (i - kRows * kLatent) / kPe;
    const int col = i < kRows * kLatent ? i % kLatent : kLatent + (i - kRows * kLatent) % kPe;
    const uint8_t code = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    q_codes[r * kEntry + col] = code;
    x = e4m3_value(code);
  }
  const float softmax_scale = 1.0f / 24.0f;
  // Q^T as the B operand, its columns in the A fragments' order: latent k-step s = 4G + j at
  // position 2c + (i & 1) + 8 (i >> 1) holds column 64G + 16c + 4j + i; k_pe k-step 2h + kk at
  // 2c + e + 8f holds column 32h + 8c + 4kk + 2f + e.
  std::vector<uint8_t> q_tile(kQBytes), qpe_tile(kQpeBytes);
  auto put = [](uint8_t* tile, int row, int k, uint16_t bits) {
    std::memcpy(tile + swizzled(row, k / 8, kRows) + 2 * (k % 8), &bits, 2);
  };
  for (int r = 0; r < kRows && kSs; ++r)
    for (int col = 0; col < kEntry; ++col) q_tile[ss_offset(kRows, r, col)] = q_codes[r * kEntry + col];
  for (int r = 0; r < kRows && !kSs; ++r) {
    for (int G = 0; G < kCodeGroups; ++G)  // (fp8: group 8 is the rope columns)
      for (int cc = 0; cc < 4; ++cc)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const int col = 64 * G + 16 * cc + 4 * j + i;
            const __half h = __float2half_rn(col < kLatent ? q[r * kLatent + col] : qp[r * kPe + col - kLatent]);
            uint16_t bits;
            std::memcpy(&bits, &h, 2);
            put(q_tile.data(), r, 16 * (4 * G + j) + 2 * cc + (i & 1) + 8 * (i >> 1), bits);
          }
    for (int h = 0; h < 2; ++h)
      for (int cc = 0; cc < 4; ++cc)
        for (int kk = 0; kk < 2; ++kk)
          for (int f = 0; f < 2; ++f)
            for (int e = 0; e < 2; ++e)
              put(qpe_tile.data(), r, 16 * (2 * h + kk) + 2 * cc + e + 8 * f,
                  to_bf16(qp[r * kPe + 32 * h + 8 * cc + 4 * kk + 2 * f + e]));
  }

  // The reference: softmax over the 1024 tokens of each row, then the weighted latents.
  std::vector<double> want(kLatent * kRows);
  for (int r = 0; r < kRows; ++r) {
    std::vector<double> sc(n);
    double mx = -1e300, total = 0;
    for (int t = 0; t < n; ++t) {
      double v = 0;
      for (int col = 0; col < kLatent; ++col) v += double(latent[size_t(t) * kLatent + col]) * q[r * kLatent + col];
      for (int col = 0; col < kPe; ++col) v += double(k_pe[size_t(t) * kPe + col]) * qp[r * kPe + col];
      sc[t] = v * softmax_scale, mx = std::fmax(mx, sc[t]);
    }
    for (int t = 0; t < n; ++t) sc[t] = std::exp(sc[t] - mx), total += sc[t];
    for (int col = 0; col < kLatent; ++col) {
      double v = 0;
      for (int t = 0; t < n; ++t) v += sc[t] * latent[size_t(t) * kLatent + col];
      want[col * kRows + r] = v / total;
    }
  }

  if (kSs) {  // each tile as its boxes would land (the padding of -DJKM_RS_PE_SW128 zero)
    std::vector<uint8_t> laid(size_t(kCheckTiles) * kTileBytes, 0);
    for (int t = 0; t < n; ++t)
      for (int col = 0; col < kEntry; ++col)
        laid[size_t(t / kTokens) * kTileBytes + ss_offset(kTokens, t % kTokens, col)] = tiles[size_t(t) * kEntry + col];
    tiles = laid;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int kHbmTiles = 64;  // per CTA, each its own: 132 x 64 x 41 KB = 355 MB on an H200
  uint8_t *d_tiles, *d_big, *d_q, *d_qpe;
  float *d_out, *d_lse;
  long long* d_cycles;
  if (!ok(cudaMalloc(&d_tiles, tiles.size()), "cudaMalloc") ||
      !ok(cudaMalloc(&d_big, size_t(sms) * kHbmTiles * kTileBytes), "cudaMalloc") ||
      !ok(cudaMalloc(&d_q, kQBytes), "cudaMalloc") || !ok(cudaMalloc(&d_qpe, kQpeBytes), "cudaMalloc") ||
      !ok(cudaMalloc(&d_out, 2 * want.size() * 4), "cudaMalloc") || !ok(cudaMalloc(&d_lse, 2 * kRows * 4), "cudaMalloc") ||
      !ok(cudaMalloc(&d_cycles, 8), "cudaMalloc"))
    return 2;
  cudaMemcpy(d_tiles, tiles.data(), tiles.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_q, q_tile.data(), kQBytes, cudaMemcpyHostToDevice);
  cudaMemcpy(d_qpe, qpe_tile.data(), kQpeBytes, cudaMemcpyHostToDevice);
  for (int b = 0; b < sms * kHbmTiles / kCheckTiles; ++b)
    cudaMemcpy(d_big + size_t(b) * tiles.size(), d_tiles, tiles.size(), cudaMemcpyDeviceToDevice);
  cudaMemset(d_out, 0xFF, 2 * want.size() * 4);  // NaN until written
  cudaMemset(d_lse, 0xFF, 2 * kRows * 4);
  if (!ok(cudaFuncSetAttribute(tile_loop, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem")) return 2;

  tile_loop<<<1, kThreads, kSmemBytes>>>(d_tiles, 0, kCheckTiles, kCheckTiles, d_q, d_qpe, softmax_scale, d_out,
                                         d_lse, d_cycles);
  if (!ok(cudaDeviceSynchronize(), "tile_loop")) return 2;
  std::vector<float> got(2 * want.size()), got_lse(2 * kRows);
  cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(got_lse.data(), d_lse, got_lse.size() * 4, cudaMemcpyDeviceToHost);
  double worst = 0, size = 0;
  for (int r = 0; r < kRows; ++r) {
    double m = -INFINITY, wsum = 0, wt[kGroups];
    for (int q = 0; q < kGroups; ++q) m = std::fmax(m, got_lse[q * kRows + r]);
    for (int q = 0; q < kGroups; ++q) wt[q] = std::exp2(got_lse[q * kRows + r] - m), wsum += wt[q];
    for (int col = 0; col < kLatent; ++col) {
      const size_t at = size_t(col) * kRows + r;
      double v = 0;
      for (int q = 0; q < kGroups; ++q) v += wt[q] * got[q * want.size() + at] / wsum;
      worst = std::isnan(v) ? INFINITY : std::fmax(worst, std::fabs(v - want[at]));
      size = std::fmax(size, std::fabs(want[at]));
    }
  }
  // P' is rounded to f16 (2^-11 relative) before P.V; the output is a weighted mean.
  const bool pass = worst <= 1e-2 * size;
  std::printf("%s tile loop, %d tokens, output vs float64 reference: %s (max |error| %.3g, max |value| %.3g)\n",
              kSs ? (kPeRowBytes == 64 ? "fp8 S^T E4M3 from shared memory" : "fp8 S^T E4M3 from shared memory, rope rows 128 B")
                  : kFp8 ? "fp8 register-A" : "ds_mla register-A",
              n, pass ? "PASS" : "FAIL", worst, size);

  cudaEvent_t t0, t1;
  cudaEventCreate(&t0), cudaEventCreate(&t1);
  long long cycles = 0;
  for (int hbm = 0; hbm < 2; ++hbm) {
    const int num_tiles = hbm ? kHbmTiles : 256, distinct = hbm ? kHbmTiles : kCheckTiles;
    const uint8_t* src = hbm ? d_big : d_tiles;
    const int64_t stride = hbm ? kHbmTiles : 0;
    constexpr int kReps = 10;
    for (int r = -1; r < kReps; ++r) {
      if (r == 0) cudaEventRecord(t0);
      tile_loop<<<sms, kThreads, kSmemBytes>>>(src, stride, distinct, num_tiles, d_q, d_qpe, softmax_scale, d_out,
                                               d_lse, d_cycles);
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
