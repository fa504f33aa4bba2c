// mla_decode_attention on the GPU, the pieces its kernels share: constants, PTX wrappers, the MMA
// element type and E4M3 conversions, the query's fetch, a split's work, the tiles' copies (TMA),
// QK^T, the online softmax, P.V and the output rows. Included once, by decode_attention_cuda.cu
// (which says how the kernels use them), before the kernels' files.
#pragma once

#include <cuda.h>  // CUtensorMap (the driver is reached through the runtime: no link to libcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "jax_kimi_mla/decode_attention.h"
#include "sm90_copy.cuh"
#include "sm90_wgmma.cuh"

namespace jax_kimi_mla {
namespace {


// Phase stamps of attention_kernel, fp8_attention_kernel and rs_attention_kernel, for
// benchmarks/probes/decode_attention.cu built with -DJKM_PHASE_STAMPS (which defines these to
// record a CTA's timeline and CTA 0's tiles); nothing otherwise. Points: 0 entry, 1 the first
// tiles' rows looked up, 2 the prologue done, 3 the first tile landed (JKM_TILE_AT(0)), 4 the
// loop left, 5 the output rows staged, 6 exit.
#ifndef JKM_PHASE_AT
#define JKM_PHASE_AT(point)
#define JKM_TILE_AT(tile)
#endif
// rs_attention_kernel's producer (its first thread) and the consumers' query, for the same probe:
// 0 the producer's place and length known, 1-4 its positions 0-3 issued; 5 the query fetched.
#ifndef JKM_START_AT
#define JKM_START_AT(point)
#endif



constexpr int kWarps = 8;
constexpr int kCtasPerSm = 1;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileRows = 16;     // query rows per CTA: the M of mma.m16n8k16
constexpr int kTileTokens = 64;   // tokens per K/V tile
// QK^T: warp w takes the 16 tokens of token group w % 4 (two n-blocks) over the columns of half
// w / 4, with that half's Q fragments held in registers for the whole CTA (no Q re-read per
// tile); the two halves' partial logits meet in shared memory.
constexpr int kTokenGroups = 4;
constexpr int kColumnHalves = kWarps / kTokenGroups;
constexpr int kTokensPerGroup = kTileTokens / kTokenGroups;  // 16: two n-blocks
constexpr int kColsPerWarp = kLatent / kWarps;        // 64: a warp's share of the output
constexpr int kOutBlocks = kColsPerWarp / 8;          // 8 n-blocks of 8 output columns
constexpr int kQkSteps = kEntry / 16;                 // 36 k-steps of QK^T
constexpr int kPvSteps = kTileTokens / 16;            // 4 k-steps of P.V
constexpr int kRowBytes = 2 * kEntry + 16;  // a query row in shared memory, skewed by 16 B (ldmatrix)
constexpr int kScoreStride = kTileTokens + 8;  // floats per logit row: float2 accesses conflict-free
constexpr int kChunkBytes = kTileTokens * 128;  // a swizzled 16-bit tile: 64 rows of one 64-column chunk
constexpr int kBoxRows = 16;                    // the smaller TMA box: rows of a 16-token group
constexpr int64_t kMaxGridYZ = 65535;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
static_assert(kColumnHalves == 2 && kTokensPerGroup == 16 && kOutBlocks % 2 == 0,
              "a warp's logits are two n-blocks of one column half");

// Programmatic dependent launch (sm_90+). The host launches combine_kernel with programmatic
// stream serialization (unless the call asks otherwise: DecodeLaunch): it may start while the
// attention kernel before it runs, once every CTA of that kernel has started and let it (each does
// so at its entry), and it waits for the whole attention grid, its memory writes included, before
// it reads anything that grid wrote. Its launch and its CTAs' start thus overlap the attention kernel's
// tail instead of following it. Without that launch attribute both instructions do nothing.
__device__ __forceinline__ void let_dependent_launch_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Where everything lives in dynamic shared memory (byte offsets, all multiples of 16; the stages
// first, at the 1024-byte-aligned start, as the 128-byte swizzle of the TMA boxes needs).
template <CacheFormat kFormat>
struct Layout {
  static constexpr bool kConverts = kFormat != CacheFormat::kBf16;
  static constexpr int kEntryBytes = kFormat == CacheFormat::kBf16   ? 2 * kEntry
                                     : kFormat == CacheFormat::kFp8 ? kEntry
                                                                    : kDsMlaEntryBytes;
  // A 16-bit tile lands by 2D tensor-map TMA boxes in nine 64-column chunks of 64 rows x 128
  // bytes, the 16-byte pieces of row r at piece ^ (r % 8) (SWIZZLE_128B): ldmatrix reads it
  // conflict-free, and a 64-token tile is 9 copies (36 with 16-row boxes) instead of 64 row
  // copies, whose number had bounded the tile. A 1-byte row lands as it is in the cache, so that
  // a run of consecutive rows is one bulk copy: plain fp8's 576 is 64 mod 128, so the 8 lanes of
  // a 16-byte shared load (quad columns 16c of tokens g, g + 1) hit 32 distinct banks; ds_mla's
  // 656 costs a 2-way conflict on those loads.
  static constexpr bool kSwizzled = !kConverts;
  static constexpr int kRawTileBytes = kSwizzled ? kEntry / 64 * kChunkBytes : kTileTokens * kEntryBytes;
  // The 1-byte formats are pipelined: P.V of tile i - 1 runs in the same barrier interval as
  // QK^T of tile i (two barriers per tile instead of three, and warps overlap the two phases).
  // That needs two V tiles (QK^T of tile i writes one while P.V of tile i - 1 reads the other)
  // and a P tile apart from the logits; it fits with two raw stages, the Q tile overlaid on the
  // second V tile. A 16-bit tile is its own V tile: three stages fill the shared memory, so P
  // lies over the logits and a barrier separates P.V of tile i - 1 from QK^T of tile i.
  static constexpr bool kPipelined = kConverts;
  // Tiles in shared memory: with the 16-bit cache kStages - 1 in flight while one is computed;
  // pipelined, one in flight while one is read by QK^T.
  static constexpr int kStages = kPipelined ? 2 : 3;
  // The V tile of P.V: the swizzled tile itself for a 16-bit cache; for a 1-byte cache the first
  // 512 columns converted by QK^T (rows of 1024 + 16 bytes: the 16-byte skew puts the 8 rows of
  // every ldmatrix in distinct banks).
  static constexpr int kVRowBytes = 2 * kLatent + 16;
  static constexpr int kVTileBytes = kTileTokens * kVRowBytes;
  static constexpr int kVTiles = kConverts ? 2 : 0;
  // The first QK^T k-step of column half 1. The 1-byte formats split at a 64-column block, 4 | 5,
  // so that each half converts (and writes to the V tile) four latent blocks.
  static constexpr int kHalfStep = kConverts ? 16 : kQkSteps / 2;
  static constexpr int kQSteps = kHalfStep > kQkSteps - kHalfStep ? kHalfStep : kQkSteps - kHalfStep;
  static constexpr int kRaw = 0;  // [kStages][kRawTileBytes]
  static constexpr int kScores = kRaw + kStages * kRawTileBytes;  // float [half][16][kScoreStride]
  // The P tile [16 rows][kPRowBytes]: over the logits (16-bit), or its own, 16-byte skewed rows.
  static constexpr int kPRowBytes = kPipelined ? 2 * kTileTokens + 16 : kScoreStride * 4;
  static constexpr int kOwnP = kScores + kColumnHalves * kTileRows * kScoreStride * 4;
  static constexpr int kP = kPipelined ? kOwnP : kScores;
  static constexpr int kEntries = kOwnP + (kPipelined ? kTileRows * kPRowBytes : 0);  // int64 [kStages][64]
  static constexpr int kZeroRows = kEntries + kStages * kTileTokens * 8;  // uint64 [kStages] (16-bit)
  static constexpr int kBarriers = kZeroRows + 32;                         // uint64 [kStages], 32 B
  static constexpr int kStats = kBarriers + 32;                            // RowStats
  static constexpr int kVTile = kStats + (int(sizeof(float)) * 3 * kTileRows + 15) / 16 * 16;  // [kVTiles][64][kVRowBytes]
  static constexpr int kBytes = kVTile + kVTiles * kVTileBytes;
  // The query tile [16][kRowBytes] is read into registers once, before the first tile lands:
  // in the last stage (16-bit), or in the second V tile, which QK^T of tile 1 first writes.
  static constexpr int kQ = kSwizzled ? kRaw + (kStages - 1) * kRawTileBytes : kVTile + kVTileBytes;
  static_assert(kEntryBytes % 16 == 0 && kRawTileBytes % 1024 == 0 && kScores % 16 == 0 && kP % 16 == 0 &&
                kEntries % 16 == 0 && kStages * 8 <= 32 && kQ % 16 == 0 && kVTile % 16 == 0);
  static_assert(kTileRows * kRowBytes <= (kSwizzled ? kRawTileBytes : kVTileBytes), "Q fits where it lies");
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
  static_assert(kThreads >= kStages * kTileTokens, "the prologue gives one thread to each token");
};

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
__device__ __forceinline__ int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

// ---- PTX: ldmatrix, mma.sync ----

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
// ones) come out as +-480; they are rare, and patched after (e4m3x8_exact) or tracked
// (qk_tile_raw).

// Two codes, each in the high byte of a 16-bit half of h.
template <ActType kElem>
__device__ __forceinline__ uint32_t e4m3x2_exact(uint32_t h) {
  if constexpr (kElem == ActType::kBF16)
    return mul_elems<kElem>((h & 0x80008000u) | ((h >> 4) & 0x07F007F0u), 0x7B807B80u);  // 2^120
  else
    return mul_elems<kElem>(e4m3x2_placed_f16x2(h), 0x5C005C00u);  // 2^8
}

// The halves of v whose code (high byte of the same half of h) is a NaN become the element NaN.
template <ActType kElem>
__device__ __forceinline__ uint32_t patch_nan_codes(uint32_t v, uint32_t h) {
  const uint32_t nan = kElem == ActType::kBF16 ? 0x7FC07FC0u : 0x7E007E00u;
  const uint32_t is_nan = (((h & 0x7F007F00u) + 0x01000100u) & 0x80008000u) >> 15;  // bit 0 / 16
  const uint32_t mask = is_nan * 0xFFFFu;
  return (v & ~mask) | (nan & mask);
}

// Whether e4m3x8_placed turns NaN codes into NaN by itself (the hardware converter); the bit
// placement turns them into +-480 instead.
template <ActType kElem>
__device__ __forceinline__ constexpr bool placed_keeps_nan() {
#if JKM_HARDWARE_FP8
  return kElem == ActType::kF16;
#else
  return false;
#endif
}

// Eight codes (the first in the lowest byte) as eight elements (16 bytes), exact except that NaN
// codes are +-480 where placed_keeps_nan is false.
template <ActType kElem>
__device__ __forceinline__ uint4 e4m3x8_placed(uint2 codes) {
#if JKM_HARDWARE_FP8
  if constexpr (kElem == ActType::kF16) {
    return make_uint4(e4m3x2_half_to_f16x2<0>(codes.x), e4m3x2_half_to_f16x2<1>(codes.x),
                      e4m3x2_half_to_f16x2<0>(codes.y), e4m3x2_half_to_f16x2<1>(codes.y));
  } else
#endif
  {
    return make_uint4(e4m3x2_exact<kElem>(__byte_perm(codes.x, 0, 0x1404)),
                      e4m3x2_exact<kElem>(__byte_perm(codes.x, 0, 0x3424)),
                      e4m3x2_exact<kElem>(__byte_perm(codes.y, 0, 0x1404)),
                      e4m3x2_exact<kElem>(__byte_perm(codes.y, 0, 0x3424)));
  }
}

// Eight codes as eight elements, exactly (NaN codes patched, a rare branch).
template <ActType kElem>
__device__ __forceinline__ uint4 e4m3x8_exact(uint2 codes) {
  uint4 v = e4m3x8_placed<kElem>(codes);
  if (!placed_keeps_nan<kElem>() && (e4m3_has_nan(codes.x) || e4m3_has_nan(codes.y))) {
    v = make_uint4(patch_nan_codes<kElem>(v.x, __byte_perm(codes.x, 0, 0x1404)),
                   patch_nan_codes<kElem>(v.y, __byte_perm(codes.x, 0, 0x3424)),
                   patch_nan_codes<kElem>(v.z, __byte_perm(codes.y, 0, 0x1404)),
                   patch_nan_codes<kElem>(v.w, __byte_perm(codes.y, 0, 0x3424)));
  }
  return v;
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

// ---- QK^T over a 1-byte cache, straight from the raw tile ----
//
// Lane (g, c) of the warp owning tokens 8w.. takes token 8w + g and, per 64-column block j, 16
// columns of it with one 16-byte shared load: R_c = 64j + [16c, 16c + 16) for codes (one 16-byte
// load), R_c = 512 + [8c, 8c + 8) + [32 + 8c, 40 + 8c) for the 64 bf16 k_pe of ds_mla (two
// loads, chosen so that they too hit distinct banks). Converted in registers, the 8 words of R_c
// are the B fragments of the block's 4 k-steps: k-step s takes b0 = R_c[4s, 4s + 1], b1 =
// R_c[4s + 2, 4s + 3], i.e. MMA column 16s + 2c + e holds R_c[4s + e] and 16s + 8 + 2c + e holds
// R_c[4s + 2 + e]. A dot product does not care about the order of its terms, so Q is stored in
// that same order (mma_column) and QK^T needs neither ldmatrix on K nor a converted K tile.

// fp8_attention_kernel's token order: position kk of a 16-token group (of the logits, P and the B
// rows of P.V) holds token fp8_token(kk) of the group (its section says why).
__host__ __device__ constexpr int fp8_token(int kk) { return kk ^ ((kk >> 1) & 1); }

// Where a kernel keeps the tokens of a 16-token group: position kk holds token ordered_token(kk).
enum class TokenOrder { kNatural, kFp8 };
template <TokenOrder kOrder>
__host__ __device__ constexpr int ordered_token(int kk) {
  return kOrder == TokenOrder::kFp8 ? fp8_token(kk) : kk;
}

// The MMA column (in the Q tile) of query column k, for the 1-byte formats.
template <CacheFormat kFormat>
__host__ __device__ constexpr int mma_column(int k) {
  const int j = k / 64, r = k % 64;
  const bool pe = kFormat == CacheFormat::kFp8DsMla && j == kLatent / 64;
  const int c = pe ? r % 32 / 8 : r / 16;          // the quad lane holding column k
  const int n = pe ? r / 32 * 8 + r % 8 : r % 16;  // its place in R_c
  return 64 * j + 16 * (n / 4) + 8 * (n / 2 % 2) + 2 * c + n % 2;
}

template <CacheFormat kFormat>
constexpr bool mma_column_is_a_pair_preserving_permutation() {
  bool hit[kEntry] = {};
  for (int k = 0; k < kEntry; ++k) {
    const int m = mma_column<kFormat>(k);
    if (m < 0 || m >= kEntry || hit[m] || (k % 2 == 1 && m != mma_column<kFormat>(k - 1) + 1))
      return false;
    hit[m] = true;
  }
  return true;
}
static_assert(mma_column_is_a_pair_preserving_permutation<CacheFormat::kFp8>() &&
              mma_column_is_a_pair_preserving_permutation<CacheFormat::kFp8DsMla>());

// The 16 x 576 query tile of rows row0.. of sequence b, in the MMA element type; for the 1-byte
// formats in the column order of mma_column (pairs of columns stay together). In two steps, so
// that all of a thread's loads are in flight at once and the first tiles' copies are issued
// between them: fetch_q loads this thread's chunks (8 elements each) into registers, store_q
// converts them and writes the tile.
constexpr int kQChunks = kTileRows * kEntry / 8;
constexpr int kQChunksPerThread = (kQChunks + kThreads - 1) / kThreads;

template <ActType kElem>
__device__ __forceinline__ void fetch_q(const DecodeAttention& a, int64_t b, int64_t row0,
                                        uint4 (&v)[kQChunksPerThread]) {
  constexpr int kChunksPerRow = kEntry / 8;
  const int64_t rows = a.rows();
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow;
    v[i] = make_uint4(0, 0, 0, 0);  // padding rows
    if (c < kQChunks && row0 + r < rows) {
      const int64_t elem = (b * rows + row0 + r) * kEntry + (c - r * kChunksPerRow) * 8;
      if (a.q_type == QType::kE4m3) {
        const uint2 codes = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.q) + elem));
        v[i] = make_uint4(codes.x, codes.y, 0, 0);
      } else {
        v[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + elem));
      }
    }
  }
}

