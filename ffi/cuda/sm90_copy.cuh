// sm_90 asynchronous copies, shared by the CUDA kernels: bulk copies (TMA) from global to shared
// memory that complete on an mbarrier, the mbarrier operations around them, and the cluster's
// barrier and shared-memory loads. For architectures below sm_90 these compile to traps; the
// hosts launch the kernels that use them on sm_90+ only.
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

// Thread block clusters: this CTA's rank and the cluster's size (1 without a cluster launch), a
// barrier of all the cluster's threads (release/acquire: shared-memory writes before it are seen by
// the other CTAs' reads after it), and loads from another CTA's shared memory (its address of the
// same variable, by rank).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
  SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t n = 1;
  SM90_ASM("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}
__device__ __forceinline__ void cluster_sync() {
  SM90_ASM("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_addr(const void* p, uint32_t rank) {
  uint32_t remote = 0;
  SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}
__device__ __forceinline__ float cluster_load(uint32_t remote) {
  float v = 0.0f;
  SM90_ASM("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ float4 cluster_load4(uint32_t remote) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  SM90_ASM("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
           : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
           : "r"(remote)
           : "memory");
  return v;
}

}  // namespace jax_kimi_mla
