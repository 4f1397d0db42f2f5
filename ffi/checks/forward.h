// Argument checks of the fused forward targets (targets.h: layernorm's, its residual variant
// without and with x's own bias, and RMSNorm's two, which have no bias and no mean), shared by
// their CPU and CUDA handlers. Python checks the same at trace time; these exist for direct
// jax.ffi.ffi_call users and exported programs, so no kernel runs on buffers it does not expect.
// Errors name the op (each handler passes its own), e.g.
//   layernorm_fwd: 'y' has shape (4, 9) but expected (4, 8) for x of shape (4, 8)
//   add_layernorm_fwd: 'residual' has dtype float32 but expected bfloat16 (x's dtype)
//   rmsnorm_fwd: 'rstd' has shape (3,) but expected (4,) for x of shape (4, 8)
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "checks/common.h"
#include "errors/ffi_errors.h"
#include "targets.h"

namespace lnbwd {

struct NormFwdShape {
  int64_t rows;
  int64_t C;
  int64_t weight_rows;   // 0: no weight; 1: one row for all rows; S: one per segment of rows/S rows
  int64_t bias_rows;
  int64_t x_bias_rows = 0;     // add_layernorm_fwd_v2 only: x_bias's rows (1 or S), else 0
  ffi::DataType param_dtype;   // the present parameters' dtype (x's when none is present)
};

// weight or bias: (0, C) absent, (1, C) shared, or (S, C) with S dividing rows.
inline ffi::Error CheckParam(const char* fn, const char* name, const ffi::AnyBuffer& p, const ffi::AnyBuffer& x,
                             int64_t* prows) {
  const auto dims = p.dimensions();
  const int64_t rows = x.dimensions()[0], C = x.dimensions()[1];
  if (dims.size() != 2 || dims[1] != C) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(dims) + " but expected (0, " +
                       std::to_string(C) + ") (absent), (1, " + std::to_string(C) + ") or (segments, " +
                       std::to_string(C) + ") for x of shape " + ShapeStr(x.dimensions()), fn);
  }
  if (dims[0] > 1 && rows % dims[0] != 0) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(dims) + " but its " +
                       std::to_string(dims[0]) + " rows must divide the " + std::to_string(rows) +
                       " rows of x (one parameter row per equal segment of rows)", fn);
  }
  const ffi::DataType t = x.element_type(), pt = p.element_type();
  if (!ParamDtypeAllowed(pt, t)) {
    return ArgError(std::string("'") + name + "' has dtype " + DtypeName(pt) + " but expected " + DtypeName(t) +
                       (Is16Bit(t) ? " or float32" : "") + " for x of dtype " + DtypeName(t), fn);
  }
  *prows = dims[0];
  return ffi::Error::Success();
}

