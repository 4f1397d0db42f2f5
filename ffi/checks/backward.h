// Argument checks of the backward targets (targets.h: layernorm's v1 and v2, and rmsnorm's, which
// has neither mean nor dbias), shared by their CPU and CUDA handlers. Python checks the same
// things at trace time; these exist for direct jax.ffi.ffi_call users and exported programs, so
// that a kernel never runs on buffers whose shapes or dtypes it does not expect. Errors name the
// op, layernorm_bwd or rmsnorm_bwd (BwdOpName), e.g.
//   layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
//   rmsnorm_bwd: 'rstd' has shape (3,) but expected (4,) for x of shape (4, 8)
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "checks/common.h"
#include "errors/ffi_errors.h"
#include "norm_kind.h"
#include "registry.h"

namespace lnbwd {

struct NormBwdShape {
  int64_t rows;
  int64_t C;
  int64_t segments;       // rows split into this many equal segments, each with its own sums
  int64_t weight_rows;    // 1 (weight shared) or segments (one weight row per segment)
  bool weight_f32;        // mixed precision: weight, dweight, dbias float32 beside bf16/f16 x
  NormKind norm;          // the target's, which its handler passes in; kRmsNorm: no mean, no dbias
};

inline ffi::Error CheckRank(const char* name, const ffi::AnyBuffer& b, size_t rank, const char* expected,
                            const char* op) {
  if (b.dimensions().size() != rank) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(b.dimensions()) + " but expected " + expected,
                    op);
  }
  return ffi::Error::Success();
}

// Checks every buffer against x's (rows, C) and dtype (Dims, HasDims: checks/common.h).
// allow_f32_weight (targets layernorm v2, rmsnorm): weight may be float32 beside bfloat16/float16
// x (mixed precision); dweight and dbias then are float32 too. Otherwise all have x's dtype.
// The handler passes its target's kind: mean and dbias are null for RMSNorm (kRmsNorm), and
// present for layernorm.
inline ffi::Error CheckNormBwdArgs(NormKind norm, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                   const ffi::AnyBuffer& weight, const ffi::AnyBuffer* mean,
                                   const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                   const ffi::AnyBuffer& dweight, const ffi::AnyBuffer* dbias,
                                   NormBwdShape* shape, bool allow_f32_weight) {
  const char* op = BwdOpName(norm);
  auto error = [op](const std::string& message) { return ArgError(message, op); };
  if (auto e = CheckRank("x", x, 2, "(rows, C)", op); e.failure()) return e;
  const int64_t rows = x.dimensions()[0];
  const int64_t C = x.dimensions()[1];
  if (C < 1) return error("'x' has shape " + ShapeStr(x.dimensions()) + " but C (the last axis) must be at least 1");
  if (C > INT32_MAX) return error("'x' has shape " + ShapeStr(x.dimensions()) + " but C must be below 2^31");

  const ffi::DataType t = x.element_type();
  if (auto e = CheckDataDtype("x", t, op); e.failure()) return e;
  // Segments: dweight/dbias are (S, C); weight is (1, C) or (S, C); S divides rows.
  if (auto e = CheckRank("dweight", dweight, 2, "(segments, C)", op); e.failure()) return e;
  if (auto e = CheckRank("weight", weight, 2, "(1, C) or (segments, C)", op); e.failure()) return e;
  const int64_t S = dweight.dimensions()[0];
  if (S < 1 || rows % S != 0) {
    return error("'dweight' has shape " + ShapeStr(dweight.dimensions()) +
                 " but its segment count must be >= 1 and divide rows=" + std::to_string(rows));
  }
  const int64_t W = weight.dimensions()[0];
  if (W != 1 && W != S) {
    return error("'weight' has shape " + ShapeStr(weight.dimensions()) + " but expected 1 or " + std::to_string(S) +
                 " rows");
  }
  const ffi::DataType stat = StatsDtype(t);
  // The parameters' dtype (weight, dweight, dbias): x's, or float32 beside 16-bit x (v2).
  const bool sixteen = t == ffi::DataType::BF16 || t == ffi::DataType::F16;
  const bool weight_f32 = allow_f32_weight && sixteen && weight.element_type() == ffi::DataType::F32;
  const ffi::DataType pt = weight_f32 ? ffi::DataType::F32 : t;
  if (allow_f32_weight && weight.element_type() != pt) {
    return error(std::string("'weight' has dtype ") + DtypeName(weight.element_type()) + " but expected " +
                 DtypeName(t) + (sixteen ? " or float32" : "") + " for x of dtype " + DtypeName(t));
  }
  struct Expect {
    const char* name;
    const ffi::AnyBuffer* buf;   // null: the target has no such buffer (RMSNorm's mean, dbias)
    Dims dims;
    ffi::DataType dtype;
  };
  const Expect expects[] = {
      {"dy", &dy, {2, rows, C}, t},       {"weight", &weight, {2, W, C}, pt}, {"mean", mean, {1, rows, 0}, stat},
      {"rstd", &rstd, {1, rows, 0}, stat}, {"dx", &dx, {2, rows, C}, t},      {"dweight", &dweight, {2, S, C}, pt},
      {"dbias", dbias, {2, S, C}, pt},
  };
  for (const Expect& e : expects) {
    if (e.buf == nullptr) continue;
    if (!HasDims(*e.buf, e.dims)) {
      return error(std::string("'") + e.name + "' has shape " + ShapeStr(e.buf->dimensions()) + " but expected " +
                   DimsStr(e.dims) + " for x of shape " + ShapeStr(x.dimensions()));
    }
    if (e.buf->element_type() != e.dtype) {
      return error(std::string("'") + e.name + "' has dtype " + DtypeName(e.buf->element_type()) + " but expected " +
                   DtypeName(e.dtype) + " for x of dtype " + DtypeName(t) +
                   (weight_f32 ? " and weight of dtype float32" : ""));
    }
  }
  shape->rows = rows;
  shape->C = C;
  shape->segments = S;
  shape->weight_rows = W;
  shape->weight_f32 = weight_f32;
  shape->norm = norm;
  return ffi::Error::Success();
}

