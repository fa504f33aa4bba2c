// A paged latent cache as its readers see it: the cache rows, the block tables and the sequence
// lengths, the addressing rules, and the dequantized value of an entry element. Shared by
// mla_decode_attention and gather_mla_cache (host and device), and the FFI parsing of those
// operands (host).
#pragma once

#include <array>
#include <cstring>
#include <string>

#include "jax_kimi_mla/epilogue.h"
#include "jax_kimi_mla/ffi_common.h"

namespace jax_kimi_mla {

struct PagedCache {
  CacheFormat cache_format = CacheFormat::kBf16;
  ActType cache16 = ActType::kBF16;  // the element type of a bf16 (16-bit) cache
  // Token row r of the cache starts at cache + r * row_bytes: the row stride, the cache's last
  // dimension in bytes. Rows may be wider than the entry (padded, e.g. to 640 elements); the
  // entry is in their first entry_bytes() bytes and the padding is never read.
  const uint8_t* cache = nullptr;
  int64_t row_bytes = 0;
  int64_t num_blocks = 0, block_size = 0;
  // log2(block_size) where the block size is a power of two (every size the serving stacks use),
  // else -1: token_row then shifts and masks instead of dividing, off the kernels' critical path.
  int block_shift = -1;
  const void* block_tables = nullptr;  // [B, max_blocks]
  bool tables_int64 = false;
  int64_t max_blocks = 0;
  const void* context_lens = nullptr;  // [B]
  bool lens_int64 = false;
  // Plain fp8: entry = Q(x * cache_scale_inv), read on the device. Null for other formats.
  const float* cache_scale_inv = nullptr;

  JKM_HD int64_t max_len() const { return max_blocks * block_size; }

  // Sets block_size and its block_shift.
  JKM_HD void set_block_size(int64_t size) {
    block_size = size, block_shift = -1;
    for (int shift = 0; shift < 31; ++shift)
      if (size == int64_t(1) << shift) block_shift = shift;
  }

  JKM_HD int64_t entry_bytes() const { return cache_entry_bytes(cache_format); }

  // Tokens of sequence b, clamped to [0, max_blocks * block_size].
  JKM_HD int64_t context_len(int64_t b) const {
    const int64_t n = load_index(context_lens, lens_int64, b);
    return n < 0 ? 0 : (n > max_len() ? max_len() : n);
  }

  // The cache row of token t (< len) of sequence b, or -1 when its block id is outside
  // [0, num_blocks): such a token is masked out and nothing is read for it.
  JKM_HD int64_t token_row(int64_t b, int64_t t) const {
    const int64_t index = block_shift >= 0 ? t >> block_shift : t / block_size;
    const int64_t block = load_index(block_tables, tables_int64, b * max_blocks + index);
    return block >= 0 && block < num_blocks ? block * block_size + (t - index * block_size) : -1;
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

// The float32 values of the 256 E4M3 codes, computed once (host).
inline const float* e4m3_values() {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> v{};
    for (int code = 0; code < 256; ++code) v[code] = e4m3_to_f32(uint8_t(code));
    return v;
  }();
  return values.data();
}

// The 576 values of the cache entry at `entry` as float32 (host: the CPU handlers, one entry at a
// time): the latent dequantized with its tile scale (fp8_ds_mla), plain fp8 codes divided by
// cache_scale_inv, 16-bit values as they are.
inline void entry_values(const PagedCache& p, const uint8_t* entry, float v[kEntry]) {
  switch (p.cache_format) {
    case CacheFormat::kFp8DsMla: {
      const float* code = e4m3_values();
      float scale[kLatent / kDsMlaTile];
      memcpy(scale, entry + kDsMlaScaleOffset, sizeof scale);
      for (int i = 0; i < kLatent; ++i) v[i] = code[entry[i]] * scale[i / kDsMlaTile];
      uint16_t pe[kRope];
      memcpy(pe, entry + kDsMlaPeOffset, sizeof pe);
      for (int i = 0; i < kRope; ++i) v[kLatent + i] = bf16_to_f32(pe[i]);
      return;
    }
    case CacheFormat::kFp8: {
      const float* code = e4m3_values();
      const float inv = *p.cache_scale_inv;
      for (int i = 0; i < kEntry; ++i) v[i] = code[entry[i]] / inv;
      return;
    }
    case CacheFormat::kBf16: {
      uint16_t h[kEntry];
      memcpy(h, entry, sizeof h);
      if (p.cache16 == ActType::kBF16)
        for (int i = 0; i < kEntry; ++i) v[i] = bf16_to_f32(h[i]);
      else
        for (int i = 0; i < kEntry; ++i) v[i] = f16_to_f32(h[i]);
      return;
    }
  }
}

// ---- FFI operands -> PagedCache (host) ----

// kv_cache bf16|f16|f8|u8 [N, bs, W] (the format from the dtype; W bytes >= the entry and a
// multiple of 16), block_tables idx [B, max_blocks], context_lens idx [B], cache_scale_inv f32
// [1] for the plain fp8 cache, else [0]. Returns an error message, empty when the operands fit.
inline std::string make_paged_cache(ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                                    ffi::AnyBuffer cache_scale_inv, int64_t batch, PagedCache& p) {
  using T = ffi::DataType;
  const auto cd = cache.dimensions(), td = tables.dimensions();
  if (cd.size() != 3) return "kv_cache must be [num_blocks, block_size, width]";
  int64_t item = 2;
  switch (cache.element_type()) {
    case T::U8: p.cache_format = CacheFormat::kFp8DsMla, item = 1; break;
    case T::F8E4M3FN: p.cache_format = CacheFormat::kFp8, item = 1; break;
    case T::BF16: p.cache_format = CacheFormat::kBf16, p.cache16 = ActType::kBF16; break;
    case T::F16: p.cache_format = CacheFormat::kBf16, p.cache16 = ActType::kF16; break;
    default: return "kv_cache must be bfloat16, float16, float8_e4m3fn or uint8";
  }
  p.num_blocks = cd[0], p.row_bytes = cd[2] * item;
  p.set_block_size(cd[1]);
  if (p.row_bytes < p.entry_bytes() || p.row_bytes % 16 != 0)
    return "kv_cache rows must hold an entry and be a multiple of 16 bytes";
  if (p.block_size < 1 && p.num_blocks > 0) return "block_size must be >= 1";
  const bool fp8_cache = p.cache_format == CacheFormat::kFp8;
  if ((cache_scale_inv.element_count() == 1) != fp8_cache ||
      cache_scale_inv.element_type() != T::F32 || cache_scale_inv.element_count() > 1)
    return "cache_scale_inv must be float32 [1] exactly for the plain fp8 cache, else [0]";
  if (td.size() != 2 || td[0] != batch || !is_index_type(tables.element_type()))
    return "block_tables must be int32/int64 [B, max_blocks]";
  if (lens.dimensions().size() != 1 || lens.dimensions()[0] != batch || !is_index_type(lens.element_type()))
    return "context_lens must be int32/int64 [B]";
  p.cache = static_cast<const uint8_t*>(cache.untyped_data());
  p.block_tables = tables.untyped_data();
  p.tables_int64 = tables.element_type() == T::S64;
  p.max_blocks = td[1];
  p.context_lens = lens.untyped_data();
  p.lens_int64 = lens.element_type() == T::S64;
  p.cache_scale_inv = fp8_cache ? static_cast<const float*>(cache_scale_inv.untyped_data()) : nullptr;
  return {};
}

}  // namespace jax_kimi_mla