template <CacheFormat kFormat, ActType kElem>
__device__ __forceinline__ void store_q(const DecodeAttention& a, const uint4 (&fetched)[kQChunksPerThread],
                                        uint8_t* q_tile) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow, chunk = c - r * kChunksPerRow;
    if (c >= kQChunks) break;
    uint4 v = fetched[i];
    if (a.q_type == QType::kE4m3)
      v = e4m3x8_exact<kElem>(make_uint2(v.x, v.y));
    else if (kElem == ActType::kBF16 && a.q_type == QType::kF16)  // f16 q meets bf16 with ds_mla
      v = f16x8_to_bf16(v);
    uint8_t* q_row = q_tile + r * kRowBytes;
    if constexpr (Layout<kFormat>::kConverts) {
      const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint32_t*>(q_row + 2 * mma_column<kFormat>(chunk * 8 + 2 * j)) = pairs[j];
    } else {
      *reinterpret_cast<uint4*>(q_row + chunk * 16) = v;
    }
  }
}

// What one CTA covers: rows [row0, row0 + 16) of sequence b, tokens [first, load_end) of its
// split in n_tiles tiles.
struct Work {
  int64_t b, row0, first, load_end, n_tiles;
  int slot;  // the partial slot the CTA writes (its split), or -1: out and lse directly (one split)
};

