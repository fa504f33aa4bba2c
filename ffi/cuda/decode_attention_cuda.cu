// mla_decode_attention on the GPU: flash-decoding (split-KV) with warp-level tensor-core MMAs.
//
// At most two launches per call, no allocation, no host synchronization, so XLA can capture it
// in a CUDA graph:
//
// 1. attention_kernel, grid (num_splits, ceil(S_q*H / 16), B folded into grid z). A CTA of 8
//    warps takes 16 query rows of one sequence (rows past S_q*H are zero padding, never stored)
//    and the tokens [split_begin, split_end) of its split, in 64-token tiles:
//    - The 16 x 576 query tile goes to shared memory once, in the MMA element type (bf16, or f16
//      when q is f16 and the cache is f16 or plain fp8; E4M3 q codes become exact bf16 values).
//    - Cache rows stream through a double buffer with one 16-byte cp.async per chunk: each token
//      is addressed through its block id, so any block size works, and tile i + 1 is in flight
//      while tile i is computed. The block ids of a tile are read two tiles ahead and kept as
//      entry addresses in a small table in shared memory, off the critical path. A masked or
//      out-of-range token reads nothing: its shared row is zero-filled and its logits are -inf.
//    - A 16-bit cache lands straight in the MMA layout (rows of 1152 + 16 bytes: the 16-byte skew
//      puts the 8 rows of every ldmatrix in distinct banks). A plain fp8 or fp8_ds_mla cache
//      lands raw and is then converted into one MMA tile: E4M3 codes become exact bf16/f16
//      values by bit placement and one multiply by a power of two (no sm_89 fp8 converter is
//      used, so sm_80 runs it); ds_mla codes are then multiplied by their tile scale (exact for
//      the power-of-two scales the writer produces), ds_mla k_pe is copied as bf16. The plain fp8
//      scales never enter the loop: logits are multiplied by
//      softmax_scale / (q_scale_inv * cache_scale_inv), the output by 1 / cache_scale_inv.
//    - QK^T: warp w computes the logits of the 16 rows x tokens [8w, 8w + 8) over the 576
//      columns with mma.sync m16n8k16 (ldmatrix for Q, non-transposed ldmatrix for K), float32,
//      in four accumulators so the 36-step dependency chain is cut to 9.
//    - Online softmax in base 2 (logits pre-multiplied by log2 e, exp2f): the 16 x 64 logits go
//      through shared memory and every warp computes the same row maxima, probabilities and sums
//      for all 16 rows (identical operations on identical data, so bit-identical across warps).
//    - P.V: warp w owns output columns [64w, 64w + 64): O[16 x 64] += P[16 x 64] V[64 x 64], V
//      being the first 512 columns of the same tile (transposed ldmatrix), P built in registers.
//    - End: one split writes out (rounded to the output dtype) and lse directly; several splits
//      each write their partial (512 normalized floats, then the natural-log lse; -inf and zeros
//      for a row that saw no token of the split). A CTA whose split starts at or past the length
//      returns at once (the combine reads only the live splits).
//    Why 8 warps and 64-token tiles: shared memory allows one CTA per SM, and with 4 warps (one
//    per scheduler) the kernel was bound by instruction latency (on an H200 an L2-resident cache
//    ran no faster than HBM); 8 warps halve each warp's share of the loads, conversion and P.V
//    (+20%). 4 warps x 32-token tiles at 2 CTAs per SM measured slower at these grid sizes.
// 2. combine_kernel (num_splits > 1 only), one CTA per (row, sequence): the live splits merged
//    with weights exp(lse_s - max lse); empty (-inf) splits are skipped and their outputs never
//    read; a NaN lse makes the row NaN.
//
// Numerics of the edges: a row that sees no visible unmasked token gets zeros and lse -inf (no
// -inf - -inf, no division by 0); a NaN in a visible token reaches that row's output and lse; a
// token a row does not see never reaches that row, even holding NaN. With S_q > 1, the rows of a
// CTA may see different lengths: the at most S_q - 1 tokens that some of its rows see and others
// do not are left out of the P.V MMA (0 * NaN would reach the rows that do not see them) and
// added in float32 to the rows that see them.
//
// Shared memory per CTA (1 CTA per SM): bf16/f16 cache 173,824 B, plain fp8 172,800 B, fp8_ds_mla
// 183,040 B. That fits sm_90 (227 KB per block); GPUs with less opt-in shared memory (A100: 163
// KB) get an error from the launch instead of a wrong answer.
//
// Measured on one H200 (B = 128, H = 16, S_q = 1, 4096 tokens, one split): bf16 cache 216 us =
// 2.8 TB/s of cache; plain fp8 0.94 TB/s; fp8_ds_mla 1.04 TB/s. All three are still bound by
// instruction latency, not by memory.
//
// Not done yet: the fp8 conversion pass costs more issue time than the MMAs and is not overlapped
// with them; the phases of a tile (load issue, QK^T, softmax, P.V) are separated by barriers;
// no PDL between the two launches. The split count is the caller's choice: one CTA per SM, so
// num_splits * ceil(S_q*H / 16) * B should reach the SM count.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "jax_kimi_mla/decode_attention.h"

