// The Python extension of one backend (compiled once for CPU, once for CUDA): its only job is
// registrations(), a dict from op name to the capsule of that op's XLA FFI handler.
#include <nanobind/nanobind.h>

#include "jax_kimi_mla/ffi_plan.h"

// Every FFI target of a backend: the epilogues, then the cache readers. Python's
// formats.FFI_TARGETS lists the same names in the same order.
#define JKM_FOR_EACH_TARGET(X) JKM_FOR_EACH_EPILOGUE(X) X(mla_decode_attention) X(gather_mla_cache)

#define JKM_SYMBOL_2(backend, name) jkm_##backend##_##name
#define JKM_SYMBOL(backend, name) JKM_SYMBOL_2(backend, name)
#define JKM_DECLARE(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(JKM_SYMBOL(JKM_BACKEND, name));
JKM_FOR_EACH_TARGET(JKM_DECLARE)

namespace nb = nanobind;

NB_MODULE(JKM_MODULE, m) {
  m.def("registrations", []() {
    nb::dict d;
#define JKM_REGISTER(name) \
  d[#name] = nb::capsule(reinterpret_cast<void*>(&JKM_SYMBOL(JKM_BACKEND, name)));
    JKM_FOR_EACH_TARGET(JKM_REGISTER)
#undef JKM_REGISTER
    return d;
  });
}