// By work, a sequence's tiles, and its live splits at a share of `share` tiles
// (DecodeAttention::live_splits, exactly: ceil(ceil(len / n) / 64) = ceil(tiles / n)), in 32 bits
// (64-bit divisions call a routine, whose saved registers rs_attention_kernel spilled; the handler
// splits by work only where a sequence's tiles fit 31 bits).
__device__ __forceinline__ unsigned sequence_tiles(const DecodeAttention& a, int64_t b) {
  return unsigned((a.context_len(b) + kTileTokens - 1) / kTileTokens);
}
__device__ __forceinline__ unsigned live_splits_of_tiles(const DecodeAttention& a, unsigned tiles, unsigned share) {
  const unsigned most = unsigned(a.num_splits), per = max((tiles + most - 1) / most, share);
  return per == 0 ? 0u : (tiles + per - 1) / per;
}
// The tiles of the calling lane's sequence among the batch's first 32 (0 past B), loaded once: the
// search and the scan below count the sequences again, and a batch split by work is small (its
// CTAs do not fill the GPU), most often one pass of a warp. Sequence b = lane + 32 k's tiles.
__device__ __forceinline__ unsigned first_pass_tiles(const DecodeAttention& a) {
  const unsigned lane = threadIdx.x % 32;
  return lane < a.batch ? sequence_tiles(a, lane) : 0u;
}
__device__ __forceinline__ unsigned tiles_of(const DecodeAttention& a, int64_t b, unsigned first_pass) {
  return b < 32 ? first_pass : sequence_tiles(a, b);
}

// What splits by work need of the batch (B > 0), in every lane of the calling warp (whole warps):
// its summed tiles, longest and shortest sequence, live sequences.
struct BatchTiles {
  uint64_t total;
  unsigned longest, shortest, live;
  __device__ bool uniform() const { return shortest == longest; }
};
__device__ __forceinline__ BatchTiles batch_tiles(const DecodeAttention& a, unsigned first_pass) {
  BatchTiles s{0, 0, ~0u, 0};
  for (int64_t b = threadIdx.x % 32; b < a.batch; b += 32) {
    const unsigned t = tiles_of(a, b, first_pass);
    s.total += t, s.longest = max(s.longest, t), s.shortest = min(s.shortest, t), s.live += t > 0;
  }
#pragma unroll
  for (int k = 16; k > 0; k /= 2) {
    s.total += __shfl_xor_sync(0xFFFFFFFFu, s.total, k), s.live += __shfl_xor_sync(0xFFFFFFFFu, s.live, k);
    s.longest = max(s.longest, __shfl_xor_sync(0xFFFFFFFFu, s.longest, k));
    s.shortest = min(s.shortest, __shfl_xor_sync(0xFFFFFFFFu, s.shortest, k));
  }
  return s;
}

// The share of a split by work (DecodeAttention::split_capacity), in tiles, in every lane of the
// calling warp: the fewest whole tiles a split may take such that the batch's live splits fit the
// capacity. It lies between the summed tiles over the capacity (each sequence's splits are at
// least its tiles over the share) and that over the capacity less the live sequences (at most one
// split a sequence more), or the longest sequence (one split each). A uniform batch's share is the
// lower bound (its splits then fill the capacity: ceil(t / ceil(t / W)) <= W); else bisection,
// which counts the lower bound first (the serving batch of 17 live sequences in 32: 3 counts).
// Every CTA finds the same share: integer arithmetic on the call's inputs.
__device__ __forceinline__ unsigned batch_share_tiles(const DecodeAttention& a, unsigned first_pass,
                                                      const BatchTiles& s) {
  const uint64_t capacity = uint64_t(a.split_capacity());
  if (s.total > INT32_MAX || capacity > INT32_MAX) return s.longest;  // one split each
  const unsigned total = unsigned(s.total), room = unsigned(capacity);
  unsigned low = (total + room - 1) / room;  // = least_split_share's, in tiles
  if (s.uniform()) return low;
  unsigned high = room > s.live ? min(s.longest, (total + room - s.live - 1) / (room - s.live)) : s.longest;
  for (unsigned share = low; low < high; share = low + (high - low) / 2) {
    unsigned splits = 0;
    for (int64_t b = threadIdx.x % 32; b < a.batch; b += 32)
      splits += live_splits_of_tiles(a, tiles_of(a, b, first_pass), share);
#pragma unroll
    for (int k = 16; k > 0; k /= 2) splits += __shfl_xor_sync(0xFFFFFFFFu, splits, k);
    if (splits <= room) high = share;
    else low = share + 1;
  }
  return low;
}
// The same in tokens (0 without splits by work or sequences): the combine's.
__device__ __forceinline__ int64_t batch_split_share(const DecodeAttention& a) {
  if (a.work_splits == 0 || a.batch == 0) return 0;
  const unsigned first_pass = first_pass_tiles(a);
  return int64_t(batch_share_tiles(a, first_pass, batch_tiles(a, first_pass))) * kTileTokens;
}

// The work of split `split` of sequence b (len tokens) for the CTA whose first row is row0: its
// first token, where its loads end (at most `visible`, the last token any of its rows sees) and its
// tiles. One division: the bounds follow from the split's size. A split at or past the length
// (first >= len) has no tiles. share: the CTA's (CtaPlace).
__device__ __forceinline__ Work split_work(const DecodeAttention& a, int64_t b, int64_t row0, int64_t split,
                                           int64_t len, int64_t visible, int64_t share) {
  Work w;
  w.b = b, w.row0 = row0;
  const int64_t split_tokens = a.split_tokens(len, share);
  w.first = split * split_tokens;
  w.load_end = min64(min64(w.first + split_tokens, len), visible);
  w.n_tiles = w.load_end > w.first ? (w.load_end - w.first + kTileTokens - 1) / kTileTokens : 0;
  w.slot = a.num_splits == 1 ? -1 : int(split);
  return w;
}

