// mla_decode_attention on the GPU: flash-decoding (split-KV) on tensor cores (mma.sync, or wgmma in
// the sm_90a kernels).
//
// At most two launches per call, no allocation, no host synchronization, so XLA can capture it
// in a CUDA graph:
//
// 1. attention_kernel, grid (num_splits, ceil(S_q*H / 16), B folded into grid z), sm_90+. A CTA
//    of 8 warps takes 16 query rows of one sequence (rows past S_q*H are zero padding, never
//    stored) and the tokens of its split, in 64-token tiles:
//    - The 16 x 576 query tile goes to shared memory once, in the MMA element type (bf16, or f16
//      when q and the cache values are all exact in f16: f16 q over an f16 or plain fp8 cache, and
//      E4M3 q, which always comes with the plain fp8 cache; E4M3 q codes become exact values),
//      and from there into registers: each warp holds the A fragments of its column half for the
//      whole split (72-80 registers), so Q is never re-read per tile.
//    - Cache rows stream through shared stages (3 for a 16-bit cache, 2 for the 1-byte ones) by
//      TMA copies that complete on one mbarrier per stage: each token is addressed through its
//      block id, so any block size works, and the next tiles are in flight while tile i is
//      computed. The cache rows of a tile's tokens are looked up a stage count of tiles ahead
//      and kept in a small table in shared memory, off the critical path.
//      A masked or out-of-range token reads nothing (or what a box brings is overwritten): its
//      shared row is zero-filled and its logits are -inf.
//    - A 16-bit cache lands by 2D tensor-map boxes (host-built TileMaps) in nine 64-column chunks
//      of 64 rows x 128 bytes, 128-byte swizzled, so that ldmatrix reads it conflict-free: 9
//      boxes of 64 rows when the tile's 64 rows are consecutive in the cache, else 9 boxes of 16
//      rows per 16-token group of consecutive rows (block sizes that are multiples of 16), plain
//      loads for any other group. The number of copies had bounded the tile when each row was
//      its own copy (64 per tile). The Q tile lives in the third stage until the first tile lands
//      there (three 72 KB stages fit only so).
//    - A plain fp8 or fp8_ds_mla cache lands raw (rows as in the cache, so a run of consecutive
//      rows is one bulk copy), 2 stages, and is never converted by a pass of its own: QK^T reads
//      the raw codes into registers with 16-byte shared loads (qk_tile_raw; the K columns a lane
//      holds are not the ones the m16n8k16 B fragment names, so Q is stored with its columns
//      permuted to match, see mma_column), converts them there, and stores the 512 latent values
//      once, converted, to a V tile (two, by tile parity) that P.V reads with ldmatrix as for
//      bf16. The conversion thus interleaves with the MMAs of the same warp, and the converted
//      tile is written once.
//      Conversion: on sm_89+ with f16 elements the hardware cvt.rn.f16x2.e4m3x2 (exact, NaN
//      kept); otherwise (bf16 elements) E4M3 codes become exact values by bit placement and one
//      multiply by a power of two, with NaN codes tracked by a cheap or-ed flag that makes the
//      token's logits NaN (no branch in the loop). ds_mla codes are then multiplied by their tile
//      scale (exact for the power-of-two scales the writer produces), ds_mla k_pe is used as
//      bf16. The plain fp8 scales never enter the loop: logits are multiplied by softmax_scale /
//      (q_scale_inv * cache_scale_inv), the output by 1 / cache_scale_inv.
//    - QK^T: warp w takes token group w % 4 (16 tokens, two n-blocks) over column half w / 4
//      (k-steps [0, 18) | [18, 36) for 16-bit caches; 64-column blocks [0, 4) | [4, 9) for the
//      1-byte ones, so that each half converts four latent blocks) with mma.sync m16n8k16,
//      float32, four independent accumulator chains. Each half writes its partial logits
//      (scaled, and -inf where the token is masked or unseen, in both halves) to its own
//      16 x 64 array; the softmax adds the two.
//    - Online softmax in base 2 (logits pre-multiplied by log2 e, exp2f): warp w owns rows 2w and
//      2w + 1 (16 lanes a row, 4 tokens a lane), adds the two partial arrays, and writes the
//      row's probabilities in the MMA element type over its logits (the P tile) and its rescaling
//      factor to shared memory; the row's max and sum stay in its lanes until the end.
//    - P.V: warp w owns output columns [64w, 64w + 64): O[16 x 64] += P[16 x 64] V[64 x 64], V
//      being the first 512 columns of the 16-bit tile or the converted V tile (transposed
//      ldmatrix), P read from the P tile with ldmatrix.
//    - Barriers per tile. 1-byte formats, pipelined (two): P.V of tile i - 1 and QK^T of tile i
//      share one interval (its V tile and P tile are not the ones QK^T writes), then the logits
//      and V tile are complete; the softmax, then the P tile is complete. 16-bit cache (three:
//      its V tile is the stage, and P lies over the logits): P.V of tile i - 1, then tile i has
//      landed; QK^T; the softmax.
//    - End: one split writes out (rounded to the output dtype) and lse directly; several splits
//      each write their partial (512 normalized floats and the natural-log lse; -inf and zeros
//      for a row that saw no token of the split). The rows leave through shared memory, in whole
//      16-byte pieces. A CTA whose split starts at or past the length returns at once (the
//      combine reads only the live splits).
//    - The prologue is a chain of global latencies (length, block table, first tile) that a
//      one-tile CTA (B = 1) mostly waits on: the query's loads are in flight with the lookups,
//      and the first copies are issued before the query tile is written.
//    Why 8 warps and 64-token tiles: shared memory allows one CTA per SM, and with 4 warps (one
//    per scheduler) the kernel was bound by instruction latency; 8 warps halve each warp's share
//    of the conversion and P.V (+20%). 4 warps x 32-token tiles at 2 CTAs per SM measured slower,
//    and so did 16 warps for plain fp8 (271 against 232 us: each warp's fixed per-tile work, about
//    300 instructions, doubled with the warps).
// 1b. fp8_attention_kernel (the default for the plain fp8 cache under an E4M3 query at S_q = 1),
//    in place of attention_kernel: the same CTA and phases, but P.V reads the raw codes and
//    converts them in registers, so no converted V tile is written or read (its section below).
// 1c. wide_attention_kernel (the default for a 16-bit cache at S_q = 1 with many query rows, on
//    sm_90): 64 rows a CTA on wgmma, the query tile resident in shared memory, so that a tile is
//    read and multiplied once per 64 heads instead of 16 (its section below).
// 1d. rs_attention_kernel (the default for fp8_ds_mla at S_q = 1 on sm_90 from 4 tiles a split):
//    the tokens as M of wgmma with the A operand converted in registers by each consumer thread,
//    two warpgroups on alternate tiles (its section below). H200, B 64 x 16k: 205 us (79%). With
//    2-8 splits, a sequence's splits are one thread block cluster and merge there (no combine).
// 2. combine_kernel (num_splits > 1, unless merged in a cluster), one CTA per (row, sequence),
//    16 warps when the rows are fewer than twice the SMs (a row's splits loaded in one round; a
//    row's columns in 2 or 4 CTAs where the SMs outnumber the rows that much), else 4: the live
//    splits merged with weights exp(lse_s - max lse); empty (-inf) splits are skipped and their
//    outputs never read; a NaN lse makes the row NaN.
//
// Numerics of the edges: a row that sees no visible unmasked token gets zeros and lse -inf (no
// -inf - -inf, no division by 0); a NaN in a visible token reaches that row's output and lse; a
// token a row does not see never reaches that row, even holding NaN. With S_q > 1, the rows of a
// CTA may see different lengths: the at most S_q - 1 tokens that some of its rows see and others
// do not are left out of the P.V MMA (0 * NaN would reach the rows that do not see them) and
// added in float32 to the rows that see them.
//
// Shared memory per CTA (1 CTA per SM): bf16/f16 cache 232,192 B (3 swizzled stages, Q in the
// last), plain fp8 219,648 B (2 raw stages, 2 V tiles with Q in the second, a P tile),
// fp8_ds_mla 229,888 B. That fits sm_90 (232,448 B per block); the host refuses GPUs below sm_90
// (A100: 163 KB, and no TMA) with an error naming the reference.
//
// History and measurements (H200): docs/DECODE_ATTENTION.md. At H = 12, B = 64, context 16k
// (bench_attention.py, 2026-12-02): bf16 312 us (91% of the copy ceiling), plain fp8 197 us (72%,
// fp8_attention_kernel), fp8_ds_mla 295 us (55%; 205 us, 79%, with rs_attention_kernel, 2026-12-03). Every format is bound by the latency of a
// tile's chain of dependent instructions in one warp (1.7-2.4 us per tile), which bf16's bytes
// nearly match and the 1-byte formats' do not: with the whole context in L2 they run no faster,
// and one barrier a tile instead of two ran slower (Thirteenth round). The split count is the
// caller's choice: one CTA per SM, so num_splits * ceil(S_q*H / 16) * B should reach the SM count.
// Two opt-in kernels that stayed slower than the defaults were retired on 2026-12-04 (fp8_ds_mla on
// f16 mma.sync with the tile scales out of the MMAs, and the 1-byte formats on wgmma fed by
// converter warps); docs/DECODE_ATTENTION.md keeps their rounds and the commit that last held them.
#include <cuda.h>  // CUtensorMap (the driver is reached through the runtime: no link to libcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "jax_kimi_mla/decode_attention.h"
#include "sm90_copy.cuh"
#include "sm90_wgmma.cuh"

// Phase stamps of attention_kernel, fp8_attention_kernel and rs_attention_kernel, for
// benchmarks/probes/decode_attention.cu built with -DJKM_PHASE_STAMPS (which defines these to
// record a CTA's timeline and CTA 0's tiles); nothing otherwise. Points: 0 entry, 1 the first
// tiles' rows looked up, 2 the prologue done, 3 the first tile landed (JKM_TILE_AT(0)), 4 the
// loop left, 5 the output rows staged, 6 exit.
#ifndef JKM_PHASE_AT
#define JKM_PHASE_AT(point)
#define JKM_TILE_AT(tile)
#endif

namespace jax_kimi_mla {
namespace {

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
// stream serialization (unless JAX_KIMI_MLA_DECODE_PDL=0): it may start while the attention kernel
// before it runs, once every CTA of that kernel has started and let it (each does so at its
// entry), and it waits for the whole attention grid, its memory writes included, before it reads
// anything that grid wrote. Its launch and its CTAs' start thus overlap the attention kernel's
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

// The work of split `split` of sequence b (len tokens) for the CTA whose first row is row0: its
// first token, where its loads end (at most `visible`, the last token any of its rows sees) and its
// tiles. One division: the bounds follow from the split's size. A split at or past the length
// (first >= len) has no tiles.
__device__ __forceinline__ Work split_work(const DecodeAttention& a, int64_t b, int64_t row0, int64_t split,
                                           int64_t len, int64_t visible) {
  Work w;
  w.b = b, w.row0 = row0;
  const int64_t split_tokens = a.split_tokens(len);
  w.first = split * split_tokens;
  w.load_end = min64(min64(w.first + split_tokens, len), visible);
  w.n_tiles = w.load_end > w.first ? (w.load_end - w.first + kTileTokens - 1) / kTileTokens : 0;
  w.slot = a.num_splits == 1 ? -1 : int(split);
  return w;
}

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

// The 16-bit cache as 2D tensors of 576 columns x (num_blocks * block_size) rows (row stride
// row_bytes, so padded rows too), read in 64-column boxes of 64 rows (a whole tile of consecutive
// rows) or of 16 rows (a token group), 128-byte swizzled. Built by the host per call; unused (and
// zero) for the 1-byte formats.
struct TileMaps {
  CUtensorMap tile, group;
};

// At the kernel's start, off the prologue's chain: the first copies then find the descriptors
// cached (a one-tile CTA at B = 1 otherwise waits for their fetch).
__device__ __forceinline__ void prefetch_tile_maps(const TileMaps& maps) {
  if (threadIdx.x == 0) prefetch_tensor_map(&maps.tile);
  if (threadIdx.x == 32) prefetch_tensor_map(&maps.group);
}

// Byte offset of 16-byte piece `piece` (of 72) of row `row` in a swizzled 16-bit tile.
__device__ __forceinline__ int swizzled_offset(int row, int piece) {
  return (piece >> 3) * kChunkBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4);
}

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

// Warp 0 issues a 16-bit tile (lane l: tokens l and l + 32; rows[t] the cache row of token t or
// -1). A tile of 64 consecutive rows is 9 boxes of 64 rows (lanes 0-8, a chunk each). Otherwise a
// 16-token group whose live tokens are a run of consecutive rows from its first token is 9 boxes
// of 16 rows; a group with any other live pattern (a block size below 16, masked block ids in the
// middle) is read with plain loads by the whole warp, before the arrivals. The rows of masked
// tokens are left to zero_rows: a box lands whatever rows follow a run (garbage, NaN), and the
// CTA zeroes them once the tile has landed, before any warp reads it. Each lane arrives once.
__device__ void issue_swizzled_tile(const DecodeAttention& a, const TileMaps& maps, const int64_t* rows,
                                    uint8_t* stage, uint64_t* bar, uint64_t* zero_rows) {
  const int lane = int(threadIdx.x);
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
      for (int i = lane; i < kBoxRows * kEntry / 8; i += 32) {
        const int t = kBoxRows * q + i / (kEntry / 8), piece = i % (kEntry / 8);
        if (rows[t] >= 0)
          *reinterpret_cast<uint4*>(stage + swizzled_offset(t, piece)) =
              __ldg(reinterpret_cast<const uint4*>(a.cache + rows[t] * a.row_bytes) + piece);
      }
    }
    if (loaded != 0) fence_proxy_async();  // before a later box lands on these bytes
  }
  if (lane == 0) *zero_rows = ~live;
  constexpr int kChunks = kEntry / 64;
  if (lane < kChunks) {
    uint8_t* chunk = stage + lane * kChunkBytes;
    if (whole) {
      mbarrier_arrive_expect_bytes(bar, kChunkBytes);
      box_copy(chunk, maps.tile, 64 * lane, int(rows[0]), bar);
    } else {
      mbarrier_arrive_expect_bytes(bar, uint32_t(__popc(boxed)) * kBoxRows * 128);
      for (uint32_t m = boxed; m != 0; m &= m - 1) {
        const int q = __ffs(int(m)) - 1;
        box_copy(chunk + q * kBoxRows * 128, maps.group, 64 * lane, int(rows[kBoxRows * q]), bar);
      }
    }
  } else {
    mbarrier_arrive(bar);
  }
}

