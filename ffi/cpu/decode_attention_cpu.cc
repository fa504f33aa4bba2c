// CPU handler of mla_decode_attention: plain float32 loops over the DecodeAttention rules, one
// query token (all its heads) at a time, in two passes over its tokens (scores and their
// maximum, then the weighted sum), so memory stays O(context x heads). The split count only sizes the CUDA kernel's
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

// q . k over 576 columns in 8 interleaved partial sums (a loop the compiler can vectorize).
float dot576(const float* q, const float* k) {
  float part[8] = {};
  for (int c = 0; c < kEntry; c += 8)
    for (int i = 0; i < 8; ++i) part[i] += q[c + i] * k[c + i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Query token j of sequence b, all heads at once, so that each entry is dequantized once per
// pass rather than once per head.
void attend(const DecodeAttention& a, int64_t b, int64_t j, std::vector<float>& q,
            std::vector<float>& scores, std::vector<float>& out) {
  const int64_t H = a.heads, first_row = (b * a.q_tokens + j) * H;
  q.resize(size_t(H * kEntry));
  for (int64_t i = 0; i < H * kEntry; ++i) q[i] = q_value(a, first_row * kEntry + i);
  float k[kEntry];

  // Pass 1: the scaled score of every visible token and head (masked tokens: -inf), and each
  // head's maximum.
  const int64_t visible = a.visible_len(a.context_len(b), j);
  scores.assign(size_t(visible * H), -std::numeric_limits<float>::infinity());
  std::vector<float> max_score(size_t(H), -std::numeric_limits<float>::infinity());
  std::vector<bool> nan(size_t(H), false);
  for (int64_t t = 0; t < visible; ++t) {
    const int64_t cache_row = a.token_row(b, t);
    if (cache_row < 0) continue;
    entry_values(a, a.cache + cache_row * a.row_bytes, k);
    for (int64_t h = 0; h < H; ++h) {
      const float s = dot576(&q[h * kEntry], k) * a.softmax_scale;
      scores[t * H + h] = s;
      if (std::isnan(s)) nan[h] = true;
      if (s > max_score[h]) max_score[h] = s;
    }
  }

  // Pass 2: the softmax-weighted sums of the latents. No visible token: zeros and lse -inf.
  out.assign(size_t(H * kLatent), 0.0f);
  std::vector<float> total(size_t(H), 0.0f);
  for (int64_t t = 0; t < visible; ++t) {
    const int64_t cache_row = a.token_row(b, t);
    if (cache_row < 0) continue;
    entry_values(a, a.cache + cache_row * a.row_bytes, k);
    for (int64_t h = 0; h < H; ++h) {
      if (nan[h] || !std::isfinite(max_score[h])) continue;
      const float p = std::exp(scores[t * H + h] - max_score[h]);
      total[h] += p;
      for (int c = 0; c < kLatent; ++c) out[h * kLatent + c] += p * k[c];
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float lse = max_score[h];  // -inf when the query sees no token
    if (nan[h]) {
      lse = std::numeric_limits<float>::quiet_NaN();
      for (int c = 0; c < kLatent; ++c) out[h * kLatent + c] = lse;
    } else if (std::isfinite(max_score[h])) {
      for (int c = 0; c < kLatent; ++c) out[h * kLatent + c] /= total[h];
      lse = max_score[h] + std::log(total[h]);
    }
    a.lse[first_row + h] = lse;
    auto* dst = static_cast<uint16_t*>(a.out) + (first_row + h) * kLatent;
    for (int c = 0; c < kLatent; ++c)
      dst[c] = a.act == ActType::kBF16 ? f32_to_bf16(out[h * kLatent + c]) : f32_to_f16(out[h * kLatent + c]);
  }
}

ffi::Error handler(ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::AnyBuffer tables,
                   ffi::AnyBuffer lens, ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   ffi::Result<ffi::AnyBuffer> partials, ffi::Dictionary attrs) {
  DecodeAttention a;
  DecodeLaunch unused;  // one implementation on the CPU: the launch options are only checked
  if (ffi::Error err = make_decode_attention(q, cache, tables, lens, q_scale_inv, cache_scale_inv,
                                             *out, *lse, *partials, attrs, a, unused);
      err.failure())
    return err;
  std::vector<float> q_rows, scores, sums;  // reused across query tokens
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t j = 0; j < a.q_tokens; ++j) attend(a, b, j, q_rows, scores, sums);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(jkm_cpu_mla_decode_attention, jax_kimi_mla::handler,
                              JKM_DECODE_ATTENTION_BINDING(xla::ffi::Ffi::Bind()));
