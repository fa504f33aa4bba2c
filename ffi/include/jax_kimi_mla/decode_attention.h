// Paged MLA decode attention, as data: what one mla_decode_attention call reads and writes, and
// the rules (causal rows, splits; the cache addressing of paged_cache.h) that the CPU handler,
// the CUDA kernels and the jnp reference all follow. Host and device.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "jax_kimi_mla/paged_cache.h"

namespace jax_kimi_mla {

// What the query and the cache hold. The cache format comes from the cache dtype (uint8:
// fp8_ds_mla, float8_e4m3fn: plain fp8, bf16/f16: the activation dtype of the query).
enum class QType : uint8_t { kBF16, kF16, kE4m3 };

inline constexpr int kAttnRowStats = kLatent + 1;  // floats of a partial per query row: 512 outputs, an lse
// The scratch may also hold, first, 16 bytes per partial row for the balancing of a sequence's
// splits (SplitClaim): 517 floats a row in all. Without them (513, as before) the splits stay as cut.
inline constexpr int kClaimFloats = 4;
inline constexpr int kMaxQueryTokens = 4;          // S_q: new tokens per sequence
inline constexpr int kMaxSplits = 1024;            // = _checks.MAX_SPLITS

// A split's claim record: the tiles at the end of a split (its last quarter) that any split of the
// same sequence may take once it is done with its own, so that the sequence's splits end together
// (rs_attention_kernel). The owner opens the record early in its run, before its first claim
// (claimed = 0, then open = kClaimOpen), and closes it (open = 0) once its own claim fails; a
// claim is an atomic add on claimed, valid while below the split's count of such tiles. The scratch holds garbage at a call's
// start: a record counts as open only with the 64-bit tag that its owner writes in this call, and
// every owner closes its record before its kernel ends.
struct alignas(16) SplitClaim {
  unsigned long long open;
  unsigned int claimed;
  // Record 0 only (DecodeAttention::stored_share): the call's split share by work, in tiles.
  unsigned int batch_share;
};
static_assert(sizeof(SplitClaim) == kClaimFloats * sizeof(float), "a claim record is a partial row's claim room");
inline constexpr unsigned long long kClaimOpen = 0x6a6b6d2d636c61ffULL;

struct DecodeAttention : PagedCache {
  QType q_type = QType::kBF16;
  ActType act = ActType::kBF16;  // the output dtype (bf16 when q is fp8)
  int64_t batch = 0, q_tokens = 0, heads = 0;  // B, S_q, H
  const void* q = nullptr;  // [B * S_q, H, 576]: query j of sequence b is row b * S_q + j
  float softmax_scale = 0.0f;
  // An fp8 q = Q(x * q_scale_inv), read on the device. Null otherwise.
  const float* q_scale_inv = nullptr;
  void* out = nullptr;    // [B * S_q, H, 512] act
  float* lse = nullptr;   // [B * S_q, H] float32, natural log
  // Split-KV partials (num_splits > 1 only), float32: the outputs [num_splits, B, S_q * H, 512],
  // then the lse [num_splits, B, S_q * H] (outputs apart so that their rows are 16-byte aligned).
  float* partials = nullptr;
  int num_splits = 1;
  int work_splits = 0;  // splits by work: split_capacity (0: every sequence cut into num_splits)
  // The splits' claim records (SplitClaim, one per split and CTA: claim_record), or null: each
  // split takes exactly its own tiles. Ahead of partials in the same scratch.
  SplitClaim* claims = nullptr;
  // By work, where the scratch holds the claims: record 0's batch_share, where the attention
  // kernel's first CTA leaves the share it found (work_place), so that combine_kernel need not
  // search it again (past a warp's 32 sequences a search reads the lengths anew at every step);
  // null otherwise.
  unsigned* stored_share = nullptr;

  JKM_HD int64_t rows() const { return q_tokens * heads; }  // query rows of one sequence