// After a 16-bit tile has landed: zero the rows of its masked tokens (every thread a share of
// their 128-byte chunk rows), before the barrier that lets the warps read it.
__device__ __forceinline__ void zero_masked_rows(uint64_t mask, uint8_t* stage) {
  if (mask == 0) return;
  for (int i = int(threadIdx.x); i < kTileTokens * (kEntry / 64); i += kThreads) {
    const int t = i % kTileTokens, chunk = i / kTileTokens;
    if ((mask >> t) & 1) {
      uint4* dst = reinterpret_cast<uint4*>(stage + chunk * kChunkBytes + t * 128);
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = make_uint4(0, 0, 0, 0);
    }
  }
  fence_proxy_async();  // before a later box lands on these bytes
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
  constexpr int kPieces = kLatent / 8;  // 8 values (16 bytes out, 32 bytes partial) per piece
  for (int i = int(threadIdx.x); i < kTileRows * kPieces; i += kThreads) {
    const int row = i / kPieces, col = 8 * (i % kPieces);
    const int64_t r = w.row0 + row;
    if (r >= rows) break;  // padding rows are last
    store_out_piece(a, w, r, col, staging + row * kStagingStride + col);
  }
}

// One CTA's work for sequence b. Block-uniform control flow throughout (barriers inside).
template <CacheFormat kFormat, ActType kElem>
__device__ void attend(const DecodeAttention& a, const TileMaps& maps, int64_t b, const Scales& scales,
                       uint8_t* smem) {
  using L = Layout<kFormat>;
  using V = VTile<L::kSwizzled, L::kVRowBytes>;
  const int64_t rows = a.rows(), len = a.context_len(b);
  // Rows are (query token, head): the first row of the CTA sees the fewest tokens, its last real
  // row the most; no row sees tokens past seen_by_any, so those are not loaded.
  const int64_t row0 = int64_t(blockIdx.y) * kTileRows;
  const int64_t last_row = min64(row0 + kTileRows, rows) - 1;
  const int64_t seen_by_all = a.row_visible_len(len, row0);
  const int64_t seen_by_any = a.row_visible_len(len, last_row);
  const Work w = split_work(a, b, row0, blockIdx.x, len, seen_by_any);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  Lane t;
  t.warp = int(threadIdx.x) / 32, t.lane = int(threadIdx.x) % 32;
  t.g = t.lane / 4, t.c = t.lane % 4;
  t.half = t.warp / kTokenGroups, t.group = t.warp % kTokenGroups;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // padding rows see as much as the last real row
    const int64_t r = w.row0 + t.g + 8 * h;
    t.visible[h] = r < rows ? a.row_visible_len(len, r) : seen_by_any;
  }

  constexpr int kStages = L::kStages;
  uint8_t* q_tile = smem + L::kQ;
  float* scores = reinterpret_cast<float*>(smem + L::kScores);
  uint8_t* p_tile = smem + L::kP;
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);  // [tile % kStages][token]
  uint8_t* raw = smem + L::kRaw;
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kZeroRows);   // [kStages] (16-bit)
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);  // [kStages]
  // The tile whose rows are in slot s goes to stage s: warp 0 issues a swizzled tile, threads 0-63
  // a raw one; they are the arrivals the stage's mbarrier counts.
  const auto issue = [&](int s) {
    uint8_t* stage = raw + s * L::kRawTileBytes;
    if constexpr (L::kSwizzled) {
      if (t.warp == 0) issue_swizzled_tile(a, maps, tile_rows + s * kTileTokens, stage, stage_full + s, zero_rows + s);
    } else {
      if (threadIdx.x < kTileTokens)
        issue_raw_tile<kFormat>(a, tile_rows[s * kTileTokens + threadIdx.x], stage, stage_full + s);
    }
  };
  // The V tile of P.V for the tile in slot s: the stage itself (16-bit), or the converted tile
  // that QK^T of that tile wrote (1-byte; two, by tile parity).
  const auto v_tile = [&](int64_t tile, int s) {
    return L::kConverts ? smem + L::kVTile + int(tile & 1) * L::kVTileBytes : raw + s * L::kRawTileBytes;
  };

  // The prologue: the query's loads in flight with the lookups, the first copies issued before
  // the query tile is written (they land elsewhere).
  __syncthreads();  // this CTA's previous sequence is done with the shared memory
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(stage_full + s, L::kSwizzled ? 32 : kTileTokens);
    mbarrier_init_fence();
  }
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<kElem>(a, b, w.row0, q_fetched);
  if (threadIdx.x < kStages * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  JKM_PHASE_AT(1);
  // In flight before the loop: every stage when pipelined, else all but the one Q lies in.
  constexpr int kFirstIssued = L::kPipelined ? kStages : kStages - 1;
#pragma unroll
  for (int s = 0; s < kFirstIssued; ++s)
    if (s < w.n_tiles) issue(s);
  store_q<kFormat, kElem>(a, q_fetched, q_tile);
  if constexpr (L::kSwizzled) fence_proxy_async();  // Q lies in the last stage, where a tile lands later
  __syncthreads();  // the query tile is complete
  // Column half 0 takes k-steps [0, kHalfStep), half 1 the rest (warp-uniform branches).
  constexpr int kHalfStep = L::kHalfStep, kHalfBlock = kHalfStep / 4;
  uint32_t q[L::kQSteps][4];
  if (t.half == 0)
    load_q_fragments<0, kHalfStep>(t, q_tile, q);
  else
    load_q_fragments<kHalfStep, kQkSteps - kHalfStep>(t, q_tile, q);
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  JKM_PHASE_AT(2);

  float out[kOutBlocks][4] = {};
  RowState state;  // of row softmax_row(t)
  RowStats& stats = *reinterpret_cast<RowStats*>(smem + L::kStats);
  // out += P V of tile `tile` (slot s), after its softmax: rescale by its alphas, then the MMAs.
  const auto accumulate_pv = [&](int64_t tile, int s) {
#pragma unroll
    for (int n = 0; n < kOutBlocks; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[n][i] *= stats.alpha[t.g + 8 * (i >> 1)];
    uint32_t p[kPvSteps][4];
    load_p_fragments<L::kPRowBytes>(t, p_tile, p);
    uint8_t* kv = v_tile(tile, s);
    const int64_t tile_first = w.first + tile * kTileTokens;
    const int64_t partly_lo = max64(seen_by_all, tile_first);
    const int64_t partly_hi = min64(seen_by_any, tile_first + kTileTokens);
    if (partly_lo < partly_hi)
      add_partly_seen<kElem, L::kPRowBytes, V>(t, int(partly_lo - tile_first), int(partly_hi - tile_first),
                                               tile_first, p_tile, kv, out);
    pv_accumulate<kElem, V>(t, p, kv, out);
  };

  // Warps 2-3 look the rows of later tiles up (thread 64 + i: token i), warps 0-1 issue the tiles:
  // both are per-tile extras on the critical path of whichever warps carry them, so they are
  // spread, and (pipelined) kept out of the softmax interval, which every warp spends alike.
  const int lookup_token = int(threadIdx.x) - kTileTokens;
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  // Tile i: [P.V of tile i - 1] QK^T of tile i | barrier | softmax of tile i | barrier. Not
  // pipelined, a barrier also separates P.V of tile i - 1 from QK^T of tile i.
  int slot = 0;  // tile % kStages: its stage and its entries
  for (int64_t tile = 0;; ++tile) {
    const int prev = slot == 0 ? kStages - 1 : slot - 1;  // the slot of tile - 1
    // Pipelined, tile - 1 + kStages goes to the stage of tile - 1, which QK^T has converted.
    if constexpr (L::kPipelined)
      if (tile > 0 && tile - 1 + kStages < w.n_tiles) issue(prev);
    if (tile > 0) accumulate_pv(tile - 1, prev);
    if (tile == w.n_tiles) break;
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    JKM_TILE_AT(tile);
    parity ^= 1u << slot;
    uint8_t* stage = raw + slot * L::kRawTileBytes;
    if constexpr (!L::kPipelined) {  // the 16-bit cache
      zero_masked_rows(zero_rows[slot], stage);
      __syncthreads();  // tile has landed, and every warp is done with tile - 1 (its stage, P)
      // Tile + kStages - 1 goes to the stage of tile - 1.
      if (tile + kStages - 1 < w.n_tiles) issue(prev);
    }
    // The rows of tile + kStages, looked up now so that their latency hides behind this tile's
    // math.
    const int64_t row_ahead = looks_up ? tile_token_row(a, w, tile + kStages, lookup_token) : -1;
    float acc[2][2][4] = {};
    uint32_t nan_lanes[2] = {0, 0};
    if constexpr (L::kConverts) {
      static_assert(kHalfStep % 4 == 0, "1-byte halves split at a 64-column block");
      uint8_t* kv = v_tile(tile, slot);
      bool nan[2];
      if (t.half == 0)
        qk_tile_raw<kFormat, kElem, 0, kHalfBlock>(t, q, stage, kv, acc, nan);
      else
        qk_tile_raw<kFormat, kElem, kHalfBlock, kEntry / 64 - kHalfBlock>(t, q, stage, kv, acc, nan);
      nan_lanes[0] = __ballot_sync(0xFFFFFFFFu, nan[0]);
      nan_lanes[1] = __ballot_sync(0xFFFFFFFFu, nan[1]);
    } else {
      if (t.half == 0)
        qk_tile<kElem, 0, kHalfStep>(t, q, stage, acc);
      else
        qk_tile<kElem, kHalfStep, kQkSteps - kHalfStep>(t, q, stage, acc);
    }
    write_logits(t, acc, nan_lanes, tile_rows + slot * kTileTokens, w.first + tile * kTileTokens, scales.logit,
                 scores + t.half * kTileRows * kScoreStride);
    // The 16 x 64 logits (and a 1-byte format's V tile) are complete; every warp is done with
    // P.V of tile - 1 and with this tile's raw stage and rows.
    __syncthreads();
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    softmax_rows<kElem, L::kPRowBytes>(t, scores, p_tile, state, stats);
    __syncthreads();  // the P tile and the rows' alphas are complete
    slot = slot + 1 == kStages ? 0 : slot + 1;
  }
  JKM_PHASE_AT(4);
  publish_row_state(t, state, stats);
  __syncthreads();
  JKM_PHASE_AT(5);
  static_assert(L::kStages * L::kRawTileBytes >= kTileRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the tiles' stages");
  write_rows(a, w, t, scales, stats, out, reinterpret_cast<float*>(smem + L::kRaw));
}

template <CacheFormat kFormat, ActType kElem>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    attention_kernel(const DecodeAttention a, const __grid_constant__ TileMaps maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  if constexpr (Layout<kFormat>::kSwizzled) prefetch_tile_maps(maps);
  const Scales scales = load_scales<kFormat>(a);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) attend<kFormat, kElem>(a, maps, b, scales, smem);
  JKM_PHASE_AT(6);
}

// ---- The plain fp8 cache under an E4M3 query: P.V from the raw tile, no converted tile ----
//
// fp8_attention_kernel takes attention_kernel's place for plain fp8 with an E4M3 mqa_q at S_q = 1
// (every row sees the whole length). The CTA, its 16 rows, the split, QK^T (qk_tile_raw, f16
// elements), the softmax and the output are attention_kernel's; what differs is that no tile is
// ever converted into shared memory:
// - P.V reads the raw codes: lane (g, c) of warp w loads 8 bytes of each of its 4 tokens of a
//   k-step (columns 64w + 8g .. + 7), pairs the tokens' bytes (prmt) and converts the pairs to
//   f16 (cvt.rn.f16x2.e4m3x2, exact, NaN kept): n-block i of the warp is columns 64w + 8g + i,
//   over g. The output store undoes that order (write_rows<true>). The latent is converted twice
//   (by QK^T and by P.V), in registers, instead of written and read back as 16-bit values: a
//   third of the shared-memory traffic, and no converted tile for P.V to wait on.
// - So a stage stays live until P.V of its tile is done: 4 raw stages (147 KB), the next tile
//   issued two tiles ahead, at the top of the iteration (out of the softmax interval).
// - Token order: position kk of a 16-token group holds token fp8_token(kk) = kk ^ ((kk >> 1) & 1),
//   so that the 8 lanes of every 16-byte QK^T load (tokens 0, 1 | 3, 2 | 4, 5 | 7, 6) and the 4
//   tokens of every P.V load split evenly between the two 64-byte halves of a bank row (576-byte
//   rows are 64 mod 128): QK^T's loads are conflict-free, P.V's 2-way (the least 8-byte loads of
//   4 tokens at the same columns allow). A lane's logits of a pair are then tokens (2c, 2c + 1) or
//   (2c + 1, 2c) (write_logits<TokenOrder::kFp8>).
// - P.V of tile i - 1 runs before QK^T of tile i, at the top of the iteration: moved into the
//   softmax interval of tile i (after the softmax, P tiles and alphas by tile parity) it ran
//   220 us against 213 (2026-12-02).
// (mma.sync with E4M3 operands, m16n8k32, is no faster on sm_90: ptxas lowers it to these same
// conversions and two f16 MMAs, and then converts Q again on every tile; measured, 2026-12-02.)
constexpr int kRawStages = 4;
constexpr int kRawPRowBytes = 2 * kTileTokens + 16;      // a P tile's rows, 16-byte skewed
constexpr int kRawPBytes = kTileRows * kRawPRowBytes;    // one P tile

#if !JKM_HARDWARE_FP8
// Without the instruction (numerics.h), the kernels that convert by it still compile but are never
// launched (kFp8KernelBuilt).
template <int kHalf>
__device__ __forceinline__ uint32_t e4m3x2_half_to_f16x2(uint32_t x) {
  __trap();
  return x;
}
#endif

// out[16 x this warp's 64 columns] += P[16 x 64] V[64 x 64], V the codes of a raw tile of
// kEntryBytes rows (the comment above): k-step k, B rows 2c, 2c + 1, 2c + 8, 2c + 9 are tokens
// 16k + ordered_token<kOrder> of those.
template <int kEntryBytes, TokenOrder kOrder>
__device__ __forceinline__ void pv_accumulate_fp8(const Lane& t, const uint32_t (&p)[kPvSteps][4], const uint8_t* raw,
                                                  float (&out)[kOutBlocks][4]) {
  const uint8_t* base = raw + kColsPerWarp * t.warp + 8 * t.g;
  const int kk[4] = {2 * t.c, 2 * t.c + 1, 2 * t.c + 8, 2 * t.c + 9};
#pragma unroll
  for (int k = 0; k < kPvSteps; ++k) {
    uint2 w[4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
      w[x] = *reinterpret_cast<const uint2*>(base + (16 * k + ordered_token<kOrder>(kk[x])) * kEntryBytes);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // columns 8g + 4h .. + 3: n-blocks 4h .. 4h + 3
      const uint32_t r0 = h ? w[0].y : w[0].x, r1 = h ? w[1].y : w[1].x;
      const uint32_t r2 = h ? w[2].y : w[2].x, r3 = h ? w[3].y : w[3].x;
      // Bytes (r0 i, r1 i, r0 i + 1, r1 i + 1): the B pairs of columns i and i + 1.
      const uint32_t b0[2] = {__byte_perm(r0, r1, 0x5140), __byte_perm(r0, r1, 0x7362)};
      const uint32_t b1[2] = {__byte_perm(r2, r3, 0x5140), __byte_perm(r2, r3, 0x7362)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t v0 = i & 1 ? e4m3x2_half_to_f16x2<1>(b0[i >> 1]) : e4m3x2_half_to_f16x2<0>(b0[i >> 1]);
        const uint32_t v1 = i & 1 ? e4m3x2_half_to_f16x2<1>(b1[i >> 1]) : e4m3x2_half_to_f16x2<0>(b1[i >> 1]);
        mma_16816<ActType::kF16>(out[4 * h + i], p[k], v0, v1);
      }
    }
  }
}

// ---- fp8_attention_kernel's loop ----

// The per-row values: the softmax's, the alphas by tile parity (P.V of tile i - 1 reads its alphas
// while the softmax of tile i writes its own).
struct Fp8Stats {
  RowStats by_parity[2];  // the rows' max and sum at the end in by_parity[0]
};

// Where everything lives in dynamic shared memory: kRawStages raw stages, the logits, the P tiles
// by tile parity, the tiles' rows, the mbarriers, the per-row values, the query tile.
struct Fp8Layout {
  static constexpr int kStageBytes = kTileTokens * kEntry;
  static constexpr int kRaw = 0;                                                  // [kRawStages][64][kEntry]
  static constexpr int kScores = kRaw + kRawStages * kStageBytes;                 // float [half][16][kScoreStride]
  static constexpr int kP = kScores + kColumnHalves * kTileRows * kScoreStride * 4;  // [parity][16][kRawPRowBytes]
  static constexpr int kEntries = kP + 2 * kRawPBytes;                            // int64 [kRawStages][64]
  static constexpr int kBarriers = kEntries + kRawStages * kTileTokens * 8;       // uint64 [kRawStages]
  static constexpr int kStats = kBarriers + 8 * kRawStages;                       // Fp8Stats
  static constexpr int kQ = kStats + (int(sizeof(Fp8Stats)) + 15) / 16 * 16;     // [16][kRowBytes]
  static constexpr int kBytes = kQ + kTileRows * kRowBytes;
  static_assert(kStageBytes % 16 == 0 && kScores % 16 == 0 && kP % 16 == 0 && kEntries % 16 == 0 && kQ % 16 == 0);
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
  static_assert(kThreads >= kRawStages * kTileTokens, "the prologue gives one thread to each token");
  static_assert(kRawStages * kStageBytes >= kTileRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the stages");
};

// One CTA's work for sequence b at S_q = 1 (attend's CTA and split). Tile i: P.V of tile i - 1,
// QK^T of tile i | barrier | softmax of tile i | barrier; tile i + 2 issued at the top, into the
// stage of tile i - 2. The P tiles and the rows' alphas are kept by tile parity, so that P.V reads
// tile i - 1's while the softmax writes tile i's.
__device__ void attend_fp8(const DecodeAttention& a, int64_t b, const Scales& scales, uint8_t* smem) {
  using L = Fp8Layout;
  constexpr CacheFormat kFormat = CacheFormat::kFp8;
  const int64_t len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(blockIdx.y) * kTileRows, blockIdx.x, len, len);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  Lane t;
  t.warp = int(threadIdx.x) / 32, t.lane = int(threadIdx.x) % 32;
  t.g = t.lane / 4, t.c = t.lane % 4;
  t.half = t.warp / kTokenGroups, t.group = t.warp % kTokenGroups;
  t.visible[0] = t.visible[1] = len;  // S_q = 1: every row sees the whole length

  uint8_t* raw = smem + L::kRaw;
  uint8_t* q_tile = smem + L::kQ;
  float* scores = reinterpret_cast<float*>(smem + L::kScores);
  uint8_t* p_tiles = smem + L::kP;
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);  // [tile % kRawStages][token]
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  Fp8Stats& stats = *reinterpret_cast<Fp8Stats*>(smem + L::kStats);
  const auto stage = [&](int s) { return raw + s * L::kStageBytes; };
  const auto issue = [&](int s) {  // threads 0-63: the tile whose rows are in slot s, to stage s
    if (threadIdx.x < kTileTokens)
      issue_raw_tile<kFormat>(a, tile_rows[s * kTileTokens + threadIdx.x], stage(s), stage_full + s);
  };

  __syncthreads();  // this CTA's previous sequence is done with the shared memory
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRawStages; ++s) mbarrier_init(stage_full + s, kTileTokens);
    mbarrier_init_fence();
  }
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<ActType::kF16>(a, b, w.row0, q_fetched);
  if (threadIdx.x < kRawStages * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  JKM_PHASE_AT(1);
#pragma unroll
  for (int s = 0; s < kRawStages; ++s)
    if (s < w.n_tiles) issue(s);
  store_q<kFormat, ActType::kF16>(a, q_fetched, q_tile);
  __syncthreads();  // the query tile is complete
  using QL = Layout<kFormat>;  // its column halves and Q fragments are attention_kernel's
  constexpr int kHalfBlock = QL::kHalfStep / 4;
  uint32_t q[QL::kQSteps][4];
  if (t.half == 0)
    load_q_fragments<0, QL::kHalfStep>(t, q_tile, q);
  else
    load_q_fragments<QL::kHalfStep, kQkSteps - QL::kHalfStep>(t, q_tile, q);
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  JKM_PHASE_AT(2);

  float out[kOutBlocks][4] = {};
  RowState state;  // of row softmax_row(t)
  const int lookup_token = int(threadIdx.x) - kTileTokens;  // warps 2-3 look the rows of later tiles up
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  int slot = 0;  // tile % kRawStages
  bool rescale = false;  // some row's alpha of the last tile is not 1 (a NaN one is not 1)
  // out += P V of tile `done` (in stage `done_slot`), after out *= its rows' alphas unless all are 1.
  const auto pv = [&](int64_t done, int done_slot) {
    const int done_parity = int(done & 1);
    if (rescale) {
      const float* alphas = stats.by_parity[done_parity].alpha;
      const float alpha[2] = {alphas[t.g], alphas[t.g + 8]};
#pragma unroll
      for (int n = 0; n < kOutBlocks; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[n][i] *= alpha[i >> 1];
    }
    uint32_t p[kPvSteps][4];
    load_p_fragments<kRawPRowBytes>(t, p_tiles + done_parity * kRawPBytes, p);
    pv_accumulate_fp8<kEntry, TokenOrder::kFp8>(t, p, stage(done_slot), out);
  };
  for (int64_t tile = 0;; ++tile) {
    const int prev = (slot + kRawStages - 1) % kRawStages, before = (slot + kRawStages - 2) % kRawStages;
    // Tile + 2 goes to the stage of tile - 2, whose P.V ended before the last barrier.
    if (tile >= 2 && tile + 2 < w.n_tiles) issue(before);
    if (tile > 0) pv(tile - 1, prev);
    if (tile == w.n_tiles) break;
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    JKM_TILE_AT(tile);
    parity ^= 1u << slot;
    const int64_t row_ahead = looks_up ? tile_token_row(a, w, tile + kRawStages, lookup_token) : -1;
    float logits[2][2][4] = {};
    bool nan[2];  // unused: the f16 conversion keeps NaN
    if (t.half == 0)
      qk_tile_raw<kFormat, ActType::kF16, 0, kHalfBlock, QL::kQSteps, true>(t, q, stage(slot), nullptr, logits, nan);
    else
      qk_tile_raw<kFormat, ActType::kF16, kHalfBlock, kEntry / 64 - kHalfBlock, QL::kQSteps, true>(
          t, q, stage(slot), nullptr, logits, nan);
    const uint32_t no_nan[2] = {0, 0};  // the f16 conversion keeps NaN
    write_logits<TokenOrder::kFp8>(t, logits, no_nan, tile_rows + slot * kTileTokens, w.first + tile * kTileTokens,
                                   scales.logit, scores + t.half * kTileRows * kScoreStride);
    __syncthreads();  // the logits are complete
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    const int p_parity = int(tile & 1);
    const bool changed = softmax_rows<ActType::kF16, kRawPRowBytes, false>(
                             t, scores, p_tiles + p_parity * kRawPBytes, state, stats.by_parity[p_parity]) != 1.0f;
    rescale = __syncthreads_or(changed);  // the P tile and the rows' alphas are complete
    slot = slot + 1 == kRawStages ? 0 : slot + 1;
  }
  JKM_PHASE_AT(4);
  publish_row_state(t, state, stats.by_parity[0]);
  __syncthreads();
  JKM_PHASE_AT(5);
  write_rows<true>(a, w, t, scales, stats.by_parity[0], out, reinterpret_cast<float*>(raw));
}

__global__ void __launch_bounds__(kThreads, 1) fp8_attention_kernel(const DecodeAttention a) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  const Scales scales = load_scales<CacheFormat::kFp8>(a);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) attend_fp8(a, b, scales, smem);
  JKM_PHASE_AT(6);
}