namespace jax_kimi_mla {
namespace {

constexpr int kWarps = 8;
constexpr int kCtasPerSm = 1;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileRows = 16;     // query rows per CTA: the M of mma.m16n8k16
constexpr int kTileTokens = 64;   // tokens per K/V tile
constexpr int kTokensPerWarp = kTileTokens / kWarps;  // 8: a warp's share of the logits (one n-block)
constexpr int kColsPerWarp = kLatent / kWarps;        // 64: a warp's share of the output
constexpr int kOutBlocks = kColsPerWarp / 8;          // 8 n-blocks of 8 output columns
constexpr int kQkSteps = kEntry / 16;                 // 36 k-steps of QK^T
constexpr int kPvSteps = kTileTokens / 16;            // 4 k-steps of P.V
constexpr int kRowBytes = 2 * kEntry + 16;  // a 16-bit tile row in shared memory, skewed by 16 B
constexpr int kScoreStride = kTileTokens + 8;  // floats per logit row: float2 accesses conflict-free
constexpr int64_t kMaxGridYZ = 65535;
constexpr int kCombineWarps = 8;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
static_assert(kTokensPerWarp == 8 && kOutBlocks % 2 == 0, "a warp's logits are one n-block");
static_assert(kThreads >= 2 * kTileTokens, "the prologue gives one thread to each token of two tiles");

// Where everything lives in dynamic shared memory (byte offsets, all multiples of 16).
template <CacheFormat kFormat>
struct Layout {
  static constexpr bool kConverts = kFormat != CacheFormat::kBf16;
  static constexpr int kEntryBytes = kFormat == CacheFormat::kBf16   ? 2 * kEntry
                                     : kFormat == CacheFormat::kFp8 ? kEntry
                                                                    : kDsMlaEntryBytes;
  // A 16-bit cache row lands in the MMA layout itself; the fp8 formats land packed.
  static constexpr int kRawRowBytes = kConverts ? kEntryBytes : kRowBytes;
  static constexpr int kRawTileBytes = kTileTokens * kRawRowBytes;
  static constexpr int kQ = 0;                                        // [16][kRowBytes]
  static constexpr int kScores = kQ + kTileRows * kRowBytes;          // float [16][kScoreStride]
  static constexpr int kEntries = kScores + kTileRows * kScoreStride * 4;  // pointers [2][64]
  static constexpr int kRaw = kEntries + 2 * kTileTokens * 8;       // [2][kRawTileBytes]
  static constexpr int kConverted = kRaw + 2 * kRawTileBytes;         // [64][kRowBytes]
  static constexpr int kBytes = kConverted + (kConverts ? kTileTokens * kRowBytes : 0);
  static_assert(kEntryBytes % 16 == 0 && kRawRowBytes % 16 == 0 && kScores % 16 == 0 &&
                kEntries % 16 == 0 && kRaw % 16 == 0 && kConverted % 16 == 0);
};

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
__device__ __forceinline__ int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

// ---- PTX: cp.async, ldmatrix, mma.sync (all sm_80) ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Four 8x8 matrices of 16-bit elements; lanes 8i..8i+7 give the row addresses of matrix i, which
// lands in r[i]. Without .trans lane l holds row l/4, columns 2(l%4) and 2(l%4)+1 of each
// matrix; with .trans it holds rows 2(l%4) and 2(l%4)+1 of column l/4.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// D[16x8] += A[16x16] B[16x8], float32 accumulate. Fragments (lane l, g = l/4, c = l%4):
// a[0] = A[g][2c..2c+1], a[1] = A[g+8][2c..], a[2] = A[g][2c+8..], a[3] = A[g+8][2c+8..];
// b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]; d = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1].
// A pair's lower-indexed element is in the low half of its register.
template <ActType kElem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (kElem == ActType::kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- The MMA element type: bf16 or f16 pairs in one word, the first value lowest ----

template <ActType kElem>
__device__ __forceinline__ uint32_t pack_elems(float lo, float hi) {  // round to nearest even
  if constexpr (kElem == ActType::kBF16) {
    const __nv_bfloat162 p = __float22bfloat162_rn(make_float2(lo, hi));
    return *reinterpret_cast<const uint32_t*>(&p);
  } else {
    const __half2 p = __float22half2_rn(make_float2(lo, hi));
    return *reinterpret_cast<const uint32_t*>(&p);
  }
}

template <ActType kElem>
__device__ __forceinline__ float elem_to_f32(uint16_t h) {
  if constexpr (kElem == ActType::kBF16) return bf16_to_f32(h);
  else return __half2float(__ushort_as_half(h));
}

template <ActType kElem>
__device__ __forceinline__ float round_to_elem(float x) {
  return elem_to_f32<kElem>(uint16_t(pack_elems<kElem>(x, 0.0f)));
}

// x * y on each half, rounded to nearest even; subnormals kept. sm_80 has no bf16x2 multiply:
// x * y + (-0) is the product, its sign of zero included.
template <ActType kElem>
__device__ __forceinline__ uint32_t mul_elems(uint32_t x, uint32_t y) {
  uint32_t d;
  if constexpr (kElem == ActType::kBF16)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(y), "r"(0x80008000u));
  else
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(x), "r"(y));
  return d;
}

// ---- E4M3 codes as exact bf16/f16 values ----
//
// A code s.eeee.mmm placed with its sign at the sign bit and eeee.mmm at the top of the exponent
// and mantissa fields of a bf16 (f16) is a bf16 (f16) of value v * 2^-120 (v * 2^-8), subnormal
// codes included; one multiply by 2^120 (2^8) makes it v exactly. The NaN codes (low 7 bits all
// ones) are rare and patched after.

// Two codes, each in the high byte of a 16-bit half of h.
template <ActType kElem>
__device__ __forceinline__ uint32_t e4m3x2_exact(uint32_t h) {
  if constexpr (kElem == ActType::kBF16)
    return mul_elems<kElem>((h & 0x80008000u) | ((h >> 4) & 0x07F007F0u), 0x7B807B80u);  // 2^120
  else
    return mul_elems<kElem>((h & 0x80008000u) | ((h >> 1) & 0x3F803F80u), 0x5C005C00u);  // 2^8
}

// The halves of v whose code (high byte of the same half of h) is a NaN become the element NaN.
template <ActType kElem>
__device__ __forceinline__ uint32_t patch_nan_codes(uint32_t v, uint32_t h) {
  const uint32_t nan = kElem == ActType::kBF16 ? 0x7FC07FC0u : 0x7E007E00u;
  const uint32_t is_nan = (((h & 0x7F007F00u) + 0x01000100u) & 0x80008000u) >> 15;  // bit 0 / 16
  const uint32_t mask = is_nan * 0xFFFFu;
  return (v & ~mask) | (nan & mask);
}

__device__ __forceinline__ bool has_nan_code(uint32_t codes4) {
  return (((codes4 & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) != 0;
}

// Eight codes (the first in the lowest byte) as eight elements (16 bytes).
template <ActType kElem>
__device__ __forceinline__ uint4 e4m3x8_exact(uint2 codes) {
  const uint32_t h[4] = {__byte_perm(codes.x, 0, 0x1404), __byte_perm(codes.x, 0, 0x3424),
                         __byte_perm(codes.y, 0, 0x1404), __byte_perm(codes.y, 0, 0x3424)};
  uint32_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = e4m3x2_exact<kElem>(h[i]);
  if (has_nan_code(codes.x) || has_nan_code(codes.y)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = patch_nan_codes<kElem>(v[i], h[i]);
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// Eight f16 values rounded to bf16.
__device__ __forceinline__ uint4 f16x8_to_bf16(uint4 x) {
  uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    w[i] = pack_elems<ActType::kBF16>(f.x, f.y);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- Per-call constants ----

struct Scales {
  float logit;  // q.k -> base-2 logit: softmax_scale * log2 e, plain-fp8 scales folded in
  float out;    // applied with the normalization: 1 / cache_scale_inv for plain fp8, else 1
};

template <CacheFormat kFormat>
__device__ __forceinline__ Scales load_scales(const DecodeAttention& a) {
  Scales s{a.softmax_scale * kLog2e, 1.0f};
  if constexpr (kFormat == CacheFormat::kFp8) {
    const float q_inv = a.q_scale_inv != nullptr ? __ldg(a.q_scale_inv) : 1.0f;
    const float cache_inv = __ldg(a.cache_scale_inv);
    s.logit = s.logit / (q_inv * cache_inv);
    s.out = 1.0f / cache_inv;
  }
  return s;
}

// ---- The pieces of the main kernel ----

// The 16 x 576 query tile of rows row0.. of sequence b, in the MMA element type.
template <ActType kElem>
__device__ void load_q(const DecodeAttention& a, int64_t b, int64_t row0, uint8_t* q_tile) {
  constexpr int kChunks = kEntry / 8;  // 8 elements each
  const int64_t rows = a.rows();
  for (int c = threadIdx.x; c < kTileRows * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c - r * kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);  // padding rows
    if (row0 + r < rows) {
      const int64_t elem = (b * rows + row0 + r) * kEntry + chunk * 8;
      if (a.q_type == QType::kE4m3) {
        const uint8_t* codes = static_cast<const uint8_t*>(a.q) + elem;
        v = e4m3x8_exact<kElem>(__ldg(reinterpret_cast<const uint2*>(codes)));
      } else {
        v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + elem));
        // A bf16 q always meets bf16 elements; an f16 q meets bf16 ones with the ds_mla cache.
        if (kElem == ActType::kBF16 && a.q_type == QType::kF16) v = f16x8_to_bf16(v);
      }
    }
    *reinterpret_cast<uint4*>(q_tile + r * kRowBytes + chunk * 16) = v;
  }
}

// What one CTA covers: rows [row0, row0 + 16) of sequence b, tokens [first, load_end) of its
// split in n_tiles tiles.
struct Work {
  int64_t b, row0, first, load_end, n_tiles;
};

// The cache entry of token `token` of tile `tile`, or null: masked, past the loaded range, or no
// such tile.
__device__ __forceinline__ const uint8_t* tile_token_entry(const DecodeAttention& a, const Work& w,
                                                           int64_t tile, int token) {
  const int64_t t = w.first + tile * kTileTokens + token;
  const int64_t row = tile < w.n_tiles && t < w.load_end ? a.token_row(w.b, t) : -1;
  return row >= 0 ? a.cache + row * a.row_bytes : nullptr;
}

// Issues the cp.async copies of one tile (cache entries `entries`, null = zero-fill) into `raw`
// as one commit group.
template <CacheFormat kFormat>
__device__ __forceinline__ void load_tile(const uint8_t* const* entries, uint8_t* raw) {
  using L = Layout<kFormat>;
  constexpr int kChunks = L::kEntryBytes / 16;
  for (int c = threadIdx.x; c < kTileTokens * kChunks; c += kThreads) {
    const int token = c / kChunks, chunk = c - token * kChunks;
    uint8_t* dst = raw + token * L::kRawRowBytes + chunk * 16;
    const uint8_t* entry = entries[token];
    if (entry != nullptr)
      cp_async16(dst, entry + chunk * 16);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  cp_async_commit();
}

// Converts a landed fp8 tile into the MMA layout. A zero-filled row converts to zeros (codes 0,
// scales 0).
template <CacheFormat kFormat, ActType kElem>
__device__ __forceinline__ void convert_tile(const uint8_t* raw, uint8_t* tile) {
  if constexpr (kFormat == CacheFormat::kFp8) {
    constexpr int kGroups = kEntry / 8;  // 8 codes each
    for (int c = threadIdx.x; c < kTileTokens * kGroups; c += kThreads) {
      const int token = c / kGroups, group = c - token * kGroups;
      const uint2 codes = *reinterpret_cast<const uint2*>(raw + token * kEntry + group * 8);
      *reinterpret_cast<uint4*>(tile + token * kRowBytes + group * 16) = e4m3x8_exact<kElem>(codes);
    }
  } else {
    static_assert(kFormat == CacheFormat::kFp8DsMla && kElem == ActType::kBF16);
    constexpr int kGroups = kLatent / 8;
    for (int c = threadIdx.x; c < kTileTokens * kGroups; c += kThreads) {
      const int token = c / kGroups, group = c - token * kGroups;
      const uint8_t* entry = raw + token * kDsMlaEntryBytes;
      const float scale =
          *reinterpret_cast<const float*>(entry + kDsMlaScaleOffset + 4 * (group * 8 / kDsMlaTile));
      const uint32_t scale2 = pack_elems<kElem>(scale, scale);  // exact for a power of two
      uint4 v = e4m3x8_exact<kElem>(*reinterpret_cast<const uint2*>(entry + group * 8));
      v = make_uint4(mul_elems<kElem>(v.x, scale2), mul_elems<kElem>(v.y, scale2),
                     mul_elems<kElem>(v.z, scale2), mul_elems<kElem>(v.w, scale2));
      *reinterpret_cast<uint4*>(tile + token * kRowBytes + group * 16) = v;
    }
    constexpr int kPeChunks = 2 * kRope / 16;  // k_pe is bf16 already
    for (int c = threadIdx.x; c < kTileTokens * kPeChunks; c += kThreads) {
      const int token = c / kPeChunks, chunk = c - token * kPeChunks;
      *reinterpret_cast<uint4*>(tile + token * kRowBytes + 2 * kLatent + chunk * 16) =
          *reinterpret_cast<const uint4*>(raw + token * kDsMlaEntryBytes + kDsMlaPeOffset + chunk * 16);
    }
  }
}

// This thread's place in the MMA fragments and the lengths its two rows see.
struct Lane {
  int warp, lane, g, c;   // g = lane / 4 (fragment row), c = lane % 4 (fragment column pair)
  int64_t visible[2];     // tokens seen by rows g and g + 8 of the tile
};

// Base-2 logits of the 16 rows x this warp's 8 tokens into `scores`; -inf where the token is
// masked or not visible to the row.
template <ActType kElem>
__device__ __forceinline__ void qk_logits(const Lane& t, const uint8_t* q_tile, const uint8_t* kv,
                                          const uint8_t* const* entries, int64_t tile_first,
                                          float logit_scale, float* scores) {
  // A: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), in the order a[0..3].
  const uint32_t q_addr =
      smem_addr(q_tile) + ((t.lane & 7) + ((t.lane >> 3) & 1) * 8) * kRowBytes + (t.lane >> 4) * 16;
  // B: matrices (the warp's 8 tokens) x (k 0-7, 8-15, 16-23, 24-31): b0, b1 of two k-steps.
  const uint32_t k_addr =
      smem_addr(kv) + (t.warp * kTokensPerWarp + (t.lane & 7)) * kRowBytes + (t.lane >> 3) * 16;
  float acc[4][4] = {};  // four independent accumulation chains, summed at the end
#pragma unroll
  for (int k = 0; k < kQkSteps; k += 2) {
    uint32_t kb[4], qa[2][4];
    ldmatrix_x4(kb, k_addr + k * 32);
    ldmatrix_x4(qa[0], q_addr + k * 32);
    ldmatrix_x4(qa[1], q_addr + (k + 1) * 32);
    mma_16816<kElem>(acc[k & 3], qa[0], kb[0], kb[1]);
    mma_16816<kElem>(acc[(k & 3) + 1], qa[1], kb[2], kb[3]);
  }
  const int token = t.warp * kTokensPerWarp + 2 * t.c;
  const bool loaded[2] = {entries[token] != nullptr, entries[token + 1] != nullptr};
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows g and g + 8
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * h + e;
      const bool seen = loaded[e] && tile_first + token + e < t.visible[h];
      v[e] = seen ? ((acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i])) * logit_scale : -INFINITY;
    }
    *reinterpret_cast<float2*>(scores + (t.g + 8 * h) * kScoreStride + token) = make_float2(v[0], v[1]);
  }
}

// Running softmax state of rows g and g + 8 (identical in the 4 lanes of a quad and in every
// warp): the running max of base-2 logits, and this lane's share of the running sum.
struct RowState {
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.0f, 0.0f};
};