// The kernel that the 'kernel' attribute names, in the registry (registry.h).
inline ffi::Error CheckKernelAttrs(int32_t kernel, int32_t block_size, const KernelFacts** out, const char* op) {
  *out = FindKernel(kernel);
  if (*out == nullptr) {
    return ArgError("'kernel' is " + std::to_string(kernel) + " but expected a kernel id from " +
                        std::to_string(MinKernelId()) + " to " + std::to_string(MaxKernelId()) +
                        " (see jax_lnbwd.KERNELS)",
                    op);
  }
  if (block_size < 0) return ArgError("'block_size' is " + std::to_string(block_size) + " but expected >= 0", op);
  return ffi::Error::Success();
}

// Whether the kernel takes this call (dtype, block size, segments, C, the device's shared
// memory): the one check of its limits, through the registry. Python asks the same at trace time.
inline ffi::Error CheckKernelLimits(const KernelFacts& k, int32_t block_size, const NormBwdShape& shape,
                                    Dtype dtype, const RefusalLimits& device) {
  const std::string why = KernelRefusal(k, {dtype, shape.C, block_size, shape.segments, shape.weight_rows}, device);
  if (!why.empty()) return ArgError(why, BwdOpName(shape.norm));
  return ffi::Error::Success();
}

// Target v2's residual gradient: with has_residual, 'dresidual' is [rows, C] of x's dtype (the
// caller aliases it to dx); without, a placeholder with no elements (its shape and dtype are not
// looked at).
inline ffi::Error CheckResidual(const ffi::AnyBuffer& dresidual, bool has_residual, const ffi::AnyBuffer& x,
                                const char* op) {
  if (!has_residual) {
    if (dresidual.element_count() != 0) {
      return ArgError("'dresidual' has shape " + ShapeStr(dresidual.dimensions()) +
                          " but has_residual is false: expected a placeholder with no elements, e.g. (0,)",
                      op);
    }
    return ffi::Error::Success();
  }
  const auto xd = x.dimensions();
  if (!HasDims(dresidual, {2, xd[0], xd[1]})) {
    return ArgError("'dresidual' has shape " + ShapeStr(dresidual.dimensions()) + " but expected " + ShapeStr(xd) +
                        " (x's shape) with has_residual",
                    op);
  }
  if (dresidual.element_type() != x.element_type()) {
    return ArgError(std::string("'dresidual' has dtype ") + DtypeName(dresidual.element_type()) + " but expected " +
                        DtypeName(x.element_type()) + " (x's dtype)",
                    op);
  }
  return ffi::Error::Success();
}

