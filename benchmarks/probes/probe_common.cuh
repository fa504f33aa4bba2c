// What the probes share: a checked CUDA call (ok), the device line they print first, how the
// event-timed ones time a call (the median of back-to-back launches between events, queued behind
// a kernel that holds the stream so that the host's gaps between launches do not count), and the
// copy ceiling they measure against.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

namespace probe_common {

// Whether a CUDA call succeeded; if not, says which and why.
inline bool ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) std::printf("%s failed: %s\n", what, cudaGetErrorString(err));
  return err == cudaSuccess;
}

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Holds the stream for about `ns` nanoseconds, so that the launches queued behind it run back to
// back, without the host's gaps between them.
__global__ void hold(int64_t ns) {
  int64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
}

// Median microseconds of `reps` back-to-back calls of f, each between two events.
inline float time_us(const std::function<void()>& f, int reps) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<cudaEvent_t> events(size_t(reps) + 1);
  for (cudaEvent_t& e : events) cudaEventCreate(&e);
  hold<<<1, 1>>>(5000000);
  cudaEventRecord(events[0]);
  for (size_t i = 1; i < events.size(); ++i) {
    f();
    cudaEventRecord(events[i]);
  }
  cudaEventSynchronize(events.back());
  std::vector<float> us;
  for (size_t i = 1; i < events.size(); ++i) {
    float ms = 0;
    cudaEventElapsedTime(&ms, events[i - 1], events[i]);
    us.push_back(1e3f * ms);
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  return median(us);
}

// Prints the GPU's name and SM count; false (said why) where it cannot be asked.
inline bool print_device() {
  cudaDeviceProp prop{};
  if (!ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties")) return false;
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  return true;
}

// The copy ceiling, printed: a 1 GiB device-to-device cudaMemcpy, bytes read + written per
// second; 0 where its buffers cannot be allocated.
inline double copy_ceiling() {
  const size_t bytes = size_t(1) << 30;
  uint8_t *src = nullptr, *dst = nullptr;
  double ceiling = 0;
  if (ok(cudaMalloc(&src, bytes), "cudaMalloc") && ok(cudaMalloc(&dst, bytes), "cudaMalloc")) {
    cudaMemset(src, 0x5A, bytes);
    const float us = time_us([&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); }, 10);
    ceiling = 2.0 * double(bytes) / (us * 1e-6);
    std::printf("copy ceiling: %.1f GB/s (1 GiB in %.1f us)\n", ceiling / 1e9, us);
  }
  cudaFree(src), cudaFree(dst);
  return ceiling;
}

}  // namespace probe_common
