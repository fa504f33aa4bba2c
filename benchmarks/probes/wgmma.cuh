// What the probes share: the swizzled tile layout, wgmma and its shared-memory descriptors,
// mbarriers and bulk copies (sm_90a), and bf16 on the host.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace probe_util {

// Byte offset of 16-byte piece `piece` of row `row` in a tile of `rows`-row chunks of 128-byte
// rows, 128-byte swizzled (the layout of the decode kernel's TMA boxes: chunk = piece / 8).
__host__ __device__ inline int swizzled(int row, int piece, int rows) {
  return (piece >> 3) * rows * 128 + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

__device__ inline uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// A shared-memory matrix descriptor: start, leading and stride byte offsets, and the swizzle
// (128 or 64 bytes: layout types 1 and 2).
__device__ inline uint64_t descriptor(const void* smem, uint32_t lbo, uint32_t sbo, int swizzle_bytes = 128) {
  const uint32_t addr = smem_addr(smem);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(swizzle_bytes == 64 ? 2 : 1) << 62);
}

// D[64 x 16] (+)= A B, bf16 operands, A K-major or, with kTransA, MN-major.
template <int kTransA>
__device__ __forceinline__ void wgmma_bf16(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, "
      "%11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

// D[64 x 16] (+)= A B, E4M3 operands, both K-major (fp8 has no transposed form).
__device__ __forceinline__ void wgmma_e4m3(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_and_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 1;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
  } while (!done);
}
// One bulk copy of `bytes` onto shared `dst`, completing on `full` (which this arrival arms).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* full) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(full)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(full))
               : "memory");
}
// This thread's generic-proxy shared-memory writes, visible to later wgmmas (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The warp index through a shuffle: ptxas then knows it is warp-uniform and does not serialize
// wgmmas behind a branch on it ("C7520 ... WG.AR in divergent path").
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xFFFFFFFFu, int(threadIdx.x) / 32, 0); }

inline float bf16_value(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

inline uint16_t to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16(f)); }

}  // namespace probe_util
