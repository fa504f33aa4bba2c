// CPU handlers: the same Plan as the CUDA kernel, walked token by token in order (so among
// tokens that share a slot, the last one's entry stays, as in the jnp reference).
#include <cstring>

#include "jax_kimi_mla/ffi_plan.h"

namespace jax_kimi_mla {
namespace {

void write_ds_mla_entry(const Epilogue& e, int64_t t, int64_t row) {
  uint8_t* entry = ds_mla_entry(e, row);
  for (int tile = 0; tile < kLatent / kDsMlaTile; ++tile) {
    float v[kTileChunks][kChunk];
    float amax = 0.0f;
    for (int c = 0; c < kTileChunks; ++c) {
      chunk_values(e, e.cache, t, 0, tile * kTileChunks + c, v[c]);
      for (float x : v[c]) amax = amax_fold(amax, x);
    }
    const float s = ds_mla_tile_scale(amax);
    for (int c = 0; c < kTileChunks; ++c) store_ds_mla_latent(entry, tile * kTileChunks + c, v[c], s);
    store_ds_mla_scale(entry, tile, s);
  }
  for (int j = 0; j < kRopeChunks; ++j) store16(ds_mla_pe_dst(entry, j), make_ds_mla_pe(e, t, j));
}

void emit(const RowSpec& r, int64_t out_row, int64_t h, int c, const Raw16& chunk) {
  store_chunk(chunk_dst(r, out_row, h, c), chunk, r.scale_inv != nullptr);
}

// One output row. Runs of chunks that are plain copies (activation output, not rotated) are one
// memcpy each: the CPU's fast path; every other chunk goes through make_chunk, all of them before
// any is stored (prefill rotates q's rope part in place, and a NeoX chunk reads another chunk of
// the row). out_row: see chunk_dst.
void emit_row(const Epilogue& e, const RowSpec& r, int64_t t, int64_t h, int64_t out_row) {
  int c = 0;
  if (r.scale_inv == nullptr) {
    const int copied = e.cos_sin != nullptr ? r.nope_chunks : r.chunks();
    if (r.nope_chunks > 0)
      std::memcpy(chunk_dst(r, out_row, h, 0), chunk_src(r, t, h, 0),
                  size_t(r.nope_chunks) * sizeof(Raw16));
    if (copied > r.nope_chunks)
      std::memcpy(chunk_dst(r, out_row, h, r.nope_chunks),
                  chunk_src(r, t, h, r.nope_chunks),
                  size_t(r.pe_chunks) * sizeof(Raw16));
    c = copied;
  }
  Raw16 chunks[kCacheChunks];  // the widest row: the 576-element cache entry or mqa_q
  for (int i = c; i < r.chunks(); ++i) chunks[i] = make_chunk(e, r, t, h, i);
  for (; c < r.chunks(); ++c) emit(r, out_row, h, c, chunks[c]);
}

void run(const Plan& plan) {
  for (int i = 0; i < plan.num_copies; ++i)
    std::memcpy(plan.copies[i].dst, plan.copies[i].src, plan.copies[i].bytes);
  const Epilogue& e = plan.e;
  for (int64_t t = 0; t < e.tokens; ++t) {
    const int64_t row = e.cache_row(t);
    if (row >= 0 && e.cache_format == CacheFormat::kFp8DsMla) {
      write_ds_mla_entry(e, t, row);
    } else if (row >= 0) {
      emit_row(e, e.cache, t, 0, row);
    }
    for (int64_t h = 0; h < e.heads; ++h)
      for (int r = 0; r < e.num_head_rows; ++r) emit_row(e, e.head_rows[r], t, h, t);
  }
}

template <Op op>
ffi::Error handler(ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  Plan plan;
  if (ffi::Error err = make_epilogue_plan(op, args, rets, attrs, plan); err.failure()) return err;
  run(plan);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla

#define JKM_CPU_HANDLER(name)                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jkm_cpu_##name,                                     \
                                jax_kimi_mla::handler<jax_kimi_mla::Op::name>,      \
                                xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
JKM_FOR_EACH_EPILOGUE(JKM_CPU_HANDLER)
