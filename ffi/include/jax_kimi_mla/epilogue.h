// What an epilogue call does, as data: the rows it writes and where each 8-element chunk of a row
// comes from. The CPU handlers walk these rows in loops, the CUDA kernel gives each chunk a
// thread; both call the chunk functions below, so the per-element work is written once.
#pragma once

#include "jax_kimi_mla/numerics.h"

namespace jax_kimi_mla {

enum class ActType : uint8_t { kBF16, kF16 };
enum class CacheFormat : uint8_t { kAct, kFp8, kDsMla };

inline constexpr int kChunk = 8;                     // elements per chunk: 16 bytes of bf16/fp16
inline constexpr int kRopeChunks = kRope / kChunk;   // 8
inline constexpr int kCacheChunks = kEntry / kChunk; // 72: the lanes of one cache entry
inline constexpr int kTileChunks = kDsMlaTile / kChunk;  // 16 chunks share one ds_mla scale

// One output row per (token, head) = [nope | pe], where the pe part is RoPE'd when RoPE is on.
// Strides are in elements; a zero head stride broadcasts a per-token source over heads (k_pe).
struct RowSpec {
  const uint16_t* nope = nullptr;
  int64_t nope_t = 0, nope_h = 0;
  int nope_chunks = 0;
  const uint16_t* pe = nullptr;
  int64_t pe_t = 0, pe_h = 0;
  int pe_chunks = 0;
  void* out = nullptr;  // activation dtype, or E4M3 codes when scale_inv is set
  int64_t out_t = 0, out_h = 0;
  const float* scale_inv = nullptr;

  JKM_HD int chunks() const { return nope_chunks + pe_chunks; }
};

struct Epilogue {
  ActType act = ActType::kBF16;
  int64_t tokens = 0, heads = 0;
  // The cache entry of token t goes to row slot_mapping[t] (out_t: the entry's stride).
  RowSpec cache;
  CacheFormat cache_format = CacheFormat::kAct;
  int64_t cache_rows = 0;  // num_blocks * block_size
  RowSpec head_rows[3];
  int num_head_rows = 0;
  const void* slots = nullptr;
  bool slots_int64 = false;
  const void* positions = nullptr;
  bool positions_int64 = false;
  const float* cos_sin = nullptr;  // [max_position, 64]; null when RoPE is off
  int64_t max_position = 0;

