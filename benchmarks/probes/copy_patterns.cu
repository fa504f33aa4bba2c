// The gather's traffic without the gather, in several load/store patterns: which way of moving
// rows * (entry bytes read + 1152 bytes written) comes closest to a cudaMemcpy of the same total?
// (docs/DECODE_ATTENTION.md, "The gather, alone": at 128k bf16 rows a 302 MB cudaMemcpy reached
// 96% of the copy ceiling, the gather and a warp-a-row stream of the same bytes 83-84%.)
//
// Every pattern copies row r's input pieces (16 bytes each: 72 for bf16, 36 for plain fp8, 41 for
// fp8_ds_mla) into its 72 output pieces (piece p takes input piece p, or p - in_pieces past the
// input), checked on the device against that rule after a poisoned output, then timed as the
// gather probe times (the median of 30 back-to-back launches between events, behind a kernel
// that holds the stream) against the 1 GiB cudaMemcpy ceiling.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/copy_patterns \
//       benchmarks/probes/copy_patterns.cu && /tmp/copy_patterns
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "../../ffi/cuda/sm90_copy.cuh"
#include "probe_common.cuh"

namespace copy_probe {

using namespace jax_kimi_mla;
using namespace probe_common;

constexpr int kOutPieces = 72;  // 1152 bytes a row
constexpr int kOutRowBytes = 16 * kOutPieces;

__device__ __forceinline__ int source_piece(int p, int in_pieces) { return p < in_pieces ? p : p - in_pieces; }

// ---- loads and stores ----
enum Load { kLdg, kLd256, kLdEvictFirst };
enum Store { kSt, kStcs, kStNoAllocate, kStEvictFirst };

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

template <int kLoad>
__device__ __forceinline__ uint4 load(const uint4* p, uint64_t policy) {
  uint4 v;
  if constexpr (kLoad == kLdg) {
    v = __ldg(p);
  } else if constexpr (kLoad == kLd256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
  }
  return v;
}

template <int kStore>
__device__ __forceinline__ void store(uint4* p, uint4 v, uint64_t policy) {
  if constexpr (kStore == kSt) {
    *p = v;
  } else if constexpr (kStore == kStcs) {
    __stcs(p, v);
  } else if constexpr (kStore == kStNoAllocate) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;"
                 ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
  }
}

// ---- patterns ----

// A warp a row (the gather probe's stream_rows, without its xor): lane l moves pieces l, l + 32, ...
__global__ void __launch_bounds__(256) warp_rows(const uint4* in, uint4* out, int64_t rows, int in_pieces) {
  const int lane = int(threadIdx.x) % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    uint4 v[3];
#pragma unroll
    for (int k = 0; k < 3; ++k)
      if (lane + 32 * k < kOutPieces) v[k] = __ldg(in + r * in_pieces + source_piece(lane + 32 * k, in_pieces));
#pragma unroll
    for (int k = 0; k < 3; ++k)
      if (lane + 32 * k < kOutPieces) out[r * kOutPieces + lane + 32 * k] = v[k];
  }
}

// A thread a piece of the flat output, kUnroll pieces a stride apart in flight per thread, grid
// stride over the launch.
template <int kUnroll, int kLoad, int kStore>
__global__ void __launch_bounds__(256) flat_pieces(const uint4* in, uint4* out, int64_t rows, int in_pieces) {
  const int64_t total = rows * kOutPieces;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const uint64_t policy = (kLoad == kLdEvictFirst || kStore == kStEvictFirst) ? evict_first_policy() : 0;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t o = base + k * stride;
      if (o < total) {
        const int64_t r = o / kOutPieces;
        v[k] = load<kLoad>(in + r * in_pieces + source_piece(int(o - r * kOutPieces), in_pieces), policy);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t o = base + k * stride;
      if (o < total) store<kStore>(out + o, v[k], policy);
    }
  }
}

// Bulk copies both ways: chunks of kRows rows land in a ring of kStages shared-memory stages (one
// bulk copy each, on an mbarrier); with `direct` (input rows as wide as output rows) each stage is
// stored back as it landed, else the CTA's threads first expand it into an output stage. Either
// way a bulk store (cp.async.bulk.global.shared::cta) writes the chunk's output rows.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

