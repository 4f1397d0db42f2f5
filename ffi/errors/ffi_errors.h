// Turning bad arguments and CUDA failures into ffi::Error values with messages that name the
// argument, its shape and what was expected, e.g.
//   layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
// These are the pieces both directions' checks use; each adds its function's name to the
// message (ArgError in checks/backward.h, FwdArgError in checks/forward.h).
#pragma once

#include <cstdint>
#include <string>

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
