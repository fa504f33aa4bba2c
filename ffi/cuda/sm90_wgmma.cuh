// sm_90a warpgroup MMA (wgmma): the matrix descriptors of 128- and 64-byte swizzled shared-memory
// tiles, and the m64n64k16 (A from shared memory or registers), m64n16k16 (A from registers) and
// m64n16k32 E4M3 (both from shared memory) MMAs with float32 accumulation. wgmma exists
// on sm_90a only (not on sm_100, whose tensor cores take other instructions): for every other
// target these compile to traps, and the host launches the kernels that use them on sm_90 GPUs
// only.
#pragma once

#include <cstdint>

#include "sm90_copy.cuh"

namespace jax_kimi_mla {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define SM90A_ASM(...) __trap()
#endif

// Byte offset of 16-byte piece `piece` of row `row` in a tile stored as chunks of `rows` rows x
// 128 bytes (64 16-bit columns each, chunk = piece / 8), 128-byte swizzled: the layout a 2D TMA
// box with SWIZZLE_128B lands, and the one the descriptors below describe.
__host__ __device__ constexpr int swizzled_piece(int row, int piece, int rows) {
  return (piece >> 3) * rows * 128 + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

// The descriptor of a 128-byte swizzled operand starting at `smem` (1024-byte aligned chunks):
// stride byte offset 1024 (the next 8 rows; for an MN-major operand the next 8 k), leading
// offset unused. A K-major operand's k-step of 16 elements is 32 bytes further in its rows.
__device__ __forceinline__ uint64_t swizzled_descriptor(const void* smem) {
  const uint32_t addr = smem_addr(smem);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// The descriptor of a 64-byte swizzled operand (rows of 64 bytes, 512-byte aligned groups of 8):
// stride byte offset 512, layout type 2. A k-step of 32 one-byte elements is 32 bytes further.
__device__ __forceinline__ uint64_t swizzled_descriptor_64(const void* smem) {
  const uint32_t addr = smem_addr(smem);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(512 >> 4) << 32) |
         (uint64_t(2) << 62);
}

// The 32 float32 accumulators a thread of a m64n64 wgmma: the m16n8 accumulators of n-blocks
// 0..7 of warp w's rows 16w..16w + 15, 4 a block.
#define JKM_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JKM_WGMMA_D32_OPERANDS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], 16-bit operands from shared memory: A K-major, B K-major
// (kTransB 0) or MN-major (1).
template <bool kF16, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
#define JKM_WGMMA(type)                                                                                 \
  SM90A_ASM("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32." type \
            "." type " " JKM_WGMMA_D32 ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                  \
            : JKM_WGMMA_D32_OPERANDS                                                                    \
            : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (kF16) JKM_WGMMA("f16");
  else JKM_WGMMA("bf16");
#undef JKM_WGMMA
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], 16-bit operands: A from registers (the m16n8k16 A
// fragments of warp w's rows 16w..16w + 15), B from shared memory, K-major (kTransB 0) or
// MN-major (1).
template <bool kF16, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                   int accumulate) {
#define JKM_WGMMA(type)                                                                                 \
  SM90A_ASM("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32." type \
            "." type " " JKM_WGMMA_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                    \
            : JKM_WGMMA_D32_OPERANDS                                                                    \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))
  if constexpr (kF16) JKM_WGMMA("f16");
  else JKM_WGMMA("bf16");
#undef JKM_WGMMA
}
#undef JKM_WGMMA_D32
#undef JKM_WGMMA_D32_OPERANDS

// D[64 x 16] (+)= A[64 x 16] B[16 x 16], 16-bit operands: A from registers (the m16n8k16 A
// fragments of warp w's rows 16w..16w + 15), B from shared memory, K-major.
template <bool kF16>
__device__ __forceinline__ void wgmma_m64n16k16_rs(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                   uint64_t b, int accumulate) {
#define JKM_WGMMA(type)                                                                                \
  SM90A_ASM("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"                                             \
            " wgmma.mma_async.sync.aligned.m64n16k16.f32." type "." type                                \
            " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"           \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(accumulate))
  if constexpr (kF16) JKM_WGMMA("f16");
  else JKM_WGMMA("bf16");
#undef JKM_WGMMA
}

// D[64 x 16] (+)= A[64 x 32] B[32 x 16], E4M3 operands from shared memory, both K-major. The
// tensor cores' E4M3 sums are coarser than float32 (over 576 columns within 6e-4 of the largest
// |S|: benchmarks/probes/wgmma_layouts.cu), so callers sum at most 128 columns in one accumulator
// and add those in float32.
__device__ __forceinline__ void wgmma_m64n16k32_e4m3_ss(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
  SM90A_ASM("{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
            " wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
            : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_fence() { SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// wgmma_fence after the last ordinary writes to accumulators `acc` (e.g. a rescale): the empty asm
// statements pin those writes before the fence, which the compiler would otherwise sink past it
// (ptxas then fences every wgmma of the group again: C7519).
template <int kBlocks, int kPerBlock>
__device__ __forceinline__ void wgmma_fence_after(float (&acc)[kBlocks][kPerBlock]) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i)
#pragma unroll
    for (int j = 0; j < kPerBlock; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
  wgmma_fence();
}
template <int kN>
__device__ __forceinline__ void wgmma_fence_after(float (&acc)[kN]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) asm volatile("" : "+f"(acc[j])::"memory");
  wgmma_fence();
}
__device__ __forceinline__ void wgmma_commit() { SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most kPending committed groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// setmaxnreg: this warpgroup's registers a thread raised (waiting until the CTA's pool has them) or
// lowered to kRegisters; every thread of the warpgroup executes it.
template <int kRegisters, bool kRaise>
__device__ __forceinline__ void set_max_registers() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg's range");
  if constexpr (kRaise) SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  else SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// The warp index through a shuffle: ptxas then knows it is warp-uniform and does not serialize
// the wgmmas behind a branch on it ("C7520 ... WG.AR in divergent path").
__device__ __forceinline__ int uniform_warp_index() { return __shfl_sync(0xFFFFFFFFu, int(threadIdx.x) / 32, 0); }

// A barrier of `threads` threads (a warpgroup or a few) on hardware barrier `id` (0 is
// __syncthreads'; warp-uniform), which the other warps of the CTA never wait on; with the OR of
// `flag` over the threads it gathers, or without.
__device__ __forceinline__ bool named_barrier_or(int id, int threads, bool flag) {
  uint32_t any;
  asm volatile("{\n .reg .pred q, r;\n setp.ne.u32 q, %1, 0;\n bar.red.or.pred r, %2, %3, q;\n selp.u32 %0, 1, 0, r;\n}\n"
               : "=r"(any)
               : "r"(uint32_t(flag)), "r"(id), "r"(threads)
               : "memory");
  return any != 0;
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace jax_kimi_mla
