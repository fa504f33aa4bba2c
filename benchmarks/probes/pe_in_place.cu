// Prefill's q RoPE in place, alone: how fast can the 64 pe columns of every q head row
// ([T, H, 192] bf16, 128 bytes of each 384-byte row) be read and written back, against the same
// bytes laid out densely? (benchmarks/RESULTS.md, round of 2026-12-04, evening: with RoPE, the
// bf16 and fp8_ds_mla prefill kernels at 96 heads reach 91% of the copy ceiling where the NoPE
// ones reach 98%; the difference is this traffic.)
//
// Each pattern moves 16-byte chunks, two a thread (loads first, then stores), as the epilogue
// kernel's q pe part does, and applies a cheap bijection (the halves of every word swapped), so
// that a chunk it did not write, or wrote twice, is seen: each in-place store kind is checked on
// the device against the rule (pe chunks swapped once, nope chunks untouched) after one launch.
// Timed as the other event-timed probes (probe_common.cuh): the median of 30 back-to-back
// launches between events, behind a kernel that holds the stream, against a 1 GiB cudaMemcpy
// (read + write bytes).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/pe_in_place \
//       benchmarks/probes/pe_in_place.cu && /tmp/pe_in_place
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "probe_common.cuh"

namespace pe_probe {

using namespace probe_common;

constexpr int kRowChunks = 24;  // 192 bf16 values a head row
constexpr int kPeChunks = 8;    // its last 64
constexpr int kThreads = 192;   // two blocks a token at 96 heads, as the epilogue's plan gives

__device__ __forceinline__ uint4 swap_halves(uint4 v) {
  const auto s = [](uint32_t w) { return __byte_perm(w, 0, 0x1032); };
  return make_uint4(s(v.x), s(v.y), s(v.z), s(v.w));
}

// Chunk c (0 .. H * 8) of token t's pe columns: its place in q.
__device__ __forceinline__ int64_t pe_chunk(int64_t t, int heads, int c) {
  return (t * heads + c / kPeChunks) * kRowChunks + (kRowChunks - kPeChunks) + c % kPeChunks;
}

// Lanes i and i + threads of a token's H * 8 chunks, a grid row a token (blockIdx.y), as many
// blocks (x) as the token's lanes need.
__device__ __forceinline__ void lanes_of(int heads, int& c0, int& c1) {
  const int per_block = 2 * kThreads;
  c0 = int(blockIdx.x) * per_block + int(threadIdx.x);
  c1 = c0 + kThreads;
  const int total = heads * kPeChunks;
  if (c0 >= total) c0 = -1;
  if (c1 >= total) c1 = -1;
}

// How a chunk is stored: a plain st.global (the epilogue's), st.global.cs (streaming: evict
// first), or with an L2::evict_first policy.
enum Store { kPlain, kStreaming, kEvictFirst };

template <int kStore>
__device__ __forceinline__ void store(uint4* p, uint4 v) {
  if constexpr (kStore == kPlain) {
    *p = v;
  } else if constexpr (kStore == kStreaming) {
    __stcs(p, v);
  } else {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w), "l"(policy)
                 : "memory");
  }
}

// The epilogue's pattern: q's pe chunks read and written back in place.
template <int kStore>
__global__ void __launch_bounds__(kThreads) pe_rmw(uint4* q, int heads) {
  int c0, c1;
  lanes_of(heads, c0, c1);
  const int64_t t = blockIdx.y;
  uint4 a{}, b{};
  if (c0 >= 0) a = q[pe_chunk(t, heads, c0)];
  if (c1 >= 0) b = q[pe_chunk(t, heads, c1)];
  if (c0 >= 0) store<kStore>(q + pe_chunk(t, heads, c0), swap_halves(a));
  if (c1 >= 0) store<kStore>(q + pe_chunk(t, heads, c1), swap_halves(b));
}

// The same chunks read from q and written densely elsewhere ([T, H, 64]).
__global__ void __launch_bounds__(kThreads) pe_to_dense(const uint4* q, uint4* dense, int heads) {
  int c0, c1;
  lanes_of(heads, c0, c1);
  const int64_t t = blockIdx.y, row = t * heads * kPeChunks;
  uint4 a{}, b{};
  if (c0 >= 0) a = q[pe_chunk(t, heads, c0)];
  if (c1 >= 0) b = q[pe_chunk(t, heads, c1)];
  if (c0 >= 0) dense[row + c0] = swap_halves(a);
  if (c1 >= 0) dense[row + c1] = swap_halves(b);
}

// The same number of chunks, dense, read and written back in place.
__global__ void __launch_bounds__(kThreads) dense_rmw(uint4* dense, int heads) {
  int c0, c1;
  lanes_of(heads, c0, c1);
  const int64_t row = int64_t(blockIdx.y) * heads * kPeChunks;
  uint4 a{}, b{};
  if (c0 >= 0) a = dense[row + c0];
  if (c1 >= 0) b = dense[row + c1];
  if (c0 >= 0) dense[row + c0] = swap_halves(a);
  if (c1 >= 0) dense[row + c1] = swap_halves(b);
}