// ---- rs_attention_kernel (fp8_ds_mla at S_q = 1, sm_90a): the tokens as M, A from registers ----
//
// 256 threads, one CTA per SM, grid and partials as attention_kernel's. The two warpgroups take
// alternate 64-token tiles of the split from a ring of kRsStages raw stages (tile i in stage
// i % kRsStages, so each stage serves one warpgroup), each warpgroup with its own softmax state;
// the two states merge at the end as two splits would. Once a warpgroup has read tile i into
// registers, its warps 0-1 (one thread a token) issue tile i + kRsStages into that stage, whose
// rows they looked up during tile i. No producer warp: a ninth warp would cap a thread at 168
// registers (3 warps on one scheduler's register file), and this loop needs about 190.
// Per tile, a warpgroup (warp w, g = lane / 4, c = lane % 4):
// - S^T = K Q^T with wgmma m64n16k16 (M: the 64 tokens, N: the 16 query rows). The latent: 32
//   k-steps of f16, A = the E4M3 codes of a thread's two tokens (rs_token), 16-byte shared loads
//   converted in registers (cvt.rn.f16x2.e4m3x2, exact), one accumulator per 128-column scale
//   tile, its scale applied to the partial logits in float32; k_pe: 4 bf16 k-steps, A = the raw
//   bf16 values. B = the query tile in shared memory (f16 latent with a per-row power-of-two
//   prescale; bf16 k_pe), 128-byte swizzled, its columns permuted to the
//   order in which the A fragments hold them (rs_q_kstep). So Q takes no registers, and no
//   converted K or V tile goes through shared memory (the traffic that bounded an earlier wgmma
//   kernel with converter warps: docs/DECODE_ATTENTION.md, Ninth and Tenth rounds).
// - Softmax against a reference per query row that the warpgroup shares (base 2; p = 2^(logit -
//   ref) in float32): a tile whose logits plus log2 of their token's largest scale all stay within
//   kRsSlack of it needs one named barrier (an OR vote, which also publishes P'); otherwise the
//   warpgroup reduces the tile's largest such value, moves the reference there, rescales out and
//   the sums, and writes P' again (rare after the first tiles). So p s_t <= 2^kRsSlack in f16 for
//   any scale. The sums are each thread's own until the end.
// - P'_t^T = p x s_t (the token's scale of scale tile t) in f16, one 16 x 64 tile per scale tile.
// - O^T += V^T P'_t^T: 8 M-blocks of 64 latent columns (blocks 2t, 2t + 1 inside scale tile t:
//   rs_column) x 4 k-steps of 16 tokens, A = the codes of a thread's 4 tokens x 4 columns
//   (32-bit loads, paired by prmt, converted in registers).
// The tile's rows are read conflict-free: for S^T a quarter-warp's two tokens are 4 rows apart
// (656 = 16 mod 128), for P.V a k-step's four lanes' tokens are 2 rows apart. ptxas keeps the
// wgmmas asynchronous only with wgmma.wait_group 0 between groups (a deeper pipeline serializes
// them: C7513/C7514), so each group's conversion overlaps the previous group's MMAs.
// Probe: benchmarks/probes/ds_rs_tile_loop.cu (the loop without paging: 1.40 us a tile from HBM
// against attention_kernel's 2.38 on the H200). History: docs/DECODE_ATTENTION.md, Sixteenth round.
constexpr int kRsGroups = 2;
constexpr int kRsStages = 4;
constexpr int kRsMinSplitTiles = 4;  // the default from this many tiles a split (choose_kernel)
constexpr float kRsSlack = 8.0f;  // log2 units: P' values up to 2^8 before the reference moves
constexpr int kScaleTiles = kLatent / kDsMlaTile;  // 4
static_assert(kRsGroups * 128 == kThreads && kScaleTiles == 4 && kTileRows == 16);