// One tile's softmax step: rescales `out` and `state`, returns P as A fragments of the P.V MMA
// (p[k] for tokens [16k, 16k + 16)) and the offsets the probabilities were taken against.
template <ActType kElem>
__device__ __forceinline__ void softmax_tile(const Lane& t, const float* scores, RowState& state,
                                             float (&out)[kOutBlocks][4], uint32_t (&p)[kPvSteps][4],
                                             float (&offset)[2]) {
  // logit[k][i] in A-fragment order: i = 0,1 row g, 2,3 row g + 8, columns 16k + 2c (+1); i =
  // 4..7 the same at columns 16k + 8 + 2c. Row of i: (i >> 1) & 1.
  float logit[kPvSteps][8];
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = 16 * k + 8 * half + 2 * t.c;
      const float2 lo = *reinterpret_cast<const float2*>(scores + t.g * kScoreStride + col);
      const float2 hi = *reinterpret_cast<const float2*>(scores + (t.g + 8) * kScoreStride + col);
      logit[k][4 * half + 0] = lo.x, logit[k][4 * half + 1] = lo.y;
      logit[k][4 * half + 2] = hi.x, logit[k][4 * half + 3] = hi.y;
    }
  float tile_max[2] = {-INFINITY, -INFINITY};  // fmaxf skips NaN: a NaN logit propagates through p
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k)
#pragma unroll
    for (int i = 0; i < 8; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], logit[k][i]);
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 2));
    const float new_max = fmaxf(state.max[h], tile_max[h]);
    // A row that has seen nothing yet keeps p = 0 (exp2(-inf - 0)), never -inf - -inf.
    offset[h] = new_max == -INFINITY ? 0.0f : new_max;
    alpha[h] = exp2f(state.max[h] - offset[h]);
    state.max[h] = new_max;
    state.sum[h] *= alpha[h];
  }