template <int kStages, int kRows, bool kDirect>
__global__ void __launch_bounds__(256) bulk_rows(const uint8_t* in, uint8_t* out, int64_t rows, int in_pieces) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint8_t* in_stages = smem + 128;
  uint8_t* out_stages = in_stages + kStages * kRows * kOutRowBytes;  // unused when direct
  const int in_bytes = 16 * in_pieces;
  const int64_t chunks = (rows + kRows - 1) / kRows;
  const int tid = int(threadIdx.x);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
    mbarrier_init_fence();
  }
  __syncthreads();
  const auto chunk_rows = [&](int64_t c) { return int(min(int64_t(kRows), rows - c * kRows)); };
  const auto issue = [&](int64_t c, int s) {
    const uint32_t bytes = uint32_t(chunk_rows(c) * in_bytes);
    mbarrier_arrive_expect_bytes(&full[s], bytes);
    bulk_copy(in_stages + s * kRows * kOutRowBytes, in + c * kRows * in_bytes, bytes, &full[s]);
  };
  if (tid == 0)
    for (int s = 0; s < kStages; ++s)
      if (int64_t c = blockIdx.x + int64_t(s) * gridDim.x; c < chunks) issue(c, s);
  int64_t k = 0;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x, ++k) {
    const int s = int(k % kStages);
    const int n = chunk_rows(c);
    mbarrier_wait(&full[s], uint32_t(k / kStages) & 1u);
    const uint8_t* src = in_stages + s * kRows * kOutRowBytes;
    if constexpr (!kDirect) {
      if (tid == 0) bulk_wait_read<kStages - 1>();  // the store of this output stage, kStages ago, has read it
      __syncthreads();
      uint4* dst = reinterpret_cast<uint4*>(out_stages + s * kRows * kOutRowBytes);
      const uint4* from = reinterpret_cast<const uint4*>(src);
      for (int i = tid; i < n * kOutPieces; i += blockDim.x) {
        const int row = i / kOutPieces, p = i - row * kOutPieces;
        dst[i] = from[row * in_pieces + source_piece(p, in_pieces)];
      }
      fence_proxy_async();
      src = out_stages + s * kRows * kOutRowBytes;
    }
    __syncthreads();
    if (tid == 0) {
      bulk_store(out + c * kRows * kOutRowBytes, src, uint32_t(n * kOutRowBytes));
      bulk_commit();
      if constexpr (kDirect) {
        // The previous stage's store has read its rows: refill that stage (one store stays in flight).
        bulk_wait_read<1>();
        if (k > 0) {
          const int prev = int((k - 1) % kStages);
          if (int64_t next = c - gridDim.x + int64_t(kStages) * gridDim.x; next < chunks) issue(next, prev);
        }
      } else {
        fence_proxy_async();
        if (int64_t next = c + int64_t(kStages) * gridDim.x; next < chunks) issue(next, s);
      }
    }
  }
  if (tid == 0) bulk_wait_all();
}

// ---- check and timing ----

__global__ void fill(uint32_t* p, int64_t words) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(i) * 2654435761u + 12345u;
}

__global__ void count_mismatches(const uint4* in, const uint4* out, int64_t rows, int in_pieces,
                                 unsigned long long* bad) {
  const int64_t total = rows * kOutPieces;
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < total; o += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = o / kOutPieces;
    const uint4 want = in[r * in_pieces + source_piece(int(o - r * kOutPieces), in_pieces)], got = out[o];
    if (want.x != got.x || want.y != got.y || want.z != got.z || want.w != got.w) atomicAdd(bad, 1ull);
  }
}

int sms() {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0);
  return n;
}

template <typename Kernel>
unsigned one_wave(Kernel kernel, size_t shared) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, shared);
  return unsigned(sms() * std::max(per_sm, 1));
}

struct Case {
  const char* format;
  int in_pieces;
  int64_t rows;
  uint4* in;
  uint4* out;
  unsigned long long* bad;
  double ceiling;
};

bool run_pattern(const Case& c, const char* name, const std::function<void()>& launch) {
  cudaMemset(c.out, 0xFF, size_t(c.rows) * kOutRowBytes);
  cudaMemset(c.bad, 0, sizeof(unsigned long long));
  launch();
  count_mismatches<<<1024, 256>>>(c.in, c.out, c.rows, c.in_pieces, c.bad);
  unsigned long long bad = 0;
  if (!ok(cudaMemcpy(&bad, c.bad, sizeof bad, cudaMemcpyDeviceToHost), name)) return false;
  const float us = time_us(launch, 30);
  const double bytes = double(c.rows) * double(16 * c.in_pieces + kOutRowBytes);
  std::printf("%-10s rows %8lld %-34s %9.2f us  %5.1f%% of the copy ceiling%s\n", c.format, (long long)c.rows,
              name, us, 100 * bytes / c.ceiling / (us * 1e-6), bad ? "  WRONG" : "");
  if (bad) std::printf("  %llu mismatched pieces\n", bad);
  return bad == 0 && ok(cudaDeviceSynchronize(), name);
}

