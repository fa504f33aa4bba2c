// The mla_decode_attention CUDA kernels (ffi/cuda/decode_attention_cuda.cu, included as it is)
// alone on a GPU, without building the extension: for the 1-byte formats, the kernel each
// `kernel` choice (DecodeLaunch) takes (mma: attention_kernel; default: auto, which for both
// (plain fp8 under an E4M3 q, fp8_ds_mla) is rs_attention_kernel from 4 tiles a split, below that
// fp8_attention_kernel or attention_kernel; rs: rs_attention_kernel at any split length) on the same
// inputs, each against the first, timed at the benchmark's memory-bound size and at B = 1, so that
// a kernel change can be judged in one short device call. The tests of
// tests/test_decode_attention.py remain the correctness reference; this only guards against
// timing a broken build. With -DJKM_PHASE_STAMPS the default kernel's CTAs stamp their phases
// (JKM_PHASE_AT: entry, lookups, prologue, first tile, loop end, rows staged, exit) and the probe
// prints where a call's time goes beyond its tiles' streaming: what a CTA spends before its first
// tile and after its last, and how the CTAs start and end; rs_attention_kernel's CTAs also stamp
// their start (JKM_START_AT: the producer's place, its first four positions issued, the query
// fetched), printed from the CTA's entry.
//
// Cases: the arguments, each format:B:context:H:splits[:work] (format bf16, fp8 or ds; with work,
// splits by work of `work` a sequence on average, at most `splits`), or four default ones.
// PROBE_LIVE=n: only n rows (at random places) hold a sequence, of a random length in [256,
// context], the others are padding (length 0), as in benchmarks/splits_sweep.py's serving batch. PROBE_KERNELS=default,rs-combine,... (comma-separated; "default" unsets the choice) times
// other kernel choices than mma, default and rs; a name ending in "-fixed" runs its choice with no
// room for the splits' claims (each split takes exactly its tiles: balance_splits=False).
// PROBE_L2_BLOCKS=n points every table at the first n blocks. -DJKM_RS_FP8_BALANCED_MIN_TILES=n
// balances plain fp8 from n tiles a split (rs_attention_kernel.cuh).
//
//   INC="-I ffi/include -I $(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')"
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJKM_SM90A_BUILT $INC -o /tmp/decode_attention \
//       benchmarks/probes/decode_attention.cu && /tmp/decode_attention
#ifdef JKM_PHASE_STAMPS
constexpr int kStampedCtas = 8192, kStampedTiles = 1024, kPhasePoints = 7;
__device__ unsigned long long g_phase_ns[kStampedCtas][kPhasePoints];  // %globaltimer: across SMs
__device__ long long g_phase_cycles[kStampedCtas][kPhasePoints];        // clock64: within a CTA
__device__ long long g_tile_cycles[kStampedTiles];                       // CTA 0: its tiles landed
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define JKM_PHASE_AT(point)                                                                       \
  do {                                                                                            \
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);         \
    if (threadIdx.x == 0 && cta < kStampedCtas)                                                   \
      g_phase_cycles[cta][point] = clock64(), g_phase_ns[cta][point] = global_ns();               \
  } while (0)
constexpr int kStartPoints = 6;
__device__ long long g_start_cycles[kStampedCtas][kStartPoints];  // JKM_START_AT: clock64
#define JKM_START_AT(point)                                                                       \
  do {                                                                                            \
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);         \
    if (threadIdx.x == ((point) < 5 ? unsigned(kRsGroups * 128) : 0u) && cta < kStampedCtas)    \
      g_start_cycles[cta][point] = clock64();                                                     \
  } while (0)
#define JKM_TILE_AT(tile)                                                                         \
  do {                                                                                            \
    if ((tile) == 0) JKM_PHASE_AT(3);                                                             \
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x % 128 == 0 &&        \
        (tile) < kStampedTiles)                                                                   \
      g_tile_cycles[tile] = clock64();                                                            \
  } while (0)
#endif
#include "../../ffi/cuda/decode_attention_cuda.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "probe_common.cuh"

