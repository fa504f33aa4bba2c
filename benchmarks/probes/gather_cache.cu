// The gather_mla_cache CUDA kernel (ffi/cuda/gather_cache_cuda.cu, included as it is, or with
// -DJKM_GATHER_SOURCE='"gather_bulk.cuh"' the candidate beside this file) alone on a GPU, without
// building the extension: bit for bit against the CPU handler's operations (the shared headers'
// host path) on hostile tables, then timed at the benchmark's sizes against a device-to-device
// copy, so that a kernel change can be judged in one short device call (about 5 s on an H200).
//
// Correctness: every format (bf16 and f16 caches, plain fp8 at a scale that is no power of two,
// fp8_ds_mla with odd, huge and power-of-two tile scales) into every output type; random bytes
// (all 256 E4M3 codes, NaN among them; 16-bit NaNs), block sizes 16 and 24, lengths 0, 1, bs - 1,
// bs, bs + 1, negative and past the table, an out-of-range block id inside a length, garbage ids
// and NaN blocks past the lengths, a block shared by two sequences, num_tokens below and above
// the tokens there are; the output poisoned first. Float32 NaNs compare as NaN (the GPU's
// arithmetic NaN is canonical, the host's keeps a payload); every other bit must match.
//
// Timing (bfloat16 out, block size 64, every sequence at the given context, random distinct
// blocks, valid entries): the median of 30 back-to-back launches timed by events (queued behind
// a kernel that holds the stream, so the host's per-launch work leaves no gaps; the events' own
// gaps are counted, so the times run a little above the profiler's), against the copy
// ceiling of a 1 GiB cudaMemcpy (bytes read + written), counting the valid rows read in cache
// bytes plus every output row written, as benchmarks/bench_attention.py's section 7 does. Beside
// each, the same bytes streamed with no gather (stream_rows): the bound of the traffic itself.
//
//   INC="-I ffi/include -I $(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')"
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a $INC -o /tmp/gather_cache \
//       benchmarks/probes/gather_cache.cu && /tmp/gather_cache [--check-only]
#ifndef JKM_GATHER_SOURCE
#define JKM_GATHER_SOURCE "../../ffi/cuda/gather_cache_cuda.cu"
#endif
#include JKM_GATHER_SOURCE

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "probe_common.cuh"