// Where a CTA of an attention kernel works: split `split` of sequence b (b >= B: nothing to do),
// query rows from row_group x the kernel's rows a CTA, the split share (batch_split_share's). By
// count the grid is (row groups, sequences of a wave, num_splits x waves of gridDim.y sequences;
// more than one wave only past 65535 sequences, never for rs_attention_kernel), so that a CTA
// takes one (sequence, split) with no loop over sequences (ptxas kept such a loop's invariants in
// registers through the whole body, and spilled). The GPU starts CTAs x first, then y, then z: a
// sequence's row groups start together (they read the same tokens, and the later ones find them
// in L2: S_q = 4, B 64 x 16k ran 45% slower with them apart), then every sequence's first splits.
// rs_attention_kernel's clusters are a sequence's splits along z. By work the grid is (row groups,
// B, work_splits), one CTA for each live split the share allows (work_place).
struct CtaPlace {
  int64_t b, share;
  int split, row_group;
};

// By work: CTA i = z * B + y (the order in which they start) takes the batch's i-th live split,
// the sequences in order: the CTA counts the live splits of the sequences before its own (a warp
// scan a pass of 32 sequences; in a uniform batch, a division). The share lets the batch have at
// most B * work_splits of them (as many as the grid's CTAs a row group); the CTAs past them have
// nothing to do. A grid with room for a long sequence's every split (num_splits of them) would
// start mostly empty CTAs, each holding an SM for its prologue and search (H200, uniform B 16 x
// 16k, 4 times the planned grid: 7-9 us).
__device__ __forceinline__ CtaPlace work_place(const DecodeAttention& a) {
  const unsigned lane = threadIdx.x % 32, first_pass = first_pass_tiles(a);
  const BatchTiles tiles = batch_tiles(a, first_pass);
  const unsigned share = batch_share_tiles(a, first_pass, tiles);
  if (a.stored_share != nullptr && threadIdx.x == 0 && (blockIdx.x | blockIdx.y | blockIdx.z) == 0)
    *a.stored_share = share;  // for combine_kernel, which reads it once this kernel is done
  const int64_t share_tokens = int64_t(share) * kTileTokens;
  // i < 65535 x work_splits (the handler keeps B within one wave): 32 bits.
  const unsigned i = blockIdx.z * unsigned(a.batch) + blockIdx.y;
  if (tiles.uniform()) {  // n live splits each: no scan
    const unsigned n = live_splits_of_tiles(a, tiles.longest, share), b = n == 0 ? unsigned(a.batch) : i / n;
    return b < a.batch ? CtaPlace{b, share_tokens, int(i - b * n), int(blockIdx.x)}
                       : CtaPlace{a.batch, share_tokens, 0, int(blockIdx.x)};
  }
  int64_t before = 0;  // live splits of the sequences before this pass's
  for (int64_t first = 0; first < a.batch; first += 32) {
    const int64_t b = first + lane;
    const int n = b < a.batch ? int(live_splits_of_tiles(a, tiles_of(a, b, first_pass), share)) : 0;
    int upto = n;  // live splits of this pass's sequences up to lane's, inclusive
#pragma unroll
    for (int k = 1; k < 32; k *= 2) {
      const int below = __shfl_up_sync(0xFFFFFFFFu, upto, k);
      if (lane >= unsigned(k)) upto += below;
    }
    const int64_t split = int64_t(i) - before - (upto - n);
    const unsigned owner = __ballot_sync(0xFFFFFFFFu, split >= 0 && split < n);
    if (owner != 0) {
      const int at = __ffs(owner) - 1;
      return {first + at, share_tokens, __shfl_sync(0xFFFFFFFFu, int(split), at), int(blockIdx.x)};
    }
    before += __shfl_sync(0xFFFFFFFFu, upto, 31);
  }
  return {a.batch, share_tokens, 0, int(blockIdx.x)};
}

// The CTA's place (whole warps: by work, each warp finds it).
__device__ __forceinline__ CtaPlace cta_place(const DecodeAttention& a) {
  if (a.work_splits > 0) return work_place(a);
  const unsigned wave = blockIdx.z / unsigned(a.num_splits);
  return {int64_t(wave) * gridDim.y + blockIdx.y, 0, int(blockIdx.z - wave * unsigned(a.num_splits)), int(blockIdx.x)};
}
// The same in a grid of one wave by count (rs_attention_kernel): the block index itself, which
// ptxas reads again where a register would have to hold it (its producer's and consumers'
// registers are few).
__device__ __forceinline__ CtaPlace cta_place_in_one_wave() { return {int64_t(blockIdx.y), 0, int(blockIdx.z), int(blockIdx.x)}; }

// The cache row of token `token` of tile `tile`, or -1: masked, past the loaded range, or no such
// tile.
__device__ __forceinline__ int64_t tile_token_row(const DecodeAttention& a, const Work& w, int64_t tile,
                                                  int token) {
  const int64_t t = w.first + tile * kTileTokens + token;
  return tile < w.n_tiles && t < w.load_end ? a.token_row(w.b, t) : -1;
}

// ---- sm_90: bulk copies (TMA) completing on an mbarrier ----
//
// A stage's mbarrier completes a phase when its issuing threads have all arrived (each once,
// announcing the bytes of its copies) and those bytes have landed. 1-byte tiles: threads 0-63,
// one per token, each run of consecutive rows one bulk copy (the number of copies, not their
// bytes, bounded a tile). 16-bit tiles: warp 0 alone, with 2D tensor-map boxes (TileMaps). The
// host launches the kernel on sm_90+ only (it also needs 206-227 KB of shared memory); for older
// architectures these compile to traps (sm90_copy.cuh).

// The box of `map` at element column `col`, cache row `row` (rows past the cache land as zeros).
__device__ __forceinline__ void box_copy(void* dst, const CUtensorMap& map, int col, int row, uint64_t* bar) {
  SM90_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
           ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(&map)), "r"(col), "r"(row), "r"(smem_addr(bar))
           : "memory");
}

// The cache as 2D tensors of 576 columns x (num_blocks * block_size) rows (row stride row_bytes,
// so padded rows too), read in boxes of 64 rows (a whole tile of consecutive rows) or of 16 rows
// (a token group): the 16-bit cache in 64-column boxes, 128-byte swizzled (tile, group); the plain
// fp8 cache (rs_attention_kernel) in 128-column boxes, 128-byte swizzled (tile, group), and its 64
// rope columns in 64-byte swizzled boxes (rope_tile, rope_group). Built by the host per call; the
// maps a format does not use are zero.
struct TileMaps {
  CUtensorMap tile, group, rope_tile, rope_group;
};

// At the kernel's start, off the prologue's chain: the first copies then find the descriptors
// cached (a one-tile CTA at B = 1 otherwise waits for their fetch).
template <CacheFormat kFormat = CacheFormat::kBf16>
__device__ __forceinline__ void prefetch_tile_maps(const TileMaps& maps) {
  if (threadIdx.x == 0) prefetch_tensor_map(&maps.tile);
  if (threadIdx.x == 32) prefetch_tensor_map(&maps.group);
  if constexpr (kFormat == CacheFormat::kFp8) {
    if (threadIdx.x == 64) prefetch_tensor_map(&maps.rope_tile);
    if (threadIdx.x == 96) prefetch_tensor_map(&maps.rope_group);
  }
}