namespace attention_probe {

using namespace jax_kimi_mla;
using namespace probe_common;

struct Case {
  CacheFormat format;
  int batch, context, heads, splits, work;
};

int entry_bytes(CacheFormat f) {
  return f == CacheFormat::kBf16 ? 2 * kEntry : f == CacheFormat::kFp8 ? kEntry : kDsMlaEntryBytes;
}

// The formats by the names a case gives them (bf16, fp8, ds) and the ones the output prints.
constexpr CacheFormat kFormats[3] = {CacheFormat::kBf16, CacheFormat::kFp8, CacheFormat::kFp8DsMla};
constexpr const char* kCaseNames[3] = {"bf16", "fp8", "ds"};
constexpr const char* kPrintNames[3] = {"bf16", "fp8", "fp8_ds_mla"};
const char* print_name(CacheFormat f) { return kPrintNames[f == CacheFormat::kBf16 ? 0 : f == CacheFormat::kFp8 ? 1 : 2]; }

// Random non-NaN E4M3 codes; ds_mla rows with power-of-two scales and bf16 k_pe; bf16 values of
// magnitude [0.5, 1) and random sign (a normal draw per value is slow at a gigabyte).
std::vector<uint8_t> make_cache(CacheFormat f, int64_t rows, std::mt19937& rng) {
  const int bytes = entry_bytes(f);
  std::vector<uint8_t> cache(size_t(rows) * bytes);
  if (f == CacheFormat::kBf16) {
    for (size_t i = 0; i < cache.size(); i += 2) {
      const uint32_t r = rng();
      const uint16_t h = uint16_t(0x3F00u | (r & 0x80FFu));
      std::memcpy(&cache[i], &h, 2);
    }
    return cache;
  }
  std::uniform_int_distribution<int> code(0, 255);
  for (auto& c : cache) {
    c = uint8_t(code(rng));
    if ((c & 0x7F) == 0x7F) c ^= 1;
  }
  if (f == CacheFormat::kFp8DsMla)
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* e = cache.data() + r * bytes;
      for (int t = 0; t < 4; ++t) {
        const float s = std::ldexp(1.0f, -6 + t);
        std::memcpy(e + kDsMlaScaleOffset + 4 * t, &s, 4);
      }
      for (int i = 0; i < kRope; ++i) {
        const uint16_t h = uint16_t(0x3C00 + code(rng)) ^ (code(rng) & 0x80 ? 0x8000 : 0);  // about 0.01..0.05
        std::memcpy(e + kDsMlaPeOffset + 2 * i, &h, 2);
      }
    }
  return cache;
}

