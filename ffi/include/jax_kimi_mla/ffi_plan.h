// From XLA FFI buffers to an Epilogue: the one place that knows each op's operand order, checks
// what the handler is given, and describes the rows it writes. Shared by the CPU and CUDA
// handlers: make_epilogue_plan is host code; the op shapes (op_shape) are host and device code,
// as the kernel plans its lanes from them. The Python wrappers check arguments first and explain
// errors to the user; these checks make a malformed direct call fail instead of touching foreign
// memory.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "jax_kimi_mla/epilogue.h"
#include "jax_kimi_mla/ffi_common.h"

namespace jax_kimi_mla {

// The epilogue FFI targets, one per kernel (ffi/module.cc adds the cache readers).
#define JKM_FOR_EACH_EPILOGUE(X) \
  X(prefill_kv_cache)            \
  X(prefill_ds_mla)              \
  X(prefill_fp8)                 \
  X(decode_kv_cache)             \
  X(decode_fp8)                  \
  X(decode_ds_mla)

enum class Op {
#define JKM_OP_ENUM(name) name,
  JKM_FOR_EACH_EPILOGUE(JKM_OP_ENUM)
#undef JKM_OP_ENUM
};

// The FFI target of an op, as its errors name it.
constexpr std::string_view target_name(Op op) {
  switch (op) {
#define JKM_OP_NAME(name) \
  case Op::name:          \
    return #name;
    JKM_FOR_EACH_EPILOGUE(JKM_OP_NAME)
#undef JKM_OP_NAME
  }
  return "epilogue";
}

// The per-head rows each op writes, in order, as compile-time shapes: the chunks read from the
// row's nope and pe sources, whether it is stored as E4M3, and whether its pe source is one row
// shared by all heads (prefill's k_pe: the CUDA kernel then rotates it once per token and chunk,
// not once per head). make_epilogue_plan fills its RowSpecs from these; the CUDA kernel is
// compiled for each.
struct RowShape {
  int nope_chunks = 0, pe_chunks = 0;
  bool fp8 = false;
  bool shared_pe = false;
  JKM_HD constexpr int chunks() const { return nope_chunks + pe_chunks; }
};

struct OpShape {
  CacheFormat cache = CacheFormat::kBf16;
  int num_rows = 0;
  RowShape rows[3] = {};
};

JKM_HD constexpr OpShape op_shape(Op op, bool rope) {
  constexpr RowShape k{kNope / kChunk, kRopeChunks, false, true};  // prefill k = [k_nope | k_pe]
  constexpr RowShape q_pe{0, kRopeChunks, false};            // prefill q[..., 128:], in place
  constexpr RowShape mqa_q{kLatent / kChunk, kRopeChunks, false};  // decode [ql_nope | q_pe]
  switch (op) {
    case Op::prefill_kv_cache:
    case Op::prefill_ds_mla: {
      const CacheFormat f = op == Op::prefill_ds_mla ? CacheFormat::kFp8DsMla : CacheFormat::kBf16;
      return rope ? OpShape{f, 2, {k, q_pe}} : OpShape{f, 1, {k}};
    }
    case Op::prefill_fp8:  // q, k, v
      return OpShape{CacheFormat::kFp8, 3,
                     {{kNope / kChunk, kRopeChunks, true}, {kNope / kChunk, kRopeChunks, true, true},
                      {kVHead / kChunk, 0, true}}};
    case Op::decode_kv_cache: return OpShape{CacheFormat::kBf16, 1, {mqa_q}};
    case Op::decode_fp8:
      return OpShape{CacheFormat::kFp8, 1, {{kLatent / kChunk, kRopeChunks, true}}};
    case Op::decode_ds_mla: return OpShape{CacheFormat::kFp8DsMla, 1, {mqa_q}};
  }
  return {};
}

// An output that XLA did not alias to its input starts as a copy of the input.
struct Copy {
  const void* src;
  void* dst;
  size_t bytes;
};

struct Plan {
  Epilogue e;
  Copy copies[2];
  int num_copies = 0;

  void copy_unless_aliased(const ffi::AnyBuffer& in, const ffi::AnyBuffer& out) {
    if (in.untyped_data() != out.untyped_data() && in.size_bytes() > 0)
      copies[num_copies++] = {in.untyped_data(), out.untyped_data(), in.size_bytes()};
  }
};

namespace detail {

// Collects the first failed check of an op's operands; later checks are skipped.
class Checker {
 public:
  explicit Checker(Op op) : op_(op) {}
  bool ok() const { return message_.empty(); }
  ffi::Error error() const { return invalid_argument(target_name(op_), message_); }
  void expect(bool condition, const char* what) {
    if (ok() && !condition) message_ = what;
  }
  void dims(const ffi::AnyBuffer& b, std::vector<int64_t> want, const char* what) {
    auto d = b.dimensions();
    bool same = d.size() == want.size();
    for (size_t i = 0; same && i < want.size(); ++i) same = d[i] == want[i];
    expect(same, what);
  }

