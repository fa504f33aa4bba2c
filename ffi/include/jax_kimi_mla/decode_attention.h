// Paged MLA decode attention, as data: what one mla_decode_attention call reads and writes, and
// the addressing rules (lengths, causal rows, block ids, splits) that the CPU handler, the CUDA
// kernels and the jnp reference all follow. Host and device.
#pragma once

#include <string>

#include "jax_kimi_mla/epilogue.h"
#include "xla/ffi/api/ffi.h"

namespace jax_kimi_mla {

// What the query and the cache hold. The cache format comes from the cache dtype (uint8:
// fp8_ds_mla, float8_e4m3fn: plain fp8, bf16/f16: the activation dtype of the query).
enum class QType : uint8_t { kBF16, kF16, kE4m3 };

inline constexpr int kAttnRowStats = kLatent + 1;  // a partial result: 512 outputs, then its lse
inline constexpr int kMaxQueryTokens = 4;          // S_q: new tokens per sequence

struct DecodeAttention {
  QType q_type = QType::kBF16;
  CacheFormat cache_format = CacheFormat::kBf16;
  ActType act = ActType::kBF16;  // the output dtype (bf16 when q is fp8)
  int64_t batch = 0, q_tokens = 0, heads = 0;  // B, S_q, H
  const void* q = nullptr;  // [B * S_q, H, 576]: query j of sequence b is row b * S_q + j
  // Token row r of the cache starts at cache + r * row_bytes (rows may be wider than the entry).
  const uint8_t* cache = nullptr;
  int64_t row_bytes = 0;
  int64_t num_blocks = 0, block_size = 0;
  const void* block_tables = nullptr;  // [B, max_blocks]
  bool tables_int64 = false;
  int64_t max_blocks = 0;
  const void* context_lens = nullptr;  // [B]
  bool lens_int64 = false;
  float softmax_scale = 0.0f;
  // Plain fp8: q = Q(x * q_scale_inv) (when q is fp8), entry = Q(x * cache_scale_inv). Null
  // otherwise. Values are read on the device.
  const float* q_scale_inv = nullptr;
  const float* cache_scale_inv = nullptr;
  void* out = nullptr;    // [B * S_q, H, 512] act
  float* lse = nullptr;   // [B * S_q, H] float32, natural log
  // Split-KV partials (num_splits > 1 only): [num_splits, B, S_q * H, kAttnRowStats] float32.
  float* partials = nullptr;
  int num_splits = 1;

  JKM_HD int64_t rows() const { return q_tokens * heads; }  // query rows of one sequence
  JKM_HD int64_t max_len() const { return max_blocks * block_size; }

  // Tokens of sequence b (the new ones included), clamped to [0, max_blocks * block_size].
  JKM_HD int64_t context_len(int64_t b) const {
    const int64_t n = load_index(context_lens, lens_int64, b);
    return n < 0 ? 0 : (n > max_len() ? max_len() : n);
  }

  // Query j of S_q is token len - S_q + j of its sequence and sees tokens [0, visible): causal
  // among the new tokens. A query that sees nothing gets zeros and lse -inf.
  JKM_HD int64_t visible_len(int64_t len, int64_t j) const {
    const int64_t n = len - q_tokens + 1 + j;
    return n < 0 ? 0 : n;
  }

  // The cache row of token t (< len) of sequence b, or -1 when its block id is outside
  // [0, num_blocks): such a token is masked out and nothing is read for it.
  JKM_HD int64_t token_row(int64_t b, int64_t t) const {
    const int64_t block = load_index(block_tables, tables_int64, b * max_blocks + t / block_size);
    return block >= 0 && block < num_blocks ? block * block_size + t % block_size : -1;
  }

  // Split s of a sequence of `len` tokens covers tokens [split_begin, split_end): equal runs of
  // whole kSplitTokens tiles, the last ones possibly empty (skipped on the device; the combine
  // reads only splits with split_begin < len).
  static constexpr int64_t kSplitTokens = 64;
  JKM_HD int64_t split_tokens(int64_t len) const {
    const int64_t per = (len + num_splits - 1) / num_splits;
    return (per + kSplitTokens - 1) / kSplitTokens * kSplitTokens;
  }
  JKM_HD int64_t split_begin(int64_t len, int s) const { return s * split_tokens(len); }
  JKM_HD int64_t split_end(int64_t len, int s) const {
    const int64_t e = (s + 1) * split_tokens(len);
    return e < len ? e : len;
  }
  JKM_HD int live_splits(int64_t len) const {  // splits with at least one token
    const int64_t per = split_tokens(len);
    return per == 0 ? 0 : int((len + per - 1) / per);
  }