// x, eps, the parameters and the outputs. bias and mean are null for RMSNorm (no such buffers).
inline ffi::Error CheckNormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight, const ffi::AnyBuffer* bias,
                                   const ffi::AnyBuffer& y, const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd,
                                   double eps, NormFwdShape* shape, const char* fn) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ArgError("'x' has shape " + ShapeStr(xd) + " but expected (rows, C)", fn);
  const int64_t rows = xd[0], C = xd[1];
  if (C < 1) return ArgError("'x' has shape " + ShapeStr(xd) + " but C (the last axis) must be at least 1", fn);
  if (C > INT32_MAX) return ArgError("'x' has shape " + ShapeStr(xd) + " but C must be below 2^31", fn);
  const ffi::DataType t = x.element_type();
  if (auto e = CheckDataDtype("x", t, fn); e.failure()) return e;
  if (auto e = CheckEps(eps, fn); e.failure()) return e;
  if (auto e = CheckParam(fn, "weight", weight, x, &shape->weight_rows); e.failure()) return e;
  shape->bias_rows = 0;
  if (bias != nullptr) {
    if (auto e = CheckParam(fn, "bias", *bias, x, &shape->bias_rows); e.failure()) return e;
    if (shape->weight_rows > 0 && shape->bias_rows > 0 && weight.element_type() != bias->element_type()) {
      return ArgError(std::string("'weight' has dtype ") + DtypeName(weight.element_type()) + " but 'bias' has " +
                         DtypeName(bias->element_type()) + "; pass both in one dtype", fn);
    }
  }
  shape->param_dtype = shape->weight_rows > 0 ? weight.element_type() : shape->bias_rows > 0 ? bias->element_type() : t;

  const ffi::DataType stat = StatsDtype(t);
  struct Expect {
    const char* name;
    const ffi::AnyBuffer* buf;   // null: the target has no such output (RMSNorm's mean)
    size_t rank;
    ffi::DataType dtype;
  };
  const Expect expects[] = {{"y", &y, 2, t}, {"mean", mean, 1, stat}, {"rstd", &rstd, 1, stat}};
  for (const Expect& e : expects) {
    if (e.buf == nullptr) continue;
    const auto d = e.buf->dimensions();
    const bool ok = d.size() == e.rank && d[0] == rows && (e.rank == 1 || d[1] == C);
    if (!ok) {
      const std::string want = e.rank == 1 ? "(" + std::to_string(rows) + ",)"
                                           : "(" + std::to_string(rows) + ", " + std::to_string(C) + ")";
      return ArgError(std::string("'") + e.name + "' has shape " + ShapeStr(d) + " but expected " + want +
                         " for x of shape " + ShapeStr(xd), fn);
    }
    if (e.buf->element_type() != e.dtype) {
      return ArgError(std::string("'") + e.name + "' has dtype " + DtypeName(e.buf->element_type()) +
                         " but expected " + DtypeName(e.dtype) + " for x of dtype " + DtypeName(t), fn);
    }
  }
  shape->rows = rows;
  shape->C = C;
  return ffi::Error::Success();
}

inline ffi::Error CheckLayernormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                        const ffi::AnyBuffer& bias, const ffi::AnyBuffer& y,
                                        const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd, double eps,
                                        NormFwdShape* shape, const char* fn) {
  return CheckNormFwdArgs(x, weight, &bias, y, &mean, rstd, eps, shape, fn);
}

// The residual variants' residual and s, which have x's shape and dtype exactly (s = x +
// residual is rounded to that dtype).
inline ffi::Error CheckResidualAndSum(const ffi::AnyBuffer& x, const ffi::AnyBuffer& residual, const ffi::AnyBuffer& s,
                                      const NormFwdShape& shape, const char* fn) {
  const struct {
    const char* name;
    const ffi::AnyBuffer& buf;
  } same_as_x[] = {{"residual", residual}, {"s", s}};
  for (const auto& a : same_as_x) {
    const auto d = a.buf.dimensions();
    if (d.size() != 2 || d[0] != shape.rows || d[1] != shape.C) {
      return ArgError(std::string("'") + a.name + "' has shape " + ShapeStr(d) + " but expected " +
                         ShapeStr(x.dimensions()) + " (x's shape)", fn);
    }
    if (a.buf.element_type() != x.element_type()) {
      return ArgError(std::string("'") + a.name + "' has dtype " + DtypeName(a.buf.element_type()) +
                         " but expected " + DtypeName(x.element_type()) + " (x's dtype)", fn);
    }
  }
  return ffi::Error::Success();
}

// The residual variant (add_layernorm_fwd): the forward's checks, then residual
// and s.
inline ffi::Error CheckAddLayernormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& residual,
                                           const ffi::AnyBuffer& weight, const ffi::AnyBuffer& bias,
                                           const ffi::AnyBuffer& y, const ffi::AnyBuffer& s,
                                           const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd, double eps,
                                           NormFwdShape* shape) {
  const char* fn = "add_layernorm_fwd";
  if (auto e = CheckLayernormFwdArgs(x, weight, bias, y, mean, rstd, eps, shape, fn); e.failure()) return e;
  return CheckResidualAndSum(x, residual, s, *shape, fn);
}