// Whole q rows read and written back in place (3x the bytes).
__global__ void __launch_bounds__(kThreads) rows_rmw(uint4* q, int heads) {
  const int total = heads * kRowChunks, per_block = 2 * kThreads;
  const int c0 = int(blockIdx.x) * per_block + int(threadIdx.x), c1 = c0 + kThreads;
  const int64_t row = int64_t(blockIdx.y) * total;
  uint4 a{}, b{};
  if (c0 < total) a = q[row + c0];
  if (c1 < total) b = q[row + c1];
  if (c0 < total) q[row + c0] = swap_halves(a);
  if (c1 < total) q[row + c1] = swap_halves(b);
}

__global__ void fill(uint32_t* p, int64_t words) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(i) * 2654435761u + 12345u;
}

// After one pe_rmw: pe chunks swapped once, every other chunk as filled.
__global__ void count_wrong(const uint4* before, const uint4* after, int64_t chunks, unsigned long long* bad) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const bool pe = i % kRowChunks >= kRowChunks - kPeChunks;
    const uint4 want = pe ? swap_halves(before[i]) : before[i], got = after[i];
    if (want.x != got.x || want.y != got.y || want.z != got.z || want.w != got.w) atomicAdd(bad, 1ull);
  }
}

}  // namespace pe_probe

int main() {
  using namespace pe_probe;
  if (!print_device()) return 1;
  const double ceiling = copy_ceiling();
  if (ceiling == 0) return 1;

  bool pass = true;
  for (int heads : {96, 12})
    for (int64_t tokens : {int64_t(8192), int64_t(32768)}) {
      const int64_t q_chunks = tokens * heads * kRowChunks, pe_chunks = tokens * heads * kPeChunks;
      uint4 *q = nullptr, *copy = nullptr, *dense = nullptr;
      unsigned long long* bad = nullptr;
      if (!ok(cudaMalloc(&q, q_chunks * 16), "cudaMalloc") || !ok(cudaMalloc(&copy, q_chunks * 16), "cudaMalloc") ||
          !ok(cudaMalloc(&dense, pe_chunks * 16), "cudaMalloc") || !ok(cudaMalloc(&bad, 8), "cudaMalloc"))
        return 1;
      fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(q), q_chunks * 4);
      fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(dense), pe_chunks * 4);
      cudaMemcpy(copy, q, q_chunks * 16, cudaMemcpyDeviceToDevice);
      const dim3 pe_grid(unsigned((heads * kPeChunks + 2 * kThreads - 1) / (2 * kThreads)), unsigned(tokens));
      const dim3 row_grid(unsigned((heads * kRowChunks + 2 * kThreads - 1) / (2 * kThreads)), unsigned(tokens));
      // Each store kind once on a fresh q, checked.
      const std::function<void()> in_place[] = {[&] { pe_rmw<kPlain><<<pe_grid, kThreads>>>(q, heads); },
                                                [&] { pe_rmw<kStreaming><<<pe_grid, kThreads>>>(q, heads); },
                                                [&] { pe_rmw<kEvictFirst><<<pe_grid, kThreads>>>(q, heads); }};
      for (const auto& launch : in_place) {
        cudaMemcpy(q, copy, q_chunks * 16, cudaMemcpyDeviceToDevice);
        launch();
        cudaMemset(bad, 0, 8);
        count_wrong<<<1024, 256>>>(copy, q, q_chunks, bad);
        unsigned long long wrong = 0;
        if (!ok(cudaMemcpy(&wrong, bad, 8, cudaMemcpyDeviceToHost), "check")) return 1;
        if (wrong) std::printf("pe_rmw: %llu chunks WRONG\n", wrong);
        pass &= wrong == 0;
      }
      const double pe_bytes = 2.0 * 16 * double(pe_chunks);
      const struct {
        const char* name;
        double bytes;
        std::function<void()> launch;
      } patterns[] = {
          {"pe in place (the epilogue's)", pe_bytes, [&] { pe_rmw<kPlain><<<pe_grid, kThreads>>>(q, heads); }},
          {"pe in place, st.global.cs", pe_bytes, [&] { pe_rmw<kStreaming><<<pe_grid, kThreads>>>(q, heads); }},
          {"pe in place, L2::evict_first", pe_bytes, [&] { pe_rmw<kEvictFirst><<<pe_grid, kThreads>>>(q, heads); }},
          {"pe read, written densely", pe_bytes, [&] { pe_to_dense<<<pe_grid, kThreads>>>(q, dense, heads); }},
          {"dense, same bytes, in place", pe_bytes, [&] { dense_rmw<<<pe_grid, kThreads>>>(dense, heads); }},
          {"whole q rows in place (3x bytes)", 3 * pe_bytes, [&] { rows_rmw<<<row_grid, kThreads>>>(q, heads); }},
      };
      for (const auto& p : patterns) {
        const float us = time_us(p.launch, 30);
        std::printf("H %3d T %6lld  %-34s %9.2f us  %5.1f%% of the copy ceiling\n", heads, (long long)tokens, p.name,
                    us, 100 * p.bytes / ceiling / (us * 1e-6));
      }
      pass &= ok(cudaDeviceSynchronize(), "patterns");
      cudaFree(q);
      cudaFree(copy);
      cudaFree(dense);
      cudaFree(bad);
    }
  std::printf(pass ? "all patterns checked\n" : "FAILED\n");
  return pass ? 0 : 1;
}
