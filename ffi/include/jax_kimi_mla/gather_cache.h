// gather_mla_cache, as data: the cached entries of a batch of sequences read through their block
// tables and written densely, dequantized, one row per token, sequence after sequence (chunked
// prefill reads its context this way). Host and device.
#pragma once

#include <cstring>
#include <string>

#include "jax_kimi_mla/paged_cache.h"

namespace jax_kimi_mla {

enum class OutType : uint8_t { kBF16, kF16, kF32 };

struct GatherCache : PagedCache {
  int64_t batch = 0;
  // Output rows. Token t of sequence b goes to row start + t, start being the clamped lengths of
  // the sequences before b; rows at or past num_tokens are dropped, and rows past the last
  // sequence's tokens are zeros.
  int64_t num_tokens = 0;
  OutType out_type = OutType::kBF16;
  void* out = nullptr;  // [num_tokens, 576]
};

// Eight float32 values stored as output elements 8g..8g+7 of row r (bf16/f16: round to nearest
// even, NaN canonical; f32: as they are).
JKM_HD void store_out8(const GatherCache& g, int64_t r, int group, const float v[8]) {
  const int64_t first = r * kEntry + group * 8;
  if (g.out_type == OutType::kF32) {
    for (int half = 0; half < 2; ++half) {
      Raw16 w;
      for (int i = 0; i < 4; ++i) w.w[i] = f32_bits(v[4 * half + i]);
      store16(static_cast<float*>(g.out) + first + 4 * half, w);
    }
    return;
  }
  Raw16 w;
  for (int i = 0; i < 4; ++i)
    w.w[i] = g.out_type == OutType::kBF16 ? bf16x2(v[2 * i], v[2 * i + 1]) : f16x2(v[2 * i], v[2 * i + 1]);
  store16(static_cast<uint16_t*>(g.out) + first, w);
}

// The whole gather on the host (the CPU handler): sequence after sequence, token after token,
// in plain loops; rows past the last token are zeros.
inline void gather_on_host(const GatherCache& g) {
  int64_t r = 0;  // the next output row
  for (int64_t b = 0; b < g.batch && r < g.num_tokens; ++b) {
    const int64_t len = g.context_len(b);
    for (int64_t t = 0; t < len && r < g.num_tokens; ++t, ++r) {
      const int64_t cache_row = g.token_row(b, t);  // -1: masked, a zero row
      float v[kEntry] = {};
      if (cache_row >= 0) entry_values(g, g.cache + cache_row * g.row_bytes, v);
      for (int group = 0; group < kEntry / 8; ++group) store_out8(g, r, group, v + 8 * group);
    }
  }
  const size_t row_bytes = kEntry * (g.out_type == OutType::kF32 ? 4 : 2);
  if (r < g.num_tokens)
    std::memset(static_cast<uint8_t*>(g.out) + r * row_bytes, 0, size_t(g.num_tokens - r) * row_bytes);
}

// ---- FFI operands -> GatherCache (host) ----

constexpr std::string_view kGatherTarget = "gather_mla_cache";  // as errors name it

// Operands: kv_cache, block_tables, context_lens, cache_scale_inv (as in make_paged_cache).
// Result: out bf16|f16|f32 [num_tokens, 576]. No attributes.
inline ffi::Error make_gather_cache(ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                                    ffi::AnyBuffer cache_scale_inv, ffi::AnyBuffer out, GatherCache& g) {
  const auto fail = [](std::string_view what) { return invalid_argument(kGatherTarget, what); };
  using T = ffi::DataType;
  g.batch = tables.dimensions().size() == 2 ? tables.dimensions()[0] : -1;
  if (std::string err = make_paged_cache(cache, tables, lens, cache_scale_inv, g.batch, g); !err.empty())
    return fail(err);
  const auto od = out.dimensions();
  switch (out.element_type()) {
    case T::BF16: g.out_type = OutType::kBF16; break;
    case T::F16: g.out_type = OutType::kF16; break;
    case T::F32: g.out_type = OutType::kF32; break;
    default: return fail("out must be bfloat16, float16 or float32");
  }
  if (od.size() != 2 || od[1] != kEntry) return fail("out must be [num_tokens, 576]");
  g.num_tokens = od[0];
  g.out = out.untyped_data();
  return ffi::Error::Success();
}

#define JKM_GATHER_CACHE_BINDING(bind) \
  (bind).Arg<xla::ffi::AnyBuffer>()    \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Ret<xla::ffi::AnyBuffer>()

}  // namespace jax_kimi_mla