// Byte offset of 16-byte piece `piece` (of 72) of row `row` in a swizzled 16-bit tile.
__device__ __forceinline__ int swizzled_offset(int row, int piece) {
  return (piece >> 3) * kChunkBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

// Byte offset of code `col` of row `row` in a plain-fp8 tile of `rows` rows as its boxes land it
// (the layout of E4M3 wgmma operands from shared memory): columns 0-511 in four chunks of rows x
// 128 bytes, 128-byte swizzled (swizzled_piece), the 64 rope columns in a fifth chunk of rows x 64
// bytes, 64-byte swizzled (16-byte piece p of row r at p ^ (r / 2 % 4)).
__host__ __device__ constexpr int fp8_tile_offset(int row, int col, int rows) {
  return col < kLatent ? swizzled_piece(row, col >> 4, rows) + (col & 15)
                       : kLatent / 128 * rows * 128 + row * 64 + ((((col - kLatent) >> 4) ^ ((row >> 1) & 3)) << 4) +
                             (col & 15);
}

// The chunks of a tile as issue_swizzled_tile lands them: the 16-bit cache in nine chunks of
// 64-column boxes, the plain fp8 cache in five (fp8_tile_offset). Chunk k lies at k x kChunkBytes.
template <CacheFormat kFormat>
struct BoxedTile {
  static constexpr bool kFp8 = kFormat == CacheFormat::kFp8;
  static constexpr int kChunks = kFp8 ? kLatent / 128 + 1 : kEntry / 64;
  static constexpr int kPieces = kFp8 ? kEntry / 16 : kEntry / 8;  // 16-byte pieces a row
  static constexpr int kBytes = kFp8 ? kTileTokens * kEntry : kChunks * kChunkBytes;
  __device__ static int row_bytes(int chunk) { return kFp8 && chunk == kChunks - 1 ? 64 : 128; }
  __device__ static int column(int chunk) { return (kFp8 ? 128 : 64) * chunk; }  // in the map's elements
  __device__ static const CUtensorMap& map(const TileMaps& maps, int chunk, bool whole) {
    if (kFp8 && chunk == kChunks - 1) return whole ? maps.rope_tile : maps.rope_group;
    return whole ? maps.tile : maps.group;
  }
  __device__ static int piece_offset(int row, int piece) {
    return kFp8 ? fp8_tile_offset(row, 16 * piece, kTileTokens) : swizzled_offset(row, piece);
  }
};
static_assert(BoxedTile<CacheFormat::kFp8>::kBytes == (BoxedTile<CacheFormat::kFp8>::kChunks - 1) * kChunkBytes + kTileTokens * 64);

// The bytes of the run of consecutive cache rows that this lane's token starts among its warp's
// 32 consecutive tokens (lane = token % 32), or 0 where the token continues a run or is masked
// (row -1): each run is one bulk copy, landing at the first token's place in a raw tile.
// Padded rows are not contiguous entries: each is its own run.
template <int kEntryBytes>
__device__ __forceinline__ uint32_t run_bytes(const DecodeAttention& a, int64_t row, int lane) {
  const int64_t prev = __shfl_up_sync(0xFFFFFFFFu, row, 1);
  const bool continues = lane > 0 && row >= 0 && prev >= 0 && prev + 1 == row && a.row_bytes == kEntryBytes;
  const uint32_t breaks = __ballot_sync(0xFFFFFFFFu, !continues);
  const uint32_t later = breaks & ~((2u << lane) - 1u);  // breaks past this lane (lane 31: none)
  const int run_end = later != 0 ? __ffs(int(later)) - 1 : 32;
  return row >= 0 && !continues ? uint32_t(run_end - lane) * kEntryBytes : 0;
}

// The thread of token `token` (< 64; two whole warps, token % 32 its lane) issues its share of a
// 1-byte tile: its run (run_bytes) with one bulk copy, or, for a masked token (row -1), zeros.
// Each of the 64 threads arrives once.
template <CacheFormat kFormat>
__device__ __forceinline__ void issue_raw_tile(const DecodeAttention& a, int64_t row, uint8_t* raw,
                                               uint64_t* bar, int token = int(threadIdx.x)) {
  using L = Layout<kFormat>;
  uint8_t* dst = raw + token * L::kEntryBytes;
  const uint32_t bytes = run_bytes<L::kEntryBytes>(a, row, token % 32);
  if (bytes != 0) {
    mbarrier_arrive_expect_bytes(bar, bytes);
    bulk_copy(dst, a.cache + row * a.row_bytes, bytes, bar);
    return;
  }
  if (row < 0) {
#pragma unroll
    for (int i = 0; i < L::kEntryBytes / 16; ++i)
      *reinterpret_cast<uint4*>(dst + 16 * i) = make_uint4(0, 0, 0, 0);
    fence_proxy_async();  // before a later bulk copy (of any thread) to these bytes
  }
  mbarrier_arrive(bar);  // a continuing row: copied by its run's first thread
}

// A warp issues a tile by TMA boxes (BoxedTile: a 16-bit tile, or rs_attention_kernel's plain fp8
// one; lane l: tokens l and l + 32; rows[t] the cache row of token t or -1). A tile of 64
// consecutive rows is a box of 64 rows a chunk (lanes 0-8 or 0-4, a chunk each). Otherwise a
// 16-token group whose live tokens are a run of consecutive rows from its first token is a box of
// 16 rows a chunk; a group with any other live pattern (a block size below 16, masked block ids in
// the middle) is read with plain loads by the whole warp, before the arrivals. The rows of masked
// tokens are left to zero_rows: a box lands whatever rows follow a run (garbage, NaN), and they
// are zeroed (zero_masked_rows) once the tile has landed, before anything reads it. Each lane
// arrives once.
template <CacheFormat kFormat = CacheFormat::kBf16>
__device__ void issue_swizzled_tile(const DecodeAttention& a, const TileMaps& maps, const int64_t* rows,
                                    uint8_t* stage, uint64_t* bar, uint64_t* zero_rows) {
  using T = BoxedTile<kFormat>;
  const int lane = int(threadIdx.x) % 32;
  uint64_t live = 0, continues = 0;  // bit t: token t has a row; its row follows token t - 1's
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = lane + 32 * h;
    const int64_t row = rows[t], prev = t > 0 ? rows[t - 1] : -1;
    live |= uint64_t(__ballot_sync(0xFFFFFFFFu, row >= 0)) << (32 * h);
    continues |= uint64_t(__ballot_sync(0xFFFFFFFFu, row >= 0 && prev >= 0 && prev + 1 == row)) << (32 * h);
  }
  const bool whole = live == ~0ull && (continues | 1ull) == ~0ull;
  uint32_t boxed = 0, loaded = 0;  // groups read by boxes, by plain loads
#pragma unroll
  for (int q = 0; q < kTileTokens / kBoxRows; ++q) {
    const uint64_t first = 1ull << (kBoxRows * q), group = (first << kBoxRows) - first;
    if ((live & group) == 0) continue;
    if ((live & first) && (live & group & ~first & ~continues) == 0) boxed |= 1u << q;
    else loaded |= 1u << q;
  }
  if (!whole) {
    for (uint32_t m = loaded; m != 0; m &= m - 1) {  // rare: every live row, 16 bytes per lane
      const int q = __ffs(int(m)) - 1;
      for (int i = lane; i < kBoxRows * T::kPieces; i += 32) {
        const int t = kBoxRows * q + i / T::kPieces, piece = i % T::kPieces;
        if (rows[t] >= 0)
          *reinterpret_cast<uint4*>(stage + T::piece_offset(t, piece)) =
              __ldg(reinterpret_cast<const uint4*>(a.cache + rows[t] * a.row_bytes) + piece);
      }
    }
    if (loaded != 0) fence_proxy_async();  // before a later box lands on these bytes
  }
  if (lane == 0) *zero_rows = ~live;
  if (lane < T::kChunks) {
    uint8_t* chunk = stage + lane * kChunkBytes;
    const int row_bytes = T::row_bytes(lane);
    if (whole) {
      mbarrier_arrive_expect_bytes(bar, uint32_t(kTileTokens * row_bytes));
      box_copy(chunk, T::map(maps, lane, true), T::column(lane), int(rows[0]), bar);
    } else {
      mbarrier_arrive_expect_bytes(bar, uint32_t(__popc(boxed)) * kBoxRows * row_bytes);
      for (uint32_t m = boxed; m != 0; m &= m - 1) {
        const int q = __ffs(int(m)) - 1;
        box_copy(chunk + q * kBoxRows * row_bytes, T::map(maps, lane, false), T::column(lane),
                 int(rows[kBoxRows * q]), bar);
      }
    }
  } else {
    mbarrier_arrive(bar);
  }
}

