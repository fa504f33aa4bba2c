// CPU handler of mla_decode_attention: plain float32 loops over the DecodeAttention rules, one
// query row at a time, in two passes over its tokens (scores and their maximum, then the
// weighted sum), so memory stays O(context). The split count only sizes the CUDA kernel's
// scratch; the CPU result does not depend on it.
#include <cmath>
#include <limits>
#include <vector>

#include "jax_kimi_mla/decode_attention.h"

namespace jax_kimi_mla {
namespace {

float q_value(const DecodeAttention& a, int64_t i) {
  switch (a.q_type) {
    case QType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(a.q)[i]);
    case QType::kF16: return f16_to_f32(static_cast<const uint16_t*>(a.q)[i]);
    case QType::kE4m3: return e4m3_to_f32(static_cast<const uint8_t*>(a.q)[i]) / *a.q_scale_inv;
  }
  return 0.0f;
}

// The float32 values of the entry at a cache row: plain fp8 codes divided by cache_scale_inv.
void entry_values(const DecodeAttention& a, int64_t cache_row, float v[kEntry]) {
  const uint8_t* entry = a.cache + cache_row * a.row_bytes;
  const float inv = a.cache_scale_inv != nullptr ? *a.cache_scale_inv : 1.0f;
  for (int c = 0; c < kEntry; ++c) v[c] = entry_value(a, entry, c) / inv;
}

void attend_row(const DecodeAttention& a, int64_t b, int64_t j, int64_t h,
                std::vector<float>& scores) {
  const int64_t row = (b * a.q_tokens + j) * a.heads + h;
  float q[kEntry], k[kEntry];
  for (int c = 0; c < kEntry; ++c) q[c] = q_value(a, row * kEntry + c);

  // Pass 1: the scaled score of every visible token (masked ones: -inf) and their maximum.
  const int64_t visible = a.visible_len(a.context_len(b), j);
  scores.assign(size_t(visible), -std::numeric_limits<float>::infinity());
  float max_score = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t t = 0; t < visible; ++t) {
    const int64_t cache_row = a.token_row(b, t);
    if (cache_row < 0) continue;
    entry_values(a, cache_row, k);
    float dot = 0.0f;
    for (int c = 0; c < kEntry; ++c) dot += q[c] * k[c];
    scores[t] = dot * a.softmax_scale;
    nan |= std::isnan(scores[t]);
    max_score = scores[t] > max_score ? scores[t] : max_score;
  }

  // Pass 2: the softmax-weighted sum of the latents. No visible token: zeros and lse -inf.
  float out[kLatent] = {};
  float lse = max_score;
  if (nan) {
    lse = std::numeric_limits<float>::quiet_NaN();
    for (float& o : out) o = lse;
  } else if (std::isfinite(max_score)) {
    float total = 0.0f;
    for (int64_t t = 0; t < visible; ++t) {
      if (a.token_row(b, t) < 0) continue;
      entry_values(a, a.token_row(b, t), k);
      const float p = std::exp(scores[t] - max_score);
      total += p;
      for (int c = 0; c < kLatent; ++c) out[c] += p * k[c];
    }
    for (float& o : out) o /= total;
    lse = max_score + std::log(total);
  }
  a.lse[row] = lse;
  auto* dst = static_cast<uint16_t*>(a.out) + row * kLatent;
  for (int c = 0; c < kLatent; ++c)
    dst[c] = a.act == ActType::kBF16 ? f32_to_bf16(out[c]) : f32_to_f16(out[c]);
}

ffi::Error handler(ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::AnyBuffer tables,
                   ffi::AnyBuffer lens, ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> partials, float softmax_scale, int64_t q_tokens,
                   int64_t num_splits) {
  DecodeAttention a;
  if (ffi::Error err = make_decode_attention(q, cache, tables, lens, q_scale_inv, cache_scale_inv,
                                             *out, *lse, *partials, softmax_scale, q_tokens,
                                             num_splits, a);
      err.failure())
    return err;
  std::vector<float> scores;
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t j = 0; j < a.q_tokens; ++j)
      for (int64_t h = 0; h < a.heads; ++h) attend_row(a, b, j, h, scores);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(jkm_cpu_mla_decode_attention, jax_kimi_mla::handler,
                              JKM_DECODE_ATTENTION_BINDING(xla::ffi::Ffi::Bind()));
