// sm_90 asynchronous copies, shared by the CUDA kernels: bulk copies (TMA) from global to shared
// memory that complete on an mbarrier, and the mbarrier operations around them. For architectures
// below sm_90 these compile to traps; the hosts launch the kernels that use them on sm_90+ only.
#pragma once

#include <cstdint>

namespace jax_kimi_mla {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define SM90_ASM(...) __trap()
#endif

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
           : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 1;
  do {
    SM90_ASM("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
             " selp.u32 %0, 1, 0, p;\n}\n"
             : "=r"(done)
             : "r"(smem_addr(bar)), "r"(parity)
             : "memory");
  } while (!done);
}
// Orders this thread's generic-proxy writes to shared memory (a zero-filled row) before later
// async-proxy ones (a bulk copy to the same place, by any thread, after a barrier).
__device__ __forceinline__ void fence_proxy_async() {
  SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Brings a tensor map (a __grid_constant__ kernel parameter, by its generic address) into the
// descriptor cache ahead of its first copy, so that copy does not wait for the fetch.
__device__ __forceinline__ void prefetch_tensor_map(const void* map) {
  SM90_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
           ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
           : "memory");
}

}  // namespace jax_kimi_mla