#pragma unroll
  for (int n = 0; n < kOutBlocks; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) out[n][i] *= alpha[i >> 1];
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k) {
    float e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int h = (i >> 1) & 1;
      e[i] = exp2f(logit[k][i] - offset[h]);
      state.sum[h] += e[i];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) p[k][j] = pack_elems<kElem>(e[2 * j], e[2 * j + 1]);
  }
}

// Tokens [lo, hi) of the tile (tile-relative) are seen by some rows of the CTA and not by others.
// Their values are added here, in float32, to the rows that see them (p rounded as the MMA would
// round it), then zeroed in this warp's columns of the V tile so that the MMA adds nothing for
// them (each warp reads only its own columns of V after the logits are complete).
template <ActType kElem>
__device__ void add_partly_seen(const Lane& t, int lo, int hi, int64_t tile_first,
                                const float* scores, const float (&offset)[2], uint8_t* kv,
                                float (&out)[kOutBlocks][4]) {
  for (int token = lo; token < hi; ++token) {
    const uint16_t* v =
        reinterpret_cast<const uint16_t*>(kv + token * kRowBytes) + t.warp * kColsPerWarp;
    bool seen[2];
    float p[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      seen[h] = tile_first + token < t.visible[h];
      p[h] = round_to_elem<kElem>(exp2f(scores[(t.g + 8 * h) * kScoreStride + token] - offset[h]));
    }
#pragma unroll
    for (int n = 0; n < kOutBlocks; ++n) {
      const uint32_t pair = *reinterpret_cast<const uint32_t*>(v + 8 * n + 2 * t.c);
      const float x[2] = {elem_to_f32<kElem>(uint16_t(pair)), elem_to_f32<kElem>(uint16_t(pair >> 16))};
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (seen[h]) {
          out[n][2 * h] = fmaf(p[h], x[0], out[n][2 * h]);
          out[n][2 * h + 1] = fmaf(p[h], x[1], out[n][2 * h + 1]);
        }
    }
  }
  __syncwarp();
  for (int token = lo; token < hi; ++token)
    for (int i = t.lane; i < kColsPerWarp / 2; i += 32)  // 4 bytes each
      *reinterpret_cast<uint32_t*>(kv + token * kRowBytes + t.warp * kColsPerWarp * 2 + 4 * i) = 0;
  __syncwarp();
}

