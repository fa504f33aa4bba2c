// CPU handler of gather_mla_cache: gather_on_host, the plain loops of gather_cache.h.
#include "jax_kimi_mla/gather_cache.h"

namespace jax_kimi_mla {
namespace {

ffi::Error handler(ffi::AnyBuffer cache, ffi::AnyBuffer tables, ffi::AnyBuffer lens,
                   ffi::AnyBuffer cache_scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GatherCache g;
  if (ffi::Error err = make_gather_cache(cache, tables, lens, cache_scale_inv, *out, g); err.failure())
    return err;
  gather_on_host(g);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_kimi_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(jkm_cpu_gather_mla_cache, jax_kimi_mla::handler,
                              JKM_GATHER_CACHE_BINDING(xla::ffi::Ffi::Bind()));