// The query prescale: the latent q meets the codes in f16 MMAs, so each query row is stored times
// a power of two 2^-k that puts its largest latent value in [2^14, 2^15) (exact for every value
// within 2^29 of it), and its logits are multiplied back by 2^k.
struct QPrescale {
  float q_unscale[kTileRows];  // 2^k: the row's latent q was stored times 2^-k
  int q_max_bits[kTileRows];   // the row's largest |latent q| (float bits), for the prescale
};

// Element `half` of a pair of q (f16 or bf16), as a float.
__device__ __forceinline__ float chunk_elem(const DecodeAttention& a, uint32_t word, int half) {
  const uint16_t h = uint16_t(word >> (16 * half));
  return a.q_type == QType::kF16 ? __half2float(__ushort_as_half(h)) : bf16_to_f32(h);
}

// The largest |latent q| of each row among fetch_q's chunks, into stats.q_max_bits (zeroed before).
__device__ __forceinline__ void q_row_max_bits(const DecodeAttention& a, const uint4 (&fetched)[kQChunksPerThread],
                                               QPrescale& stats) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow;
    if (c >= kQChunks) break;
    if (c - r * kChunksPerRow >= kLatent / 8) continue;  // k_pe: no prescale
    const uint32_t words[4] = {fetched[i].x, fetched[i].y, fetched[i].z, fetched[i].w};
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(chunk_elem(a, words[j / 2], j % 2)));  // NaN skipped
    atomicMax(&stats.q_max_bits[r], __float_as_int(m));  // nonnegative floats order as their bits
  }
}

// The exponent field of a nonnegative float (0 for zero and subnormals, 255 for NaN).
__device__ __forceinline__ uint32_t exponent_of(float x) { return (__float_as_uint(x) >> 23) & 0xFFu; }

struct RsLayout {
  static constexpr int kStageBytes = kTileTokens * kDsMlaEntryBytes;            // 41,984
  static constexpr int kRaw = 0;                                                // [kRsStages][64][656]
  static constexpr int kQ = kRaw + kRsStages * kStageBytes;                     // 8 x [16][128 B] f16, swizzled
  static constexpr int kQpe = kQ + kLatent / 64 * kTileRows * 128;              // [16][128 B] bf16, swizzled
  static constexpr int kP = kQpe + kTileRows * 128;                             // [group][scale tile][16][128 B]
  static constexpr int kMax = kP + kRsGroups * kScaleTiles * kTileRows * 128;   // float [group][warp][16]
  static constexpr int kRef = kMax + kRsGroups * 4 * kTileRows * 4;             // float [group][16]: the end's max
  static constexpr int kMasks = kRef + kRsGroups * kTileRows * 4;               // uint32 [stage][2]: live tokens
  static constexpr int kBarriers = kMasks + kRsStages * 8;                      // uint64 full[stages], empty[stages]
  static constexpr int kStats = kBarriers + 2 * kRsStages * 8;                  // QPrescale
  static constexpr int kLse = kStats + (int(sizeof(QPrescale)) + 15) / 16 * 16; // float [16]: a cluster's rows
  static constexpr int kBytes = kLse + kTileRows * 4;
  // At the end, over the stages: the staged output rows, and warpgroup 1's out; over the P tiles,
  // a cluster merge's weights.
  static constexpr int kExchange = kStageBytes;
  static_assert(kStageBytes % 1024 == 0 && kQ % 1024 == 0 && kQpe % 1024 == 0 && kP % 1024 == 0);
  static_assert(kTileRows * kStagingStride * 4 <= kExchange && kExchange + 64 * 128 * 4 <= kQ);
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
};

// The token of S^T's M row 16w + g + 8h: rows g and g + 1 of a quarter-warp 4 tokens apart.
__host__ __device__ constexpr int rs_token(int w, int g, int h) { return 16 * w + 8 * h + (g >> 1) + 4 * (g & 1); }
// The latent column of P.V's M row 16w + g + 8h of block mb: blocks 2t, 2t + 1 in scale tile t,
// a thread's 4 columns of a scale tile one 32-bit word.
__host__ __device__ constexpr int rs_column(int mb, int w, int g, int h) {
  return 128 * (mb >> 1) + 32 * w + 4 * g + 2 * (mb & 1) + h;
}
// The query row of accumulator element k = 2 (x >> 2) + (x & 1) of lane column c.
__device__ __forceinline__ int rs_row(int k, int c) { return 8 * (k >> 1) + 2 * c + (k & 1); }
// Where the query tile holds latent column col: the A fragments of k-step 4G + j take the codes
// 64G + 16c + 4j + [0, 4) of a token, as (2c, 2c + 1) and (2c + 8, 2c + 9); the k_pe k-step
// 2h + kk takes k_pe columns 32h + 8c + 4kk + [0, 4) as (2c, 2c + 1), (2c + 8, 2c + 9).
__host__ __device__ constexpr int rs_q_kstep(int col) {
  const int G = col / 64, c = col % 64 / 16, j = col % 16 / 4, i = col % 4;
  return 16 * (4 * G + j) + 2 * c + (i & 1) + 8 * (i >> 1);
}
__host__ __device__ constexpr int rs_qpe_kstep(int col) {
  const int h = col / 32, c = col % 32 / 8, kk = col % 8 / 4, f = col % 4 / 2, e = col % 2;
  return 16 * (2 * h + kk) + 2 * c + 8 * f + e;
}

// The query tile from fetch_q's chunks: latent as f16 times the row's prescale, k_pe as bf16.
__device__ __forceinline__ void rs_store_q(const DecodeAttention& a, const uint4 (&fetched)[kQChunksPerThread],
                                           const QPrescale& stats, uint8_t* q_tile, uint8_t* qpe_tile) {
  constexpr int kChunksPerRow = kEntry / 8;
#pragma unroll
  for (int i = 0; i < kQChunksPerThread; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, r = c / kChunksPerRow, chunk = c - r * kChunksPerRow;
    if (c >= kQChunks) break;
    const uint32_t words[4] = {fetched[i].x, fetched[i].y, fetched[i].z, fetched[i].w};
    if (chunk < kLatent / 8) {
      const float prescale = 1.0f / stats.q_unscale[r];  // a power of two: exact
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = rs_q_kstep(8 * chunk + 2 * j);
        *reinterpret_cast<uint32_t*>(q_tile + swizzled_piece(r, k / 8, kTileRows) + 2 * (k % 8)) =
            pack_elems<ActType::kF16>(chunk_elem(a, words[j], 0) * prescale, chunk_elem(a, words[j], 1) * prescale);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = rs_qpe_kstep(8 * (chunk - kLatent / 8) + 2 * j);
        *reinterpret_cast<uint32_t*>(qpe_tile + swizzled_piece(r, k / 8, kTileRows) + 2 * (k % 8)) =
            a.q_type == QType::kF16 ? pack_elems<ActType::kBF16>(chunk_elem(a, words[j], 0), chunk_elem(a, words[j], 1))
                                    : words[j];
      }
    }
  }
}

// One warpgroup's softmax state and out^T (o[mb][x]: M row 16w + g + 8 ((x >> 1) & 1) of block
// mb, query row rs_row(k, c), k = 2 (x >> 2) + (x & 1)).
struct RsState {
  float o[8][8];
  float ref[4], sum[4];  // per query row k: the reference max (log2 units), this thread's sum
};

// The splits of a sequence launched as one thread block cluster (rank = split) merge there instead
// of in combine_kernel. Each CTA has staged its split's rows (normalized, float32, kStagingStride
// apart) and their lse (-inf: empty or not a live split, rows of zeros). CTA k then merges output
// pieces k, k + n, ... of every row over the cluster's n CTAs, with combine_kernel's weights
// (exp(lse_s - max lse) over the non-empty splits; a NaN lse makes the row NaN), and writes them;
// rank 0 writes the lse. weights: [kTileRows][kMaxClusterSplits] floats of this CTA's.
constexpr int kMaxClusterSplits = 8;  // a portable cluster size

__device__ void merge_cluster_splits(const DecodeAttention& a, int64_t b, int64_t row0, const float* staging,
                                     const float* row_lse, float* weights) {
  const int n = int(cluster_size()), me = int(cluster_rank()), tid = int(threadIdx.x);
  const int rows = int(min64(a.rows() - row0, kTileRows));
  cluster_sync();  // every split's rows and lse are staged
  if (tid < rows) {
    float lse[kMaxClusterSplits], m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      lse[j] = j < n ? cluster_load(cluster_addr(row_lse + tid, j)) : -INFINITY;
      m = fmaxf(m, lse[j]);  // skips NaN: a NaN lse propagates through its weight
    }
    float weight[kMaxClusterSplits], sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      weight[j] = lse[j] == -INFINITY ? 0.0f : expf(lse[j] - m);
      sum += weight[j];
    }
    const bool empty = sum == 0.0f;  // no split saw a token (a NaN sum is not empty)
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) weights[tid * kMaxClusterSplits + j] = empty ? 0.0f : weight[j] / sum;
    if (me == 0) a.lse[b * a.rows() + row0 + tid] = empty ? -INFINITY : m + logf(sum);
  }
  __syncthreads();
  constexpr int kPieces = kLatent / 8;
  const int mine = (kPieces - me + n - 1) / n;
  for (int i = tid; i < rows * mine; i += int(blockDim.x)) {
    const int row = i / mine, col = 8 * (me + n * (i % mine));
    float v[8] = {};
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j >= n) break;
      const float w = weights[row * kMaxClusterSplits + j];
      const uint32_t src = cluster_addr(staging + row * kStagingStride + col, j);
      const float4 lo = cluster_load4(src), hi = cluster_load4(src + 16);
      const float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = fmaf(w, x[e], v[e]);
    }
    store_out8(a, b, row0 + row, col, v);
  }
  cluster_sync();  // the other CTAs are done reading this one's rows
}