namespace gather_probe {  // named: nvcc's stubs cannot tell two anonymous namespaces apart

using namespace jax_kimi_mla;
using namespace probe_common;

const char* format_name(CacheFormat f, ActType c16) {
  if (f != CacheFormat::kBf16) return f == CacheFormat::kFp8 ? "fp8" : "fp8_ds_mla";
  return c16 == ActType::kBF16 ? "bf16" : "f16";
}
const char* out_name(OutType o) { return o == OutType::kBF16 ? "bf16" : o == OutType::kF16 ? "f16" : "f32"; }
int out_bytes(OutType o) { return o == OutType::kF32 ? 4 : 2; }

ffi::Error launch_any(cudaStream_t stream, const GatherCache& g) {
  return launch_instance(g, [&](auto format, auto cache16, auto out) {
    return launch<format.value, cache16.value, out.value>(stream, g);
  });
}

// A case on the host: the cache bytes, int32 tables and lengths, and the GatherCache over host
// memory (the CPU handler's view); device copies are made by `upload`.
struct Case {
  std::vector<uint8_t> cache;
  std::vector<int32_t> tables, lens;
  float scale_inv = 1.0f;
  GatherCache g;
};

Case make_case(CacheFormat fmt, ActType c16, OutType out, int block_size, const std::vector<int>& lens,
               int64_t num_tokens, std::mt19937& rng) {
  Case c;
  GatherCache& g = c.g;
  g.cache_format = fmt, g.cache16 = c16, g.out_type = out;
  g.set_block_size(block_size);
  g.batch = int64_t(lens.size());
  int max_len = 0;
  for (int n : lens) max_len = std::max(max_len, n);
  g.max_blocks = std::max(1, (std::min(max_len, 40) + block_size - 1) / block_size);  // lengths past 40 clamp
  g.num_blocks = g.batch * g.max_blocks + 3;
  g.row_bytes = g.entry_bytes() + (fmt == CacheFormat::kFp8DsMla ? 0 : 64);  // bf16/fp8 rows padded
  c.cache.resize(size_t(g.num_blocks * block_size * g.row_bytes));
  for (auto& byte : c.cache) byte = uint8_t(rng());
  if (fmt == CacheFormat::kFp8DsMla) {  // tile scales: powers of two, odd values, huge, tiny
    const float scales[] = {0.0078125f, 3.0f, 0.7f, 0x1p121f, 0x1p-130f, -2.5f, 1.0f, 6e-5f};
    for (int64_t r = 0; r < g.num_blocks * block_size; ++r)
      for (int k = 0; k < 4; ++k)
        std::memcpy(&c.cache[size_t(r * g.row_bytes + kDsMlaScaleOffset + 4 * k)], &scales[rng() % 8], 4);
  }
  c.scale_inv = 448.0f / 10.0f;
  c.tables.resize(size_t(g.batch * g.max_blocks));
  std::vector<int32_t> ids(size_t(g.num_blocks));
  for (int i = 0; i < int(ids.size()); ++i) ids[size_t(i)] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  for (size_t i = 0; i < c.tables.size(); ++i) c.tables[i] = ids[i];
  const int32_t garbage[] = {2147480000, -7, int32_t(g.num_blocks), -2147483647};
  for (int64_t b = 0; b < g.batch; ++b) {
    const int64_t n = std::clamp<int64_t>(lens[size_t(b)], 0, g.max_len());
    const int64_t used = (n + block_size - 1) / block_size;
    for (int64_t j = used; j < g.max_blocks; ++j) {  // past the length: garbage ids, NaN blocks
      const int32_t id = c.tables[size_t(b * g.max_blocks + j)];
      std::memset(&c.cache[size_t(int64_t(id) * block_size * g.row_bytes)], 0x7F, size_t(block_size * g.row_bytes));
      c.tables[size_t(b * g.max_blocks + j)] = garbage[j % 4];
    }
    if (used > 2) c.tables[size_t(b * g.max_blocks + 1)] = int32_t(g.num_blocks + 5);  // masked inside
  }
  if (g.batch > 1) c.tables[size_t((g.batch - 1) * g.max_blocks)] = c.tables[0];  // a shared block
  c.lens = std::vector<int32_t>(lens.begin(), lens.end());
  g.num_tokens = num_tokens;
  return c;
}

// The CPU handler's gather (gather_on_host) over host memory.
std::vector<uint8_t> host_gather(Case& c) {
  GatherCache g = c.g;
  g.cache = c.cache.data(), g.block_tables = c.tables.data(), g.context_lens = c.lens.data();
  g.cache_scale_inv = g.cache_format == CacheFormat::kFp8 ? &c.scale_inv : nullptr;
  std::vector<uint8_t> out(size_t(g.num_tokens) * kEntry * size_t(out_bytes(g.out_type)));
  g.out = out.data();
  gather_on_host(g);
  return out;
}

// Device buffers of a GatherCache.
struct DeviceCase {
  uint8_t* cache = nullptr;
  int32_t *tables = nullptr, *lens = nullptr;
  float* scale_inv = nullptr;
  uint8_t* out = nullptr;
  size_t out_size = 0;
  GatherCache g;

