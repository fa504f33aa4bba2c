// CUDA handlers: one launch per call. A lane is one 8-element chunk of one output row (a pe
// lane with NeoX RoPE: two, below). A token's lanes fall into parts: the cache entry (its 64
// latent lanes, then its pe lanes), then for each head row the nope lanes of every head and the pe
// lanes of every head (without RoPE, the row's lanes of every head: one part). A block covers
// lanes of one part of one token, or of a few consecutive tokens where a token's part is smaller
// than a block (a sub-block of threads per token, plan_blocks), so what kind of chunk its lanes
// are, where the token's rows start, and whether it needs the slot or the position are the same
// for a sub-block: a lane only finds its head and chunk (constant divisors) and adds their
// offsets, and only the blocks that rotate run the RoPE arithmetic. The kernel is compiled per
// op, RoPE off / GPT-J / NeoX, activation dtype and (fp8 ops) lanes a thread in the nope rows.
// With NeoX, pe lane j (0..3) of a row owns pe chunks j and j + 4 (its pairs' two halves: it
// loads both, then stores both, so a row rotated in place is never read after another thread
// wrote it). Each thread owns Parts::lanes_per_thread lanes and runs in two phases, all loads,
// then the arithmetic and stores; a pe lane loads its own slice of the token's cos/sin row (after
// the position), so no lane waits for another and the kernel has no block-wide barrier. A
// thread's lanes of a pe part are one pe chunk of different heads: they share one cos/sin slice,
// and where all heads share the pe source (prefill's k = [k_nope | k_pe]) one value, which the
// thread finishes once and stores for each (run_shared_pe_part). The 16 lanes of a ds_mla scale
// tile are one half warp (threads 0..63 of the cache part's sub-block, whose size is a multiple
// of 16) and reduce their amax by shuffles.
#include <cuda_runtime.h>

#include <algorithm>

#include "jax_kimi_mla/ffi_plan.h"