__device__ __forceinline__ void attend_rs(const DecodeAttention& a, int64_t b, const Scales& scales, uint8_t* smem) {
  using L = RsLayout;
  constexpr int kEntryBytes = kDsMlaEntryBytes;
  const int64_t len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(blockIdx.y) * kTileRows, blockIdx.x, len, len);
  // A split past the length: the combine skips it; in a cluster it stages empty rows for the merge.
  const bool in_cluster = cluster_size() > 1;
  if (a.num_splits > 1 && w.first >= len && !in_cluster) return;

  uint8_t* raw = smem + L::kRaw;
  uint8_t* q_tile = smem + L::kQ;
  uint8_t* qpe_tile = smem + L::kQpe;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + L::kMasks);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kRsStages;
  QPrescale& stats = *reinterpret_cast<QPrescale*>(smem + L::kStats);
  const auto stage = [&](int s) { return raw + s * L::kStageBytes; };
  const int tid = int(threadIdx.x), warp = uniform_warp_index(), lane = tid % 32;
  const int group = warp / 4, wq = warp % 4, g = lane / 4, c = lane % 4, gtid = tid % 128;
  // Warps 0-1 of a warpgroup (thread `token`) issue a tile: its live tokens' mask, then the copies.
  const auto issue = [&](int s, int64_t row, int token) {
    const uint32_t live = __ballot_sync(0xFFFFFFFFu, row >= 0);
    if (lane == 0) masks[2 * s + token / 32] = live;
    issue_raw_tile<CacheFormat::kFp8DsMla>(a, row, stage(s), full + s, token);
  };

  __syncthreads();  // this CTA's previous sequence is done with the shared memory
  if (tid == 0) {
    for (int s = 0; s < kRsStages; ++s) mbarrier_init(full + s, kTileTokens), mbarrier_init(empty + s, 128);
    mbarrier_init_fence();
  }
  if (tid < kTileRows) stats.q_max_bits[tid] = 0;
  uint4 q_fetched[kQChunksPerThread];
  fetch_q<ActType::kF16>(a, b, w.row0, q_fetched);
  const int64_t first_row = tile_token_row(a, w, tid / kTileTokens, tid % kTileTokens);
  __syncthreads();  // the mbarriers and the zeroed maxima are ready
  JKM_PHASE_AT(1);
  if (tid / kTileTokens < w.n_tiles) issue(tid / kTileTokens, first_row, tid % kTileTokens);
  q_row_max_bits(a, q_fetched, stats);
  __syncthreads();
  if (tid < kTileRows) {  // the prescale 2^-k puts the row's largest latent value in [2^14, 2^15)
    const uint32_t e = exponent_of(__int_as_float(stats.q_max_bits[tid]));
    stats.q_unscale[tid] = e == 0 || e == 0xFF ? 1.0f : ldexpf(1.0f, max(int(e) - 127 - 14, -126));
  }
  __syncthreads();
  rs_store_q(a, q_fetched, stats, q_tile, qpe_tile);
  fence_proxy_async();  // the query tile is read by wgmma
  __syncthreads();

  uint8_t* p_mine = smem + L::kP + group * kScaleTiles * kTileRows * 128;
  float* max_mine = reinterpret_cast<float*>(smem + L::kMax) + group * 4 * kTileRows;
  const int bar_id = 1 + group;
  const int tok0 = rs_token(wq, g, 0), tok1 = rs_token(wq, g, 1);
  float unscale[4];  // the query rows' prescale, undone on the logits
#pragma unroll
  for (int k = 0; k < 4; ++k) unscale[k] = stats.q_unscale[rs_row(k, c)] * scales.logit;
  RsState st;
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int x = 0; x < 8; ++x) st.o[mb][x] = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) st.ref[k] = -INFINITY, st.sum[k] = 0.0f;
  JKM_PHASE_AT(2);

  for (int64_t i = group; i < w.n_tiles; i += kRsGroups) {
    const int s = int(i % kRsStages);
    const uint8_t* tile = stage(s);
    const bool issues = gtid < kTileTokens && i + kRsStages < w.n_tiles;
    const int64_t next_row = issues ? tile_token_row(a, w, i + kRsStages, gtid) : -1;
    mbarrier_wait(full + s, uint32_t(i / kRsStages) & 1);
    JKM_TILE_AT(i);
    const uint8_t* row0 = tile + tok0 * kEntryBytes;
    const uint8_t* row1 = tile + tok1 * kEntryBytes;
    const uint32_t live = masks[2 * s + wq / 2];
    const bool live0 = (live >> (tok0 % 32)) & 1, live1 = (live >> (tok1 % 32)) & 1;

    // S^T, latent: group G = columns 64G .. 64G + 63, k-steps 4G .. 4G + 3, scale tile G / 2.
    float acc[kScaleTiles][8], acc_pe[8];
    uint32_t frag[2][16];
    uint4 next0 = *reinterpret_cast<const uint4*>(row0 + 16 * c);
    uint4 next1 = *reinterpret_cast<const uint4*>(row1 + 16 * c);
#pragma unroll
    for (int G = 0; G < kLatent / 64; ++G) {
      const uint32_t w0[4] = {next0.x, next0.y, next0.z, next0.w}, w1[4] = {next1.x, next1.y, next1.z, next1.w};
      if (G + 1 < kLatent / 64) {
        next0 = *reinterpret_cast<const uint4*>(row0 + 64 * (G + 1) + 16 * c);
        next1 = *reinterpret_cast<const uint4*>(row1 + 64 * (G + 1) + 16 * c);
      }
      uint32_t(&f)[16] = frag[G & 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        f[4 * j + 0] = e4m3x2_half_to_f16x2<0>(w0[j]);
        f[4 * j + 1] = e4m3x2_half_to_f16x2<0>(w1[j]);
        f[4 * j + 2] = e4m3x2_half_to_f16x2<1>(w0[j]);
        f[4 * j + 3] = e4m3x2_half_to_f16x2<1>(w1[j]);
      }
      if (G >= 1) wgmma_wait<0>();  // group G - 1 done (frag[G & 1] was group G - 2's)
      if (G % 2 == 0) wgmma_fence_after(acc[G / 2]);
      else wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int step = 4 * G + j;
        wgmma_m64n16k16_rs<true>(acc[G / 2], f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3],
                                 swizzled_descriptor(q_tile + step / 4 * kTileRows * 128 + 32 * (step % 4)),
                                 (G & 1) || j);
      }
      wgmma_commit();
    }
    {  // k_pe: 16-byte piece 4h + c of a token's k_pe holds the bf16 pairs of k-steps 2h, 2h + 1
      uint4 pe[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        pe[0][h] = *reinterpret_cast<const uint4*>(row0 + kLatent + 16 + 16 * (4 * h + c));
        pe[1][h] = *reinterpret_cast<const uint4*>(row1 + kLatent + 16 + 16 * (4 * h + c));
      }
      wgmma_fence_after(acc_pe);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wgmma_m64n16k16_rs<false>(acc_pe, pe[0][h].x, pe[1][h].x, pe[0][h].y, pe[1][h].y,
                                  swizzled_descriptor(qpe_tile + 32 * (2 * h)), h);
        wgmma_m64n16k16_rs<false>(acc_pe, pe[0][h].z, pe[1][h].z, pe[0][h].w, pe[1][h].w,
                                  swizzled_descriptor(qpe_tile + 32 * (2 * h + 1)), 1);
      }
      wgmma_commit();
    }
    const float4 sc0 = *reinterpret_cast<const float4*>(row0 + kLatent);
    const float4 sc1 = *reinterpret_cast<const float4*>(row1 + kLatent);
    wgmma_wait<0>();

    // Logits (log2 units; -inf for a masked token or one past the length) and the vote.
    const float tile_scale[2][kScaleTiles] = {{sc0.x, sc0.y, sc0.z, sc0.w}, {sc1.x, sc1.y, sc1.z, sc1.w}};
    // The reference covers logit + log2(the token's largest scale), so that p s_t <= 2^kRsSlack
    // fits f16 whatever the scales (floored: a zero scale must not hide the token's k_pe logit).
    const float top_scale[2] = {__log2f(fmaxf(fmaxf(fmaxf(sc0.x, sc0.y), fmaxf(sc0.z, sc0.w)), 1e-30f)),
                                __log2f(fmaxf(fmaxf(fmaxf(sc1.x, sc1.y), fmaxf(sc1.z, sc1.w)), 1e-30f))};
    float logit[8], reach[8];  // reach: logit + top_scale, what the reference must cover
    bool over = false;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
      float v = 0.0f;
#pragma unroll
      for (int t = 0; t < kScaleTiles; ++t) v = fmaf(tile_scale[h][t], acc[t][x], v);
      v = fmaf(v, unscale[k], acc_pe[x] * scales.logit);
      logit[x] = (h ? live1 : live0) ? v : -INFINITY;
      reach[x] = logit[x] + top_scale[h];
      over |= reach[x] > st.ref[k] + kRsSlack;
    }
    // P'_t^T: (query row n, token m) of scale tile t's P tile at swizzled_piece(n, m / 8) + 2 (m % 8).
    float p[8];
    const auto write_p = [&]() {
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1), m = h ? tok1 : tok0;
        // (a NaN logit while the reference is still -inf must stay NaN: it reaches out and lse)
        p[x] = st.ref[k] != -INFINITY ? exp2f(logit[x] - st.ref[k]) : logit[x] != logit[x] ? logit[x] : 0.0f;
#pragma unroll
        for (int t = 0; t < kScaleTiles; ++t)
          *reinterpret_cast<__half*>(p_mine + t * kTileRows * 128 + swizzled_piece(rs_row(k, c), m / 8, kTileRows) +
                                     2 * (m % 8)) = __float2half_rn(p[x] * tile_scale[h][t]);
      }
      fence_proxy_async();  // P is read by wgmma
    };
    write_p();
    if (named_barrier_or(bar_id, 128, over)) {  // rare: the reference moves to the tile's max
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float v = fmaxf(reach[4 * (k >> 1) + (k & 1)], reach[4 * (k >> 1) + 2 + (k & 1)]);
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 8));
        v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 16));
        if (g == 0) max_mine[wq * kTileRows + rs_row(k, c)] = v;
      }
      named_barrier_sync(bar_id, 128);
      float alpha[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = rs_row(k, c);
        const float m = fmaxf(fmaxf(max_mine[n], max_mine[kTileRows + n]),
                              fmaxf(max_mine[2 * kTileRows + n], max_mine[3 * kTileRows + n]));
        const float ref = fmaxf(st.ref[k], m);
        alpha[k] = ref == -INFINITY ? 1.0f : exp2f(st.ref[k] - ref);
        st.ref[k] = ref;
        st.sum[k] *= alpha[k];
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int x = 0; x < 8; ++x) st.o[mb][x] *= alpha[2 * (x >> 2) + (x & 1)];
      write_p();
      named_barrier_sync(bar_id, 128);  // P is complete; the maxima may be written again
    }
#pragma unroll
    for (int x = 0; x < 8; ++x) st.sum[2 * (x >> 2) + (x & 1)] += p[x];

    // O^T += V^T P'^T: k-step ks takes tokens 16 ks + 2c + e + 8f; a thread's column word of
    // scale tile t is at 128t + 32w + 4g (byte 2v + h: block 2t + v, row half h).
    uint32_t vfrag[2][8][4];
#pragma unroll
    for (int ks = 0; ks < kTileTokens / 16; ++ks) {
      uint32_t v[kScaleTiles][2][2];  // [scale tile][e][f]
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const uint8_t* row = tile + (16 * ks + 2 * c + e + 8 * f) * kEntryBytes + 32 * wq + 4 * g;
#pragma unroll
          for (int t = 0; t < kScaleTiles; ++t) v[t][e][f] = *reinterpret_cast<const uint32_t*>(row + 128 * t);
        }
      uint32_t(&f)[8][4] = vfrag[ks & 1];
#pragma unroll
      for (int t = 0; t < kScaleTiles; ++t)