// out[16 x this warp's 64 columns] += P[16 x 64] V[64 x 64].
template <ActType kElem>
__device__ __forceinline__ void pv_accumulate(const Lane& t, const uint32_t (&p)[kPvSteps][4],
                                              const uint8_t* kv, float (&out)[kOutBlocks][4]) {
  // Transposed matrices (tokens 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of each
  // 16-token x 16-column block: b0, b1 of n-block 2j, then of n-block 2j + 1.
  const uint32_t v_addr = smem_addr(kv) + ((t.lane & 7) + ((t.lane >> 3) & 1) * 8) * kRowBytes +
                          (t.warp * kColsPerWarp + (t.lane >> 4) * 8) * 2;
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k)
#pragma unroll
    for (int j = 0; j < kOutBlocks / 2; ++j) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_addr + k * 16 * kRowBytes + j * 32);
      mma_16816<kElem>(out[2 * j], p[k], vb[0], vb[1]);
      mma_16816<kElem>(out[2 * j + 1], p[k], vb[2], vb[3]);
    }
}

// Rows g and g + 8: normalized output and lse, to out/lse (one split) or to the split's partial.
__device__ __forceinline__ void write_rows(const DecodeAttention& a, const Work& w, const Lane& t,
                                           const Scales& scales, const RowState& state,
                                           const float (&out)[kOutBlocks][4]) {
  const int64_t rows = a.rows();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = state.sum[h];
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    const int64_t r = w.row0 + t.g + 8 * h;
    if (r >= rows) continue;
    const bool empty = sum == 0.0f;  // saw no visible unmasked token; a NaN sum is not empty
    const float norm = empty ? 0.0f : scales.out / sum;
    const float lse = empty ? -INFINITY : (state.max[h] + log2f(sum)) * kLn2;
    const int col = t.warp * kColsPerWarp + 2 * t.c;
    const bool lse_writer = t.warp == 0 && t.c == 0;
    if (a.num_splits == 1) {
      uint16_t* o = static_cast<uint16_t*>(a.out) + (w.b * rows + r) * kLatent + col;
#pragma unroll
      for (int n = 0; n < kOutBlocks; ++n) {
        const float x0 = empty ? 0.0f : out[n][2 * h] * norm;
        const float x1 = empty ? 0.0f : out[n][2 * h + 1] * norm;
        store4(o + 8 * n, a.act == ActType::kBF16 ? bf16x2(x0, x1) : f16x2(x0, x1));
      }
      if (lse_writer) a.lse[w.b * rows + r] = lse;
    } else {
      float* part = a.partial(int(blockIdx.x), w.b, r);
#pragma unroll
      for (int n = 0; n < kOutBlocks; ++n) {
        part[col + 8 * n] = empty ? 0.0f : out[n][2 * h] * norm;
        part[col + 8 * n + 1] = empty ? 0.0f : out[n][2 * h + 1] * norm;
      }
      if (lse_writer) part[kLatent] = lse;
    }
  }
}