// x's own bias (add_layernorm_fwd_v2, add_rmsnorm_fwd): a parameter ((1, C) or (S, C); (0, C)
// absent unless `required`) of the parameters' dtype (x's, or float32 beside 16-bit x; the one
// dtype of the target's other parameters when they are present; `params_have` names them for
// the message: "weight and bias have", or RMSNorm's "weight has").
inline ffi::Error CheckXBias(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_bias, bool required, const char* params_have,
                             NormFwdShape* shape, const char* fn) {
  if (auto e = CheckParam(fn, "x_bias", x_bias, x, &shape->x_bias_rows); e.failure()) return e;
  if (shape->x_bias_rows == 0) {
    if (!required) return ffi::Error::Success();
    return ArgError("'x_bias' has shape " + ShapeStr(x_bias.dimensions()) + " but expected (1, " +
                       std::to_string(shape->C) + ") or (segments, " + std::to_string(shape->C) +
                       "): this target adds it (" + kAddLayernormFwdTarget + " has none)", fn);
  }
  const bool params = shape->weight_rows > 0 || shape->bias_rows > 0;
  if (params && x_bias.element_type() != shape->param_dtype) {
    return ArgError(std::string("'x_bias' has dtype ") + DtypeName(x_bias.element_type()) + " but " + params_have + " " +
                       DtypeName(shape->param_dtype) + "; pass the parameters in one dtype", fn);
  }
  shape->param_dtype = x_bias.element_type();
  return ffi::Error::Success();
}

// The residual variant with x's own bias (add_bias_layernorm_fwd: s = x + x_bias +
// residual): v1's checks, then x_bias, a parameter that must be present ((1, C) or (S, C)) and
// of the parameters' dtype (x's, or float32 beside 16-bit x; the one dtype of weight and bias
// when they are present).
inline ffi::Error CheckAddBiasLayernormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_bias,
                                               const ffi::AnyBuffer& residual, const ffi::AnyBuffer& weight,
                                               const ffi::AnyBuffer& bias, const ffi::AnyBuffer& y,
                                               const ffi::AnyBuffer& s, const ffi::AnyBuffer& mean,
                                               const ffi::AnyBuffer& rstd, double eps, NormFwdShape* shape) {
  if (auto e = CheckAddLayernormFwdArgs(x, residual, weight, bias, y, s, mean, rstd, eps, shape); e.failure()) {
    return e;
  }
  return CheckXBias(x, x_bias, /*required=*/true, "weight and bias have", shape, "add_layernorm_fwd");
}

// rmsnorm_fwd: x, weight ((0, C) absent, (1, C) or (S, C)), y, rstd, eps, offset.
inline ffi::Error CheckRmsnormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight, const ffi::AnyBuffer& y,
                                      const ffi::AnyBuffer& rstd, double eps, double offset, NormFwdShape* shape,
                                      const char* fn) {
  if (auto e = CheckNormFwdArgs(x, weight, nullptr, y, nullptr, rstd, eps, shape, fn); e.failure()) return e;
  return CheckOffset(offset, fn);
}

// add_rmsnorm_fwd: s = (x [+ x_bias]) + residual, then the rmsnorm of s. x_bias is
// optional ((0, C): absent).
inline ffi::Error CheckAddRmsnormFwdArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_bias,
                                         const ffi::AnyBuffer& residual, const ffi::AnyBuffer& weight,
                                         const ffi::AnyBuffer& y, const ffi::AnyBuffer& s, const ffi::AnyBuffer& rstd,
                                         double eps, double offset, NormFwdShape* shape) {
  const char* fn = "add_rmsnorm_fwd";
  if (auto e = CheckRmsnormFwdArgs(x, weight, y, rstd, eps, offset, shape, fn); e.failure()) return e;
  if (auto e = CheckResidualAndSum(x, residual, s, *shape, fn); e.failure()) return e;
  return CheckXBias(x, x_bias, /*required=*/false, "weight has", shape, fn);
}

}  // namespace lnbwd