#pragma unroll
        for (int hv = 0; hv < 2; ++hv) {
          const uint32_t sel = hv ? 0x7362u : 0x5140u;  // bytes 2hv, 2hv + 1 of the e = 0 and e = 1 tokens
          const uint32_t lo = __byte_perm(v[t][0][0], v[t][1][0], sel), hi = __byte_perm(v[t][0][1], v[t][1][1], sel);
          f[2 * t + hv][0] = e4m3x2_half_to_f16x2<0>(lo);
          f[2 * t + hv][1] = e4m3x2_half_to_f16x2<1>(lo);
          f[2 * t + hv][2] = e4m3x2_half_to_f16x2<0>(hi);
          f[2 * t + hv][3] = e4m3x2_half_to_f16x2<1>(hi);
        }
      if (ks >= 1) wgmma_wait<0>();
      if (ks == 0) wgmma_fence_after(st.o);
      else wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
        wgmma_m64n16k16_rs<true>(st.o[mb], f[mb][0], f[mb][1], f[mb][2], f[mb][3],
                                 swizzled_descriptor(p_mine + (mb / 2) * kTileRows * 128 + 32 * ks), 1);
      wgmma_commit();
    }
    mbarrier_arrive(empty + s);  // the stage is read (into registers): tile i + kRsStages may land there
    if (issues) {
      mbarrier_wait(empty + s, uint32_t(i / kRsStages) & 1);
      issue(s, next_row, gtid);
    }
    // P.V's last group runs under the copies' issue; waiting for it at the next tile's top instead
    // makes ptxas serialize the wgmmas (C7515).
    wgmma_wait<0>();
  }
  wgmma_wait<0>();
  JKM_PHASE_AT(4);

  // The warpgroups' states meet: each its sums per row, warpgroup 1 its out; warpgroup 0 merges.
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v = st.sum[k];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
    if (g == 0) max_mine[wq * kTileRows + rs_row(k, c)] = v;  // now the warps' sums
    if (wq == 0 && g == 0) reinterpret_cast<float*>(smem + L::kRef)[group * kTileRows + rs_row(k, c)] = st.ref[k];
  }
  float* exchange = reinterpret_cast<float*>(raw + L::kExchange);  // [64][128 threads]
  if (group == 1)
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int x = 0; x < 8; ++x) exchange[(8 * mb + x) * 128 + gtid] = st.o[mb][x];
  __syncthreads();
  float* staging = reinterpret_cast<float*>(raw);
  const int64_t rows = a.rows();
  if (group == 0) {
    const float* sums = reinterpret_cast<const float*>(smem + L::kMax);
    const float* refs = reinterpret_cast<const float*>(smem + L::kRef);
    float f0[4], f1[4], norm[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int n = rs_row(k, c);
      const float m0 = refs[n], m1 = refs[kTileRows + n], m = fmaxf(m0, m1);
      f0[k] = m0 == -INFINITY ? 0.0f : exp2f(m0 - m);
      f1[k] = m1 == -INFINITY ? 0.0f : exp2f(m1 - m);
      float l[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float* s = sums + q * 4 * kTileRows;
        l[q] = s[n] + s[kTileRows + n] + s[2 * kTileRows + n] + s[3 * kTileRows + n];
      }
      const float sum = f0[k] * l[0] + f1[k] * l[1];
      const bool empty_row = sum == 0.0f;  // saw no visible unmasked token; a NaN sum is not empty
      norm[k] = empty_row ? 0.0f : scales.out / sum;
      const int64_t r = w.row0 + n;
      if (wq == 0 && g == 0 && r < rows) {
        const float lse = empty_row ? -INFINITY : (m + log2f(sum)) * kLn2;
        if (in_cluster) reinterpret_cast<float*>(smem + L::kLse)[n] = lse;
        else store_lse(a, w, r, lse);
      }
    }
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        const int h = (x >> 1) & 1, k = 2 * (x >> 2) + (x & 1);
        const float v = norm[k] == 0.0f ? 0.0f : (f0[k] * st.o[mb][x] + f1[k] * exchange[(8 * mb + x) * 128 + gtid]) * norm[k];
        staging[rs_row(k, c) * kStagingStride + rs_column(mb, wq, g, h)] = v;
      }
  }
  __syncthreads();
  JKM_PHASE_AT(5);
  if (in_cluster) {
    merge_cluster_splits(a, w.b, w.row0, staging, reinterpret_cast<const float*>(smem + L::kLse),
                         reinterpret_cast<float*>(smem + L::kP));
    return;
  }
  constexpr int kPieces = kLatent / 8;
  for (int i = tid; i < kTileRows * kPieces; i += kThreads) {
    const int row = i / kPieces, col = 8 * (i % kPieces);
    const int64_t r = w.row0 + row;
    if (r >= rows) break;  // padding rows are last
    store_out_piece(a, w, r, col, staging + row * kStagingStride + col);
  }
}

// One sequence a CTA (grid z = B <= 65535: a loop over sequences, as the other kernels have, makes
// ptxas hoist the loop's invariants and spill).
__global__ void __launch_bounds__(kThreads, 1) rs_attention_kernel(const DecodeAttention a) {
  extern __shared__ __align__(1024) uint8_t smem[];
  JKM_PHASE_AT(0);
  let_dependent_launch_start();
  attend_rs(a, blockIdx.z, load_scales<CacheFormat::kFp8DsMla>(a), smem);
  JKM_PHASE_AT(6);
}

// One CTA per (query row, sequence, column part): out = sum_s w_s o_s / sum_s w_s,
// w_s = exp(lse_s - max lse) over the live splits whose lse is not -inf; lse = max + log(sum w_s).
// At B = 1 the combine is on the critical path of a call, so its loads are few rounds of latency:
// warp w merges splits w, w + kCombineWarps, ... in rounds of kCombineRound splits whose lse and
// outputs are all loaded at once (lane: columns 4 lane + 128 k of the CTA's part), with its own
// running max; the warps' sums then meet, rescaled to the common max, in a fixed order. With few
// rows, a row's 512 columns are split over kColumnParts CTAs, so that more SMs share its loads
// (each part computes the same weights; part 0 writes the lse). An empty (-inf) split is skipped
// and its outputs never enter the sums; a NaN lse makes the row NaN.
constexpr int kCombineRound = 4;

template <int kCombineWarps, int kColumnParts>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const DecodeAttention a) {
  constexpr int kPartColumns = kLatent / kColumnParts;
  constexpr int kLaneChunks = kPartColumns / 128;  // float4 of a lane per split
  static_assert(kLaneChunks >= 1, "a part holds whole 128-column chunks");
  __shared__ __align__(16) float warp_acc[kCombineWarps][kPartColumns];
  __shared__ float warp_weight[kCombineWarps], warp_max[kCombineWarps], warp_factor[kCombineWarps], row_stats[2];
  static_assert(kCombineWarps <= 32, "warp 0 rescales the warps' sums, a lane each");
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t rows = a.rows(), r = blockIdx.x;
  const int first_column = int(blockIdx.z) * kPartColumns;
  wait_for_prior_grid();  // the partials are the attention kernel's
  for (int64_t b = blockIdx.y; b < a.batch; b += gridDim.y) {
    const int64_t len = a.context_len(b);
    float4 acc[kLaneChunks] = {};
    float weight_sum = 0.0f, max_lse = -INFINITY;  // this warp's sums, relative to max_lse
    // A round's loads go out before the live count is known (they do not wait for the length's
    // load): every split's partial exists, and a dead split's values are never used.
    for (int first = warp; first < a.num_splits; first += kCombineWarps * kCombineRound) {
      float4 o[kCombineRound][kLaneChunks];
      float lse[kCombineRound];
#pragma unroll
      for (int i = 0; i < kCombineRound; ++i) {
        const int s = first + i * kCombineWarps;
        lse[i] = s < a.num_splits ? *a.partial_lse(s, b, r) : -INFINITY;
        const float4* part = reinterpret_cast<const float4*>(a.partial(s < a.num_splits ? s : first, b, r) + first_column);
#pragma unroll
        for (int k = 0; k < kLaneChunks; ++k) o[i][k] = part[32 * k + lane];
      }
      const int live = a.live_splits(len);
#pragma unroll
      for (int i = 0; i < kCombineRound; ++i) {
        if (first + i * kCombineWarps >= live || lse[i] == -INFINITY) continue;  // dead, empty, or no such split
        const float new_max = fmaxf(max_lse, lse[i]);  // skips NaN: a NaN lse propagates through its weight
        const float rescale = max_lse == -INFINITY ? 1.0f : expf(max_lse - new_max);
        const float weight = expf(lse[i] - (new_max == -INFINITY ? 0.0f : new_max));
        max_lse = new_max;
        weight_sum = fmaf(weight_sum, rescale, weight);
#pragma unroll
        for (int k = 0; k < kLaneChunks; ++k) {
          acc[k].x = fmaf(weight, o[i][k].x, acc[k].x * rescale);
          acc[k].y = fmaf(weight, o[i][k].y, acc[k].y * rescale);
          acc[k].z = fmaf(weight, o[i][k].z, acc[k].z * rescale);
          acc[k].w = fmaf(weight, o[i][k].w, acc[k].w * rescale);
        }
      }
      if (first + kCombineWarps * kCombineRound >= live) break;  // no live split in later rounds
    }
#pragma unroll
    for (int k = 0; k < kLaneChunks; ++k) reinterpret_cast<float4*>(warp_acc[warp])[32 * k + lane] = acc[k];
    if (lane == 0) warp_weight[warp] = weight_sum, warp_max[warp] = max_lse;
    __syncthreads();

    if (warp == 0) {  // each warp's factor to the row's max, once: lane w < kCombineWarps for warp w
      const float m = lane < kCombineWarps ? warp_max[lane] : -INFINITY;
      float row_max = m;
#pragma unroll
      for (int k = 16; k > 0; k /= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xFFFFFFFFu, row_max, k));
      // A warp that merged no split has zero sums (NaN ones after a NaN lse): any finite factor
      // keeps them so.
      const float factor = m == -INFINITY ? 1.0f : expf(m - row_max);
      float weight = lane < kCombineWarps ? factor * warp_weight[lane] : 0.0f;
      for (int k = 1; k < 32; k *= 2) weight += __shfl_xor_sync(0xFFFFFFFFu, weight, k);  // fixed order
      if (lane < kCombineWarps) warp_factor[lane] = factor;
      if (lane == 0) row_stats[0] = row_max, row_stats[1] = weight;
    }
    __syncthreads();
    const float row_max = row_stats[0], total_weight = row_stats[1];
    const bool empty = total_weight == 0.0f;  // no live split saw a token (NaN is not empty)
    for (int col = 2 * int(threadIdx.x); col < kPartColumns; col += 64 * kCombineWarps) {
      float2 total = make_float2(0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < kCombineWarps; ++w) {
        const float2 pair = *reinterpret_cast<const float2*>(&warp_acc[w][col]);
        total.x = fmaf(warp_factor[w], pair.x, total.x), total.y = fmaf(warp_factor[w], pair.y, total.y);
      }
      const float x0 = empty ? 0.0f : total.x / total_weight, x1 = empty ? 0.0f : total.y / total_weight;
      reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.out) + (b * rows + r) * kLatent)[(first_column + col) / 2] =
          a.act == ActType::kBF16 ? bf16x2(x0, x1) : f16x2(x0, x1);
    }
    if (threadIdx.x == 0 && blockIdx.z == 0)
      a.lse[b * rows + r] = empty ? -INFINITY : (row_max == -INFINITY ? 0.0f : row_max) + logf(total_weight);
    __syncthreads();  // the next sequence's sums go where these were read
  }
}

// ---- Many query rows over a 16-bit cache: 64 rows a CTA on wgmma ----
//
// wide_attention_kernel takes attention_kernel's place for a bf16/f16 cache at S_q = 1 when a
// sequence has many query rows (H >= 64, or H >= 32 from B = 8: DeepSeek's 128 heads without TP
// or 32 at TP 4, Kimi-K3's 96 under data-parallel attention). attention_kernel's 16-row CTAs read
// every tile once per 16 heads and issue 544 mma.sync a tile; here a CTA takes 64 rows, the M of
// wgmma, so a tile is read once per 64 heads and its math is 68 asynchronous wgmma:
// - Two warpgroups, one CTA per SM. The query tile (64 x 576, 72 KB) stays in shared memory for
//   the whole split, in the layout the cache tiles land in (nine 64-column chunks of 64 rows x 128
//   bytes, 128-byte swizzled: the K-major operand layout of wgmma). Two 72 KB stages, landed by
//   issue_swizzled_tile's tensor-map boxes as attention_kernel's; masked rows zeroed.
// - Warpgroup 0: S = Q K^T by 36 wgmma m64n64k16, both operands K-major from shared memory (a
//   k-step is 32 bytes further in the rows of chunk k / 4). The accumulators are the rows' logits
//   (thread: rows 16w + g and + 8 of its warp w, tokens 8j + 2c + {0, 1}); the online softmax runs
//   on them in registers (a row's four lanes are a quad), and P, rounded to the element type, is
//   laid straight into the A fragments of P.V, which it also publishes in shared memory, with the
//   rows' alphas, for warpgroup 1. Warpgroup 1 meanwhile looks the rows of the tile after next up.
// - P.V: warpgroup h takes output columns [256h, 256h + 256), 4 chunks x 4 k-steps of wgmma
//   m64n64k16, A = P from registers, B = the stage's chunk read MN-major (its rows are tokens:
//   16 tokens are 2048 bytes further).
// - Two barriers a tile: (1) P is published; (2) P.V is done, so the stage takes the tile after
//   next at once (one tile in flight while one is computed). A tile with masked rows has a third,
//   after they are zeroed.
// - Measured on the H200 (docs/DECODE_ATTENTION.md, Fourteenth round): B 64 x 8k, H 128, 331 us
//   against attention_kernel's 942 (442 TFLOP/s, 55% of a bf16 matmul). Tried: the logits split
//   between the warpgroups by tokens (m64n32k16 each, the maxima and P exchanged): 354 us, the
//   query tile being read from shared memory twice a tile.
constexpr int kWideRows = 64;            // query rows per CTA: the M of wgmma
// The kernel takes sequences of at least kWideMinRows rows, or of kWideMinRowsBatched in batches of
// kWideMinBatch or more (the same rule: ops.wide_kernel_applies): at 32 heads it is 14-26% faster
// from B = 8 on, and 15% slower at B = 1, context 4096 (docs/DECODE_ATTENTION.md, Fourteenth round).
constexpr int kWideMinRows = 64, kWideMinRowsBatched = 32, kWideMinBatch = 8;
constexpr int kWideThreads = kThreads;   // two warpgroups (issue_swizzled_tile, zero_masked_rows count on 256)
constexpr int kWideGroupChunks = kLatent / 64 / 2;  // P.V: the 64-column output chunks of a warpgroup
static_assert(kWideRows == kTileTokens && kWideThreads == 256, "Q and the tiles share the chunk layout");