#ifdef JKM_PHASE_STAMPS
// One more call of the default kernel, stamped: where its CTAs' time goes, in us. Per CTA, the
// phases by clock64 converted at that CTA's own rate (its cycles over its %globaltimer span); the
// starts and ends across CTAs by %globaltimer.
void print_phases(const DecodeAttention& a, const Case& k, double tiles_per_cta) {
  static unsigned long long ns[kStampedCtas][kPhasePoints];
  static long long cycles[kStampedCtas][kPhasePoints], tiles[kStampedTiles], starts[kStampedCtas][kStartPoints];
  std::memset(ns, 0, sizeof ns), std::memset(cycles, 0, sizeof cycles), std::memset(starts, 0, sizeof starts);
  cudaMemcpyToSymbol(g_phase_ns, ns, sizeof ns), cudaMemcpyToSymbol(g_phase_cycles, cycles, sizeof cycles);
  cudaMemcpyToSymbol(g_start_cycles, starts, sizeof starts);
  (void)run(nullptr, a, DecodeLaunch{});
  if (!ok(cudaDeviceSynchronize(), "stamped call")) return;
  cudaMemcpyFromSymbol(ns, g_phase_ns, sizeof ns), cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof cycles);
  cudaMemcpyFromSymbol(tiles, g_tile_cycles, sizeof tiles);
  cudaMemcpyFromSymbol(starts, g_start_cycles, sizeof starts);
  // Mean [min, max] over the stamped CTAs: the phases' lengths, and rs_attention_kernel's start
  // (JKM_START_AT, then the phases' ends) as times from the CTA's entry.
  struct Spread {
    double sum = 0, lo = 1e30, hi = 0;
    int n = 0;
    void add(double us) { sum += us, lo = std::min(lo, us), hi = std::max(hi, us), ++n; }
    void print(const char* name) const {
      if (n > 0) std::printf(" %s %.2f [%.2f, %.2f];", name, sum / n, lo, hi);
    }
  };
  constexpr int kStartRows = kStartPoints + 3;
  const char* start_names[kStartRows] = {"producer's place", "position 0 issued", "1 issued", "2 issued",
                                         "3 issued", "query fetched", "lookups", "prologue", "first tile"};
  const char* names[kPhasePoints - 1] = {"lookups", "prologue", "first tile", "loop", "rows staged", "out"};
  Spread start[kStartRows], phase[kPhasePoints - 1];
  const int grid_splits = k.work > 0 ? k.work : k.splits;
  const int ctas = int(std::min<int64_t>(int64_t(grid_splits) * ((k.heads + kTileRows - 1) / kTileRows) * k.batch, kStampedCtas));
  unsigned long long first_in = ~0ull, last_in = 0, first_out = ~0ull, last_out = 0;
  int n = 0;
  double rate0 = 0;
  for (int c = 0; c < ctas; ++c) {
    if (ns[c][6] == 0 || ns[c][3] == 0) continue;  // not stamped, or no tile (a split past the length)
    const double rate = double(cycles[c][6] - cycles[c][0]) / double(ns[c][6] - ns[c][0]);  // cycles a ns
    if (c == 0) rate0 = rate;
    for (int p = 0; p + 1 < kPhasePoints; ++p) phase[p].add((cycles[c][p + 1] - cycles[c][p]) / rate * 1e-3);
    for (int p = 0; p < kStartRows; ++p) {
      const long long at = p < kStartPoints ? starts[c][p] : cycles[c][p - kStartPoints + 1];
      if (at != 0) start[p].add((at - cycles[c][0]) / rate * 1e-3);
    }
    first_in = std::min(first_in, ns[c][0]), last_in = std::max(last_in, ns[c][0]);
    first_out = std::min(first_out, ns[c][6]), last_out = std::max(last_out, ns[c][6]);
    ++n;
  }
  std::printf("  start, us from entry:");
  for (int p = 0; p < kStartRows; ++p) start[p].print(start_names[p]);
  std::printf("\n");
  if (n == 0) return;
  std::printf("  phases of %d CTAs (us, mean [min, max]):", n);
  for (int p = 0; p + 1 < kPhasePoints; ++p) phase[p].print(names[p]);
  std::printf("\n  span %.2f us: CTAs start over %.2f us, end over %.2f us; loop %.3f us a tile (mean)\n",
              (last_out - first_in) * 1e-3, (last_in - first_in) * 1e-3, (last_out - first_out) * 1e-3,
              phase[3].sum / n / std::max(1.0, tiles_per_cta - 1));
  if (rate0 > 0) {
    const int m = int(std::min<double>(tiles_per_cta, kStampedTiles));
    std::printf("  CTA 0's tiles landed (us from its entry):");
    for (int i = 0; i < m; ++i)
      if (i < 8 || i >= m - 4) std::printf(" %d:%.2f", i, (tiles[i] - cycles[0][0]) / rate0 * 1e-3);
    std::printf("\n");
  }
}
#endif