  bool alloc(const GatherCache& host, size_t cache_bytes) {
    g = host;
    out_size = size_t(g.num_tokens) * kEntry * size_t(out_bytes(g.out_type));
    const bool good = ok(cudaMalloc(&cache, cache_bytes), "cudaMalloc cache") &&
                      ok(cudaMalloc(&tables, size_t(std::max<int64_t>(1, g.batch * g.max_blocks)) * 4),
                         "cudaMalloc tables") &&
                      ok(cudaMalloc(&lens, size_t(std::max<int64_t>(1, g.batch)) * 4), "cudaMalloc lens") &&
                      ok(cudaMalloc(&scale_inv, 4), "cudaMalloc scale") &&
                      ok(cudaMalloc(&out, std::max<size_t>(out_size, 16)), "cudaMalloc out");
    g.cache = cache, g.block_tables = tables, g.context_lens = lens, g.out = out;
    g.cache_scale_inv = g.cache_format == CacheFormat::kFp8 ? scale_inv : nullptr;
    return good;
  }
  ~DeviceCase() {
    cudaFree(cache), cudaFree(tables), cudaFree(lens), cudaFree(scale_inv), cudaFree(out);
  }
};

bool run_once(DeviceCase& d) {
  const ffi::Error err = launch_any(nullptr, d.g);
  if (err.failure()) {
    std::printf("launch failed: %s\n", err.message().c_str());
    return false;
  }
  return ok(cudaGetLastError(), "launch");
}

bool check_case(CacheFormat fmt, ActType c16, OutType out, int block_size, int64_t num_tokens, std::mt19937& rng) {
  const std::vector<int> lens = {block_size + 1, 0, 1, block_size - 1, block_size, 40, -3, 9, 1000, 33};
  Case c = make_case(fmt, c16, out, block_size, lens, num_tokens, rng);
  const std::vector<uint8_t> want = host_gather(c);
  DeviceCase d;
  if (!d.alloc(c.g, c.cache.size())) return false;
  ok(cudaMemcpy(d.cache, c.cache.data(), c.cache.size(), cudaMemcpyHostToDevice), "copy cache");
  ok(cudaMemcpy(d.tables, c.tables.data(), c.tables.size() * 4, cudaMemcpyHostToDevice), "copy tables");
  ok(cudaMemcpy(d.lens, c.lens.data(), c.lens.size() * 4, cudaMemcpyHostToDevice), "copy lens");
  ok(cudaMemcpy(d.scale_inv, &c.scale_inv, 4, cudaMemcpyHostToDevice), "copy scale");
  ok(cudaMemset(d.out, 0xFF, d.out_size), "poison");
  if (!run_once(d) || !ok(cudaDeviceSynchronize(), "sync")) return false;
  std::vector<uint8_t> got(d.out_size);
  ok(cudaMemcpy(got.data(), d.out, d.out_size, cudaMemcpyDeviceToHost), "copy out");
  const int width = out_bytes(out);
  int64_t bad = 0, first_bad = -1;
  for (size_t i = 0; i < got.size(); i += size_t(width)) {
    uint32_t a = 0, b = 0;
    std::memcpy(&a, &got[i], size_t(width)), std::memcpy(&b, &want[i], size_t(width));
    const bool nan_pair = width == 4 && std::isnan(f32_from_bits(a)) && std::isnan(f32_from_bits(b));
    if (a != b && !nan_pair) {
      if (first_bad < 0) first_bad = int64_t(i / size_t(width));
      ++bad;
    }
  }
  std::printf("check %-10s -> %-4s bs %2d num_tokens %4lld: %s", format_name(fmt, c16), out_name(out), block_size,
              (long long)num_tokens, bad ? "FAIL" : "ok");
  if (bad) std::printf(" (%lld values differ, first at row %lld column %lld)", (long long)bad,
                       (long long)(first_bad / kEntry), (long long)(first_bad % kEntry));
  std::printf("\n");
  return bad == 0;
}

// Valid entries on the device: 16-bit values of magnitude about 2^-8..2^7, E4M3 codes that are no
// NaN, power-of-two ds_mla tile scales (as the encoder writes them).
__global__ void fill_cache(uint8_t* cache, int64_t rows, int64_t row_bytes, CacheFormat fmt, uint32_t seed) {
  const int64_t words = rows * row_bytes / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15, h *= 0x85EBCA77u, h ^= h >> 13, h *= 0xC2B2AE3Du, h ^= h >> 16;
    const int64_t col = (i * 4) % row_bytes;
    uint32_t w = h;
    if (fmt == CacheFormat::kBf16) {
      w = (h & 0x807F807Fu) | 0x3C003C00u;  // exponents 120..127
    } else if (fmt == CacheFormat::kFp8 || col < kLatent) {
      w = h & 0xF7F7F7F7u;  // exponent field below 15: no NaN code
    } else if (col < kDsMlaPeOffset) {
      w = (120u + (h & 7u)) << 23;  // a power-of-two tile scale
    } else {
      w = (h & 0x807F807Fu) | 0x3C003C00u;  // k_pe bf16
    }
    reinterpret_cast<uint32_t*>(cache)[i] = w;
  }
}