struct WideLayout {
  static constexpr int kTileBytes = kEntry / 64 * kChunkBytes;              // 73,728
  static constexpr int kQ = 0;                                             // the query tile
  static constexpr int kStage = kQ + kTileBytes;                           // [2][kTileBytes]
  static constexpr int kP = kStage + 2 * kTileBytes;                       // uint4 [4 warps][k-step][32 lanes]
  static constexpr int kAlphas = kP + 4 * kPvSteps * 32 * 16;             // float [64]: the tile's
  static constexpr int kRowMax = kAlphas + kWideRows * 4;                 // float [64]: at the end
  static constexpr int kRowSum = kRowMax + kWideRows * 4;                 // float [64]: at the end
  static constexpr int kEntries = kRowSum + kWideRows * 4;                // int64 [2][64]
  static constexpr int kZeroRows = kEntries + 2 * kTileTokens * 8;         // uint64 [2]
  static constexpr int kBarriers = kZeroRows + 16;                         // uint64 [2]
  static constexpr int kBytes = kBarriers + 16;
  static_assert(kBytes <= 232448, "more than sm_90's 227 KB of shared memory per block");
  static_assert(2 * kTileBytes >= kWideRows * kStagingStride * int(sizeof(float)),
                "the output rows are staged over the stages");
};

template <ActType kElem>
__device__ void attend_wide(const DecodeAttention& a, const TileMaps& maps, int64_t b, const Scales& scales,
                            uint8_t* smem) {
  using L = WideLayout;
  constexpr bool kF16 = kElem == ActType::kF16;
  const int64_t rows = a.rows(), len = a.context_len(b);
  const Work w = split_work(a, b, int64_t(blockIdx.y) * kWideRows, blockIdx.x, len, len);
  if (a.num_splits > 1 && w.first >= len) return;  // not a live split: the combine skips it

  const int warp = uniform_warp_index(), lane = int(threadIdx.x) % 32;
  const int group = warp / 4, gw = warp % 4;  // warpgroup; its warp gw holds rows 16 gw ..
  const int g = lane / 4, c = lane % 4;
  uint8_t* q_tile = smem + L::kQ;
  const auto stage = [&](int s) { return smem + L::kStage + s * L::kTileBytes; };
  uint4* p_frags = reinterpret_cast<uint4*>(smem + L::kP);
  float* alphas = reinterpret_cast<float*>(smem + L::kAlphas);
  float* row_max = reinterpret_cast<float*>(smem + L::kRowMax);
  float* row_sum = reinterpret_cast<float*>(smem + L::kRowSum);
  int64_t* tile_rows = reinterpret_cast<int64_t*>(smem + L::kEntries);   // [tile % 2][token]
  uint64_t* zero_rows = reinterpret_cast<uint64_t*>(smem + L::kZeroRows);  // [tile % 2]: its masked tokens
  uint64_t* stage_full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  const auto issue = [&](int s) {  // the tile whose rows are in slot s, to stage s (warp 0)
    if (warp == 0) issue_swizzled_tile(a, maps, tile_rows + s * kTileTokens, stage(s), stage_full + s, zero_rows + s);
  };

  __syncthreads();  // this CTA's previous sequence is done with the shared memory
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) mbarrier_init(stage_full + s, 32);
    mbarrier_init_fence();
  }
  if (threadIdx.x < 2 * kTileTokens)
    tile_rows[threadIdx.x] = tile_token_row(a, w, threadIdx.x / kTileTokens, threadIdx.x % kTileTokens);
  // The query tile: 64 rows x 72 pieces of 16 bytes, all of a thread's loads in flight at once.
  constexpr int kPieces = kEntry / 8, kQPerThread = kWideRows * kPieces / kWideThreads;
  static_assert(kWideRows * kPieces % kWideThreads == 0);
  uint4 q_pieces[kQPerThread];
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) {
    const int p = int(threadIdx.x) + i * kWideThreads, r = p / kPieces;
    q_pieces[i] = make_uint4(0, 0, 0, 0);  // padding rows
    if (w.row0 + r < rows)
      q_pieces[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) +
                                                         (b * rows + w.row0 + r) * kEntry) + (p - r * kPieces));
  }
  __syncthreads();  // the rows of the first tiles and the mbarriers are ready
  for (int s = 0; s < 2; ++s)
    if (s < w.n_tiles) issue(s);
#pragma unroll
  for (int i = 0; i < kQPerThread; ++i) {
    const int p = int(threadIdx.x) + i * kWideThreads, r = p / kPieces;
    *reinterpret_cast<uint4*>(q_tile + swizzled_offset(r, p - r * kPieces)) = q_pieces[i];
  }
  fence_proxy_async();  // the query tile is read by wgmma (the async proxy)
  __syncthreads();

  const uint64_t q_desc = swizzled_descriptor(q_tile);
  float out[kWideGroupChunks][32] = {};  // P.V: output chunk 4 group + ch, the m64n64 accumulators
  float s[32] = {};                       // warpgroup 0: the tile's logits
  float max_run[2] = {-INFINITY, -INFINITY}, sum_run[2] = {0.0f, 0.0f};  // warpgroup 0: rows g, g + 8
  uint32_t parity = 0;  // bit s: the phase of stage s's mbarrier that the next wait expects
  const int lookup_token = int(threadIdx.x) - 4 * 32;  // warps 4-5 look the rows of tile + 2 up
  const bool looks_up = lookup_token >= 0 && lookup_token < kTileTokens;
  for (int64_t tile = 0; tile < w.n_tiles; ++tile) {
    const int slot = int(tile & 1);
    // The descriptors' bases, opaque to the compiler: else it hoists every operand descriptor of
    // the tile out of the loop.
    uint64_t stage_desc = swizzled_descriptor(stage(slot)), qk_desc = q_desc;
    asm volatile("" : "+l"(stage_desc), "+l"(qk_desc));
    mbarrier_wait(stage_full + slot, (parity >> slot) & 1);
    parity ^= 1u << slot;
    const uint64_t masked = zero_rows[slot];
    if (masked != 0) {  // (uniform)
      zero_masked_rows(masked, stage(slot));
      fence_proxy_async();  // the zeros are read by wgmma
      __syncthreads();
    }
    uint4 frags[kPvSteps];  // P.V's A fragments: rows g | g + 8 x tokens 16k + 2c, + 1 | + 8
    float alpha[2] = {1.0f, 1.0f};
    int64_t row_ahead = -1;
    if (group == 0) {  // S = Q K^T, the online softmax, P
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kQkSteps; ++k) {
        const uint32_t at = uint32_t((k / 4) * kChunkBytes + (k % 4) * 32);
        wgmma_m64n64k16_ss<kF16, 0>(s, qk_desc + (at >> 4), stage_desc + (at >> 4), k > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      // Base-2 logits, -inf for masked tokens (and those past the split).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool live = ((masked >> (8 * j + 2 * c + (e & 1))) & 1) == 0;
          s[4 * j + e] = live ? s[4 * j + e] * scales.logit : -INFINITY;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[4 * j + e]);  // fmaxf skips NaN: it propagates through p
        }
      float offset[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xFFFFFFFFu, tile_max[h], 2));
        const float new_max = fmaxf(max_run[h], tile_max[h]);
        offset[h] = new_max == -INFINITY ? 0.0f : new_max;  // a row that saw nothing yet keeps p = 0
        alpha[h] = exp2f(max_run[h] - offset[h]);
        max_run[h] = new_max;
      }
      float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        s[i] = exp2f(s[i] - offset[(i >> 1) & 1]);
        tile_sum[(i >> 1) & 1] += s[i];  // before rounding, as the lse is
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) sum_run[h] = sum_run[h] * alpha[h] + tile_sum[h];
#pragma unroll
      for (int k = 0; k < kPvSteps; ++k) {
        frags[k] = make_uint4(pack_elems<kElem>(s[8 * k], s[8 * k + 1]), pack_elems<kElem>(s[8 * k + 2], s[8 * k + 3]),
                              pack_elems<kElem>(s[8 * k + 4], s[8 * k + 5]), pack_elems<kElem>(s[8 * k + 6], s[8 * k + 7]));
        p_frags[(gw * kPvSteps + k) * 32 + lane] = frags[k];
      }
      if (c == 0) alphas[16 * gw + g] = alpha[0], alphas[16 * gw + g + 8] = alpha[1];
    } else if (looks_up) {
      row_ahead = tile_token_row(a, w, tile + 2, lookup_token);
    }
    __syncthreads();  // (1) P and the alphas are published; the tile's rows are no longer read
    if (looks_up) tile_rows[slot * kTileTokens + lookup_token] = row_ahead;
    if (group == 1) {
#pragma unroll
      for (int k = 0; k < kPvSteps; ++k) frags[k] = p_frags[(gw * kPvSteps + k) * 32 + lane];
      alpha[0] = alphas[16 * gw + g], alpha[1] = alphas[16 * gw + g + 8];
    }
    if (alpha[0] != 1.0f || alpha[1] != 1.0f)  // (a NaN alpha is not 1)
#pragma unroll
      for (int ch = 0; ch < kWideGroupChunks; ++ch)
#pragma unroll
        for (int i = 0; i < 32; ++i) out[ch][i] *= alpha[(i >> 1) & 1];
    wgmma_fence_after(out);
#pragma unroll
    for (int k = 0; k < kPvSteps; ++k) {
      const uint32_t pa[4] = {frags[k].x, frags[k].y, frags[k].z, frags[k].w};
#pragma unroll
      for (int ch = 0; ch < kWideGroupChunks; ++ch) {
        const uint32_t at = uint32_t((kWideGroupChunks * group + ch) * kChunkBytes + k * 16 * 128);
        wgmma_m64n64k16_rs<kF16, 1>(out[ch], pa, stage_desc + (at >> 4), 1);
      }
    }
    wgmma_commit();
    // Retired here, not across the loop's back edge, where ptxas would serialize every wgmma
    // (C7515: the accumulators' moves at the edge).
    wgmma_wait<0>();
    __syncthreads();  // (2) both warpgroups are done with the stage: it takes tile + 2
    if (tile + 2 < w.n_tiles) issue(slot);
  }
  if (group == 0) {  // the rows' sums: the quad's
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = sum_run[h];
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      if (c == 0) row_sum[16 * gw + g + 8 * h] = sum, row_max[16 * gw + g + 8 * h] = max_run[h];
    }
  }
  __syncthreads();  // the stages are free: the rows are staged over them
  float* staging = reinterpret_cast<float*>(smem + L::kStage);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * gw + g + 8 * h;
    const float sum = row_sum[row];
    const bool empty = sum == 0.0f;  // saw no unmasked token; a NaN sum is not empty
    const float norm = empty ? 0.0f : scales.out / sum;
    float* dst = staging + row * kStagingStride + 256 * group + 2 * c;
#pragma unroll
    for (int ch = 0; ch < kWideGroupChunks; ++ch)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(dst + 64 * ch + 8 * j) =
            make_float2(out[ch][4 * j + 2 * h] * norm, out[ch][4 * j + 2 * h + 1] * norm);
    const int64_t r = w.row0 + row;
    if (group == 0 && c == 0 && r < rows) {
      const float lse = empty ? -INFINITY : (row_max[row] + log2f(sum)) * kLn2;
      store_lse(a, w, r, lse);
    }
  }
  __syncthreads();
  for (int i = int(threadIdx.x); i < kWideRows * (kLatent / 8); i += kWideThreads) {
    const int row = i / (kLatent / 8), col = 8 * (i % (kLatent / 8));
    const int64_t r = w.row0 + row;
    if (r >= rows) break;  // padding rows are last
    store_out_piece(a, w, r, col, staging + row * kStagingStride + col);
  }
}

template <ActType kElem>
__global__ void __launch_bounds__(kWideThreads, 1)
    wide_attention_kernel(const DecodeAttention a, const __grid_constant__ TileMaps maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  let_dependent_launch_start();
  prefetch_tile_maps(maps);
  const Scales scales = load_scales<CacheFormat::kBf16>(a);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) attend_wide<kElem>(a, maps, b, scales, smem);
}

// ---- Host side ----

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jax_kimi_mla mla_decode_attention: ") + what + ": " +
                              cudaGetErrorString(err));
}

// The driver's tensor-map encoder, looked up once.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The TMA boxes of a 16-bit cache (TileMaps). An empty cache gets none: no token has a row.
ffi::Error make_tile_maps(const DecodeAttention& a, TileMaps& maps) {
  const int64_t rows = a.num_blocks * a.block_size;
  if (rows == 0) return ffi::Error::Success();
  if (rows > INT32_MAX)  // box coordinates are int32
    return ffi::Error::InvalidArgument(
        "jax_kimi_mla mla_decode_attention: a 16-bit cache of more than 2^31 - 1 rows");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr)
    return ffi::Error::Internal("jax_kimi_mla mla_decode_attention: the CUDA driver has no cuTensorMapEncodeTiled");
  const cuuint64_t dims[2] = {cuuint64_t(kEntry), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(a.row_bytes)};
  const cuuint32_t elem_strides[2] = {1, 1};
  for (const auto& [map, box_rows] : {std::pair{&maps.tile, kTileTokens}, std::pair{&maps.group, kBoxRows}}) {
    const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
    const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<uint8_t*>(a.cache), dims, strides,
                              box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return ffi::Error::Internal("jax_kimi_mla mla_decode_attention: cuTensorMapEncodeTiled failed (CUresult " +
                                  std::to_string(int(r)) + ")");
  }
  return ffi::Error::Success();
}