// After a tile of issue_swizzled_tile has landed: zero the rows of its masked tokens (thread
// `thread` of `threads` a share of their chunk rows), before the barrier that lets the warps read it.
template <CacheFormat kFormat = CacheFormat::kBf16>
__device__ __forceinline__ void zero_masked_rows(uint64_t mask, uint8_t* stage, int thread = int(threadIdx.x),
                                                 int threads = kThreads) {
  using T = BoxedTile<kFormat>;
  if (mask == 0) return;
  for (int i = thread; i < kTileTokens * T::kChunks; i += threads) {
    const int t = i % kTileTokens, chunk = i / kTileTokens, row_bytes = T::row_bytes(chunk);
    if ((mask >> t) & 1) {
      uint4* dst = reinterpret_cast<uint4*>(stage + chunk * kChunkBytes + t * row_bytes);
      for (int j = 0; j < row_bytes / 16; ++j) dst[j] = make_uint4(0, 0, 0, 0);
    }
  }
  fence_proxy_async();  // before a later box lands on these bytes, and before wgmma reads them
}

// This thread's place in the MMA fragments and the lengths its two rows see.
struct Lane {
  int warp, lane, g, c;   // g = lane / 4 (fragment row), c = lane % 4 (fragment column pair)
  int half, group;        // QK^T: column half and token group (tokens [16 group, 16 group + 16))
  int64_t visible[2];     // tokens seen by rows g and g + 8 of the tile
};

// The query's A fragments of this warp's column half, k-step kFirst + i in q[i], kept in
// registers for the CTA's whole split.
template <int kFirst, int kCount, int kQSteps, int kQRowBytes = kRowBytes>
__device__ __forceinline__ void load_q_fragments(const Lane& t, const uint8_t* q_tile,
                                                 uint32_t (&q)[kQSteps][4]) {
  // Matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15), in the order a[0..3]; k-step k is at + 32k
  // (32 bytes: 16 columns of 16 bits, or 32 E4M3 codes).
  const uint32_t addr =
      smem_addr(q_tile) + ((t.lane & 7) + ((t.lane >> 3) & 1) * 8) * kQRowBytes + (t.lane >> 4) * 16;
#pragma unroll
  for (int i = 0; i < kCount; ++i) ldmatrix_x4(q[i], addr + (kFirst + i) * 32);
}

// Partial QK^T of the 16 rows x this warp's 16 tokens over k-steps [kFirst, kFirst + kCount) of
// a swizzled 16-bit tile: acc[n][k % 2] for n-block n (tokens +8n); four independent chains.
template <ActType kElem, int kFirst, int kCount, int kQSteps>
__device__ __forceinline__ void qk_tile(const Lane& t, const uint32_t (&q)[kQSteps][4],
                                        const uint8_t* kv, float (&acc)[2][2][4]) {
  // B: matrices (tokens +0-7 | +8-15) x (k 0-7 | 8-15): b0, b1 of n-block 0, then of n-block 1.
  // k-step s reads pieces 2s, 2s + 1 of its tokens: chunk s / 4, piece 2 (s % 4) + (0 | 1),
  // swizzled by the row's low bits, which are lane % 8.
  const int row = t.group * kTokensPerGroup + (t.lane & 7) + ((t.lane >> 4) & 1) * 8;
  const uint32_t row_addr = smem_addr(kv) + row * 128;
  uint32_t piece[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) piece[m] = uint32_t((2 * m + ((t.lane >> 3) & 1)) ^ (t.lane & 7)) << 4;
#pragma unroll
  for (int k = 0; k < kCount; ++k) {
    const int s = kFirst + k;
    uint32_t kb[4];
    ldmatrix_x4(kb, row_addr + (s / 4) * kChunkBytes + piece[s % 4]);
    mma_16816<kElem>(acc[0][k & 1], q[k], kb[0], kb[1]);
    mma_16816<kElem>(acc[1][k & 1], q[k], kb[2], kb[3]);
  }
}

// The same over a raw 1-byte tile, 64-column blocks [kFirstBlock, kFirstBlock + kBlocks) (the
// order of the comment above mma_column): lane (g, c) takes tokens 16 group + g and + 8 + g,
// converts their columns as it goes (the conversion interleaves with the MMAs, no pass of its
// own, no barrier) and stores their latent values once into the V tile, in natural column order,
// for P.V. A zero-filled row gives zeros (codes 0, scales 0). nan[n] tells whether this lane's
// columns of its n-block-n token hold a NaN code where the conversion does not keep NaN: the loop
// stays free of branches, and write_logits makes that token's logits NaN, as a NaN in K would
// (its +-480 stand-ins in the V tile are never seen: every row that sees the token gets p = NaN,
// and a row that does not never reads it).
// With kFp8Order (fp8_attention_kernel), lane g of n-block n takes token fp8_token(8n + g) of the
// group, and no V tile is written (v_tile unused).
template <CacheFormat kFormat, ActType kElem, int kFirstBlock, int kBlocks, int kQSteps, bool kFp8Order = false>
__device__ __forceinline__ void qk_tile_raw(const Lane& t, const uint32_t (&q)[kQSteps][4],
                                            const uint8_t* raw, uint8_t* v_tile,
                                            float (&acc)[2][2][4], bool (&nan)[2]) {
  using L = Layout<kFormat>;
  constexpr bool kDsMla = kFormat == CacheFormat::kFp8DsMla;
  const uint8_t* row[2];
  uint8_t* v_row[2];
  uint32_t nan_bits[2] = {0, 0};
  uint32_t scale2[2][kLatent / kDsMlaTile];  // ds_mla: each token's tile scales as element pairs
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int token = t.group * kTokensPerGroup + (kFp8Order ? fp8_token(8 * n + t.g) : 8 * n + t.g);
    row[n] = raw + token * L::kEntryBytes;
    if constexpr (!kFp8Order) v_row[n] = v_tile + token * L::kVRowBytes;
    if constexpr (kDsMla) {  // exact for powers of 2
      const float4 s = *reinterpret_cast<const float4*>(row[n] + kDsMlaScaleOffset);
      scale2[n][0] = pack_elems<kElem>(s.x, s.x), scale2[n][1] = pack_elems<kElem>(s.y, s.y);
      scale2[n][2] = pack_elems<kElem>(s.z, s.z), scale2[n][3] = pack_elems<kElem>(s.w, s.w);
    }
  }
#pragma unroll
  for (int jj = 0; jj < kBlocks; ++jj) {
    const int j = kFirstBlock + jj;
    uint32_t b[2][8];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      if (kDsMla && j == kLatent / 64) {  // k_pe: bf16 already
        const uint4 lo = *reinterpret_cast<const uint4*>(row[n] + kDsMlaPeOffset + 16 * t.c);
        const uint4 hi = *reinterpret_cast<const uint4*>(row[n] + kDsMlaPeOffset + 64 + 16 * t.c);
        b[n][0] = lo.x, b[n][1] = lo.y, b[n][2] = lo.z, b[n][3] = lo.w;
        b[n][4] = hi.x, b[n][5] = hi.y, b[n][6] = hi.z, b[n][7] = hi.w;
      } else {
        const uint4 codes = *reinterpret_cast<const uint4*>(row[n] + 64 * j + 16 * t.c);
        uint4 lo = e4m3x8_placed<kElem>(make_uint2(codes.x, codes.y));
        uint4 hi = e4m3x8_placed<kElem>(make_uint2(codes.z, codes.w));
        if (!placed_keeps_nan<kElem>())
          nan_bits[n] |= e4m3_nan_bits(codes.x) | e4m3_nan_bits(codes.y) | e4m3_nan_bits(codes.z) |
                         e4m3_nan_bits(codes.w);
        if constexpr (kDsMla) {  // columns 64j + 16c.. share the scale of tile j / 2
          const uint32_t sc = scale2[n][j / 2 < kLatent / kDsMlaTile ? j / 2 : 0];  // (j < 8 here)
          lo = make_uint4(mul_elems<kElem>(lo.x, sc), mul_elems<kElem>(lo.y, sc),
                          mul_elems<kElem>(lo.z, sc), mul_elems<kElem>(lo.w, sc));
          hi = make_uint4(mul_elems<kElem>(hi.x, sc), mul_elems<kElem>(hi.y, sc),
                          mul_elems<kElem>(hi.z, sc), mul_elems<kElem>(hi.w, sc));
        }
        if (!kFp8Order && j < kLatent / 64) {
          *reinterpret_cast<uint4*>(v_row[n] + 2 * (64 * j + 16 * t.c)) = lo;
          *reinterpret_cast<uint4*>(v_row[n] + 2 * (64 * j + 16 * t.c) + 16) = hi;
        }
        b[n][0] = lo.x, b[n][1] = lo.y, b[n][2] = lo.z, b[n][3] = lo.w;
        b[n][4] = hi.x, b[n][5] = hi.y, b[n][6] = hi.z, b[n][7] = hi.w;
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      mma_16816<kElem>(acc[0][s & 1], q[4 * jj + s], b[0][2 * s], b[0][2 * s + 1]);
      mma_16816<kElem>(acc[1][s & 1], q[4 * jj + s], b[1][2 * s], b[1][2 * s + 1]);
    }
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) nan[n] = (nan_bits[n] & 0x80808080u) != 0;
}

