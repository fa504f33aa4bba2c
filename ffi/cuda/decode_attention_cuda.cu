// mla_decode_attention on the GPU: flash-decoding (split-KV) on tensor cores (mma.sync, or wgmma in
// the sm_90a kernels).
//
// At most two launches per call, no allocation, no host synchronization, so XLA can capture it
// in a CUDA graph. This file is the design reference and the host side (which kernel a call
// takes, its launch, the FFI handler); each kernel is in a header of its own, after the pieces
// they share (decode_attention_common.cuh): attention_kernel.cuh (1 below),
// fp8_attention_kernel.cuh (1b), wide_attention_kernel.cuh (1c), rs_attention_kernel.cuh (1d)
// and combine_kernel.cuh (2).
//
// 1. attention_kernel, grid (ceil(S_q*H / 16), B up to 65535, num_splits x waves of 65535
//    sequences), sm_90+. A CTA of 8 warps takes 16 query rows of one sequence (rows past S_q*H are
//    zero padding, never stored) and the tokens of its split, in 64-token tiles:
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
// 1b. fp8_attention_kernel (the default for the plain fp8 cache under an E4M3 query at S_q = 1
//    where rs_attention_kernel is not: shorter splits, GPUs other than sm_90),
//    in place of attention_kernel: the same CTA and phases, but P.V reads the raw codes and
//    converts them in registers, so no converted V tile is written or read (its section below).
// 1c. wide_attention_kernel (the default for a 16-bit cache at S_q = 1 with many query rows, on
//    sm_90): 64 rows a CTA on wgmma, the query tile resident in shared memory, so that a tile is
//    read and multiplied once per 64 heads instead of 16 (its section below).
// 1d. rs_attention_kernel (the default for fp8_ds_mla, and for the plain fp8 cache under an E4M3
//    query, at S_q = 1 on sm_90 from 4 tiles a split): the tokens as M of wgmma, two consumer
//    warpgroups on alternate tiles and a producer warpgroup that looks up and issues them (384
//    threads, registers moved to the consumers by setmaxnreg; its section below); fp8_ds_mla's A
//    operand converted in registers by each consumer thread, plain fp8's S^T on E4M3 operands from
//    shared memory (its tiles by tensor-map boxes). H200, B 64 x 16k, before the producer: fp8_ds_mla
//    205 us (79%), plain fp8 187 us (76%); its loop from L2 then got 17-22% faster on an H100
//    (docs/DECODE_ATTENTION.md, Twenty-sixth round). With 2-8 splits, a sequence's splits are one
//    thread block cluster and merge there (no combine).
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
// caller's choice: one CTA per SM, so num_splits * ceil(S_q*H / 16) * B should reach the SM count;
// with work_splits the grid holds B x work_splits CTAs a row group, which share the batch's tokens
// out at run time, a live split each (DecodeAttention::split_capacity, work_place, ops.split_plan).
// Two opt-in kernels that stayed slower than the defaults were retired on 2026-12-04 (fp8_ds_mla on
// f16 mma.sync with the tile scales out of the MMAs, and the 1-byte formats on wgmma fed by
// converter warps); docs/DECODE_ATTENTION.md keeps their rounds and the commit that last held them.
#include <cuda.h>  // CUtensorMap (the driver is reached through the runtime: no link to libcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "attention_kernel.cuh"
#include "fp8_attention_kernel.cuh"
#include "rs_attention_kernel.cuh"
#include "combine_kernel.cuh"
#include "wide_attention_kernel.cuh"