  JKM_HD int head_chunks() const {
    int n = 0;
    for (int r = 0; r < num_head_rows; ++r) n += head_rows[r].chunks();
    return n;
  }
  // The cos/sin row of token t, or null without RoPE.
  JKM_HD const float* rope_row(int64_t t) const {
    if (cos_sin == nullptr) return nullptr;
    return cos_sin + clamp_position(load_index(positions, positions_int64, t), max_position) * kRope;
  }
  // The cache row of token t, or -1 when its slot is padding or out of range.
  JKM_HD int64_t cache_row(int64_t t) const {
    int64_t slot = load_index(slots, slots_int64, t);
    return slot_is_valid(slot, cache_rows) ? slot : -1;
  }
};

// ---- 16-byte moves ----

struct Raw16 {
  uint32_t w[4];
};

JKM_HD Raw16 load16(const void* p) {
  Raw16 r;
#if defined(__CUDA_ARCH__)
  uint4 v = *static_cast<const uint4*>(p);
  r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
#else
  std::memcpy(r.w, p, 16);
#endif
  return r;
}

JKM_HD void store16(void* p, const Raw16& r) {
#if defined(__CUDA_ARCH__)
  *static_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
#else
  std::memcpy(p, r.w, 16);
#endif
}

JKM_HD void store8(void* p, uint32_t lo, uint32_t hi) {
#if defined(__CUDA_ARCH__)
  *static_cast<uint2*>(p) = make_uint2(lo, hi);
#else
  uint32_t w[2] = {lo, hi};
  std::memcpy(p, w, 8);
#endif
}

JKM_HD uint16_t half_word(const Raw16& r, int i) { return uint16_t(r.w[i / 2] >> (16 * (i % 2))); }

// ---- chunk arithmetic ----

JKM_HD void widen8(ActType act, const Raw16& raw, float v[kChunk]) {
  for (int i = 0; i < kChunk; ++i)
    v[i] = act == ActType::kBF16 ? bf16_to_f32(half_word(raw, i)) : f16_to_f32(half_word(raw, i));
}

// Rotates the 4 pairs of pe chunk j (pairs 4j..4j+3) by the cos/sin row of the token.
JKM_HD void rope8(const float* rope_row, int j, float v[kChunk]) {
  for (int i = 0; i < kChunk / 2; ++i) {
    int pair = j * (kChunk / 2) + i;
    rope_pair(v[2 * i], v[2 * i + 1], rope_row[pair], rope_row[kRope / 2 + pair], v[2 * i],
              v[2 * i + 1]);
  }
}

JKM_HD Raw16 narrow8(bool to_bf16, const float v[kChunk]) {
  Raw16 r;
  for (int i = 0; i < kChunk / 2; ++i) {
    uint32_t lo = to_bf16 ? f32_to_bf16(v[2 * i]) : f32_to_f16(v[2 * i]);
    uint32_t hi = to_bf16 ? f32_to_bf16(v[2 * i + 1]) : f32_to_f16(v[2 * i + 1]);
    r.w[i] = lo | (hi << 16);
  }
  return r;
}

// Q(v * mult): 8 E4M3 codes packed into two words.
JKM_HD void e4m3x8(const float v[kChunk], float mult, uint32_t w[2]) {
  for (int i = 0; i < 2; ++i) {
    uint32_t p0 = e4m3_encode_pair(mul_rn(v[4 * i], mult), mul_rn(v[4 * i + 1], mult));
    uint32_t p1 = e4m3_encode_pair(mul_rn(v[4 * i + 2], mult), mul_rn(v[4 * i + 3], mult));
    w[i] = p0 | (p1 << 16);
  }
}

// Where chunk c of row r for (t, h) is read from, and the cos/sin row it is rotated by: null for
// nope chunks and without RoPE, so only pe chunks load the token's position. Returns the pe chunk
// index through *pe_chunk.
JKM_HD const uint16_t* chunk_source(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h,
                                    int c, const float** rotate_by, int* pe_chunk) {
  if (c < r.nope_chunks) {
    *rotate_by = nullptr;
    return r.nope + t * r.nope_t + h * r.nope_h + int64_t(c) * kChunk;
  }
  *pe_chunk = c - r.nope_chunks;
  *rotate_by = e.rope_row(t);
  return r.pe + t * r.pe_t + h * r.pe_h + int64_t(*pe_chunk) * kChunk;
}

// The float32 values of chunk c, RoPE'd when it is a pe chunk and RoPE is on.
JKM_HD void chunk_values(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h, int c,
                         float v[kChunk]) {
  const float* rotate_by;
  int pe_chunk = 0;
  widen8(e.act, load16(chunk_source(e, r, t, h, c, &rotate_by, &pe_chunk)), v);
  if (rotate_by != nullptr) rope8(rotate_by, pe_chunk, v);
}

// Chunk c of a row whose output is in the activation dtype (16 bytes) or in plain E4M3 (the first
// 8 bytes). Unrotated activation chunks are the input bits themselves. Computing a chunk and
// storing it are separate so that a kernel can issue its loads before it stores anything.
JKM_HD Raw16 make_chunk(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h, int c) {
  const float* rotate_by;
  int pe_chunk = 0;
  const Raw16 raw = load16(chunk_source(e, r, t, h, c, &rotate_by, &pe_chunk));
  if (rotate_by == nullptr && r.scale_inv == nullptr) return raw;
  float v[kChunk];
  widen8(e.act, raw, v);
  if (rotate_by != nullptr) rope8(rotate_by, pe_chunk, v);
  if (r.scale_inv == nullptr) return narrow8(e.act == ActType::kBF16, v);
  Raw16 codes{};
  e4m3x8(v, *r.scale_inv, codes.w);
  return codes;
}

// Where chunk c of an output row starting at element `out_elem` goes, and how wide it is.
JKM_HD void* chunk_dst(const RowSpec& r, int64_t out_elem, int c) {
  const int64_t i = out_elem + int64_t(c) * kChunk;
  if (r.scale_inv != nullptr) return static_cast<uint8_t*>(r.out) + i;
  return static_cast<uint16_t*>(r.out) + i;
}

JKM_HD void store_chunk(void* dst, const Raw16& chunk, bool e4m3) {
  if (e4m3)
    store8(dst, chunk.w[0], chunk.w[1]);
  else
    store16(dst, chunk);
}

// ---- the fp8_ds_mla entry ----

JKM_HD uint8_t* ds_mla_entry(const Epilogue& e, int64_t row) {
  return static_cast<uint8_t*>(e.cache.out) + row * kDsMlaEntryBytes;
}

// Tile j's latent chunk (0..15 within the tile) quantized with the tile's scale s.
JKM_HD void store_ds_mla_latent(uint8_t* entry, int latent_chunk, const float v[kChunk], float s) {
  uint32_t w[2];
  e4m3x8(v, 1.0f / s, w);  // s is a power of two: x * (1 / s) == x / s exactly
  store8(entry + latent_chunk * kChunk, w[0], w[1]);
}

JKM_HD void store_ds_mla_scale(uint8_t* entry, int tile, float s) {
  uint32_t b = f32_bits(s);
  uint8_t* p = entry + kDsMlaScaleOffset + 4 * tile;
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(b >> (8 * i));  // little-endian
}

// pe chunk j (0..7) of the entry: bfloat16 from the float32 value, or the bf16 bits themselves
// when nothing changes them.
JKM_HD Raw16 make_ds_mla_pe(const Epilogue& e, int64_t t, int j) {
  const RowSpec& r = e.cache;
  if (e.cos_sin == nullptr && e.act == ActType::kBF16) return load16(r.pe + t * r.pe_t + j * kChunk);
  float v[kChunk];
  chunk_values(e, r, t, 0, r.nope_chunks + j, v);
  return narrow8(true, v);
}

JKM_HD uint8_t* ds_mla_pe_dst(uint8_t* entry, int j) { return entry + kDsMlaPeOffset + j * kChunk * 2; }

}  // namespace jax_kimi_mla