// One CTA's work for sequence b. Block-uniform control flow throughout (barriers inside).
template <CacheFormat kFormat, ActType kElem>
__device__ void attend(const DecodeAttention& a, int64_t b, const Scales& scales, uint8_t* smem) {
  using L = Layout<kFormat>;
  const int split = int(blockIdx.x);
  const int64_t rows = a.rows(), len = a.context_len(b);
  Work w;
  w.b = b;
  w.row0 = int64_t(blockIdx.y) * kTileRows;
  w.first = a.split_begin(len, split);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it
  // Rows are (query token, head): the first row of the CTA sees the fewest tokens, its last real
  // row the most; no row sees tokens past seen_by_any, so those are not loaded.
  const int64_t last_row = min64(w.row0 + kTileRows, rows) - 1;
  const int64_t seen_by_all = a.visible_len(len, w.row0 / a.heads);
  const int64_t seen_by_any = a.visible_len(len, last_row / a.heads);
  w.load_end = min64(a.split_end(len, split), seen_by_any);
  w.n_tiles = w.load_end > w.first ? (w.load_end - w.first + kTileTokens - 1) / kTileTokens : 0;

  Lane t;
  t.warp = int(threadIdx.x) / 32, t.lane = int(threadIdx.x) % 32;
  t.g = t.lane / 4, t.c = t.lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // padding rows see as much as the last real row
    const int64_t r = w.row0 + t.g + 8 * h;
    t.visible[h] = r < rows ? a.visible_len(len, r / a.heads) : seen_by_any;
  }

  uint8_t* q_tile = smem + L::kQ;
  float* scores = reinterpret_cast<float*>(smem + L::kScores);
  const uint8_t** entries = reinterpret_cast<const uint8_t**>(smem + L::kEntries);  // [tile % 2][token]
  uint8_t* raw = smem + L::kRaw;

  __syncthreads();  // this CTA's previous sequence is done with the shared memory
  load_q<kElem>(a, b, w.row0, q_tile);
  if (threadIdx.x < 2 * kTileTokens)
    entries[threadIdx.x] = tile_token_entry(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  __syncthreads();
  if (w.n_tiles > 0) load_tile<kFormat>(entries, raw);

  float out[kOutBlocks][4] = {};
  RowState state;
  for (int64_t tile = 0; tile < w.n_tiles; ++tile) {
    const int slot = int(tile & 1);
    cp_async_wait_all();
    __syncthreads();  // tile has landed, and every warp is done with tile - 1
    if (tile + 1 < w.n_tiles)
      load_tile<kFormat>(entries + (slot ^ 1) * kTileTokens, raw + (slot ^ 1) * L::kRawTileBytes);
    // The entries of tile + 2, looked up now so that their latency hides behind this tile's math.
    const uint8_t* entry_after_next =
        threadIdx.x < kTileTokens ? tile_token_entry(a, w, tile + 2, int(threadIdx.x)) : nullptr;
    uint8_t* kv = raw + slot * L::kRawTileBytes;
    if constexpr (L::kConverts) {
      uint8_t* converted = smem + L::kConverted;
      convert_tile<kFormat, kElem>(kv, converted);
      __syncthreads();
      kv = converted;
    }
    const int64_t tile_first = w.first + tile * kTileTokens;
    qk_logits<kElem>(t, q_tile, kv, entries + slot * kTileTokens, tile_first, scales.logit, scores);
    __syncthreads();  // the 16 x 64 logits are complete; this slot's entries are no longer read
    if (threadIdx.x < kTileTokens) entries[slot * kTileTokens + threadIdx.x] = entry_after_next;

    uint32_t p[kPvSteps][4];
    float offset[2];
    softmax_tile<kElem>(t, scores, state, out, p, offset);
    const int64_t partly_lo = max64(seen_by_all, tile_first);
    const int64_t partly_hi = min64(seen_by_any, tile_first + kTileTokens);
    if (partly_lo < partly_hi)
      add_partly_seen<kElem>(t, int(partly_lo - tile_first), int(partly_hi - tile_first), tile_first,
                             scores, offset, kv, out);
    pv_accumulate<kElem>(t, p, kv, out);
  }
  write_rows(a, w, t, scales, state, out);
}