// Whether the kernel runs what this call needs beyond layernorm's v1 (registry.h's rmsnorm and
// v2_operands: a float32 weight beside 16-bit x, an added residual gradient): the registry says
// which kernels do; the CPU reference runs them for every id, and refuses what the GPU would.
// An unknown id passes here: CheckKernelAttrs names it.
inline ffi::Error CheckKernelRuns(int32_t kernel, const NormBwdShape& shape, bool has_residual) {
  const KernelFacts* k = FindKernel(kernel);
  if (k == nullptr) return ffi::Error::Success();
  std::string what;
  bool KernelFacts::*fact = nullptr;
  if (shape.norm == NormKind::kRmsNorm && !k->rmsnorm) {
    what = "rmsnorm";
    fact = &KernelFacts::rmsnorm;
  } else if ((shape.weight_f32 || has_residual) && !k->v2_operands) {
    what = shape.weight_f32 ? "a float32 weight beside 16-bit x (mixed precision)"
                            : "an added residual gradient ('dresidual')";
    fact = &KernelFacts::v2_operands;
  } else {
    return ffi::Error::Success();
  }
  return ArgError("kernel " + std::to_string(kernel) + " does not support " + what + "; kernels " +
                      KernelIdsWith(fact) + " do",
                  BwdOpName(shape.norm));
}

// Each target's checks, in the order both of its handlers run them (after them the CPU handler
// checks the kernel against the default device limits, the CUDA handler against this GPU's).
// Target layernorm_bwd v1: every buffer of x's dtype.
inline ffi::Error CheckLayernormBwdTarget(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                          const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                          const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                          const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                          NormBwdShape* shape) {
  return CheckNormBwdArgs(NormKind::kLayerNorm, dy, x, weight, &mean, rstd, dx, dweight, &dbias, shape,
                          /*allow_f32_weight=*/false);
}

// Target layernorm_bwd v2: v1's buffers with a float32 weight allowed, the residual gradient,
// and the kernel's support for those two.
inline ffi::Error CheckLayernormBwdV2Target(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                            const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                            const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dresidual,
                                            const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dweight,
                                            const ffi::AnyBuffer& dbias, int32_t kernel, bool has_residual,
                                            NormBwdShape* shape) {
  constexpr NormKind kLn = NormKind::kLayerNorm;
  if (auto e = CheckNormBwdArgs(kLn, dy, x, weight, &mean, rstd, dx, dweight, &dbias, shape,
                                /*allow_f32_weight=*/true);
      e.failure()) {
    return e;
  }
  if (auto e = CheckResidual(dresidual, has_residual, x, BwdOpName(kLn)); e.failure()) return e;
  return CheckKernelRuns(kernel, *shape, has_residual);
}

// Target rmsnorm_bwd: v2's buffers without mean and dbias, a kernel that runs rmsnorm, a finite
// offset.
inline ffi::Error CheckRmsnormBwdTarget(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& rstd,
                                        const ffi::AnyBuffer& dresidual, const ffi::AnyBuffer& dx,
                                        const ffi::AnyBuffer& dweight, int32_t kernel, bool has_residual,
                                        double offset, NormBwdShape* shape) {
  constexpr NormKind kRms = NormKind::kRmsNorm;
  if (auto e = CheckNormBwdArgs(kRms, dy, x, weight, nullptr, rstd, dx, dweight, nullptr, shape,
                                /*allow_f32_weight=*/true);
      e.failure()) {
    return e;
  }
  if (auto e = CheckResidual(dresidual, has_residual, x, BwdOpName(kRms)); e.failure()) return e;
  if (auto e = CheckKernelRuns(kernel, *shape, has_residual); e.failure()) return e;
  return CheckOffset(offset, BwdOpName(kRms));
}

}  // namespace lnbwd