int run_case(const Case& k, std::mt19937& rng) {
  const int bs = 64, max_blocks = (k.context + bs - 1) / bs;
  const int64_t num_blocks = int64_t(k.batch) * max_blocks, rows = num_blocks * bs;
  const bool fp8 = k.format == CacheFormat::kFp8;
  const std::vector<uint8_t> cache = make_cache(k.format, rows, rng);
  std::vector<int32_t> tables(size_t(k.batch) * max_blocks), lens(k.batch, k.context);
  // PROBE_L2_BLOCKS=n: the tables name only blocks 0 .. n - 1 (a cache that stays in L2: how fast a
  // kernel's loop runs when memory does not bound it).
  const char* l2_blocks = std::getenv("PROBE_L2_BLOCKS");
  const int64_t distinct = l2_blocks ? std::max<int64_t>(1, std::atoll(l2_blocks)) : int64_t(tables.size());
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = int32_t(int64_t(i) % distinct);
  std::shuffle(tables.begin(), tables.end(), rng);
  if (const char* live = std::getenv("PROBE_LIVE")) {
    std::fill(lens.begin(), lens.end(), 0);
    std::uniform_int_distribution<int> length(std::min(256, k.context), k.context);
    for (int i = 0; i < std::min(k.batch, std::atoi(live)); ++i) lens[i] = length(rng);
    std::shuffle(lens.begin(), lens.end(), rng);
  }
  // q: E4M3 codes with the plain fp8 cache (as the bench runs it), else bf16 about N(0, 1).
  const int64_t q_elems = int64_t(k.batch) * k.heads * kEntry;
  std::vector<uint8_t> q(size_t(q_elems) * (fp8 ? 1 : 2));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < q_elems; ++i) {
    if (fp8) {
      uint8_t c = uint8_t(rng() & 0xFF);
      if ((c & 0x7F) >= 0x60) c &= 0xBF;  // moderate codes
      q[i] = c;
    } else {
      const uint16_t h = __bfloat16_as_ushort(__float2bfloat16(normal(rng)));
      std::memcpy(&q[2 * i], &h, 2);
    }
  }
  const float q_inv = 14.0f, cache_inv = 56.0f;

  uint8_t *d_cache, *d_q;
  int32_t *d_tables, *d_lens;
  float *d_scales, *d_lse, *d_partials;
  uint16_t* d_out;
  const int64_t out_elems = int64_t(k.batch) * k.heads * kLatent;
  const size_t partial_rows = k.splits > 1 ? size_t(k.splits) * k.batch * k.heads : 0;
  const size_t partial_floats = partial_rows * (kClaimFloats + kAttnRowStats);  // the claims first
  if (!ok(cudaMalloc(&d_cache, cache.size()), "malloc") || !ok(cudaMalloc(&d_q, q.size()), "malloc") ||
      !ok(cudaMalloc(&d_tables, tables.size() * 4), "malloc") || !ok(cudaMalloc(&d_lens, lens.size() * 4), "malloc") ||
      !ok(cudaMalloc(&d_scales, 8), "malloc") || !ok(cudaMalloc(&d_lse, size_t(k.batch) * k.heads * 4), "malloc") ||
      !ok(cudaMalloc(&d_partials, partial_floats * 4 + 16), "malloc") || !ok(cudaMalloc(&d_out, out_elems * 2), "malloc"))
    return 2;
  cudaMemcpy(d_cache, cache.data(), cache.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_q, q.data(), q.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice);
  const float scales[2] = {q_inv, cache_inv};
  cudaMemcpy(d_scales, scales, 8, cudaMemcpyHostToDevice);

  DecodeAttention a;
  a.cache_format = k.format;
  a.cache = d_cache;
  a.row_bytes = entry_bytes(k.format);
  a.num_blocks = num_blocks;
  a.set_block_size(bs);
  a.block_tables = d_tables, a.max_blocks = max_blocks;
  a.context_lens = d_lens;
  a.cache_scale_inv = fp8 ? d_scales + 1 : nullptr;
  a.q_type = fp8 ? QType::kE4m3 : QType::kBF16, a.act = ActType::kBF16;
  a.batch = k.batch, a.q_tokens = 1, a.heads = k.heads;
  a.q = d_q, a.softmax_scale = 0.0417f;
  a.q_scale_inv = fp8 ? d_scales : nullptr;
  a.out = d_out, a.lse = d_lse, a.num_splits = k.splits, a.work_splits = k.work;
  a.partials = k.splits > 1 ? d_partials + partial_rows * kClaimFloats : nullptr;
  SplitClaim* const claims = k.splits > 1 ? reinterpret_cast<SplitClaim*>(d_partials) : nullptr;

  // The kernels by the `kernel` choice: attention_kernel (forced), the default,
  // rs_attention_kernel where the format is a 1-byte one (else the default); each against the first.
  std::vector<std::string> kernels = {"mma", "default", "rs"};
  if (const char* env = std::getenv("PROBE_KERNELS")) {
    kernels.clear();
    std::stringstream list(env);
    for (std::string name; std::getline(list, name, ',');) kernels.push_back(name);
  }
  const int kKernels = int(kernels.size());
  std::vector<std::vector<uint16_t>> out(kKernels);
  std::vector<std::vector<float>> lse(kKernels);
  std::vector<float> us(kKernels);
  const std::string kFixed = "-fixed";
  const auto fixed = [&](const std::string& name) {
    return name.size() > kFixed.size() && name.compare(name.size() - kFixed.size(), kFixed.size(), kFixed) == 0;
  };
  const auto choose = [&](const std::string& name) {
    DecodeLaunch launch;  // "default" (or an unknown name): the kernel that suits the call
    kernel_request(fixed(name) ? name.substr(0, name.size() - kFixed.size()) : name, launch.kernel);
    return launch;
  };
  for (int kernel = 0; kernel < kKernels; ++kernel) {
    const DecodeLaunch launch = choose(kernels[kernel]);
    a.claims = fixed(kernels[kernel]) ? nullptr : claims;
    cudaMemset(d_out, 0xFF, out_elems * 2);
    if (ffi::Error e = run(nullptr, a, launch); e.failure() || !ok(cudaDeviceSynchronize(), "attention")) {
      std::printf("run failed\n");
      return 2;
    }
    out[kernel].resize(out_elems), lse[kernel].resize(size_t(k.batch) * k.heads);
    cudaMemcpy(out[kernel].data(), d_out, out_elems * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(lse[kernel].data(), d_lse, lse[kernel].size() * 4, cudaMemcpyDeviceToHost);
    us[kernel] = time_us([&] { (void)run(nullptr, a, launch); }, 20);
  }
  double tokens = 0;
  for (int len : lens) tokens += len;
  const double bytes = tokens * a.row_bytes;
  const double tiles_per_cta = tokens / bs / (double(k.batch) * (k.work > 0 ? k.work : k.splits));
  bool agree = true;
  std::printf("%-10s B %d context %d H %d splits %d", print_name(k.format), k.batch, k.context, k.heads, k.splits);
  std::printf(k.work > 0 ? " by work of %d:" : ":", k.work);
  for (int kernel = 0; kernel < kKernels; ++kernel) {
    double worst = 0, size = 0, lse_worst = 0;
    for (int64_t i = 0; i < out_elems; ++i) {
      const float x = bf16_to_f32(out[kernel][i]), y = bf16_to_f32(out[0][i]);
      worst = std::isnan(x) != std::isnan(y) ? INFINITY : std::fmax(worst, std::fabs(x - y));
      size = std::fmax(size, std::fabs(y));
    }
    for (size_t i = 0; i < lse[0].size(); ++i) lse_worst = std::fmax(lse_worst, std::fabs(lse[kernel][i] - lse[0][i]));
    const bool same = worst <= 2e-2 * (1 + size) && lse_worst <= 1e-2;
    agree = agree && same;
    std::printf(" %s %.2f us (%.0f GB/s, %.2f us a tile%s%s, max |diff| %.3g, lse %.3g);",
                kernels[kernel].c_str(), us[kernel], bytes / (us[kernel] * 1e3),
                us[kernel] / tiles_per_cta, kernel == 0 ? "" : ", ", kernel == 0 ? "" : same ? "agrees" : "DIFFERS",
                worst, lse_worst);
  }
  std::printf("\n");
#ifdef JKM_PHASE_STAMPS
  print_phases(a, k, tiles_per_cta);
#endif
  cudaFree(d_cache), cudaFree(d_q), cudaFree(d_tables), cudaFree(d_lens), cudaFree(d_scales), cudaFree(d_lse);
  cudaFree(d_partials), cudaFree(d_out);
  return agree ? 0 : 1;
}

}  // namespace attention_probe

