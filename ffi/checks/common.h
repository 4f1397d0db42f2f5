// Argument checks that every family of targets makes (checks/forward.h, checks/backward.h,
// checks/qk_norm.h), each error prefixed with the op the user called (ArgError, errors/ffi_errors.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "dtype.h"
#include "errors/ffi_errors.h"

namespace lnbwd {

inline bool Is16Bit(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }

// The data's dtype: one the kernels take (float32, bfloat16, float16, float64), named `name`.
inline ffi::Error CheckDataDtype(const char* name, ffi::DataType t, const char* op) {
  if (t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F64) {
    return ffi::Error::Success();
  }
  return ArgError(std::string("'") + name + "' has dtype " + DtypeName(t) +
                      " but expected float32, bfloat16, float16 or float64",
                  op);
}

// The statistics' dtype (mean, rstd) for data of dtype t: float32, or float64 for float64 data.
inline ffi::DataType StatsDtype(ffi::DataType t) {
  return t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// Whether a parameter (weight, bias, x_bias) of dtype pt goes with data of dtype t: the same
// dtype, or float32 beside bfloat16/float16 data (mixed precision: used as float32, never rounded).
inline bool ParamDtypeAllowed(ffi::DataType pt, ffi::DataType t) {
  return pt == t || (pt == ffi::DataType::F32 && Is16Bit(t));
}

// eps, added to the variance (or mean square): a positive finite number.
inline ffi::Error CheckEps(double eps, const char* op) {
  if (std::isfinite(eps) && eps > 0.0) return ffi::Error::Success();
  return ArgError("'eps' is " + std::to_string(eps) + " but expected a positive finite number", op);
}

// Expected dims of one buffer: rank 1 (d0,) or rank 2 (d0, d1). Shapes are compared as numbers;
// text is built only for an error message, so the common path allocates nothing.
struct Dims {
  size_t rank;
  int64_t d0, d1;
};

inline bool HasDims(const ffi::AnyBuffer& b, const Dims& want) {
  const auto dims = b.dimensions();
  return dims.size() == want.rank && dims[0] == want.d0 && (want.rank == 1 || dims[1] == want.d1);
}

inline std::string DimsStr(const Dims& d) {
  return d.rank == 1 ? "(" + std::to_string(d.d0) + ",)" : "(" + std::to_string(d.d0) + ", " + std::to_string(d.d1) + ")";
}

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