// This column half's base-2 partial logits of the 16 rows x this warp's 16 tokens into `scores`
// (the half's [16][kScoreStride] array): -inf where the token is masked or not visible to the
// row (in both halves, so their sum is -inf, whatever the data), NaN where visible and lanes
// 4i..4i + 3 of nan_lanes[n] flag the n-block's token i (qk_tile_raw).
// The logits are stored by position (kOrder: the lane's logit pair of positions 2c, 2c + 1 holds
// tokens ordered_token of those).
template <TokenOrder kOrder = TokenOrder::kNatural>
__device__ __forceinline__ void write_logits(const Lane& t, const float (&acc)[2][2][4],
                                             const uint32_t (&nan_lanes)[2],
                                             const int64_t* rows, int64_t tile_first,
                                             float logit_scale, float* scores) {
  // Row g + 8h sees the tile's tokens [0, seen[h]): 32-bit compares per logit instead of 64-bit.
  int seen[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) seen[h] = int(min64(max64(t.visible[h] - tile_first, 0), kTileTokens));
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int position = t.group * kTokensPerGroup + 8 * n + 2 * t.c;
    int token[2];  // of the lane's logits e = 0, 1 (positions position + e)
    bool loaded[2], nan[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      token[e] = t.group * kTokensPerGroup + ordered_token<kOrder>(8 * n + 2 * t.c + e);
      // A row is -1 (masked) or a row index: its sign is its high word's (little-endian words).
      loaded[e] = reinterpret_cast<const int32_t*>(rows + token[e])[1] >= 0;
      nan[e] = ((nan_lanes[n] >> (8 * t.c + 4 * e)) & 0xFu) != 0;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * h + e;
        const bool live = loaded[e] && token[e] < seen[h];
        const float logit = (acc[n][0][i] + acc[n][1][i]) * logit_scale;
        v[e] = !live ? -INFINITY : nan[e] ? NAN : logit;
      }
      *reinterpret_cast<float2*>(scores + (t.g + 8 * h) * kScoreStride + position) = make_float2(v[0], v[1]);
    }
  }
}

// ---- Softmax: warp w owns rows 2w and 2w + 1 of the tile ----
//
// Lane l takes row 2w + l / 16, tokens 4 (l % 16) .. + 3: it adds the two halves' partial logits,
// the 16 lanes of the row agree on its maximum, and the lane writes its 4 probabilities, in the
// MMA element type, to the P tile (row r at p_tile + r * kPRowBytes, 64 elements; with the 16-bit
// cache that is over the row's logits), and lane 0 of the row its rescaling factor (alpha). Each
// row's softmax is computed once, not by every warp (which had put 8 x 32 exp2 per tile on the
// critical path).

// Running softmax state of this lane's row (the max identical in its 16 lanes; each lane sums its
// own tokens).
struct RowState {
  float max = -INFINITY;
  float sum = 0.0f;
};

// Shared per-row values: the tile's alpha while the tiles run, then the row's max and sum.
struct RowStats {
  float alpha[kTileRows];
  float max[kTileRows], sum[kTileRows];
};

__device__ __forceinline__ int softmax_row(const Lane& t) { return 2 * t.warp + t.lane / 16; }

// The online softmax's step for this lane's row over the tile: its 4 probabilities (positions
// 4 (lane % 16) ..) into e, the row's state updated; returns the row's alpha.
__device__ __forceinline__ float online_softmax(const Lane& t, const float* scores, RowState& state, float (&e)[4]) {
  static_assert(kWarps * 2 == kTileRows && kTileTokens == 16 * 4, "2 rows per warp, 4 tokens per lane");
  const float* logits = scores + softmax_row(t) * kScoreStride + 4 * (t.lane % 16);
  const float4 a = *reinterpret_cast<const float4*>(logits);
  const float4 b = *reinterpret_cast<const float4*>(logits + kTileRows * kScoreStride);
  const float logit[4] = {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w};
  // fmaxf skips NaN: a NaN logit propagates through its p.
  float tile_max = fmaxf(fmaxf(logit[0], logit[1]), fmaxf(logit[2], logit[3]));
#pragma unroll
  for (int m = 8; m > 0; m /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, m));
  const float new_max = fmaxf(state.max, tile_max);
  // A row that has seen nothing yet keeps p = 0 (exp2(-inf - 0)), never -inf - -inf.
  const float offset = new_max == -INFINITY ? 0.0f : new_max;
  const float alpha = exp2f(state.max - offset);
  state.max = new_max;
#pragma unroll
  for (int i = 0; i < 4; ++i) e[i] = exp2f(logit[i] - offset);
  state.sum = state.sum * alpha + ((e[0] + e[1]) + (e[2] + e[3]));
  return alpha;
}

// Returns the row's alpha.
template <ActType kElem, int kPRowBytes, bool kPOverLogits = true>
__device__ __forceinline__ float softmax_rows(const Lane& t, const float* scores, uint8_t* p_tile, RowState& state,
                                              RowStats& stats) {
  const int row = softmax_row(t), token = 4 * (t.lane % 16);
  float e[4];
  const float alpha = online_softmax(t, scores, state, e);
  if constexpr (kPOverLogits) __syncwarp();  // every lane of the row has read its logits before P overwrites them
  *reinterpret_cast<uint2*>(p_tile + row * kPRowBytes + 2 * token) =
      make_uint2(pack_elems<kElem>(e[0], e[1]), pack_elems<kElem>(e[2], e[3]));
  if (t.lane % 16 == 0) stats.alpha[row] = alpha;
  return alpha;
}

// After the loop: the row's max and sum (its 16 lanes' sums) to the shared stats.
__device__ __forceinline__ void publish_row_state(const Lane& t, const RowState& state, RowStats& stats) {
  float sum = state.sum;
#pragma unroll
  for (int m = 8; m > 0; m /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, m);
  if (t.lane % 16 == 0) stats.max[softmax_row(t)] = state.max, stats.sum[softmax_row(t)] = sum;
}

// The P tile's A fragments of the P.V MMA (p[k] for tokens [16k, 16k + 16)).
template <int kPRowBytes>
__device__ __forceinline__ void load_p_fragments(const Lane& t, const uint8_t* p_tile, uint32_t (&p)[kPvSteps][4]) {
  const uint32_t addr = smem_addr(p_tile) + ((t.lane & 7) + ((t.lane >> 3) & 1) * 8) * kPRowBytes + (t.lane >> 4) * 16;
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k) ldmatrix_x4(p[k], addr + k * 32);
}