int main(int argc, char** argv) {
  using namespace attention_probe;
  if (!print_device()) return 2;
  std::mt19937 rng(7);
  int status = 0;
  std::vector<Case> cases = {Case{CacheFormat::kFp8, 64, 16384, 12, 2, 0}, Case{CacheFormat::kFp8DsMla, 64, 16384, 12, 2, 0},
                             Case{CacheFormat::kFp8, 1, 4096, 12, 64, 0}, Case{CacheFormat::kFp8DsMla, 1, 4096, 12, 64, 0}};
  if (argc > 1) cases.clear();
  for (int i = 1; i < argc; ++i) {  // format:B:context:H:splits[:work]
    char format[16] = {};
    Case k{};
    const int named =
        std::sscanf(argv[i], "%15[^:]:%d:%d:%d:%d:%d", format, &k.batch, &k.context, &k.heads, &k.splits, &k.work);
    const auto* name = std::find_if(kCaseNames, kCaseNames + 3, [&](const char* n) { return std::strcmp(n, format) == 0; });
    if (named < 5 || name == kCaseNames + 3) {
      std::printf("a case is format:B:context:H:splits[:work] with format bf16, fp8 or ds, not %s\n", argv[i]);
      return 2;
    }
    k.format = kFormats[name - kCaseNames];
    cases.push_back(k);
  }
  for (const Case& k : cases) status |= run_case(k, rng);
  return status;
}
