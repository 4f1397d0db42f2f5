// Argument checks that both directions' targets make (checks/forward.h, checks/backward.h), each
// error prefixed with the op the user called (ArgError, errors/ffi_errors.h).
#pragma once

#include <cmath>
#include <string>

#include "dtype.h"
#include "errors/ffi_errors.h"

namespace lnbwd {

inline bool Is16Bit(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }

// The dtype of argument `name` as the kernels and the registry name it. Every dtype is listed: one
// that no kernel takes is an error, never a fallback (the checks admit only these four first).
inline ffi::Error ToKernelDtype(const char* name, ffi::DataType t, Dtype* out, const char* op) {
  switch (t) {
    case ffi::DataType::F32: *out = Dtype::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = Dtype::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = Dtype::kF16; return ffi::Error::Success();
    case ffi::DataType::F64: *out = Dtype::kF64; return ffi::Error::Success();
    default: return ArgError(std::string("'") + name + "' has dtype " + DtypeName(t) + ", which no kernel takes", op);
  }
}

// RMSNorm's weight offset (the 1 of Gemma's 1 + w): any finite number.
inline ffi::Error CheckOffset(double offset, const char* op) {
  if (std::isfinite(offset)) return ffi::Error::Success();
  return ArgError("'offset' is " + std::to_string(offset) + " but expected a finite number", op);
}

}  // namespace lnbwd