 private:
  Op op_;
  std::string message_;
};

inline const uint16_t* act_ptr(const ffi::AnyBuffer& b) {
  return static_cast<const uint16_t*>(b.untyped_data());
}

}  // namespace detail

// A strided view of rows [T, H, width]: row (t, h) starts at data + t * per_token + h * per_head
// (elements; per_head = 0 shares one row among all heads).
template <typename T>
struct Strided {
  T* data = nullptr;
  int64_t per_token = 0, per_head = 0;
  Strided offset(int64_t columns) const { return {data + columns, per_token, per_head}; }
};

// A RowSpec from its named parts: where its nope and pe chunks come from, where it goes.
inline RowSpec row_spec(const RowShape& shape, Strided<const uint16_t> nope, Strided<const uint16_t> pe,
                        Strided<void> out, const float* scale_inv) {
  RowSpec r;
  r.nope = nope.data, r.nope_t = nope.per_token, r.nope_h = nope.per_head, r.nope_chunks = shape.nope_chunks;
  r.pe = pe.data, r.pe_t = pe.per_token, r.pe_h = pe.per_head, r.pe_chunks = shape.pe_chunks;
  r.out = out.data, r.out_t = out.per_token, r.out_h = out.per_head;
  r.scale_inv = scale_inv;
  return r;
}

// Operand order (formats.EPILOGUES in Python; ops._operands builds it):
//   prefill:  q, k_nope, k_pe, kv_c_normed, [v], kv_cache, slot_mapping, positions, cos_sin_cache,
//             [q_scale_inv, k_scale_inv, v_scale_inv, cache_scale_inv]  -> k | q_fp8, q | k_fp8,
//             [v_fp8], kv_cache
//   decode:   ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, positions, cos_sin_cache,
//             [q_scale_inv, cache_scale_inv]  -> mqa_q, kv_cache
// Without RoPE, positions and cos_sin_cache are empty arrays; prefill's q and q_out are empty
// too for the bf16 and ds_mla caches (q comes back unchanged and is never read).
// Optional int64 attributes k_nope_col, v_col, k_pe_col, q_pe_col: that input is a wider tensor
// whose columns [col, col + width) are read (e.g. k_nope and v straight from kv_b_proj's output).
// Optional string attribute rope_style: "gptj" (the default when absent) or "neox".
// kv_cache [N, bs, W], or a stack [..., N, bs, W]: W may exceed the entry (576 elements, 656
// bytes for ds_mla) when a row is a multiple of 16 bytes; entries go to the first columns of their
// row, the rest is never written.
inline ffi::Error make_epilogue_plan(Op op, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                     ffi::Dictionary attrs, Plan& plan) {
  const bool prefill = op == Op::prefill_kv_cache || op == Op::prefill_ds_mla || op == Op::prefill_fp8;
  const bool fp8_prefill = op == Op::prefill_fp8;
  const size_t num_in = 8 + (fp8_prefill ? 5 : 0) + (op == Op::decode_fp8 ? 2 : 0);
  const size_t num_out = fp8_prefill ? 4 : (prefill ? 3 : 2);
  if (args.size() != num_in || rets.size() != num_out)
    return invalid_argument(target_name(op), "wrong number of operands");

  std::vector<ffi::AnyBuffer> in, out;
  for (size_t i = 0; i < num_in; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    in.push_back(*b);
  }
  for (size_t i = 0; i < num_out; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    out.push_back(**b);
  }

  size_t next = 4;
  const ffi::AnyBuffer &a = in[0], &b = in[1];  // prefill: q, k_nope; decode: ql_nope, q_pe
  const ffi::AnyBuffer &k_pe = in[prefill ? 2 : 3], &kv_c = in[prefill ? 3 : 2];
  const ffi::AnyBuffer* v = fp8_prefill ? &in[next++] : nullptr;
  const ffi::AnyBuffer &cache = in[next], &slots = in[next + 1], &positions = in[next + 2],
                       &cos_sin = in[next + 3];
  const ffi::AnyBuffer* scales = num_in > next + 4 ? &in[next + 4] : nullptr;
  const ffi::AnyBuffer& cache_out = out.back();

  detail::Checker ck(op);
  const ffi::DataType act = kv_c.element_type();
  ck.expect(is_act_type(act), "kv_c_normed must be bfloat16 or float16");
  ck.expect(kv_c.dimensions().size() == 2, "kv_c_normed must be [T, 512]");
  if (!ck.ok()) return ck.error();
  const int64_t T = kv_c.dimensions()[0];
  const ffi::AnyBuffer& per_head = prefill ? b : a;  // k_nope or ql_nope: [T, H, width]
  ck.expect(per_head.dimensions().size() == 3, "k_nope / ql_nope must be [T, H, width]");
  if (!ck.ok()) return ck.error();
  const int64_t H = per_head.dimensions()[1];
  const bool rope = cos_sin.element_count() > 0;

  ck.dims(kv_c, {T, kLatent}, "kv_c_normed must be [T, 512]");
  ck.expect(is_index_type(slots.element_type()) && slots.element_count() == size_t(T),
            "slot_mapping must be int32/int64 [T]");
  if (rope) {
    auto d = cos_sin.dimensions();
    ck.expect(cos_sin.element_type() == ffi::DataType::F32 && d.size() == 2 && d[1] == kRope,
              "cos_sin_cache must be float32 [max_position, 64]");
    ck.expect(is_index_type(positions.element_type()) && positions.element_count() == size_t(T),
              "positions must be int32/int64 [T]");
  }
  for (size_t i = 0; scales != nullptr && i < num_in - (next + 4); ++i)
    ck.expect(scales[i].element_type() == ffi::DataType::F32 && scales[i].element_count() == 1,
              "scale_inv arguments must be float32 with one element");

  const OpShape shape = op_shape(op, rope);
  const ffi::DataType cache_type = shape.cache == CacheFormat::kFp8DsMla ? ffi::DataType::U8
                                   : shape.cache == CacheFormat::kFp8 ? ffi::DataType::F8E4M3FN
                                                                      : act;
  const int64_t item = cache_type == act ? 2 : 1;
  // [num_blocks, block_size, W], or a stack of them [..., num_blocks, block_size, W]: the leading
  // dimensions are blocks too (slot s is row s of the whole buffer).
  const auto cache_dims = cache.dimensions();
  ck.expect(cache.element_type() == cache_type && cache_dims.size() >= 3,
            "kv_cache has the wrong dtype or rank for this op");
  if (!ck.ok()) return ck.error();
  const int64_t row_width = cache_dims[cache_dims.size() - 1];  // elements of the cache dtype
  ck.expect(row_width * item >= cache_entry_bytes(shape.cache) && row_width * item % 16 == 0,
            "kv_cache rows must hold an entry and be a multiple of 16 bytes");
  ck.expect(cache_out.element_type() == cache_type && cache_out.size_bytes() == cache.size_bytes(),
            "the output cache must match the input cache");
  if (!ck.ok()) return ck.error();

  Epilogue& e = plan.e;
  e.act = act == ffi::DataType::BF16 ? ActType::kBF16 : ActType::kF16;
  e.tokens = T;
  e.heads = H;
  e.slots = slots.untyped_data();
  e.slots_int64 = slots.element_type() == ffi::DataType::S64;
  if (rope) {
    e.positions = positions.untyped_data();
    e.positions_int64 = positions.element_type() == ffi::DataType::S64;
    e.cos_sin = static_cast<const float*>(cos_sin.untyped_data());
    e.max_position = cos_sin.dimensions()[0];
    ck.expect(e.max_position > 0, "cos_sin_cache must have at least one row");
  }
  if (attrs.contains("rope_style")) {
    auto style = attrs.get<std::string_view>("rope_style");
    ck.expect(style.has_value() && (*style == "gptj" || *style == "neox"),
              "rope_style must be the string \"gptj\" or \"neox\"");
    if (style.has_value() && *style == "neox") e.rope_style = RopeStyle::kNeox;
  }
  e.cache_format = shape.cache;
  e.cache_rows = 1;
  for (size_t i = 0; i + 1 < cache_dims.size(); ++i) e.cache_rows *= cache_dims[i];
  // An activation source: [lead..., width] read from column `col` (the attribute `col_attr`,
  // default 0), so a per-head or per-token input can be a wider producer tensor.
  struct Source {
    const uint16_t* data;
    int64_t width;
    Strided<const uint16_t> per_head() const { return {data, heads * width, width}; }
    Strided<const uint16_t> per_token() const { return {data, width, 0}; }  // shared by all heads
    int64_t heads;
  };
  auto source = [&](const ffi::AnyBuffer& x, int64_t lead, int64_t need, const char* col_attr,
                    const char* what) {
    int64_t col = 0;
    if (col_attr != nullptr && attrs.contains(col_attr)) {
      auto value = attrs.get<int64_t>(col_attr);
      ck.expect(value.has_value(), "column attributes must be int64");
      if (value.has_value()) col = *value;
    }
    auto d = x.dimensions();
    const int64_t width = d.size() > 0 ? d.back() : 0;
    ck.expect(x.element_type() == act && width % kChunk == 0 && col % kChunk == 0 && col >= 0 &&
                  col + need <= width && x.element_count() == size_t(lead * width),
              what);
    return Source{detail::act_ptr(x) + col, width, H};
  };
  // An output [T, H, width] of `type`, its rows as a strided view.
  auto output = [&](const ffi::AnyBuffer& x, ffi::DataType type, int64_t width) {
    ck.expect(x.element_type() == type && x.element_count() == size_t(T * H * width),
              "an output has the wrong dtype or shape");
    return Strided<void>{x.untyped_data(), H * width, width};
  };
  const Source kp = source(k_pe, T, kRope, "k_pe_col", "k_pe must be [T, 64] or [T, 1, 64]");
  e.cache = row_spec({kLatent / kChunk, kRopeChunks}, {detail::act_ptr(kv_c), kLatent, 0}, kp.per_token(),
                     {cache_out.untyped_data(), row_width, 0}, nullptr);
  plan.copy_unless_aliased(cache, cache_out);

  const auto scale = [&](int i) { return static_cast<const float*>(scales[i].untyped_data()); };
  // The next head row: its chunk counts come from the op's shape.
  const auto add_row = [&](Strided<const uint16_t> nope, Strided<const uint16_t> pe, Strided<void> out,
                           const float* scale_inv) {
    ck.expect(!shape.rows[e.num_head_rows].shared_pe || pe.per_head == 0,
              "internal: a shared pe row must read one pe row for all heads");
    e.head_rows[e.num_head_rows] = row_spec(shape.rows[e.num_head_rows], nope, pe, out, scale_inv);
    ++e.num_head_rows;
  };
  if (op == Op::prefill_kv_cache || op == Op::prefill_ds_mla) {
    const Source kn = source(b, T * H, kNope, "k_nope_col", "k_nope must be [T, H, 128]");
    add_row(kn.per_head(), kp.per_token(), output(out[0], act, kQkHead), nullptr);  // k
    if (rope) {  // q[..., 128:] rotated in place
      const Source q = source(a, T * H, kQkHead, nullptr, "q must be [T, H, 192]");
      const Strided<void> q_out = output(out[1], act, kQkHead);
      add_row({}, q.per_head().offset(kNope), {static_cast<uint16_t*>(q_out.data) + kNope, q_out.per_token, q_out.per_head},
              nullptr);
      plan.copy_unless_aliased(a, out[1]);
    } else {
      ck.expect(a.element_count() == 0 && out[1].element_count() == 0,
                "without RoPE, q is not passed to the handler");
    }
  } else if (fp8_prefill) {
    const Source q = source(a, T * H, kQkHead, nullptr, "q must be [T, H, 192]");
    const Source kn = source(b, T * H, kNope, "k_nope_col", "k_nope must be [T, H, 128]");
    const Source vs = source(*v, T * H, kVHead, "v_col", "v must be [T, H, 128]");
    const ffi::DataType f8 = ffi::DataType::F8E4M3FN;
    add_row(q.per_head(), q.per_head().offset(kNope), output(out[0], f8, kQkHead), scale(0));  // q_fp8
    add_row(kn.per_head(), kp.per_token(), output(out[1], f8, kQkHead), scale(1));  // k_fp8
    add_row(vs.per_head(), {}, output(out[2], f8, kVHead), scale(2));  // v_fp8
    e.cache.scale_inv = scale(3);
  } else {
    const Source ql = source(a, T * H, kLatent, nullptr, "ql_nope must be [B, H, 512]");
    const Source qp = source(b, T * H, kRope, "q_pe_col", "q_pe must be [B, H, 64]");
    const bool fp8 = op == Op::decode_fp8;
    add_row(ql.per_head(), qp.per_head(), output(out[0], fp8 ? ffi::DataType::F8E4M3FN : act, kEntry),
            fp8 ? scale(0) : nullptr);  // mqa_q
    if (fp8) e.cache.scale_inv = scale(1);
  }
  if (!ck.ok()) return ck.error();
  return ffi::Error::Success();
}

}  // namespace jax_kimi_mla