template <CacheFormat kFormat, ActType kElem>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) attention_kernel(const DecodeAttention a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const Scales scales = load_scales<kFormat>(a);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) attend<kFormat, kElem>(a, b, scales, smem);
}

// One CTA per (query row, sequence): out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max lse)
// over the live splits whose lse is not -inf; lse = max + log(sum w_s). Warp w merges splits w,
// w + 8, ... (lane: the column pairs 64k + 2 lane); the loop body has no branch, so the loads of
// several splits are in flight at once; the warps' sums then meet in a fixed order.
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const DecodeAttention a) {
  __shared__ float warp_acc[kCombineWarps][kLatent];
  __shared__ float warp_weight[kCombineWarps], warp_max[kCombineWarps];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t rows = a.rows(), r = blockIdx.x;
  for (int64_t b = blockIdx.y; b < a.batch; b += gridDim.y) {
    const int live = a.live_splits(a.context_len(b));
    float max_lse = -INFINITY;  // fmaxf skips NaN: a NaN lse propagates through its weight
    for (int s = int(threadIdx.x); s < live; s += 32 * kCombineWarps)
      max_lse = fmaxf(max_lse, a.partial(s, b, r)[kLatent]);
    for (int m = 16; m > 0; m /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xFFFFFFFFu, max_lse, m));
    __syncthreads();  // the previous sequence is done with the shared sums
    if (lane == 0) warp_max[warp] = max_lse;
    __syncthreads();
    for (int w = 0; w < kCombineWarps; ++w) max_lse = fmaxf(max_lse, warp_max[w]);
    const float shift = max_lse == -INFINITY ? 0.0f : max_lse;

    float acc[kLatent / 32] = {};
    float weight_sum = 0.0f;
#pragma unroll 4
    for (int s = warp; s < live; s += kCombineWarps) {
      const float* part = a.partial(s, b, r);
      float o[kLatent / 32];
#pragma unroll
      for (int k = 0; k < kLatent / 64; ++k)
        o[2 * k] = part[64 * k + 2 * lane], o[2 * k + 1] = part[64 * k + 2 * lane + 1];
      const float lse = part[kLatent];
      const bool used = lse != -INFINITY;  // an empty split's outputs never enter the sums
      const float weight = used ? expf(lse - shift) : 0.0f;
      weight_sum += weight;
#pragma unroll
      for (int i = 0; i < kLatent / 32; ++i) acc[i] = used ? fmaf(weight, o[i], acc[i]) : acc[i];
    }
#pragma unroll
    for (int k = 0; k < kLatent / 64; ++k) {
      warp_acc[warp][64 * k + 2 * lane] = acc[2 * k];
      warp_acc[warp][64 * k + 2 * lane + 1] = acc[2 * k + 1];
    }
    if (lane == 0) warp_weight[warp] = weight_sum;
    __syncthreads();

    static_assert(32 * kCombineWarps * 2 == kLatent, "a thread writes one column pair");
    float total[2] = {0.0f, 0.0f}, total_weight = 0.0f;
    for (int w = 0; w < kCombineWarps; ++w) {
      total[0] += warp_acc[w][2 * threadIdx.x], total[1] += warp_acc[w][2 * threadIdx.x + 1];
      total_weight += warp_weight[w];
    }
    const bool empty = total_weight == 0.0f;  // no live split saw a token (NaN is not empty)
    const float norm = empty ? 0.0f : 1.0f / total_weight;
    uint32_t* out =
        reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.out) + (b * rows + r) * kLatent);
    const float x0 = total[0] * norm, x1 = total[1] * norm;
    out[threadIdx.x] = a.act == ActType::kBF16 ? bf16x2(x0, x1) : f16x2(x0, x1);
    if (threadIdx.x == 0) a.lse[b * rows + r] = empty ? -INFINITY : shift + logf(total_weight);
  }
}

