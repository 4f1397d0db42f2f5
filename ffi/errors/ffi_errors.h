// Turning bad arguments and CUDA failures into ffi::Error values with messages that name the
// argument, its shape and what was expected, e.g.
//   layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
// These are the pieces both directions' checks use: ArgError puts the name of the op the user
// called in front of every message.
#pragma once

#include <cstdint>
#include <string>

#include "norm_kind.h"
#include "xla/ffi/api/ffi.h"

namespace lnbwd {

namespace ffi = xla::ffi;

// Formats dims as "(4, 8)" or "(8,)". Only called on the error path. Built with std::to_string,
// not iostreams: the extension may carry its own static libstdc++, whose stream/locale state
// is not set up inside a host process that loaded another libstdc++ first (a crash seen with
// jax 0.11 on the GPU machine).
inline std::string ShapeStr(ffi::AnyBuffer::Dimensions dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "an unsupported dtype";
  }
}

// An argument the target cannot take: "op: message". `op` is the op the user called, e.g.
// "layernorm_fwd", "add_rmsnorm_fwd" or "rmsnorm_bwd" (BwdOpName).
inline ffi::Error ArgError(const std::string& message, const char* op) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// The backward op of a norm kind, as errors name it.
constexpr const char* BwdOpName(NormKind k) {
  switch (k) {
    case NormKind::kLayerNorm: return "layernorm_bwd";
    case NormKind::kRmsNorm: return "rmsnorm_bwd";
  }
  return "norm_bwd";   // not reached: every kind is listed above
}

}  // namespace lnbwd

// file:line: operation <expr> failed: <cuda message>, as jaxlib's gpu/ handlers report it.
#define LNBWD_FFI_RETURN_IF_CUDA_ERROR(expr)                                                  \
  do {                                                                                        \
    cudaError_t lnbwd_status_ = (expr);                                                       \
    if (lnbwd_status_ != cudaSuccess) {                                                       \
      return ::xla::ffi::Error::Internal(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                         ": operation " #expr " failed: " +                   \
                                         cudaGetErrorString(lnbwd_status_));                  \
    }                                                                                         \
  } while (0)