namespace jax_kimi_mla {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kLanesPerThread = 2;  // in most parts (Parts::lanes_per_thread)
constexpr int kStreamRowLanes = 4;  // in the fp8 nope / whole-row parts of a call that streams
constexpr int kSharedPeLanes = 4;   // in a part of shared pe lanes: one rotation, four stores
constexpr int kMaxBlockTokens = 8;  // tokens a block of one part may hold (a power of two)
constexpr int kMagicShift = 20;     // thread / threads as thread * magic >> 20: exact below 256
constexpr int64_t kMaxGridY = 65535;

// Where the blocks of one part go, chosen per call (plan_blocks). A block holds `tokens`
// consecutive tokens' sub-blocks of `threads` threads each, and a token's lanes of the part take
// `segments` blocks. In a token group, block i of the part is segment i >> subgroup_shift of the
// tokens of sub-group i & (2^subgroup_shift - 1): no division on the device.
struct PartBlocks {
  int threads = 0, tokens = 1, segments = 0;
  int blocks = 0;          // in a token group: segments << subgroup_shift
  int subgroup_shift = 0;  // log2(group / tokens)
  unsigned magic = 0;      // ceil(2^kMagicShift / threads)
};

// A grid row (blockIdx.y, z) covers a group of `group` tokens (a power of two, a multiple of
// every part's tokens): the blocks of part 0, then part 1, ...
template <int kParts>
struct BlockPlan {
  int group = 1;
  PartBlocks parts[kParts];
};

// A token's sub-block, as one of its threads sees it.
struct SubBlock {
  int thread, threads;
};

// Where one lane reads and writes. dst is null when nothing is stored (a skipped slot); for a
// ds_mla cache lane it is the entry itself.
struct Lane {
  const uint16_t* src = nullptr;  // null: no lane here
  void* dst = nullptr;
  int chunk = 0;  // the chunk within its row
  int pe = -1;    // the pe chunk index (0..7); negative for a nope chunk
  // NeoX RoPE: the lane's second chunk, pe chunk pe + 4 of the same row, and where it goes.
  const uint16_t* partner = nullptr;
  void* partner_dst = nullptr;
};

// The lanes of a row's pe chunks: with NeoX RoPE a lane owns chunks j and j + 4.
template <bool kRopeOn, RopeStyle kStyle>
JKM_HD constexpr int pe_lanes(int pe_chunks) {
  return kRopeOn && kStyle == RopeStyle::kNeox ? pe_chunks / 2 : pe_chunks;
}

// Part 0 is the cache entry; part 1 + 2r holds the nope lanes of head row r, part 2 + 2r its pe
// lanes (a row without nope or pe chunks has an empty part). Without RoPE nothing tells a pe
// chunk from a nope chunk, so part 1 + 2r holds the whole row (its chunks in order) and part
// 2 + 2r is empty: fewer, fuller blocks.
template <Op op, bool kRopeOn, RopeStyle kStyle>
struct Parts {
  static constexpr int kCount = 1 + 2 * op_shape(op, kRopeOn).num_rows;
  static constexpr CacheFormat kCacheFormat = op_shape(op, kRopeOn).cache;
  static constexpr int kCacheLanes = kLatent / kChunk + pe_lanes<kRopeOn, kStyle>(kRopeChunks);
  // Lanes per thread: one in a ds_mla cache part (the quantization's registers are one lane's),
  // and with NeoX RoPE in the cache part and the pe parts (whose lanes own two chunks each
  // already; two such lanes in the cache part took the kernels from 48-75 to 64-99 registers);
  // kSharedPeLanes in a shared pe part, whose lanes of one thread are one chunk of several heads
  // (one value); row_lanes in a nope or whole-row part (kLanesPerThread, or kStreamRowLanes:
  // stream_row_lanes). (Four lanes a thread in the other pe parts too, sharing one cos/sin slice,
  // were slower on the H200: H = 12 fp8_ds_mla RoPE prefill 85% -> 80% of the copy ceiling.)
  static JKM_HD constexpr int lanes_per_thread(int p, int row_lanes) {
    if (p > 0 && shared_pe(p)) return kSharedPeLanes;
    constexpr bool kNeox = kRopeOn && kStyle == RopeStyle::kNeox;
    if (p == 0) return kCacheFormat == CacheFormat::kFp8DsMla || kNeox ? 1 : kLanesPerThread;
    if (pe_only(p)) return kNeox ? 1 : kLanesPerThread;
    return row_lanes;
  }
  // The lanes a thread of a nope or whole-row part takes in a call that streams (plan_blocks):
  // four where the rows are stored as E4M3, whose 8-byte stores left a two-lane thread few bytes
  // in flight (H200, benchmarks/RESULTS.md, round of 2026-12-04 evening: H = 12 fp8 RoPE prefill
  // 90% -> 95% of the copy ceiling). The 16-bit rows gained nothing, and calls of one wave or
  // less lost: B = 1 decode took 1.31 -> 1.57 us with half the blocks.
  static constexpr int stream_row_lanes() {
    return op_shape(op, kRopeOn).rows[0].fp8 ? kStreamRowLanes : kLanesPerThread;
  }
  // Whether head-row part p (p >= 1) holds pe lanes only.
  static JKM_HD constexpr bool pe_only(int p) { return (p - 1) % 2 == 1; }
  // Whether head-row part p (p >= 1) holds the pe lanes of a row whose pe source all heads share:
  // its lane h * per_head + j is chunk j of head h, the same value for every h.
  static JKM_HD constexpr bool shared_pe(int p) {
    return kRopeOn && pe_only(p) && op_shape(op, kRopeOn).rows[(p - 1) / 2].shared_pe;
  }
  // Lanes per head of head-row part p.
  static JKM_HD constexpr int per_head(int p) {
    const RowShape r = op_shape(op, kRopeOn).rows[(p - 1) / 2];
    if (!kRopeOn) return pe_only(p) ? 0 : r.chunks();
    return pe_only(p) ? pe_lanes<kRopeOn, kStyle>(r.pe_chunks) : r.nope_chunks;
  }
  static JKM_HD constexpr int64_t lanes(int p, int64_t heads) { return p == 0 ? kCacheLanes : heads * per_head(p); }
};

template <Op op, bool kRopeOn, RopeStyle kStyle>
using OpBlockPlan = BlockPlan<Parts<op, kRopeOn, kStyle>::kCount>;

// NeoX RoPE: pe lane j takes pe chunk j + 4 too (a row's pe chunks are contiguous in its source
// and in its output: `byte_dst` says whether the output holds 1-byte elements). The source's
// partner and the output's may be located at different times (the cache's output is looked up last).
template <bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ void locate_partner_src(Lane& l) {
  if constexpr (kRopeOn && kStyle == RopeStyle::kNeox) {
    if (l.pe >= 0) l.partner = l.src + kNeoxPartnerChunk * kChunk;
  }
}
template <bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ void locate_partner_dst(Lane& l, bool byte_dst) {
  if constexpr (kRopeOn && kStyle == RopeStyle::kNeox) {
    if (l.pe < 0 || l.dst == nullptr) return;
    constexpr int kAhead = kNeoxPartnerChunk * kChunk;  // elements
    l.partner_dst = byte_dst ? static_cast<void*>(static_cast<uint8_t*>(l.dst) + kAhead)
                             : static_cast<void*>(static_cast<uint16_t*>(l.dst) + kAhead);
  }
}

// Lane `lane` of the cache part of token t: where it reads. Where it writes follows from the
// token's slot (place_in_cache), looked up after the lane's loads are issued.
template <Op op, bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ Lane locate_in_cache(const Epilogue& e, int64_t t, int lane) {
  Lane l;
  l.chunk = lane;
  l.src = chunk_src(e.cache, t, 0, lane);
  l.pe = lane - kLatent / kChunk;
  locate_partner_src<kRopeOn, kStyle>(l);  // the second pe chunk's source
  return l;
}

// Cache lane l of the entry at row slot_row (or -1: nothing is stored): where it writes.
template <Op op, bool kRopeOn, RopeStyle kStyle>
__device__ __forceinline__ void place_in_cache(const Epilogue& e, int64_t slot_row, Lane& l) {
  constexpr CacheFormat kCache = op_shape(op, kRopeOn).cache;
  if (slot_row < 0) return;
  l.dst = kCache == CacheFormat::kFp8DsMla ? static_cast<void*>(ds_mla_entry(e, slot_row))
                                           : chunk_dst(e.cache, slot_row, 0, l.chunk);
  // A ds_mla lane's dst is its entry: the second pe chunk's place follows from it.
  locate_partner_dst<kRopeOn, kStyle>(l, kCache == CacheFormat::kFp8);
}

// Lane `lane` of head-row part p of token t: head lane / per_head, and its chunk.
template <Op op, bool kRopeOn, RopeStyle kStyle, int p>
__device__ __forceinline__ Lane locate_in_head_row(const Epilogue& e, int64_t t, int lane) {
  using P = Parts<op, kRopeOn, kStyle>;
  constexpr int r = (p - 1) / 2, kPerHead = P::per_head(p);
  constexpr bool kPe = P::pe_only(p);
  constexpr RowShape shape = op_shape(op, kRopeOn).rows[r];
  const RowSpec& spec = e.head_rows[r];
  const int h = lane / kPerHead, j = lane - h * kPerHead;
  Lane l;
  l.chunk = kPe ? shape.nope_chunks + j : j;
  // A nope chunk's pe is negative; with RoPE a part holds nope or pe chunks only, and says which
  // at compile time.
  l.pe = kPe ? j : kRopeOn ? -1 : l.chunk - shape.nope_chunks;
  l.src = l.pe >= 0 ? spec.pe + chunk_elem(t, spec.pe_t, h, spec.pe_h, l.pe)
                    : spec.nope + chunk_elem(t, spec.nope_t, h, spec.nope_h, l.chunk);
  const int64_t out = chunk_elem(t, spec.out_t, h, spec.out_h, l.chunk);
  l.dst = shape.fp8 ? static_cast<void*>(static_cast<uint8_t*>(spec.out) + out)
                    : static_cast<void*>(static_cast<uint16_t*>(spec.out) + out);
  locate_partner_src<kRopeOn, kStyle>(l);
  locate_partner_dst<kRopeOn, kStyle>(l, shape.fp8);
  return l;
}

// A shared pe part (Parts::shared_pe): thread i's lanes i, i + threads, ... are one chunk j
// (threads, the sub-block's size, is a multiple of the per-head lane count) of several heads, so it
// loads, rotates and quantizes that chunk once and stores it for each head.
template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct, int p>
__device__ __forceinline__ void run_shared_pe_part(const Epilogue& e, int64_t t, int seg, SubBlock sb,
                                                   int part_lanes) {
  constexpr RowShape shape = op_shape(op, kRopeOn).rows[(p - 1) / 2];
  constexpr int kLanes = kSharedPeLanes;
  constexpr bool kNeox = kStyle == RopeStyle::kNeox;
  const int first = seg * sb.threads * kLanes + sb.thread;
  if (first >= part_lanes) return;
  const Lane l = locate_in_head_row<op, kRopeOn, kStyle, p>(e, t, first);
  const Raw16 raw = load16(l.src);
  Raw16 partner;
  if constexpr (kNeox) partner = load16(l.partner);
  const float mult = shape.fp8 ? __ldg(e.head_rows[(p - 1) / 2].scale_inv) : 0.0f;
  const RopeSlice slice = rope_slice(kStyle, e.rope_row(t), l.pe);
  // With NeoX the lane's second chunk is finished and stored after the first, so that only one
  // result is live (both at once cost the f16 kernels twice their registers).
#pragma unroll
  for (int half = 0; half < (kNeox ? 2 : 1); ++half) {
    const Raw16 out = half == 0 ? finish_chunk(kAct, raw, true, slice, kStyle, partner, l.pe, shape.fp8, mult)
                                : finish_chunk(kAct, partner, true, slice, kStyle, raw, l.pe + kNeoxPartnerChunk,
                                               shape.fp8, mult);
#pragma unroll 1
    for (int k = 0; k < kLanes; ++k) {
      const int lane = first + k * sb.threads;
      if (lane >= part_lanes) break;
      const Lane lk = locate_in_head_row<op, kRopeOn, kStyle, p>(e, t, lane);
      store_chunk(half == 0 ? lk.dst : lk.partner_dst, out, shape.fp8);
    }
  }
}

// Part p's lanes [seg * sb.threads * lanes_per_thread(p), ...) of token t, by a sub-block of
// sb.threads threads: its thread i takes lanes i, i + sb.threads, ... of that range.
template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct, int kRowLanes, int p>
__device__ __forceinline__ void run_part(const Epilogue& e, int64_t t, int seg, SubBlock sb, int part_lanes) {
  if constexpr (p > 0 && Parts<op, kRopeOn, kStyle>::shared_pe(p))
    return run_shared_pe_part<op, kRopeOn, kStyle, kAct, p>(e, t, seg, sb, part_lanes);
  constexpr OpShape shape = op_shape(op, kRopeOn);
  constexpr bool kCachePart = p == 0;
  constexpr bool kDsMla = kCachePart && shape.cache == CacheFormat::kFp8DsMla;
  // Whether the part's rows are stored as E4M3 (plain fp8), then with which scale.
  constexpr bool kFp8 = kCachePart ? shape.cache == CacheFormat::kFp8 : shape.rows[(p - 1) / 2].fp8;
  const float* scale_inv = kCachePart ? e.cache.scale_inv : e.head_rows[(p - 1) / 2].scale_inv;
  // Phase 1: every load: the inputs, then the slot (cache part), the scale, and the position when
  // a lane rotates.
  constexpr int kLanes = Parts<op, kRopeOn, kStyle>::lanes_per_thread(p, kRowLanes);
  const int first = seg * sb.threads * kLanes + sb.thread;
  Lane lanes[kLanes];
  Raw16 raw[kLanes];
  Raw16 partner[kLanes];  // NeoX only
  bool rotates = false;
#pragma unroll
  for (int k = 0; k < kLanes; ++k) {
    const int lane = first + k * sb.threads;
    if (lane >= part_lanes) continue;
    if constexpr (kCachePart)
      lanes[k] = locate_in_cache<op, kRopeOn, kStyle>(e, t, lane);
    else
      lanes[k] = locate_in_head_row<op, kRopeOn, kStyle, p>(e, t, lane);
    raw[k] = load16(lanes[k].src);
    if constexpr (kRopeOn && kStyle == RopeStyle::kNeox)
      if (lanes[k].partner != nullptr) partner[k] = load16(lanes[k].partner);
    rotates |= kRopeOn && lanes[k].pe >= 0;
  }
  if constexpr (kCachePart) {
    // After the lanes' loads, so that the slot's latency overlaps theirs (with the slot first, the
    // compiler made the two-lane kernels' loads wait for it).
    const int64_t slot_row = e.cache_row(t);
#pragma unroll
    for (int k = 0; k < kLanes; ++k)
      if (lanes[k].src != nullptr) place_in_cache<op, kRopeOn, kStyle>(e, slot_row, lanes[k]);
  }
  const float mult = kFp8 && lanes[0].src != nullptr ? __ldg(scale_inv) : 0.0f;
  const float* rope_row = rotates ? e.rope_row(t) : nullptr;

  // Phase 2: arithmetic and stores, a pe lane's slice of the cos/sin row loaded first (loaded
  // in phase 1, the slices of two lanes would hold registers that cost occupancy). In a pe part
  // a thread's lanes are one pe chunk of different heads (`threads` is a multiple of the lanes
  // per head): one slice serves them all.
  constexpr bool kOneSlice = kRopeOn && !kCachePart && Parts<op, kRopeOn, kStyle>::pe_only(p);
  RopeSlice slice;
#pragma unroll
  for (int k = 0; k < kLanes; ++k) {
    const Lane& l = lanes[k];
    if (l.src == nullptr) continue;
    const bool rotate = kRopeOn && l.pe >= 0;
    if (rotate && (!kOneSlice || k == 0)) slice = rope_slice(kStyle, rope_row, l.pe);
    constexpr bool kPairs = kRopeOn && kStyle == RopeStyle::kNeox;  // pe lanes own two chunks
    if constexpr (kDsMla) {
      auto* entry = static_cast<uint8_t*>(l.dst);
      if (l.pe >= 0) {
        const Raw16 out = finish_ds_mla_pe(kAct, raw[k], rotate, slice, kStyle, partner[k], l.pe);
        if (entry != nullptr) store16(ds_mla_pe_dst(entry, l.pe), out);
        if constexpr (kPairs) {
          const Raw16 out2 = finish_ds_mla_pe(kAct, partner[k], rotate, slice, kStyle, raw[k],
                                              l.pe + kNeoxPartnerChunk);
          if (entry != nullptr) store16(ds_mla_pe_dst(entry, l.pe + kNeoxPartnerChunk), out2);
        }
        continue;
      }
      // Latent lanes 0..63 are the sub-block's threads 0..63: whole half warps.
      float v[kChunk];
      widen8(kAct, raw[k], v);
      float amax = 0.0f;
      for (float x : v) amax = amax_fold(amax, x);
      const unsigned tile_mask = 0xFFFFu << (threadIdx.x & 16);
      for (int offset = kTileChunks / 2; offset > 0; offset /= 2)
        amax = amax_fold(amax, __shfl_xor_sync(tile_mask, amax, offset, kTileChunks));
      if (entry == nullptr) continue;
      const float s = ds_mla_tile_scale(amax);
      store_ds_mla_latent(entry, l.chunk, v, s);
      if (l.chunk % kTileChunks == 0) store_ds_mla_scale(entry, l.chunk / kTileChunks, s);
      continue;
    }
    const Raw16 out = finish_chunk(kAct, raw[k], rotate, slice, kStyle, partner[k], l.pe, kFp8, mult);
    if (l.dst != nullptr) store_chunk(l.dst, out, kFp8);
    if constexpr (kPairs) {
      if (l.partner == nullptr) continue;
      const Raw16 out2 = finish_chunk(kAct, partner[k], rotate, slice, kStyle, raw[k],
                                      l.pe + kNeoxPartnerChunk, kFp8, mult);
      if (l.partner_dst != nullptr) store_chunk(l.partner_dst, out2, kFp8);
    }
  }
}

// Block x of a token group's blocks (the parts in order, BlockPlan): the part it covers and its
// place there, found in block-wide arithmetic, then, for each thread, its token's sub-block and
// that part's code.
template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct, int kRowLanes, int p = 0>
__device__ __forceinline__ void dispatch_part(const Epilogue& e, const OpBlockPlan<op, kRopeOn, kStyle>& plan,
                                              int64_t group_start, int block) {
  using P = Parts<op, kRopeOn, kStyle>;
  if constexpr (p > 0 && p < P::kCount && P::per_head(p) == 0) {  // an empty part
    dispatch_part<op, kRopeOn, kStyle, kAct, kRowLanes, p + 1>(e, plan, group_start, block);
  } else if constexpr (p < P::kCount) {
    const PartBlocks& part = plan.parts[p];
    if (block >= part.blocks)
      return dispatch_part<op, kRopeOn, kStyle, kAct, kRowLanes, p + 1>(e, plan, group_start,
                                                                        block - part.blocks);
    const int sub = part.tokens == 1 ? 0 : int((threadIdx.x * part.magic) >> kMagicShift);
    if (sub >= part.tokens) return;  // threads past the block's sub-blocks
    const int64_t t = group_start + (block & ((1 << part.subgroup_shift) - 1)) * part.tokens + sub;
    if (t >= e.tokens) return;
    const SubBlock sb{int(threadIdx.x) - sub * part.threads, part.threads};
    run_part<op, kRopeOn, kStyle, kAct, kRowLanes, p>(e, t, block >> part.subgroup_shift, sb,
                                                      int(P::lanes(p, e.heads)));
  }
}

// Block (x, y, z): block x of token group y + z * gridDim.y; kRowLanes lanes a thread in the nope
// and whole-row parts.
template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct, int kRowLanes>
__global__ void __launch_bounds__(kMaxThreads)
    epilogue_kernel(const Epilogue e, const OpBlockPlan<op, kRopeOn, kStyle> plan) {
  const int64_t group_start = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * plan.group;
  if (group_start >= e.tokens) return;
  dispatch_part<op, kRopeOn, kStyle, kAct, kRowLanes>(e, plan, group_start, int(blockIdx.x));
}

ffi::Error cuda_error(Op op, const char* what, cudaError_t err) {
  return internal_error(target_name(op), std::string(what) + ": " + cudaGetErrorString(err));
}

// Whether a call of `tokens` tokens and `heads` heads has more lanes than about one wave of a GPU
// of `sm_count` SMs: then its blocks stream (plan_blocks, Parts::stream_row_lanes).
template <Op op, bool kRopeOn, RopeStyle kStyle>
bool call_streams(int64_t heads, int64_t tokens, int sm_count) {
  using P = Parts<op, kRopeOn, kStyle>;
  constexpr int64_t kWaveLanes = 1024;  // a wave's lanes an SM: half its 2048 threads
  int64_t token_lanes = 0;
  for (int p = 0; p < P::kCount; ++p) token_lanes += P::lanes(p, heads);
  return tokens * token_lanes > kWaveLanes * sm_count;
}

// The block size and each part's sub-blocks, for `heads` heads, a thread taking `row_lanes` lanes
// of a nope or whole-row part (H200, benchmarks/RESULTS.md, round of 2026-12-04):
// - A call whose lanes fit in about one wave is a chain of latencies: a block takes one token's
//   lanes (tokens that share a block would only share its slowest chain).
// - A larger call streams: where a token's part is smaller than a block, a block holds several
//   tokens' sub-blocks (a power of two, up to kMaxBlockTokens), so that few threads idle (at 12
//   heads a token's parts are 24-144 threads' worth, and a block per token left a third idle).
// Each candidate block size (whole warps, from kMaxThreads down) gives each part the shape whose
// blocks leave the fewest lanes idle, each block also costing kBlockCost lanes (so that a part is
// not cut into needlessly small blocks); the size with the fewest idle lanes a token wins. A
// sub-block of the cache part holds the whole entry, and a ds_mla entry's 64 latent lanes are its
// threads 0..63 (whole half warps: its size is a multiple of 16); one of a pe part whose thread's
// lanes share a cos/sin slice or a value is a multiple of the per-head lane count.
template <Op op, bool kRopeOn, RopeStyle kStyle>
int plan_blocks(int64_t heads, bool streams, int row_lanes, OpBlockPlan<op, kRopeOn, kStyle>& plan) {
  using P = Parts<op, kRopeOn, kStyle>;
  constexpr int64_t kBlockCost = 64;
  int best_threads = kMaxThreads;
  int64_t best = INT64_MAX;
  for (int n = kMaxThreads; n >= (P::kCacheLanes + 31) / 32 * 32; n -= 32) {
    OpBlockPlan<op, kRopeOn, kStyle> candidate;
    int64_t cost = 0;  // in 1/kMaxBlockTokens lanes a token
    for (int p = 0; p < P::kCount; ++p) {
      const int64_t lanes = P::lanes(p, heads);
      const int per_thread = P::lanes_per_thread(p, row_lanes);
      PartBlocks& part = candidate.parts[p];
      part = {n, 1, 0};
      if (lanes == 0) continue;
      const int align = p == 0 ? 16 : P::pe_only(p) && kRopeOn ? int(P::per_head(p)) : 1;
      int64_t part_cost = INT64_MAX;
      for (int block_tokens = 1; block_tokens <= (streams ? kMaxBlockTokens : 1); block_tokens *= 2) {
        const int threads = n / block_tokens;
        if (threads % align != 0 || (p == 0 && threads * per_thread < P::kCacheLanes)) break;
        if (block_tokens > 1 && lanes > threads * per_thread) break;
        const int64_t segments = (lanes + threads * per_thread - 1) / (threads * per_thread);
        const int64_t c = segments * (n * per_thread + kBlockCost) * (kMaxBlockTokens / block_tokens) -
                          lanes * kMaxBlockTokens;
        if (c < part_cost) part_cost = c, part = {threads, block_tokens, int(segments)};
      }
      cost += part_cost;
    }
    if (cost < best) best = cost, best_threads = n, plan = candidate;
  }
  for (const PartBlocks& part : plan.parts) plan.group = std::max(plan.group, part.tokens);
  for (PartBlocks& part : plan.parts) {
    while ((part.tokens << part.subgroup_shift) < plan.group) ++part.subgroup_shift;
    part.blocks = part.segments << part.subgroup_shift;
    part.magic = ((1u << kMagicShift) + part.threads - 1) / part.threads;
  }
  return best_threads;
}

template <Op op, bool kRopeOn, RopeStyle kStyle, ActType kAct>
ffi::Error launch(cudaStream_t stream, const Epilogue& e) {
  using P = Parts<op, kRopeOn, kStyle>;
  int device = 0, sm_count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return cuda_error(op, "reading the GPU's SM count", cudaGetLastError());
  const bool streaming = call_streams<op, kRopeOn, kStyle>(e.heads, e.tokens, sm_count);
  constexpr int kStreamLanes = P::stream_row_lanes();
  const int row_lanes = streaming ? kStreamLanes : kLanesPerThread;
  OpBlockPlan<op, kRopeOn, kStyle> plan;
  const int threads = plan_blocks<op, kRopeOn, kStyle>(e.heads, streaming, row_lanes, plan);
  int64_t blocks = 0;
  for (const PartBlocks& part : plan.parts) blocks += part.blocks;
  const int64_t groups = (e.tokens + plan.group - 1) / plan.group;
  const int64_t grid_y = std::min(groups, kMaxGridY);
  const int64_t grid_z = (groups + grid_y - 1) / grid_y;
  bool too_large = e.heads * kEntry > INT32_MAX || blocks > INT32_MAX || grid_z > kMaxGridY;
  for (int r = 0; r < e.num_head_rows; ++r) {  // TokenOffset is 32-bit on the GPU
    const RowSpec& spec = e.head_rows[r];
    for (int64_t stride : {spec.nope_h, spec.pe_h, spec.out_h})
      too_large |= stride < 0 || e.heads * (stride + kEntry) > INT32_MAX;
  }
  if (too_large)
    return invalid_argument(target_name(op), "problem too large for one launch");
  if (reinterpret_cast<uintptr_t>(e.cos_sin) % 16 != 0)  // read as float4 rows
    return invalid_argument(target_name(op), "cos_sin_cache is not 16-byte aligned");
  const dim3 grid{unsigned(blocks), unsigned(grid_y), unsigned(grid_z)};
  if (row_lanes == kLanesPerThread)
    epilogue_kernel<op, kRopeOn, kStyle, kAct, kLanesPerThread><<<grid, threads, 0, stream>>>(e, plan);
  else if constexpr (kStreamLanes != kLanesPerThread)
    epilogue_kernel<op, kRopeOn, kStyle, kAct, kStreamLanes><<<grid, threads, 0, stream>>>(e, plan);
  return ffi::Error::Success();
}

// The kernel of a call: RoPE off, GPT-J or NeoX, by activation dtype.
template <Op op, bool kRopeOn, RopeStyle kStyle>
ffi::Error launch_act(cudaStream_t stream, const Epilogue& e) {
  return e.act == ActType::kBF16 ? launch<op, kRopeOn, kStyle, ActType::kBF16>(stream, e)
                                 : launch<op, kRopeOn, kStyle, ActType::kF16>(stream, e);
}

template <Op op>
ffi::Error run(cudaStream_t stream, const Plan& plan) {
  for (int i = 0; i < plan.num_copies; ++i) {
    const Copy& c = plan.copies[i];
    cudaError_t err = cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return cuda_error(op, "copying an un-aliased output", err);
  }
  const Epilogue& e = plan.e;
  if (e.tokens > 0) {
    ffi::Error err = e.cos_sin == nullptr ? launch_act<op, false, RopeStyle::kGptj>(stream, e)
                     : e.rope_style == RopeStyle::kNeox ? launch_act<op, true, RopeStyle::kNeox>(stream, e)
                                                        : launch_act<op, true, RopeStyle::kGptj>(stream, e);
    if (err.failure()) return err;
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error(op, "kernel launch", err);
}

template <Op op>
ffi::Error handler(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  Plan plan;
  if (ffi::Error err = make_epilogue_plan(op, args, rets, attrs, plan); err.failure()) return err;
  return run<op>(stream, plan);
}

}  // namespace
}  // namespace jax_kimi_mla

#define JKM_CUDA_HANDLER(name)                                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                             \
      jkm_cuda_##name, jax_kimi_mla::handler<jax_kimi_mla::Op::name>,                        \
      xla::ffi::Ffi::Bind()                                                                  \
          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                                     \
          .RemainingArgs()                                                                   \
          .RemainingRets()                                                                   \
          .Attrs(),                                                                  \
      {xla::ffi::Traits::kCmdBufferCompatible});
JKM_FOR_EACH_EPILOGUE(JKM_CUDA_HANDLER)