// Launches kernel with `bytes` of dynamic shared memory. The attribute is set on every call: it
// belongs to the current device, and a process may drive several. It is a host-side call (no
// stream work), so graph capture is unaffected.
template <typename... Params, typename... Args>
ffi::Error launch_with_shared_memory(cudaStream_t stream, void (*kernel)(Params...), dim3 grid, int threads, int bytes,
                                     const Args&... args) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) {
    const std::string what = "allowing " + std::to_string(bytes) + " bytes of shared memory per block";
    return cuda_error(what.c_str(), err);
  }
  kernel<<<grid, threads, bytes, stream>>>(args...);
  return ffi::Error::Success();
}

template <CacheFormat kFormat, ActType kElem>
ffi::Error launch_attention(cudaStream_t stream, const DecodeAttention& a, dim3 grid) {
  TileMaps maps{};
  if constexpr (Layout<kFormat>::kSwizzled)
    if (ffi::Error map_err = make_tile_maps(a, maps); map_err.failure()) return map_err;
  return launch_with_shared_memory(stream, attention_kernel<kFormat, kElem>, grid, kThreads, Layout<kFormat>::kBytes,
                                   a, maps);
}

template <ActType kElem>
ffi::Error launch_wide_attention(cudaStream_t stream, const DecodeAttention& a, dim3 grid) {
  TileMaps maps{};
  if (ffi::Error map_err = make_tile_maps(a, maps); map_err.failure()) return map_err;
  return launch_with_shared_memory(stream, wide_attention_kernel<kElem>, grid, kWideThreads, WideLayout::kBytes, a,
                                   maps);
}

// rs_attention_kernel's launch over grid, its shared memory allowed; with a cluster of the grid's
// splits (grid.x CTAs) where `cluster` (attribute: the storage of that setting).
cudaLaunchConfig_t rs_launch_config(dim3 grid, cudaStream_t stream, bool cluster, cudaLaunchAttribute& attribute,
                                    cudaError_t& err) {
  err = cudaFuncSetAttribute(rs_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, RsLayout::kBytes);
  attribute = cudaLaunchAttribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = grid.x, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = dim3(kThreads), config.dynamicSmemBytes = RsLayout::kBytes;
  config.stream = stream, config.attrs = &attribute, config.numAttrs = cluster ? 1 : 0;
  return config;
}

// rs_attention_kernel, its splits as one cluster (merged there, no combine_kernel) or not.
ffi::Error launch_rs_attention(cudaStream_t stream, const DecodeAttention& a, dim3 grid, bool cluster) {
  cudaLaunchAttribute attribute;
  cudaError_t err = cudaSuccess;
  const cudaLaunchConfig_t config = rs_launch_config(grid, stream, cluster, attribute, err);
  if (err != cudaSuccess) return cuda_error("allowing rs_attention_kernel's shared memory", err);
  err = cudaLaunchKernelEx(&config, rs_attention_kernel, a);
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("launching rs_attention_kernel", err);
}

// Whether a call's splits (2..kMaxClusterSplits) may be clusters of rs_attention_kernel: every
// cluster of the grid resident at once (one CTA per SM, a cluster inside one GPC), as the split
// count's wave rule assumes. The most resident clusters are asked once per device and size.
bool rs_splits_fit_a_cluster(int device, dim3 grid) {
  const int splits = int(grid.x);
  if (splits < 2 || splits > kMaxClusterSplits || device < 0 || device >= 64) return false;
  static std::atomic<int> resident[64][kMaxClusterSplits + 1] = {};  // + 1: 0 is not asked yet
  int known = resident[device][splits].load(std::memory_order_relaxed);
  if (known == 0) {
    int clusters = 0;
    cudaLaunchAttribute attribute;
    cudaError_t err = cudaSuccess;
    const cudaLaunchConfig_t config = rs_launch_config(dim3(unsigned(splits)), nullptr, true, attribute, err);
    if (err != cudaSuccess || cudaOccupancyMaxActiveClusters(&clusters, rs_attention_kernel, &config) != cudaSuccess) {
      cudaGetLastError();  // not an error of the call: it takes combine_kernel
      clusters = 0;
    }
    known = clusters + 1;
    resident[device][splits].store(known, std::memory_order_relaxed);
  }
  return int64_t(grid.y) * grid.z <= known - 1;
}

// The kernel a call takes. JAX_KIMI_MLA_DECODE_KERNEL (a developer's switch, as the PDL one below) may ask
// for another than the default where that one applies:
// - fp8_attention_kernel (the default where it applies): the plain fp8 cache under an E4M3 query
//   at S_q = 1, in a build that has the sm_89+ fp8 conversion (not JAX_KIMI_MLA_SOFTWARE_FP8).
//   "mma" asks for attention_kernel instead.
// - rs_attention_kernel (the default where it applies; "rs" forces it, "mma" refuses it): fp8_ds_mla
//   at S_q = 1 on an sm_90 GPU, in a build with sm_90a code and the fp8 conversion, B <= 65535, from
//   kRsMinSplitTiles tiles a split. Its splits merge in a cluster where rs_splits_fit_a_cluster
//   ("rs-combine" forces the kernel with combine_kernel's merge instead).
// - wide_attention_kernel (the default where it applies): a 16-bit cache at S_q = 1 with many query
//   rows (kWideMinRows, or fewer in larger batches), on an sm_90 GPU, in a build with sm_90a code
//   (wgmma). "mma" asks for attention_kernel instead, "wide" for this kernel with fewer rows too.
// - attention_kernel: everything else.
enum class DecodeKernel { kMma, kFp8, kRs, kWide };

#ifdef JKM_SOFTWARE_FP8
constexpr bool kFp8KernelBuilt = false;
#else
constexpr bool kFp8KernelBuilt = true;
#endif
#ifdef JKM_SM90A_BUILT  // CMake: the architectures include sm_90a, so wgmma runs on sm_90 GPUs
constexpr bool kWgmmaBuilt = true;
#else
constexpr bool kWgmmaBuilt = false;
#endif

std::string kernel_choice() {
  const char* env = std::getenv("JAX_KIMI_MLA_DECODE_KERNEL");
  return env != nullptr ? env : "";
}

DecodeKernel choose_kernel(const DecodeAttention& a, int major, const std::string& choice) {
  if (choice != "mma" && kFp8KernelBuilt && a.cache_format == CacheFormat::kFp8 && a.q_type == QType::kE4m3 &&
      a.q_tokens == 1)
    return DecodeKernel::kFp8;
  // rs_attention_kernel from 4 tiles a split (of the longest sequence the table holds): with fewer,
  // its one-warpgroup tiles and longer prologue lose to attention_kernel (H200, H 12: 15.3 against
  // 12.2 us at B = 1, context 4096; 19.8 against 20.1 at B = 8, 4 tiles a split).
  if (choice != "mma" && kFp8KernelBuilt && kWgmmaBuilt && major == 9 &&
      a.cache_format == CacheFormat::kFp8DsMla && a.q_tokens == 1 && a.batch <= kMaxGridYZ &&
      (choice == "rs" || choice == "rs-combine" || a.split_tokens(a.max_len()) >= kRsMinSplitTiles * kTileTokens))
    return DecodeKernel::kRs;
  const bool many_rows = a.rows() >= kWideMinRows || (a.rows() >= kWideMinRowsBatched && a.batch >= kWideMinBatch);
  if (choice != "mma" && kWgmmaBuilt && major == 9 && a.cache_format == CacheFormat::kBf16 && a.q_tokens == 1 &&
      (many_rows || choice == "wide"))
    return DecodeKernel::kWide;
  return DecodeKernel::kMma;
}

// The MMA element type: f16 where both q and the cache's values are exact in f16 (f16 q over an
// f16 or plain fp8 cache; E4M3 q, which comes with the plain fp8 cache: E4M3 x E4M3 products are
// exact either way, and sm_89+ converts E4M3 to f16 in hardware), bf16 otherwise (bf16 q; ds_mla
// values and k_pe need bf16's range).
ActType mma_type(const DecodeAttention& a) {
  const bool f16 = a.q_type == QType::kE4m3 ||
                   (a.q_type == QType::kF16 && a.cache_format != CacheFormat::kFp8DsMla);
  return f16 ? ActType::kF16 : ActType::kBF16;
}

// combine_kernel by programmatic dependent launch (let_dependent_launch_start) unless
// JAX_KIMI_MLA_DECODE_PDL=0 (a developer's switch for comparisons, read when a call is launched or
// captured into a CUDA graph, so set before the first call): the call's span at B = 1-8 is about
// 1 us shorter (docs/DECODE_ATTENTION.md, Twenty-second round).
bool programmatic_combine() {
  const char* env = std::getenv("JAX_KIMI_MLA_DECODE_PDL");
  return env == nullptr || std::string(env) != "0";
}

// combine_kernel over (rows, sequences) x kColumnParts, by programmatic dependent launch or not.
template <int kCombineWarps, int kColumnParts>
cudaError_t launch_combine(cudaStream_t stream, const DecodeAttention& a, dim3 row_grid, bool programmatic) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(row_grid.x, row_grid.y, kColumnParts), config.blockDim = dim3(32 * kCombineWarps);
  config.stream = stream, config.attrs = &attribute, config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, combine_kernel<kCombineWarps, kColumnParts>, a);
}

ffi::Error run(cudaStream_t stream, const DecodeAttention& a) {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9)
    return ffi::Error::InvalidArgument(
        "jax_kimi_mla mla_decode_attention: the CUDA kernel needs an sm_90+ GPU (Hopper or newer); on this "
        "GPU use jax_kimi_mla.reference.mla_decode_attention");
  const int64_t rows = a.rows();
  const std::string choice = kernel_choice();
  const DecodeKernel kernel = choose_kernel(a, major, choice);
  const int64_t rows_per_cta = kernel == DecodeKernel::kWide ? kWideRows : kTileRows;
  const int64_t row_groups = (rows + rows_per_cta - 1) / rows_per_cta;
  if (row_groups > kMaxGridYZ)
    return ffi::Error::InvalidArgument(
        "jax_kimi_mla mla_decode_attention: too many query rows (S_q * H)");
  // Grid z (y for the combine) holds at most 65535 sequences; the kernels loop over the rest.
  const unsigned batch_blocks = unsigned(a.batch < kMaxGridYZ ? a.batch : kMaxGridYZ);
  const dim3 grid(unsigned(a.num_splits), unsigned(row_groups), batch_blocks);
  const bool f16 = mma_type(a) == ActType::kF16;
  ffi::Error err = ffi::Error::Success();
  bool merged_in_cluster = false;  // the splits merged in the attention kernel: no combine
  if (kernel == DecodeKernel::kWide) {
    err = f16 ? launch_wide_attention<ActType::kF16>(stream, a, grid)
              : launch_wide_attention<ActType::kBF16>(stream, a, grid);
  } else if (kernel == DecodeKernel::kFp8) {
    err = launch_with_shared_memory(stream, fp8_attention_kernel, grid, kThreads, Fp8Layout::kBytes, a);
  } else if (kernel == DecodeKernel::kRs) {
    merged_in_cluster = choice != "rs-combine" && rs_splits_fit_a_cluster(device, grid);
    err = launch_rs_attention(stream, a, grid, merged_in_cluster);
  } else {
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
  }
  if (err.failure()) return err;
  if (a.num_splits > 1 && !merged_in_cluster) {
    // Few rows (small B): 16 warps a row, so that a row's splits are loaded in one round, and
    // where the SMs outnumber the rows, a row's columns in 2 or 4 CTAs, so that more SMs load
    // them (H200, H 12, context 4096: B = 1 -0.5 us, and at B = 8 and 16 four parts were
    // 1-2 us slower than one); many rows: 4 warps a row, so that the CTAs are small and many
    // are resident.
    int sm_count = 0;
    cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
    const int64_t ctas = rows * batch_blocks;
    const bool programmatic = programmatic_combine();
    const dim3 row_grid(unsigned(rows), batch_blocks);
    cudaError_t combine_err;
    if (4 * ctas <= sm_count)
      combine_err = launch_combine<16, 4>(stream, a, row_grid, programmatic);
    else if (2 * ctas <= sm_count)
      combine_err = launch_combine<16, 2>(stream, a, row_grid, programmatic);
    else if (ctas < 2 * int64_t(sm_count))
      combine_err = launch_combine<16, 1>(stream, a, row_grid, programmatic);
    else
      combine_err = launch_combine<4, 1>(stream, a, row_grid, programmatic);
    if (combine_err != cudaSuccess) return cuda_error("launching combine_kernel", combine_err);
  }
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