// ---- Host side ----

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_kimi_mla mla_decode_attention: ") + what + ": " +
                              cudaGetErrorString(err));
}

template <CacheFormat kFormat, ActType kElem>
ffi::Error launch_attention(cudaStream_t stream, const DecodeAttention& a, dim3 grid) {
  constexpr int kBytes = Layout<kFormat>::kBytes;
  const auto kernel = attention_kernel<kFormat, kElem>;
  // Set on every call: the attribute belongs to the current device, and a process may drive
  // several. It is a host-side call (no stream work), so graph capture is unaffected.
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (err != cudaSuccess) {
    const std::string what = "allowing " + std::to_string(kBytes) + " bytes of shared memory per block";
    return cuda_error(what.c_str(), err);
  }
  kernel<<<grid, kThreads, kBytes, stream>>>(a);
  return ffi::Error::Success();
}

// The MMA element type: f16 where q is f16 and the cache's values are exact in f16 (an f16 cache,
// E4M3 codes), bf16 otherwise (ds_mla values and k_pe need bf16's range).
ActType mma_type(const DecodeAttention& a) {
  const bool f16 = a.q_type == QType::kF16 && a.cache_format != CacheFormat::kFp8DsMla;
  return f16 ? ActType::kF16 : ActType::kBF16;
}

ffi::Error run(cudaStream_t stream, const DecodeAttention& a) {
  const int64_t rows = a.rows();
  const int64_t row_groups = (rows + kTileRows - 1) / kTileRows;
  if (row_groups > kMaxGridYZ)
    return ffi::Error::InvalidArgument(
        "jax_kimi_mla mla_decode_attention: too many query rows (S_q * H)");
  // Grid z (y for the combine) holds at most 65535 sequences; the kernels loop over the rest.
  const unsigned batch_blocks = unsigned(a.batch < kMaxGridYZ ? a.batch : kMaxGridYZ);
  const dim3 grid(unsigned(a.num_splits), unsigned(row_groups), batch_blocks);
  const bool f16 = mma_type(a) == ActType::kF16;
  ffi::Error err = ffi::Error::Success();
  switch (a.cache_format) {
    case CacheFormat::kBf16:
      err = f16 ? launch_attention<CacheFormat::kBf16, ActType::kF16>(stream, a, grid)
                : launch_attention<CacheFormat::kBf16, ActType::kBF16>(stream, a, grid);
      break;
    case CacheFormat::kFp8:
      err = f16 ? launch_attention<CacheFormat::kFp8, ActType::kF16>(stream, a, grid)
                : launch_attention<CacheFormat::kFp8, ActType::kBF16>(stream, a, grid);
      break;
    case CacheFormat::kFp8DsMla:
      err = launch_attention<CacheFormat::kFp8DsMla, ActType::kBF16>(stream, a, grid);
      break;
  }
  if (err.failure()) return err;
  if (a.num_splits > 1)
    combine_kernel<<<dim3(unsigned(rows), batch_blocks), 32 * kCombineWarps, 0, stream>>>(a);
  const cudaError_t launch_err = cudaGetLastError();
  return launch_err == cudaSuccess ? ffi::Error::Success() : cuda_error("kernel launch", launch_err);
}

ffi::Error decode_attention_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                                    ffi::AnyBuffer block_tables, ffi::AnyBuffer context_lens,
                                    ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                                    ffi::Result<ffi::AnyBuffer> partials, float softmax_scale,
                                    int64_t q_tokens, int64_t num_splits) {
  DecodeAttention a;
  if (ffi::Error err = make_decode_attention(q, kv_cache, block_tables, context_lens, q_scale_inv,
                                             cache_scale_inv, *out, *lse, *partials, softmax_scale,
                                             q_tokens, num_splits, a);
      err.failure())
    return err;
  if (a.batch == 0 || a.heads == 0 || a.rows() == 0) return ffi::Error::Success();
  // cp.async moves 16-byte chunks; q is read in 16-byte (8-byte for fp8) chunks.
  if (reinterpret_cast<uintptr_t>(a.cache) % 16 != 0 || a.row_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.q) % 16 != 0)
    return ffi::Error::InvalidArgument(
        "jax_kimi_mla mla_decode_attention: kv_cache, its rows and q must be 16-byte aligned");
  return run(stream, a);
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jkm_cuda_mla_decode_attention, jax_kimi_mla::decode_attention_handler,
    JKM_DECODE_ATTENTION_BINDING(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