  // Query j of S_q is token len - S_q + j of its sequence and sees tokens [0, visible): causal
  // among the new tokens. A query that sees nothing gets zeros and lse -inf.
  JKM_HD int64_t visible_len(int64_t len, int64_t j) const {
    const int64_t n = len - q_tokens + 1 + j;
    return n < 0 ? 0 : n;
  }
  // The same for query row r (query r / H): no division for the usual S_q = 1.
  JKM_HD int64_t row_visible_len(int64_t len, int64_t r) const {
    return q_tokens == 1 ? len : visible_len(len, r / heads);
  }

  // Split s of a sequence of `len` tokens covers tokens [s * per, min((s + 1) * per, len)), per =
  // split_tokens(len, share): equal runs of whole kSplitTokens tiles, the last ones possibly empty
  // (skipped on the device; the combine reads only splits with s * per < len). A split holds at
  // least 1 / num_splits of its sequence and at least `share` tokens (batch_split_share: 0
  // without splits by work), so a sequence never has more than num_splits splits.
  static constexpr int64_t kSplitTokens = 64;
  JKM_HD int64_t split_tokens(int64_t len, int64_t share) const {
    const int64_t per = (len + num_splits - 1) / num_splits;
    const int64_t tiled = (per + kSplitTokens - 1) / kSplitTokens * kSplitTokens;
    return tiled > share ? tiled : share;
  }
  JKM_HD static int splits_of(int64_t len, int64_t per) { return per == 0 ? 0 : int((len + per - 1) / per); }
  JKM_HD int live_splits(int64_t len, int64_t share) const { return splits_of(len, split_tokens(len, share)); }
  // Splits by work (work_splits > 0): the batch's B * work_splits splits shared out by length
  // instead of by count, so that a ragged or padded batch (a serve loop's decode step) keeps the
  // CTAs that a uniform one of work_splits splits a sequence would use, each with a like amount of
  // work. The share is the fewest whole tiles a split may take such that the batch, every
  // sequence cut by split_tokens(len, share), has at most B * work_splits live splits: they then
  // run in the waves that ops.split_plan planned, where a few more would start a wave of their
  // own (batch_split_share, decode_attention_common.cuh, searches it; the grid has a CTA for each,
  // work_place). A uniform batch is cut as by work_splits alone; num_splits (the partials' room)
  // bounds what a long sequence takes.
  JKM_HD int64_t split_capacity() const { return batch * work_splits; }
  // The share's lower bound: `tiles` (the batch's summed tiles) over the capacity, the share
  // itself where every sequence holds the same tiles.
  JKM_HD int64_t least_split_share(int64_t tiles) const {
    if (work_splits == 0 || batch == 0) return 0;
    return (tiles + split_capacity() - 1) / split_capacity() * kSplitTokens;
  }