// The V tile of P.V: the swizzled 16-bit tile itself, or a 1-byte format's converted tile of
// kVRow-byte rows. Byte offset of 16-byte piece `piece` (of the 64 latent pieces) of token `row`;
// a row 8 tokens further is 8 * kRowStride bytes further (the swizzle depends on row % 8 only).
template <bool kSwizzled, int kVRow>
struct VTile {
  static constexpr int kRowStride = kSwizzled ? 128 : kVRow;
  static __device__ __forceinline__ int offset(int row, int piece) {
    return kSwizzled ? swizzled_offset(row, piece) : row * kVRow + piece * 16;
  }
};

// Tokens [lo, hi) of the tile (tile-relative) are seen by some rows of the CTA and not by others.
// Their values are added here, in float32, to the rows that see them (p from the P tile, as the
// MMA would take it), then zeroed in this warp's columns of the V tile so that the MMA adds nothing for
// them (each warp reads only its own columns of V after the logits are complete).
template <ActType kElem, int kPRowBytes, typename V>
__device__ void add_partly_seen(const Lane& t, int lo, int hi, int64_t tile_first,
                                const uint8_t* p_tile, uint8_t* kv,
                                float (&out)[kOutBlocks][4]) {
  constexpr int kPieces = kColsPerWarp / 8;  // this warp's 16-byte pieces of a row
  for (int token = lo; token < hi; ++token) {
    bool seen[2];
    float p[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      seen[h] = tile_first + token < t.visible[h];
      p[h] = elem_to_f32<kElem>(reinterpret_cast<const uint16_t*>(p_tile + (t.g + 8 * h) * kPRowBytes)[token]);
    }
#pragma unroll
    for (int n = 0; n < kOutBlocks; ++n) {
      const uint32_t pair =
          *reinterpret_cast<const uint32_t*>(kv + V::offset(token, t.warp * kPieces + n) + 4 * t.c);
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
  static_assert(kPieces * 4 == 32, "a lane zeroes 4 bytes of the warp's columns");
  for (int token = lo; token < hi; ++token)
    *reinterpret_cast<uint32_t*>(kv + V::offset(token, t.warp * kPieces + t.lane / 4) + 4 * (t.lane % 4)) = 0;
  __syncwarp();
}

// out[16 x this warp's 64 columns] += P[16 x 64] V[64 x 64].
template <ActType kElem, typename V>
__device__ __forceinline__ void pv_accumulate(const Lane& t, const uint32_t (&p)[kPvSteps][4],
                                              const uint8_t* kv, float (&out)[kOutBlocks][4]) {
  // Transposed matrices (tokens 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of each
  // 16-token x 16-column block: b0, b1 of n-block 2j, then of n-block 2j + 1.
  const int row = (t.lane & 7) + ((t.lane >> 3) & 1) * 8;
  uint32_t v_addr[kOutBlocks / 2];
#pragma unroll
  for (int j = 0; j < kOutBlocks / 2; ++j)
    v_addr[j] = smem_addr(kv) + V::offset(row, t.warp * (kColsPerWarp / 8) + 2 * j + (t.lane >> 4));
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k)
#pragma unroll
    for (int j = 0; j < kOutBlocks / 2; ++j) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_addr[j] + k * 16 * V::kRowStride);
      mma_16816<kElem>(out[2 * j], p[k], vb[0], vb[1]);
      mma_16816<kElem>(out[2 * j + 1], p[k], vb[2], vb[3]);
    }
}

// The CTA's 16 normalized output rows, to out/lse (one split) or to the split's partial. The
// fragments scatter each row over 8 warps, so they go through shared memory (`staging`, free once
// the tiles are done) and leave as whole 16-byte pieces of consecutive columns: stored straight
// from the fragments, the 8 rows of each store instruction touched 8 lines, and at B = 1 (one
// tile per CTA) that took as long as the tile (2.3 us).
constexpr int kStagingStride = kLatent + 8;  // floats per staged row (float2 writes of 8 rows: 2-way)

// Output columns [col, col + 8) of query row r of sequence b, in out's dtype.
__device__ __forceinline__ void store_out8(const DecodeAttention& a, int64_t b, int64_t r, int col, const float (&v)[8]) {
  store16(static_cast<uint16_t*>(a.out) + (b * a.rows() + r) * kLatent + col, narrow8(a.act == ActType::kBF16, v));
}

// Output columns [col, col + 8) of query row r of the CTA's sequence, from 8 staged floats
// (16-byte aligned): to out in its dtype (one split), or to the CTA's partial slot (Work::slot).
__device__ __forceinline__ void store_out_piece(const DecodeAttention& a, const Work& w, int64_t r, int col,
                                                const float* staged) {
  const float4 lo = *reinterpret_cast<const float4*>(staged);
  const float4 hi = *reinterpret_cast<const float4*>(staged + 4);
  if (w.slot < 0) {
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    store_out8(a, w.b, r, col, v);
  } else {
    float4* part = reinterpret_cast<float4*>(a.partial(w.slot, w.b, r) + col);
    part[0] = lo, part[1] = hi;
  }
}

// Rows [0, kRows) of the CTA's staging (kStagingStride floats apart) to out or the CTA's partial
// slot, a piece of 8 values a step over kThreads threads; rows from `rows` on are padding (last),
// not stored.
template <int kRows, int kThreads>
__device__ __forceinline__ void store_staged_rows(const DecodeAttention& a, const Work& w, int64_t rows,
                                                  const float* staging, int tid) {
  constexpr int kPieces = kLatent / 8;  // 8 values (16 bytes out, 32 bytes partial) per piece
  for (int i = tid; i < kRows * kPieces; i += kThreads) {
    const int row = i / kPieces, col = 8 * (i % kPieces);
    const int64_t r = w.row0 + row;
    if (r >= rows) break;
    store_out_piece(a, w, r, col, staging + row * kStagingStride + col);
  }
}

// The lse (natural log) of query row r of the CTA's sequence: to lse, or to its partial slot.
__device__ __forceinline__ void store_lse(const DecodeAttention& a, const Work& w, int64_t r, float lse) {
  if (w.slot < 0) a.lse[w.b * a.rows() + r] = lse;
  else *a.partial_lse(w.slot, w.b, r) = lse;
}

// kFp8Columns: the fragments of fp8_attention_kernel's P.V, whose out[i][2h + e] is column 16c + 8e + i
// of the warp's 64 (else out[n][2h + e] is column 8n + 2c + e).
template <bool kFp8Columns = false>
__device__ __forceinline__ void write_rows(const DecodeAttention& a, const Work& w, const Lane& t,
                                           const Scales& scales, const RowStats& stats,
                                           const float (&out)[kOutBlocks][4], float* staging) {
  const int64_t rows = a.rows();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = t.g + 8 * h;
    const float sum = stats.sum[row];
    const bool empty = sum == 0.0f;  // saw no visible unmasked token; a NaN sum is not empty
    const float norm = empty ? 0.0f : scales.out / sum;
    float* dst = staging + row * kStagingStride + t.warp * kColsPerWarp;
    if constexpr (kFp8Columns) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int i = 0; i < kOutBlocks; i += 4)
          *reinterpret_cast<float4*>(dst + 16 * t.c + 8 * e + i) =
              empty ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                    : make_float4(out[i][2 * h + e] * norm, out[i + 1][2 * h + e] * norm,
                                  out[i + 2][2 * h + e] * norm, out[i + 3][2 * h + e] * norm);
    } else {
#pragma unroll
      for (int n = 0; n < kOutBlocks; ++n)
        *reinterpret_cast<float2*>(dst + 2 * t.c + 8 * n) =
            empty ? make_float2(0.0f, 0.0f) : make_float2(out[n][2 * h] * norm, out[n][2 * h + 1] * norm);
    }
    const int64_t r = w.row0 + row;
    if (t.warp == 0 && t.c == 0 && r < rows) {
      const float lse = empty ? -INFINITY : (stats.max[row] + log2f(sum)) * kLn2;
      store_lse(a, w, r, lse);
    }
  }
  __syncthreads();
  store_staged_rows<kTileRows, kThreads>(a, w, rows, staging, int(threadIdx.x));
}

}  // namespace
}  // namespace jax_kimi_mla