namespace jax_kimi_mla {
namespace {

// ---- Host side ----

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return internal_error(kDecodeAttentionTarget, std::string(what) + ": " + cudaGetErrorString(err));
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

// The TMA boxes of a 16-bit or plain fp8 cache (TileMaps). An empty cache gets none: no token has
// a row.
ffi::Error make_tile_maps(const DecodeAttention& a, TileMaps& maps) {
  const int64_t rows = a.num_blocks * a.block_size;
  if (rows == 0) return ffi::Error::Success();
  if (rows > INT32_MAX)  // box coordinates are int32 (choose_kernel keeps larger fp8 caches off boxes)
    return invalid_argument(kDecodeAttentionTarget, "a 16-bit cache of more than 2^31 - 1 rows");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr)
    return internal_error(kDecodeAttentionTarget, "the CUDA driver has no cuTensorMapEncodeTiled");
  const bool fp8 = a.cache_format == CacheFormat::kFp8;
  const cuuint64_t dims[2] = {cuuint64_t(kEntry), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(a.row_bytes)};
  const cuuint32_t elem_strides[2] = {1, 1};
  struct Box {
    CUtensorMap* map;
    cuuint32_t columns, rows;
    CUtensorMapSwizzle swizzle;
  };
  // BoxedTile: 128-byte rows of 64 16-bit or 128 E4M3 columns; plain fp8's rope columns in 64 bytes.
  const cuuint32_t columns = fp8 ? 128 : 64;
  const Box boxes[4] = {{&maps.tile, columns, kTileTokens, CU_TENSOR_MAP_SWIZZLE_128B},
                        {&maps.group, columns, kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B},
                        {&maps.rope_tile, kRope, kTileTokens, CU_TENSOR_MAP_SWIZZLE_64B},
                        {&maps.rope_group, kRope, kBoxRows, CU_TENSOR_MAP_SWIZZLE_64B}};
  for (int i = 0; i < (fp8 ? 4 : 2); ++i) {
    const cuuint32_t box[2] = {boxes[i].columns, boxes[i].rows};
    const CUresult r = encode(boxes[i].map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
                              const_cast<uint8_t*>(a.cache), dims, strides, box, elem_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, boxes[i].swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return internal_error(kDecodeAttentionTarget, "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ")");
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
// splits (grid.z CTAs) where `cluster` (attribute: the storage of that setting).
template <CacheFormat kFormat, bool kByWork>
cudaLaunchConfig_t rs_launch_config(dim3 grid, cudaStream_t stream, bool cluster, cudaLaunchAttribute& attribute,
                                    cudaError_t& err) {
  constexpr int kBytes = RsLayout<kFormat>::kBytes;
  err = cudaFuncSetAttribute(rs_attention_kernel<kFormat, kByWork>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  attribute = cudaLaunchAttribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = 1, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = grid.z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid, config.blockDim = dim3(kRsThreads), config.dynamicSmemBytes = kBytes;
  config.stream = stream, config.attrs = &attribute, config.numAttrs = cluster ? 1 : 0;
  return config;
}

// A count the CUDA runtime gives per device (an occupancy query: `ask(count)` returns its
// cudaError_t), asked once and kept in `slot` as the count + 1 (0: not asked yet). A failed query
// counts 0, and its error is cleared: it is not the call's (the call takes another form).
constexpr int kMaxDevices = 64;  // devices whose answers are kept
template <class Ask>
int asked_once(std::atomic<int>& slot, Ask ask) {
  int known = slot.load(std::memory_order_relaxed);
  if (known == 0) {
    int count = 0;
    if (ask(count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    known = count + 1;
    slot.store(known, std::memory_order_relaxed);
  }
  return known - 1;
}

// Whether a call's splits (2..kMaxClusterSplits) may be clusters of rs_attention_kernel: every
// cluster of the grid resident at once (one CTA per SM, a cluster inside one GPC), as the split
// count's wave rule assumes. The most resident clusters are asked once per device and size.
template <CacheFormat kFormat>
bool rs_splits_fit_a_cluster(int device, dim3 grid) {
  const int splits = int(grid.z);
  if (splits < 2 || splits > kMaxClusterSplits || device < 0 || device >= kMaxDevices) return false;
  static std::atomic<int> resident[kMaxDevices][kMaxClusterSplits + 1] = {};
  const int clusters = asked_once(resident[device][splits], [splits](int& count) {  // failed: combine_kernel
    cudaLaunchAttribute attribute;
    cudaError_t err = cudaSuccess;
    const cudaLaunchConfig_t config =
        rs_launch_config<kFormat, false>(dim3(1, 1, unsigned(splits)), nullptr, true, attribute, err);
    return err != cudaSuccess ? err : cudaOccupancyMaxActiveClusters(&count, rs_attention_kernel<kFormat, false>, &config);
  });
  return int64_t(grid.x) * grid.y <= clusters;
}

// rs_attention_kernel, its splits as one cluster (merged there, no combine_kernel) where they fit
// one, the call did not ask for "rs-combine" and splits are by count (by work, the grid's splits
// a sequence does not take would hold their SMs until the cluster's merge); merged_in_cluster says
// which.
template <CacheFormat kFormat>
ffi::Error launch_rs_attention(cudaStream_t stream, const DecodeAttention& a, dim3 grid, const DecodeLaunch& launch,
                               int device, bool& merged_in_cluster) {
  merged_in_cluster = launch.kernel != KernelRequest::kRsCombine && a.work_splits == 0 &&
                      rs_splits_fit_a_cluster<kFormat>(device, grid);
  TileMaps maps{};
  if constexpr (kFormat == CacheFormat::kFp8)
    if (ffi::Error map_err = make_tile_maps(a, maps); map_err.failure()) return map_err;
  cudaLaunchAttribute attribute;
  cudaError_t err = cudaSuccess;
  const bool by_work = a.work_splits > 0;
  const cudaLaunchConfig_t config = by_work ? rs_launch_config<kFormat, true>(grid, stream, false, attribute, err)
                                            : rs_launch_config<kFormat, false>(grid, stream, merged_in_cluster, attribute, err);
  if (err != cudaSuccess) return cuda_error("allowing rs_attention_kernel's shared memory", err);
  err = by_work ? cudaLaunchKernelEx(&config, rs_attention_kernel<kFormat, true>, a, maps)
                : cudaLaunchKernelEx(&config, rs_attention_kernel<kFormat, false>, a, maps);
  return err == cudaSuccess ? ffi::Error::Success() : cuda_error("launching rs_attention_kernel", err);
}

// The kernel a call takes. The call's `kernel` attribute (DecodeLaunch; for comparisons and tests)
// may ask for another than the default where that one applies:
// - rs_attention_kernel ("rs" forces it where it applies, "mma" refuses it): fp8_ds_mla, or the
//   plain fp8 cache under an E4M3 query (of at most 2^31 - 1 rows: its boxes' coordinates), at
//   S_q = 1 on an sm_90 GPU, in a build with sm_90a code and the fp8 conversion, B <= 65535, tables
//   of at most kRsMaxTokens tokens a sequence. The default there from kRsMinSplitTiles tiles a
//   split. Its splits merge in a cluster where rs_splits_fit_a_cluster ("rs-combine" forces the
//   kernel with combine_kernel's merge instead), else in combine_kernel, their last tiles shared
//   out at run time where the call's scratch holds the claims (balance_splits).
// - fp8_attention_kernel (the default where it applies and rs_attention_kernel is not taken): the
//   plain fp8 cache under an E4M3 query at S_q = 1, in a build that has the sm_89+ fp8 conversion
//   (not JAX_KIMI_MLA_SOFTWARE_FP8). "mma" asks for attention_kernel instead.
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

DecodeKernel choose_kernel(const DecodeAttention& a, int major, KernelRequest choice) {
  using R = KernelRequest;
  const bool fp8_under_e4m3 = a.cache_format == CacheFormat::kFp8 && a.q_type == QType::kE4m3;
  const bool rs_asked = choice == R::kRs || choice == R::kRsCombine;
  const bool rs_applies = kFp8KernelBuilt && kWgmmaBuilt && major == 9 && a.q_tokens == 1 && a.batch <= kMaxGridYZ &&
                          a.max_len() <= kRsMaxTokens &&
                          (a.cache_format == CacheFormat::kFp8DsMla ||
                           (fp8_under_e4m3 && a.num_blocks * a.block_size <= INT32_MAX));
  // rs_attention_kernel from 4 tiles a split (of a batch of sequences as long as the table holds:
  // by work, work_splits of them): with fewer, its one-warpgroup tiles and longer prologue lose
  // (H200, H 12, B = 1, context 4096: fp8_ds_mla 15.3 against attention_kernel's 12.2 us, plain
  // fp8 16.2 against fp8_attention_kernel's 13.4).
  const int64_t table_tiles = (a.max_len() + kTileTokens - 1) / kTileTokens;
  if (choice != R::kMma && rs_applies &&
      (rs_asked || a.split_tokens(a.max_len(), a.least_split_share(a.batch * table_tiles)) >= kRsMinSplitTiles * kTileTokens))
    return DecodeKernel::kRs;
  if (choice != R::kMma && kFp8KernelBuilt && fp8_under_e4m3 && a.q_tokens == 1) return DecodeKernel::kFp8;
  const bool many_rows = a.rows() >= kWideMinRows || (a.rows() >= kWideMinRowsBatched && a.batch >= kWideMinBatch);
  if (choice != R::kMma && kWgmmaBuilt && major == 9 && a.cache_format == CacheFormat::kBf16 && a.q_tokens == 1 &&
      (many_rows || choice == R::kWide))
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

// combine_kernel over (rows, sequences) x kColumnParts, by programmatic dependent launch
// (let_dependent_launch_start; the default, DecodeLaunch::programmatic_combine) or not: by it the
// call's span at B = 1-8 is about 1 us shorter (docs/DECODE_ATTENTION.md, Twenty-second round).
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

// How many CTAs of combine_kernel<kWarps, 1> an SM holds at once (0 where the query fails: the
// call takes a smaller form), asked once per device.
template <int kWarps>
int64_t combine_ctas_per_sm(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  static std::atomic<int> resident[kMaxDevices] = {};
  return asked_once(resident[device], [](int& count) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, combine_kernel<kWarps, 1>, 32 * kWarps, 0);
  });
}

ffi::Error run(cudaStream_t stream, const DecodeAttention& a, const DecodeLaunch& launch) {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9)
    return invalid_argument(kDecodeAttentionTarget,
                            "the CUDA kernel needs an sm_90+ GPU (Hopper or newer); on this GPU use "
                            "jax_kimi_mla.reference.mla_decode_attention");
  const int64_t rows = a.rows();
  const DecodeKernel kernel = choose_kernel(a, major, launch.kernel);
  const int64_t rows_per_cta = kernel == DecodeKernel::kWide ? kWideRows : kTileRows;
  const int64_t row_groups = (rows + rows_per_cta - 1) / rows_per_cta;
  if (row_groups > kMaxGridYZ)
    return invalid_argument(kDecodeAttentionTarget, "too many query rows (S_q * H)");
  // Grid y (of the combine too) holds at most 65535 sequences: the attention kernels take the rest
  // as further waves of splits in grid z (cta_place; rs_attention_kernel is not taken past 65535),
  // the combine loops over them. By work, a CTA for each of the B x work_splits splits the share
  // allows (work_place; the handler keeps B within one wave).
  const unsigned batch_blocks = unsigned(a.batch < kMaxGridYZ ? a.batch : kMaxGridYZ);
  const int64_t sequence_waves = (a.batch + batch_blocks - 1) / batch_blocks;
  if (a.num_splits * sequence_waves > kMaxGridYZ)
    return invalid_argument(kDecodeAttentionTarget, "too many sequences for the split count (num_splits x ceil(B / 65535) > 65535)");
  const int64_t grid_splits = a.work_splits > 0 ? a.work_splits : a.num_splits * sequence_waves;
  const dim3 grid(unsigned(row_groups), batch_blocks, unsigned(grid_splits));
  const bool f16 = mma_type(a) == ActType::kF16;
  ffi::Error err = ffi::Error::Success();
  bool merged_in_cluster = false;  // the splits merged in the attention kernel: no combine
  if (kernel == DecodeKernel::kWide) {
    err = f16 ? launch_wide_attention<ActType::kF16>(stream, a, grid)
              : launch_wide_attention<ActType::kBF16>(stream, a, grid);
  } else if (kernel == DecodeKernel::kFp8) {
    err = launch_with_shared_memory(stream, fp8_attention_kernel, grid, kThreads, Fp8Layout::kBytes, a);
  } else if (kernel == DecodeKernel::kRs) {
    err = a.cache_format == CacheFormat::kFp8
              ? launch_rs_attention<CacheFormat::kFp8>(stream, a, grid, launch, device, merged_in_cluster)
              : launch_rs_attention<CacheFormat::kFp8DsMla>(stream, a, grid, launch, device, merged_in_cluster);
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
    // 1-2 us slower than one); more rows: the most warps a row (16, 8, 4, else 2) whose CTAs are
    // all resident at once. (16 warps of 118 registers fit once an SM: H 12, B 16's 192 CTAs ran
    // as two waves, 5.4 us on an H100; fewer warps than fit were no faster: docs/DECODE_ATTENTION.md,
    // Twenty-eighth round.)
    int sm_count = 0;
    cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
    const int64_t ctas = rows * batch_blocks;
    const bool programmatic = launch.programmatic_combine;
    const dim3 row_grid(unsigned(rows), batch_blocks);
    cudaError_t combine_err;
    if (4 * ctas <= sm_count)
      combine_err = launch_combine<16, 4>(stream, a, row_grid, programmatic);
    else if (2 * ctas <= sm_count)
      combine_err = launch_combine<16, 2>(stream, a, row_grid, programmatic);
    else if (ctas <= combine_ctas_per_sm<16>(device) * sm_count)
      combine_err = launch_combine<16, 1>(stream, a, row_grid, programmatic);
    else if (ctas <= combine_ctas_per_sm<8>(device) * sm_count)
      combine_err = launch_combine<8, 1>(stream, a, row_grid, programmatic);
    else if (ctas <= combine_ctas_per_sm<4>(device) * sm_count)
      combine_err = launch_combine<4, 1>(stream, a, row_grid, programmatic);
    else
      combine_err = launch_combine<2, 1>(stream, a, row_grid, programmatic);
    if (combine_err != cudaSuccess) return cuda_error("launching combine_kernel", combine_err);
  }
  const cudaError_t launch_err = cudaGetLastError();
  return launch_err == cudaSuccess ? ffi::Error::Success() : cuda_error("kernel launch", launch_err);
}

ffi::Error decode_attention_handler(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                                    ffi::AnyBuffer block_tables, ffi::AnyBuffer context_lens,
                                    ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                                    ffi::Result<ffi::AnyBuffer> partials, ffi::Dictionary attrs) {
  DecodeAttention a;
  DecodeLaunch launch;
  if (ffi::Error err = make_decode_attention(q, kv_cache, block_tables, context_lens, q_scale_inv,
                                             cache_scale_inv, *out, *lse, *partials, attrs, a, launch);
      err.failure())
    return err;
  if (a.batch == 0 || a.heads == 0 || a.rows() == 0) return ffi::Error::Success();
  // Splits by work need the batch in one wave of the grid (work_place) and a sequence's tiles in 32
  // bits (batch_split_share); past them (absurd sizes) the splits are by count, the grid's many.
  if (a.batch > kMaxGridYZ || (a.max_len() + kTileTokens - 1) / kTileTokens > INT32_MAX) a.work_splits = 0;
  // cp.async moves 16-byte chunks; q is read in 16-byte (8-byte for fp8) chunks.
  if (reinterpret_cast<uintptr_t>(a.cache) % 16 != 0 || a.row_bytes % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.q) % 16 != 0)
    return invalid_argument(kDecodeAttentionTarget, "kv_cache, its rows and q must be 16-byte aligned");
  return run(stream, a, launch);
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jkm_cuda_mla_decode_attention, jax_kimi_mla::decode_attention_handler,
    JKM_DECODE_ATTENTION_BINDING(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