  // Partial result of split s for query row r of sequence b: 512 normalized outputs, and its lse.
  JKM_HD int64_t partial_row(int s, int64_t b, int64_t r) const { return (int64_t(s) * batch + b) * rows() + r; }
  JKM_HD float* partial(int s, int64_t b, int64_t r) const { return partials + partial_row(s, b, r) * kLatent; }
  JKM_HD float* partial_lse(int s, int64_t b, int64_t r) const {
    return partials + int64_t(num_splits) * batch * rows() * kLatent + partial_row(s, b, r);
  }
  // The claim record of split s's CTA whose first query row is row0 (16 bytes of the partial row's
  // kClaimFloats).
  JKM_HD SplitClaim* claim_record(int s, int64_t b, int64_t row0) const { return claims + partial_row(s, b, row0); }
};

// How the CUDA handler launches a call, from the optional attributes `kernel` (string: "auto",
// the default, or a kernel asked for where it applies: decode_attention_cuda.cu, choose_kernel)
// `programmatic_combine` (bool, default true: combine_kernel starts as a programmatic dependent of
// the attention kernel) and `balance_splits` (bool, default true: where rs_attention_kernel's
// splits merge in combine_kernel and the scratch has room for the claims, a sequence's splits share
// out their last tiles at run time; false: each split takes exactly its tiles, so that results
// repeat bit for bit). The CPU handler checks and ignores them, and `work_splits` too (the split
// geometry: DecodeAttention::split_capacity).
// Host.
enum class KernelRequest : uint8_t { kAuto, kMma, kRs, kRsCombine, kWide };
struct DecodeLaunch {
  KernelRequest kernel = KernelRequest::kAuto;
  bool programmatic_combine = true;
  bool balance_splits = true;
};

// The request a `kernel` attribute's string names (_checks.DECODE_KERNELS); false for any other.
inline bool kernel_request(std::string_view name, KernelRequest& request) {
  constexpr std::pair<std::string_view, KernelRequest> kNames[] = {
      {"auto", KernelRequest::kAuto}, {"mma", KernelRequest::kMma}, {"wide", KernelRequest::kWide},
      {"rs", KernelRequest::kRs},     {"rs-combine", KernelRequest::kRsCombine}};
  for (const auto& [known, value] : kNames) {
    if (name == known) {
      request = value;
      return true;
    }
  }
  return false;
}

// ---- FFI operands -> DecodeAttention (host) ----

constexpr std::string_view kDecodeAttentionTarget = "mla_decode_attention";  // as errors name it

// Operands: q act|f8 [B * S_q, H, 576]; kv_cache act|f8|u8 [N, bs, W]; block_tables idx [B,
// max_blocks]; context_lens idx [B]; q_scale_inv f32 [1] or [0]; cache_scale_inv f32 [1] or [0].
// Results: out act [B * S_q, H, 512]; lse f32 [B * S_q, H]; partials f32 [num_splits * B * S_q *
// H * 517] (the claims, then the outputs and the lse; * 513: no claims; empty when num_splits ==
// 1). Attributes: softmax_scale (f32), q_tokens (i64 S_q, 1..4), num_splits (i64 >= 1); optional:
// work_splits (i64 0..num_splits, DecodeAttention::split_capacity), kernel, programmatic_combine,
// balance_splits (DecodeLaunch). The query
// is 3-D so that the decode epilogue's mqa_q [B, H, 576] (B * S_q rows) feeds it with no reshape,
// which XLA may turn into a copy.
// The Python wrapper checks all of this first and explains; these checks keep a malformed direct
// call from touching foreign memory.
inline ffi::Error make_decode_attention(ffi::AnyBuffer q, ffi::AnyBuffer cache,
                                        ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                                        ffi::AnyBuffer q_scale_inv, ffi::AnyBuffer cache_scale_inv,
                                        ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                        ffi::AnyBuffer partials, ffi::Dictionary attrs,
                                        DecodeAttention& a, DecodeLaunch& launch) {
  const auto fail = [](std::string_view what) { return invalid_argument(kDecodeAttentionTarget, what); };
  using T = ffi::DataType;
  const auto softmax_scale = attrs.get<float>("softmax_scale");
  const auto q_tokens_attr = attrs.get<int64_t>("q_tokens"), num_splits_attr = attrs.get<int64_t>("num_splits");
  if (!softmax_scale.has_value() || !q_tokens_attr.has_value() || !num_splits_attr.has_value())
    return fail("the attributes softmax_scale (f32), q_tokens and num_splits (i64) are required");
  const int64_t q_tokens = *q_tokens_attr, num_splits = *num_splits_attr;
  if (attrs.contains("kernel")) {
    const auto kernel = attrs.get<std::string_view>("kernel");
    if (!kernel.has_value() || !kernel_request(*kernel, launch.kernel))
      return fail("kernel must be the string \"auto\", \"mma\", \"rs\", \"rs-combine\" or \"wide\"");
  }
  if (attrs.contains("programmatic_combine")) {
    const auto programmatic = attrs.get<bool>("programmatic_combine");
    if (!programmatic.has_value()) return fail("programmatic_combine must be a bool");
    launch.programmatic_combine = *programmatic;
  }
  int64_t work_splits = 0;
  if (attrs.contains("work_splits")) {
    const auto work = attrs.get<int64_t>("work_splits");
    if (!work.has_value()) return fail("work_splits must be an i64");
    work_splits = *work;
  }
  if (attrs.contains("balance_splits")) {
    const auto balance = attrs.get<bool>("balance_splits");
    if (!balance.has_value()) return fail("balance_splits must be a bool");
    launch.balance_splits = *balance;
  }
  const auto qd = q.dimensions();
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
  if (std::string err = make_paged_cache(cache, tables, lens, cache_scale_inv, a.batch, a); !err.empty())
    return fail(err.c_str());
  if (a.cache_format == CacheFormat::kBf16 && cache.element_type() != q.element_type())
    return fail("a bf16/fp16 kv_cache must have the dtype of q");
  if ((q_scale_inv.element_count() == 1) != (a.q_type == QType::kE4m3) ||
      q_scale_inv.element_type() != T::F32 || q_scale_inv.element_count() > 1)
    return fail("q_scale_inv must be float32 [1] exactly when q is fp8, else [0]");
  if (a.q_type == QType::kE4m3 && a.cache_format != CacheFormat::kFp8)
    return fail("an fp8 q needs the plain fp8 cache");
  const T out_type = a.act == ActType::kBF16 ? T::BF16 : T::F16;
  const auto od = out.dimensions(), ld = lse.dimensions();
  if (out.element_type() != out_type || od.size() != 3 || od[0] != qd[0] || od[1] != a.heads ||
      od[2] != kLatent)
    return fail("out must be [B * S_q, H, 512] in the output dtype");
  if (lse.element_type() != T::F32 || ld.size() != 2 || ld[0] != qd[0] || ld[1] != a.heads)
    return fail("lse must be float32 [B * S_q, H]");
  if (num_splits < 1 || num_splits > kMaxSplits)
    return fail(("num_splits must be 1.." + std::to_string(kMaxSplits)).c_str());
  if (work_splits < 0 || work_splits > num_splits) return fail("work_splits must be 0..num_splits");
  const size_t partial_rows = num_splits == 1 ? 0 : size_t(num_splits * a.batch * a.rows());
  const bool with_claims = partials.element_count() == partial_rows * (kAttnRowStats + kClaimFloats);
  if (partials.element_type() != T::F32 || (partials.element_count() != partial_rows * kAttnRowStats && !with_claims))
    return fail("partials must be float32 [num_splits * B * S_q * H * 517] (or * 513: no balancing; empty for one split)");
  a.q = q.untyped_data();
  a.softmax_scale = *softmax_scale;
  a.q_scale_inv = a.q_type == QType::kE4m3 ? static_cast<const float*>(q_scale_inv.untyped_data()) : nullptr;
  a.out = out.untyped_data();
  a.lse = static_cast<float*>(lse.untyped_data());
  float* scratch = static_cast<float*>(partials.untyped_data());
  a.partials = num_splits == 1 ? nullptr : scratch + (with_claims ? partial_rows * kClaimFloats : 0);
  a.claims = num_splits > 1 && with_claims && launch.balance_splits ? reinterpret_cast<SplitClaim*>(scratch) : nullptr;
  a.num_splits = int(num_splits);
  a.work_splits = num_splits == 1 ? 0 : int(work_splits);
  a.stored_share = a.work_splits > 0 && with_claims ? &reinterpret_cast<SplitClaim*>(scratch)->batch_share : nullptr;
  return ffi::Error::Success();
}

// The binding both backends share, after their context arguments. The attributes come as a
// dictionary, so that the optional ones may be absent (programs exported before they existed).
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
      .Attrs()

}  // namespace jax_kimi_mla
