// Turning bad arguments and CUDA failures into ffi::Error values with messages that name the
// argument, its shape and what was expected, e.g.
//   layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace lnbwd {

namespace ffi = xla::ffi;

inline std::string ShapeStr(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << (dims.size() == 1 ? ",)" : ")");
  return out.str();
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

inline ffi::Error ArgError(const std::string& message) {
  return ffi::Error::InvalidArgument("layernorm_bwd: " + message);
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
