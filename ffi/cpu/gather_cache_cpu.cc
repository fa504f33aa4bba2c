// CPU handler of gather_mla_cache: sequence after sequence, token after token, in plain loops.
#include <cstring>

#include "jax_kimi_mla/gather_cache.h"

namespace jax_kimi_mla {
namespace {

ffi::Error handler(ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                   ffi::AnyBuffer cache_scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GatherCache g;
  if (ffi::Error err = make_gather_cache(cache, tables, lens, cache_scale_inv, *out, g); err.failure())
    return err;
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
  if (r < g.num_tokens)  // rows past the last token: zeros
    std::memset(static_cast<uint8_t*>(g.out) + r * row_bytes, 0, size_t(g.num_tokens - r) * row_bytes);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(jkm_cpu_gather_mla_cache, jax_kimi_mla::handler,
                              JKM_GATHER_CACHE_BINDING(xla::ffi::Ffi::Bind()));
