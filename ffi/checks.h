// Argument checks shared by the CPU and CUDA handlers. Python checks the same things at trace
// time; these exist for direct jax.ffi.ffi_call users and exported programs, so that a kernel
// never runs on buffers whose shapes or dtypes it does not expect.
#pragma once

#include <cstdint>

#include "errors.h"

namespace lnbwd {

struct LayernormBwdShape {
  int64_t rows;
  int64_t C;
};

inline ffi::Error CheckRank(const char* name, const ffi::AnyBuffer& b, size_t rank, const char* expected) {
  if (b.dimensions().size() != rank) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(b.dimensions()) + " but expected " + expected);
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckLayernormBwdArgs(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                        const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                        const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                        LayernormBwdShape* shape) {
  if (auto e = CheckRank("x", x, 2, "(rows, C)"); e.failure()) return e;
  const int64_t rows = x.dimensions()[0];
  const int64_t C = x.dimensions()[1];
  const std::string x_shape = ShapeStr(x.dimensions());
  const std::string vec_shape = "(" + std::to_string(C) + ",)";
  const std::string row_shape = "(" + std::to_string(rows) + ",)";
  if (C < 1) return ArgError("'x' has shape " + x_shape + " but C (the last axis) must be at least 1");
  if (C > INT32_MAX) return ArgError("'x' has shape " + x_shape + " but C must be below 2^31");

  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::F64) {
    return ArgError(std::string("'x' has dtype ") + DtypeName(t) + " but expected float32, bfloat16, float16 or float64");
  }
  struct Expect {
    const char* name;
    const ffi::AnyBuffer& buf;
    const std::string& shape_text;
    ffi::DataType dtype;
    size_t rank;
  };
  const ffi::DataType stat = t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
  const Expect expects[] = {
      {"dy", dy, x_shape, t, 2},          {"weight", weight, vec_shape, t, 1},
      {"mean", mean, row_shape, stat, 1}, {"rstd", rstd, row_shape, stat, 1},
      {"dx", dx, x_shape, t, 2},          {"dweight", dweight, vec_shape, t, 1},
      {"dbias", dbias, vec_shape, t, 1},
  };
  for (const Expect& e : expects) {
    const std::string got = ShapeStr(e.buf.dimensions());
    if (got != e.shape_text) {
      return ArgError(std::string("'") + e.name + "' has shape " + got + " but expected " + e.shape_text +
                      " for x of shape " + x_shape);
    }
    if (e.buf.element_type() != e.dtype) {
      return ArgError(std::string("'") + e.name + "' has dtype " + DtypeName(e.buf.element_type()) +
                      " but expected " + DtypeName(e.dtype) + " for x of dtype " + DtypeName(t));
    }
  }
  shape->rows = rows;
  shape->C = C;
  return ffi::Error::Success();
}

}  // namespace lnbwd
