// What every handler's parsing of its FFI operands shares (host code): the operand dtype classes,
// and the form of its errors, "jax_kimi_mla <target>: <what is wrong>", the target named as in
// ffi/module.cc (its FFI name without the jax_kimi_mla_ prefix and the _v<ABI> suffix).
#pragma once

#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_kimi_mla {

namespace ffi = xla::ffi;

inline bool is_act_type(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }
inline bool is_index_type(ffi::DataType t) { return t == ffi::DataType::S32 || t == ffi::DataType::S64; }

inline std::string error_text(std::string_view target, std::string_view what) {
  std::string text = "jax_kimi_mla ";
  text.append(target).append(": ").append(what);
  return text;
}

// A malformed call (a direct FFI call that skipped the Python checks, or a limit of the kernel).
inline ffi::Error invalid_argument(std::string_view target, std::string_view what) {
  return ffi::Error::InvalidArgument(error_text(target, what));
}

// A failure of the CUDA runtime or driver, or a case the handler cannot have been given.
inline ffi::Error internal_error(std::string_view target, std::string_view what) {
  return ffi::Error::Internal(error_text(target, what));
}

}  // namespace jax_kimi_mla