// The gather at B sequences of `context` tokens, bfloat16 out: microseconds and the fraction of
// the copy ceiling (bytes per second).
bool time_case(CacheFormat fmt, int64_t batch, int64_t context, double ceiling) {
  GatherCache g;
  g.cache_format = fmt, g.cache16 = ActType::kBF16, g.out_type = OutType::kBF16;
  g.set_block_size(64);
  g.batch = batch, g.max_blocks = (context + 63) / 64;
  g.num_blocks = batch * g.max_blocks + 64;
  g.row_bytes = g.entry_bytes();
  g.num_tokens = batch * context;
  std::mt19937 rng(uint32_t(batch * 131 + context));
  std::vector<int32_t> ids(size_t(g.num_blocks));
  for (int i = 0; i < int(ids.size()); ++i) ids[size_t(i)] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  const std::vector<int32_t> lens(static_cast<size_t>(batch), static_cast<int32_t>(context));
  DeviceCase d;
  const size_t cache_bytes = size_t(g.num_blocks * 64 * g.row_bytes);
  if (!d.alloc(g, cache_bytes)) return false;
  fill_cache<<<1024, 256>>>(d.cache, g.num_blocks * 64, g.row_bytes, fmt, 12345u);
  const float scale = 56.0f;  // the layer's FP8_SCALE_INV (448 / 8): not a power of two
  ok(cudaMemcpy(d.tables, ids.data(), size_t(batch * g.max_blocks) * 4, cudaMemcpyHostToDevice), "copy tables");
  ok(cudaMemcpy(d.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "copy lens");
  ok(cudaMemcpy(d.scale_inv, &scale, 4, cudaMemcpyHostToDevice), "copy scale");
  if (!run_once(d) || !ok(cudaDeviceSynchronize(), "sync")) return false;
  const float us = time_us([&] { run_once(d); }, 30);
  const double bytes = double(batch * context) * double(g.entry_bytes() + 2 * kEntry);
  const double floor_us = bytes / ceiling * 1e6;
  std::printf("time %-10s B %3lld context %6lld: %8.2f us, floor %8.2f us, %5.1f%% of the copy ceiling\n",
              format_name(fmt, ActType::kBF16), (long long)batch, (long long)context, us, floor_us,
              100 * floor_us / us);
  return ok(cudaDeviceSynchronize(), "timing");
}

// The traffic of a gather without its gather: row r's entry_bytes read from a contiguous array
// (16-byte loads, lane l taking pieces l, l + 32, ...) and its 1152 output bytes written
// contiguously, the stores depending on every load (an xor of them), a warp a row, grid-stride
// over one wave. What the gather's bytes cost with no table, no lookups and no conversion: the
// bound of its kernel at each size.
__global__ void stream_rows(const uint4* in, uint4* out, int64_t rows, int in_pieces) {
  constexpr int kOutPieces = 2 * kEntry / 16;  // 72
  const int lane = int(threadIdx.x) % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int p = lane; p < in_pieces; p += 32) {
      const uint4 v = in[r * in_pieces + p];
      acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
    for (int p = lane; p < kOutPieces; p += 32) out[r * kOutPieces + p] = acc;
  }
}

// The streaming bound at a size: microseconds for rows * (entry_bytes read + 1152 written).
void time_stream(CacheFormat fmt, int64_t rows, double ceiling) {
  GatherCache g;
  g.cache_format = fmt;
  const int in_pieces = int(g.entry_bytes() / 16);
  uint4 *in = nullptr, *out = nullptr;
  if (!ok(cudaMalloc(&in, size_t(rows) * in_pieces * 16), "cudaMalloc") ||
      !ok(cudaMalloc(&out, size_t(rows) * 2 * kEntry), "cudaMalloc"))
    return;
  cudaMemset(in, 0x3C, size_t(rows) * in_pieces * 16);
  int sms = 0, per_sm = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_rows, 256, 0);
  const unsigned blocks = unsigned(std::min<int64_t>((rows + 7) / 8, int64_t(sms) * per_sm));
  const float us = time_us([&] { stream_rows<<<blocks, 256>>>(in, out, rows, in_pieces); }, 30);
  const double floor_us = double(rows) * double(g.entry_bytes() + 2 * kEntry) / ceiling * 1e6;
  std::printf("stream %-10s rows %7lld: %8.2f us, floor %8.2f us, %5.1f%% of the copy ceiling\n",
              format_name(fmt, ActType::kBF16), (long long)rows, us, floor_us, 100 * floor_us / us);
  cudaFree(in), cudaFree(out);
}

}  // namespace gather_probe

int main(int argc, char** argv) {
  using namespace gather_probe;
  const bool check_only = argc > 1 && std::string(argv[1]) == "--check-only";  // e.g. under compute-sanitizer
  if (!print_device()) return 1;
  std::mt19937 rng(2026);
  bool pass = true;
  const CacheFormat formats[] = {CacheFormat::kBf16, CacheFormat::kBf16, CacheFormat::kFp8, CacheFormat::kFp8DsMla};
  const ActType c16s[] = {ActType::kBF16, ActType::kF16, ActType::kBF16, ActType::kBF16};
  for (int f = 0; f < 4; ++f)
    for (OutType out : {OutType::kBF16, OutType::kF16, OutType::kF32})
      for (int bs : {16, 24})
        for (int64_t num_tokens : {int64_t(50), int64_t(400)})
          pass &= check_case(formats[f], c16s[f], out, bs, num_tokens, rng);
  std::printf("correctness: %s\n", pass ? "PASS" : "FAIL");
  if (check_only) return pass ? 0 : 1;

  const double ceiling = copy_ceiling();
  if (ceiling == 0) return 1;
  const int64_t sizes[][2] = {{16, 4096}, {1, 131072}, {64, 16384}};
  for (const auto& s : sizes)
    for (CacheFormat fmt : {CacheFormat::kBf16, CacheFormat::kFp8, CacheFormat::kFp8DsMla}) {
      pass &= time_case(fmt, s[0], s[1], ceiling);
      time_stream(fmt, s[0] * s[1], ceiling);
    }
  return pass ? 0 : 1;
}