  // Partial result of split s for query row r of sequence b: 512 normalized outputs, then lse.
  JKM_HD float* partial(int s, int64_t b, int64_t r) const {
    return partials + ((int64_t(s) * batch + b) * rows() + r) * kAttnRowStats;
  }
};

// The float32 value of an E4M3 code (exact).
JKM_HD float e4m3_to_f32(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xFu, mant = code & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return f32_from_bits(sign | 0x7FC00000u);  // NaN
  if (exp == 0) return f32_from_bits(sign | f32_bits(float(mant) * 0.001953125f));  // mant * 2^-9
  return f32_from_bits(sign | ((exp + 120u) << 23) | (mant << 20));
}

// Element i (0..575) of the cache entry at `row` as float32: the latent dequantized with its
// tile scale (fp8_ds_mla), the stored code or 16-bit value otherwise. Plain fp8 values are the
// codes: the caller divides by cache_scale_inv.
JKM_HD float entry_value(const DecodeAttention& a, const uint8_t* entry, int i) {
  switch (a.cache_format) {
    case CacheFormat::kFp8DsMla: {
      if (i >= kLatent) {
        uint16_t h;
        memcpy(&h, entry + kDsMlaPeOffset + 2 * (i - kLatent), 2);
        return bf16_to_f32(h);
      }
      float s;
      memcpy(&s, entry + kDsMlaScaleOffset + 4 * (i / kDsMlaTile), 4);
      return e4m3_to_f32(entry[i]) * s;
    }
    case CacheFormat::kFp8: return e4m3_to_f32(entry[i]);
    case CacheFormat::kBf16: {
      uint16_t h;
      memcpy(&h, entry + 2 * i, 2);
      return a.act == ActType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
  return 0.0f;
}

// ---- FFI operands -> DecodeAttention (host) ----
//
// Operands: q act|f8 [B * S_q, H, 576]; kv_cache act|f8|u8 [N, bs, W]; block_tables idx [B,
// max_blocks]; context_lens idx [B]; q_scale_inv f32 [1] or [0]; cache_scale_inv f32 [1] or [0].
// Results: out act [B * S_q, H, 512]; lse f32 [B * S_q, H]; partials f32 [num_splits * B * S_q *
// H * 513] (empty when num_splits == 1). Attributes: softmax_scale (f32), q_tokens (i64 S_q,
// 1..4), num_splits (i64 >= 1). The query is 3-D so that the decode epilogue's mqa_q [B, H, 576]
// (B * S_q rows) feeds it with no reshape, which XLA may turn into a copy.
// The Python wrapper checks all of this first and explains; these checks keep a malformed direct
// call from touching foreign memory.
namespace ffi = xla::ffi;

inline ffi::Error make_decode_attention(ffi::AnyBuffer q, ffi::AnyBuffer cache,
                                        ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                                        ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                                        ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                        ffi::AnyBuffer partials, float softmax_scale,
                                        int64_t q_tokens, int64_t num_splits,
                                        DecodeAttention& a) {
  const auto fail = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("jax_kimi_mla mla_decode_attention: ") + what);
  };
  using T = ffi::DataType;
  const auto is_index = [](T t) { return t == T::S32 || t == T::S64; };
  const auto qd = q.dimensions(), cd = cache.dimensions(), td = tables.dimensions();
  if (q_tokens < 1 || q_tokens > kMaxQueryTokens) return fail("q_tokens (S_q) must be 1..4");
  if (qd.size() != 3 || qd[2] != kEntry || qd[0] % q_tokens != 0)
    return fail("q must be [B * S_q, H, 576]");
  a.batch = qd[0] / q_tokens, a.q_tokens = q_tokens, a.heads = qd[1];
  switch (q.element_type()) {
    case T::BF16: a.q_type = QType::kBF16, a.act = ActType::kBF16; break;
    case T::F16: a.q_type = QType::kF16, a.act = ActType::kF16; break;
    case T::F8E4M3FN: a.q_type = QType::kE4m3, a.act = ActType::kBF16; break;
    default: return fail("q must be bfloat16, float16 or float8_e4m3fn");
  }
  if (cd.size() != 3) return fail("kv_cache must be [num_blocks, block_size, width]");
  int64_t entry_bytes = 2 * kEntry, item = 2;
  switch (cache.element_type()) {
    case T::U8: a.cache_format = CacheFormat::kFp8DsMla, entry_bytes = kDsMlaEntryBytes, item = 1; break;
    case T::F8E4M3FN: a.cache_format = CacheFormat::kFp8, entry_bytes = kEntry, item = 1; break;
    default:
      if (cache.element_type() != q.element_type())
        return fail("a bf16/fp16 kv_cache must have the dtype of q");
      a.cache_format = CacheFormat::kBf16;
  }
  a.num_blocks = cd[0], a.block_size = cd[1], a.row_bytes = cd[2] * item;
  if (a.row_bytes < entry_bytes || a.row_bytes % 16 != 0)
    return fail("kv_cache rows must hold an entry and be a multiple of 16 bytes");
  if (a.block_size < 1 && a.num_blocks > 0) return fail("block_size must be >= 1");
  const bool fp8_cache = a.cache_format == CacheFormat::kFp8;
  if ((q_scale_inv.element_count() == 1) != (a.q_type == QType::kE4m3) ||
      q_scale_inv.element_type() != T::F32 || q_scale_inv.element_count() > 1)
    return fail("q_scale_inv must be float32 [1] exactly when q is fp8, else [0]");
  if ((cache_scale_inv.element_count() == 1) != fp8_cache ||
      cache_scale_inv.element_type() != T::F32 || cache_scale_inv.element_count() > 1)
    return fail("cache_scale_inv must be float32 [1] exactly for the plain fp8 cache, else [0]");
  if (a.q_type == QType::kE4m3 && !fp8_cache) return fail("an fp8 q needs the plain fp8 cache");
  if (td.size() != 2 || td[0] != a.batch || !is_index(tables.element_type()))
    return fail("block_tables must be int32/int64 [B, max_blocks]");
  if (lens.dimensions().size() != 1 || lens.dimensions()[0] != a.batch ||
      !is_index(lens.element_type()))
    return fail("context_lens must be int32/int64 [B]");
  const T out_type = a.act == ActType::kBF16 ? T::BF16 : T::F16;
  const auto od = out.dimensions(), ld = lse.dimensions();
  if (out.element_type() != out_type || od.size() != 3 || od[0] != qd[0] || od[1] != a.heads ||
      od[2] != kLatent)
    return fail("out must be [B * S_q, H, 512] in the output dtype");
  if (lse.element_type() != T::F32 || ld.size() != 2 || ld[0] != qd[0] || ld[1] != a.heads)
    return fail("lse must be float32 [B * S_q, H]");
  if (num_splits < 1 || num_splits > 1024) return fail("num_splits must be 1..1024");
  const size_t want = num_splits == 1 ? 0 : size_t(num_splits * a.batch * a.rows() * kAttnRowStats);
  if (partials.element_type() != T::F32 || partials.element_count() != want)
    return fail("partials must be float32 [num_splits * B * S_q * H * 513] (empty for one split)");
  a.q = q.untyped_data();
  a.cache = static_cast<const uint8_t*>(cache.untyped_data());
  a.block_tables = tables.untyped_data();
  a.tables_int64 = tables.element_type() == T::S64;
  a.max_blocks = td[1];
  a.context_lens = lens.untyped_data();
  a.lens_int64 = lens.element_type() == T::S64;
  a.softmax_scale = softmax_scale;
  a.q_scale_inv = a.q_type == QType::kE4m3 ? static_cast<const float*>(q_scale_inv.untyped_data()) : nullptr;
  a.cache_scale_inv = fp8_cache ? static_cast<const float*>(cache_scale_inv.untyped_data()) : nullptr;
  a.out = out.untyped_data();
  a.lse = static_cast<float*>(lse.untyped_data());
  a.partials = num_splits == 1 ? nullptr : static_cast<float*>(partials.untyped_data());
  a.num_splits = int(num_splits);
  return ffi::Error::Success();
}

// The binding both backends share, after their context arguments.
#define JKM_DECODE_ATTENTION_BINDING(bind)                                                      \
  (bind).Arg<xla::ffi::AnyBuffer>()                                                             \
      .Arg<xla::ffi::AnyBuffer>()                                                               \
      .Arg<xla::ffi::AnyBuffer>()                                                               \
      .Arg<xla::ffi::AnyBuffer>()                                                               \
      .Arg<xla::ffi::AnyBuffer>()                                                               \
      .Arg<xla::ffi::AnyBuffer>()                                                               \
      .Ret<xla::ffi::AnyBuffer>()                                                               \
      .Ret<xla::ffi::AnyBuffer>()                                                               \
      .Ret<xla::ffi::AnyBuffer>()                                                               \
      .Attr<float>("softmax_scale")                                                             \
      .Attr<int64_t>("q_tokens")                                                                \
      .Attr<int64_t>("num_splits")

}  // namespace jax_kimi_mla
