// What an epilogue call does, as data: the rows it writes and where each 8-element chunk of a row
// comes from. The CPU handlers walk these rows in loops, the CUDA kernel gives each chunk a lane
// of a thread; both call the chunk functions below, so the per-element work is written once.
#pragma once

#include "jax_kimi_mla/numerics.h"

namespace jax_kimi_mla {

enum class ActType : uint8_t { kBF16, kF16 };
// The cache formats, named as in Python (jax_kimi_mla.formats): "bf16" (the activation dtype, bf16
// or fp16), "fp8" (E4M3, per-tensor scale), "fp8_ds_mla" (656-byte block-scaled entries).
enum class CacheFormat : uint8_t { kBf16, kFp8, kFp8DsMla };

// The bytes of one cache entry: 656 (fp8_ds_mla), 576 (plain fp8), 1152 (bf16/fp16).
JKM_HD constexpr int64_t cache_entry_bytes(CacheFormat format) {
  return format == CacheFormat::kFp8DsMla ? kDsMlaEntryBytes : format == CacheFormat::kFp8 ? kEntry : 2 * kEntry;
}

inline constexpr int kChunk = 8;                     // elements per chunk: 16 bytes of bf16/fp16
inline constexpr int kRopeChunks = kRope / kChunk;   // 8
inline constexpr int kCacheChunks = kEntry / kChunk; // 72: the chunks of one cache entry
inline constexpr int kTileChunks = kDsMlaTile / kChunk;  // 16 chunks share one ds_mla scale
// NeoX pairs element k of the rope part with k ^ 32: pe chunk j's partners are in chunk j ^ 4.
inline constexpr int kNeoxPartnerChunk = (kRope / 2) / kChunk;

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
  // The cache entry of token t goes to row slot_mapping[t]. cache.out_t is the row stride, in
  // elements of the cache dtype: the cache's last dimension, which may be wider than the entry
  // (padded rows; the padding is never written).
  RowSpec cache;
  CacheFormat cache_format = CacheFormat::kBf16;
  int64_t cache_rows = 0;  // num_blocks * block_size (times any stack dimensions in front)
  RowSpec head_rows[3];
  int num_head_rows = 0;
  const void* slots = nullptr;
  bool slots_int64 = false;
  const void* positions = nullptr;
  bool positions_int64 = false;
  const float* cos_sin = nullptr;  // [max_position, 64]; null when RoPE is off
  int64_t max_position = 0;
  RopeStyle rope_style = RopeStyle::kGptj;

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

// On the GPU these are global-memory accesses (inputs through the read-only path: no input is
// written by the call, except q with RoPE, each chunk of which one thread reads, then writes).
JKM_HD Raw16 load16(const void* p) {
  Raw16 r;
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(static_cast<const uint4*>(p));
  r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
#else
  std::memcpy(r.w, p, 16);
#endif
  return r;
}

JKM_HD void store16(void* p, const Raw16& r) {
#if defined(__CUDA_ARCH__)
  __stwb(static_cast<uint4*>(p), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
#else
  std::memcpy(p, r.w, 16);
#endif
}

JKM_HD void store8(void* p, uint32_t lo, uint32_t hi) {
#if defined(__CUDA_ARCH__)
  __stwb(static_cast<uint2*>(p), make_uint2(lo, hi));
#else
  uint32_t w[2] = {lo, hi};
  std::memcpy(p, w, 8);
#endif
}

JKM_HD void store4(void* p, uint32_t w) {
#if defined(__CUDA_ARCH__)
  __stwb(static_cast<unsigned int*>(p), w);
#else
  std::memcpy(p, &w, 4);
#endif
}

JKM_HD uint16_t half_word(const Raw16& r, int i) { return uint16_t(r.w[i / 2] >> (16 * (i % 2))); }

// ---- chunk arithmetic ----

JKM_HD void widen8(ActType act, const Raw16& raw, float v[kChunk]) {
  for (int i = 0; i < kChunk; ++i)
    v[i] = act == ActType::kBF16 ? bf16_to_f32(half_word(raw, i)) : f16_to_f32(half_word(raw, i));
}

// The cos/sin values that pe chunk j (elements 8j..8j+7 of the rope part) is turned by, its first
// pair first: GPT-J pairs 4j..4j+3 (inside the chunk), NeoX pairs 8(j % 4)..8(j % 4) + 7 (shared
// by chunk j and its partner chunk j ^ kNeoxPartnerChunk). A kernel loads only these from the
// token's cos/sin row, not the whole row.
struct RopeSlice {
  float cos[kChunk], sin[kChunk];  // GPT-J fills the first 4 of each
};

JKM_HD constexpr int rope_slice_pairs(RopeStyle style) { return style == RopeStyle::kGptj ? kChunk / 2 : kChunk; }

// The slice of pe chunk j from the token's cos/sin row (cos of pairs 0..31, then their sin); on
// the GPU in 16-byte loads (the row is 16-byte aligned, and so is each slice).
JKM_HD RopeSlice rope_slice(RopeStyle style, const float* row, int j) {
  RopeSlice r;
  const int first = style == RopeStyle::kGptj ? j * (kChunk / 2) : (j % kNeoxPartnerChunk) * kChunk;
  for (int i = 0; i < rope_slice_pairs(style); i += 4) {
#if defined(__CUDA_ARCH__)
    const float4 c = __ldg(reinterpret_cast<const float4*>(row + first + i));
    const float4 s = __ldg(reinterpret_cast<const float4*>(row + kRope / 2 + first + i));
    r.cos[i] = c.x, r.cos[i + 1] = c.y, r.cos[i + 2] = c.z, r.cos[i + 3] = c.w;
    r.sin[i] = s.x, r.sin[i + 1] = s.y, r.sin[i + 2] = s.z, r.sin[i + 3] = s.w;
#else
    for (int k = i; k < i + 4; ++k) r.cos[k] = row[first + k], r.sin[k] = row[kRope / 2 + first + k];
#endif
  }
  return r;
}

// Rotates pe chunk j by its slice. A NeoX pair's other element is in pe chunk
// j ^ kNeoxPartnerChunk, whose values are `partner` (unused for GPT-J).
JKM_HD void rope8(RopeStyle style, const RopeSlice& r, int j, float v[kChunk], const float partner[kChunk]) {
  if (style == RopeStyle::kGptj) {
    for (int i = 0; i < kChunk / 2; ++i) rope_pair(v[2 * i], v[2 * i + 1], r.cos[i], r.sin[i], v[2 * i], v[2 * i + 1]);
    return;
  }
  for (int i = 0; i < kChunk; ++i) v[i] = rope_element(style, j * kChunk + i, v[i], partner[i], r.cos[i], r.sin[i]);
}

// rope8 on raw chunks: the partner chunk is widened only for NeoX.
JKM_HD void rope8_raw(ActType act, RopeStyle style, const RopeSlice& r, int j, float v[kChunk],
                      const Raw16& partner) {
  float p[kChunk];
  if (style == RopeStyle::kNeox) widen8(act, partner, p);
  rope8(style, r, j, v, p);
}

JKM_HD Raw16 narrow8(bool to_bf16, const float v[kChunk]) {
  Raw16 r;
  for (int i = 0; i < kChunk / 2; ++i)
    r.w[i] = to_bf16 ? bf16x2(v[2 * i], v[2 * i + 1]) : f16x2(v[2 * i], v[2 * i + 1]);
  return r;
}

// Q(v * mult): 8 E4M3 codes packed into two words.
JKM_HD void e4m3x8(const float v[kChunk], float mult, uint32_t w[2]) {
  for (int i = 0; i < 2; ++i)
    w[i] = e4m3x4(mul_rn(v[4 * i], mult), mul_rn(v[4 * i + 1], mult), mul_rn(v[4 * i + 2], mult),
                  mul_rn(v[4 * i + 3], mult));
}

// Offsets within one token's rows (head x head stride + chunk): 32-bit on the GPU, which keeps
// each lane's index arithmetic narrow (the CUDA launcher checks that a token's rows fit), 64-bit
// on the host.
#if defined(__CUDA_ARCH__)
using TokenOffset = int32_t;
#else
using TokenOffset = int64_t;
#endif

// The element offset of chunk c of head h's row in row t, for strides per_t and per_h.
JKM_HD int64_t chunk_elem(int64_t t, int64_t per_t, int64_t h, int64_t per_h, int c) {
  return t * per_t + (TokenOffset(h) * TokenOffset(per_h) + TokenOffset(c) * kChunk);
}

// Where chunk c of row r for (t, h) is read from.
JKM_HD const uint16_t* chunk_src(const RowSpec& r, int64_t t, int64_t h, int c) {
  if (c < r.nope_chunks) return r.nope + chunk_elem(t, r.nope_t, h, r.nope_h, c);
  return r.pe + chunk_elem(t, r.pe_t, h, r.pe_h, c - r.nope_chunks);
}

// Whether chunk c of row r is rotated (a pe chunk, with RoPE), and then its slice, so that only
// pe chunks load the token's position.
JKM_HD bool chunk_rotation(const Epilogue& e, const RowSpec& r, int64_t t, int c, RopeSlice& slice) {
  if (c < r.nope_chunks || e.cos_sin == nullptr) return false;
  slice = rope_slice(e.rope_style, e.rope_row(t), c - r.nope_chunks);
  return true;
}

// The chunk that chunk c's RoPE partners are in: pe chunk j ^ kNeoxPartnerChunk with NeoX RoPE,
// else c itself.
JKM_HD int partner_chunk(const Epilogue& e, const RowSpec& r, int c) {
  if (c < r.nope_chunks || e.cos_sin == nullptr || e.rope_style != RopeStyle::kNeox) return c;
  return r.nope_chunks + ((c - r.nope_chunks) ^ kNeoxPartnerChunk);
}

// A loaded chunk made into its output: rotated as pe chunk j by `slice` when `rotate` is
// set (in `style`; `partner`: the loaded partner chunk for NeoX), then narrowed back to
// the activation dtype (16 bytes), or quantized to E4M3 as Q(v * mult) when `quantize` is set
// (the first 8 bytes). Chunks that nothing changes are the input bits themselves. Loading and
// finishing are separate so that a kernel can issue all its loads before it computes or stores
// anything.
JKM_HD Raw16 finish_chunk(ActType act, const Raw16& raw, bool rotate, const RopeSlice& slice, RopeStyle style,
                          const Raw16& partner, int j, bool quantize, float mult) {
  if (!rotate && !quantize) return raw;
  float v[kChunk];
  widen8(act, raw, v);
  if (rotate) rope8_raw(act, style, slice, j, v, partner);
  if (!quantize) return narrow8(act == ActType::kBF16, v);
  Raw16 codes{};
  e4m3x8(v, mult, codes.w);
  return codes;
}

// The float32 values of chunk c, RoPE'd when it is a pe chunk and RoPE is on.
JKM_HD void chunk_values(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h, int c,
                         float v[kChunk]) {
  widen8(e.act, load16(chunk_src(r, t, h, c)), v);
  RopeSlice slice;
  if (chunk_rotation(e, r, t, c, slice))
    rope8_raw(e.act, e.rope_style, slice, c - r.nope_chunks, v,
              load16(chunk_src(r, t, h, partner_chunk(e, r, c))));
}

// Chunk c of a row, loaded and finished.
JKM_HD Raw16 make_chunk(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h, int c) {
  const int p = partner_chunk(e, r, c);
  const Raw16 raw = load16(chunk_src(r, t, h, c));
  RopeSlice slice;
  const bool rotate = chunk_rotation(e, r, t, c, slice);
  return finish_chunk(e.act, raw, rotate, slice, e.rope_style,
                      p == c ? raw : load16(chunk_src(r, t, h, p)), c - r.nope_chunks,
                      r.scale_inv != nullptr, r.scale_inv != nullptr ? *r.scale_inv : 0.0f);
}

// Where chunk c of head h's output row goes (activation dtype, or E4M3 bytes). out_row is the
// token for a head row, the slot's cache row for the cache entry (h = 0 there).
JKM_HD void* chunk_dst(const RowSpec& r, int64_t out_row, int64_t h, int c) {
  const int64_t i = chunk_elem(out_row, r.out_t, h, r.out_h, c);
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
  return static_cast<uint8_t*>(e.cache.out) + row * e.cache.out_t;  // out_t: the row's bytes
}

// Tile j's latent chunk (0..15 within the tile) quantized with the tile's scale s.
JKM_HD void store_ds_mla_latent(uint8_t* entry, int latent_chunk, const float v[kChunk], float s) {
  uint32_t w[2];
  e4m3x8(v, 1.0f / s, w);  // s is a power of two: x * (1 / s) == x / s exactly
  store8(entry + latent_chunk * kChunk, w[0], w[1]);
}

JKM_HD void store_ds_mla_scale(uint8_t* entry, int tile, float s) {
  store4(entry + kDsMlaScaleOffset + 4 * tile, f32_bits(s));  // little-endian, 4-byte aligned
}

// pe chunk j (0..7) of the entry from its loaded input: bfloat16 from the float32 value, or the
// bf16 bits themselves when nothing changes them.
JKM_HD Raw16 finish_ds_mla_pe(ActType act, const Raw16& raw, bool rotate, const RopeSlice& slice, RopeStyle style,
                              const Raw16& partner, int j) {
  if (!rotate && act == ActType::kBF16) return raw;
  float v[kChunk];
  widen8(act, raw, v);
  if (rotate) rope8_raw(act, style, slice, j, v, partner);
  return narrow8(true, v);
}

JKM_HD Raw16 make_ds_mla_pe(const Epilogue& e, int64_t t, int j) {
  const int c = kLatent / kChunk + j, p = partner_chunk(e, e.cache, c);
  const Raw16 raw = load16(chunk_src(e.cache, t, 0, c));
  RopeSlice slice;
  const bool rotate = chunk_rotation(e, e.cache, t, c, slice);
  return finish_ds_mla_pe(e.act, raw, rotate, slice, e.rope_style,
                          p == c ? raw : load16(chunk_src(e.cache, t, 0, p)), j);
}

JKM_HD uint8_t* ds_mla_pe_dst(uint8_t* entry, int j) { return entry + kDsMlaPeOffset + j * kChunk * 2; }

}  // namespace jax_kimi_mla
