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
  int64_t segments;       // rows split into this many equal segments, each with its own sums
  int64_t weight_rows;    // 1 (weight shared) or segments (one weight row per segment)
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
  const std::string row_shape = "(" + std::to_string(rows) + ",)";
  // Segments: dweight/dbias are (S, C); weight is (1, C) or (S, C); S divides rows.
  if (auto e = CheckRank("dweight", dweight, 2, "(segments, C)"); e.failure()) return e;
  if (auto e = CheckRank("weight", weight, 2, "(1, C) or (segments, C)"); e.failure()) return e;
  const int64_t S = dweight.dimensions()[0];
  if (S < 1 || rows % S != 0) {
    return ArgError("'dweight' has shape " + ShapeStr(dweight.dimensions()) + " but its segment count must be >= 1 and divide rows=" + std::to_string(rows));
  }
  const int64_t W = weight.dimensions()[0];
  if (W != 1 && W != S) {
    return ArgError("'weight' has shape " + ShapeStr(weight.dimensions()) + " but expected 1 or " + std::to_string(S) + " rows");
  }
  const std::string w_shape = "(" + std::to_string(W) + ", " + std::to_string(C) + ")";
  const std::string vec_shape = "(" + std::to_string(S) + ", " + std::to_string(C) + ")";
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
    size_t rank;   // informational: the shape text already fixes the rank
  };
  const ffi::DataType stat = t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
  const Expect expects[] = {
      {"dy", dy, x_shape, t, 2},          {"weight", weight, w_shape, t, 2},
      {"mean", mean, row_shape, stat, 1}, {"rstd", rstd, row_shape, stat, 1},
      {"dx", dx, x_shape, t, 2},          {"dweight", dweight, vec_shape, t, 2},
      {"dbias", dbias, vec_shape, t, 2},
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
  shape->segments = S;
  shape->weight_rows = W;
  return ffi::Error::Success();
}

}  // namespace lnbwd