template <int kStages, int kRows, bool kDirect>
bool run_bulk(const Case& c, const char* name, int ctas_per_sm) {
  auto* kernel = bulk_rows<kStages, kRows, kDirect>;
  const size_t shared = 128 + size_t(kStages) * kRows * kOutRowBytes * (kDirect ? 1 : 2);
  if (!ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)), name)) return false;
  const unsigned grid = unsigned(sms() * ctas_per_sm);
  return run_pattern(c, name, [&] {
    kernel<<<grid, 256, shared>>>(reinterpret_cast<const uint8_t*>(c.in), reinterpret_cast<uint8_t*>(c.out),
                                  c.rows, c.in_pieces);
  });
}

template <int kUnroll, int kLoad, int kStore>
bool run_flat(const Case& c, const char* name, bool whole_grid = false) {
  auto* kernel = flat_pieces<kUnroll, kLoad, kStore>;
  const int64_t threads = (c.rows * kOutPieces + kUnroll - 1) / kUnroll;
  const unsigned grid = whole_grid ? unsigned((threads + 255) / 256) : one_wave(kernel, 0);
  return run_pattern(c, name, [&] { kernel<<<grid, 256>>>(c.in, c.out, c.rows, c.in_pieces); });
}

}  // namespace copy_probe

int main() {
  using namespace copy_probe;
  if (!print_device()) return 1;
  const double ceiling = copy_ceiling();
  if (ceiling == 0) return 1;
  const size_t largest_total = size_t(1048576) * (16 * 72 + kOutRowBytes) / 2;  // a copy beside each case
  uint8_t *src = nullptr, *dst = nullptr;
  if (!ok(cudaMalloc(&src, largest_total), "cudaMalloc") || !ok(cudaMalloc(&dst, largest_total), "cudaMalloc"))
    return 1;
  cudaMemset(src, 0x5A, largest_total);

  bool pass = true;
  const struct { const char* name; int in_pieces; } formats[] = {{"bf16", 72}, {"fp8", 36}, {"fp8_ds_mla", 41}};
  for (int64_t rows : {int64_t(65536), int64_t(131072), int64_t(1048576)})
    for (const auto& f : formats) {
      Case c{f.name, f.in_pieces, rows, nullptr, nullptr, nullptr, ceiling};
      if (!ok(cudaMalloc(&c.in, size_t(rows) * 16 * f.in_pieces), "cudaMalloc") ||
          !ok(cudaMalloc(&c.out, size_t(rows) * kOutRowBytes), "cudaMalloc") ||
          !ok(cudaMalloc(&c.bad, sizeof(unsigned long long)), "cudaMalloc"))
        return 1;
      fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(c.in), rows * 4 * f.in_pieces);
      const size_t same_total = size_t(rows) * (16 * f.in_pieces + kOutRowBytes) / 2;
      const float memcpy_us = time_us([&] { cudaMemcpyAsync(dst, src, same_total, cudaMemcpyDeviceToDevice); }, 30);
      std::printf("%-10s rows %8lld %-34s %9.2f us  %5.1f%% of the copy ceiling\n", f.name, (long long)rows,
                  "cudaMemcpy of the same total", memcpy_us, 100 * 2.0 * same_total / ceiling / (memcpy_us * 1e-6));
      pass &= run_pattern(c, "warp a row, one wave", [&] {
        warp_rows<<<one_wave(warp_rows, 0), 256>>>(c.in, c.out, c.rows, c.in_pieces);
      });
      pass &= run_flat<1, kLdg, kSt>(c, "flat x1, one wave");
      pass &= run_flat<1, kLdg, kSt>(c, "flat x1, whole grid", true);
      pass &= run_flat<4, kLdg, kSt>(c, "flat x4, one wave");
      pass &= run_flat<8, kLdg, kSt>(c, "flat x8, one wave");
      pass &= run_flat<4, kLd256, kSt>(c, "flat x4, loads L2::256B");
      pass &= run_flat<4, kLdg, kStcs>(c, "flat x4, st.cs");
      pass &= run_flat<4, kLdg, kStNoAllocate>(c, "flat x4, st L1::no_allocate");
      pass &= run_flat<4, kLdEvictFirst, kStEvictFirst>(c, "flat x4, both L2 evict_first");
      pass &= run_flat<4, kLdg, kStEvictFirst>(c, "flat x4, stores L2 evict_first");
      pass &= run_bulk<4, 16, false>(c, "bulk 4 x 16 rows, expanded", 1);
      pass &= run_bulk<2, 16, false>(c, "bulk 2 x 16 rows, expanded, 2/SM", 2);
      pass &= run_bulk<6, 8, false>(c, "bulk 6 x 8 rows, expanded", 1);
      if (f.in_pieces == kOutPieces) {
        pass &= run_bulk<4, 16, true>(c, "bulk 4 x 16 rows, direct", 1);
        pass &= run_bulk<8, 16, true>(c, "bulk 8 x 16 rows, direct", 1);
      }
      cudaFree(c.in), cudaFree(c.out), cudaFree(c.bad);
    }
  cudaFree(src), cudaFree(dst);
  std::printf("patterns: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
