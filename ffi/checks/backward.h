// Argument checks of the backward targets (jax_lnbwd_layernorm_bwd_v1 and _v2, and
// jax_lnbwd_rmsnorm_bwd_v1, which has neither mean nor dbias), shared by their CPU and CUDA
// handlers. Python checks the same things at trace time; these exist for direct
// jax.ffi.ffi_call users and exported programs, so that a kernel never runs on buffers whose
// shapes or dtypes it does not expect. Errors name the function, e.g.
//   layernorm_bwd: 'dy' has shape (4, 9) but x has shape (4, 8)
//   rmsnorm_bwd: 'rstd' has shape (3,) but expected (4,) for x of shape (4, 8)
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "errors/ffi_errors.h"
#include "kernels/norm_kind.h"
#include "registry.h"

namespace lnbwd {

// The message, prefixed with the backward's name, layernorm_bwd or rmsnorm_bwd (checks/forward.h's
// FwdArgError: the forward's).
inline ffi::Error ArgError(const std::string& message, NormKind norm = NormKind::kLayerNorm) {
  return ffi::Error::InvalidArgument(std::string(norm_name(norm)) + "_bwd: " + message);
}

struct LayernormBwdShape {
  int64_t rows;
  int64_t C;
  int64_t segments;       // rows split into this many equal segments, each with its own sums
  int64_t weight_rows;    // 1 (weight shared) or segments (one weight row per segment)
  bool weight_f32 = false;  // mixed precision: weight, dweight, dbias float32 beside bf16/f16 x
  NormKind norm = NormKind::kLayerNorm;   // kRmsNorm: no mean, no dbias
};

inline ffi::Error CheckRank(const char* name, const ffi::AnyBuffer& b, size_t rank, const char* expected,
                            NormKind norm = NormKind::kLayerNorm) {
  if (b.dimensions().size() != rank) {
    return ArgError(std::string("'") + name + "' has shape " + ShapeStr(b.dimensions()) + " but expected " + expected,
                    norm);
  }
  return ffi::Error::Success();
}

// Expected dims of one buffer: rank 1 (d0,) or rank 2 (d0, d1).
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

// Checks every buffer against x's (rows, C) and dtype. Shapes are compared as numbers; text
// is built only for the error message, so the common path allocates nothing.
// allow_f32_weight (targets layernorm v2, rmsnorm): weight may be float32 beside bfloat16/float16
// x (mixed precision); dweight and dbias then are float32 too. Otherwise all have x's dtype.
// mean and dbias are null for RMSNorm (norm = kRmsNorm), and present for layernorm.
inline ffi::Error CheckNormBwdArgs(NormKind norm, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                   const ffi::AnyBuffer& weight, const ffi::AnyBuffer* mean,
                                   const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                   const ffi::AnyBuffer& dweight, const ffi::AnyBuffer* dbias,
                                   LayernormBwdShape* shape, bool allow_f32_weight) {
  auto error = [norm](const std::string& message) { return ArgError(message, norm); };
  if (auto e = CheckRank("x", x, 2, "(rows, C)", norm); e.failure()) return e;
  const int64_t rows = x.dimensions()[0];
  const int64_t C = x.dimensions()[1];
  if (C < 1) return error("'x' has shape " + ShapeStr(x.dimensions()) + " but C (the last axis) must be at least 1");
  if (C > INT32_MAX) return error("'x' has shape " + ShapeStr(x.dimensions()) + " but C must be below 2^31");

  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::F64) {
    return error(std::string("'x' has dtype ") + DtypeName(t) + " but expected float32, bfloat16, float16 or float64");
  }
  // Segments: dweight/dbias are (S, C); weight is (1, C) or (S, C); S divides rows.
  if (auto e = CheckRank("dweight", dweight, 2, "(segments, C)", norm); e.failure()) return e;
  if (auto e = CheckRank("weight", weight, 2, "(1, C) or (segments, C)", norm); e.failure()) return e;
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
  const ffi::DataType stat = t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
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

// Targets layernorm_bwd v1 and v2: every buffer present.
inline ffi::Error CheckLayernormBwdArgs(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                        const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dx,
                                        const ffi::AnyBuffer& dweight, const ffi::AnyBuffer& dbias,
                                        LayernormBwdShape* shape, bool allow_f32_weight = false) {
  return CheckNormBwdArgs(NormKind::kLayerNorm, dy, x, weight, &mean, rstd, dx, dweight, &dbias, shape,
                          allow_f32_weight);
}

// x's dtype as the kernels and the registry name it (CheckLayernormBwdArgs admits only these).
inline ffi::Error ToKernelDtype(ffi::DataType t, Dtype* out, NormKind norm = NormKind::kLayerNorm) {
  switch (t) {
    case ffi::DataType::F32: *out = Dtype::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = Dtype::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = Dtype::kF16; return ffi::Error::Success();
    case ffi::DataType::F64: *out = Dtype::kF64; return ffi::Error::Success();
    default: return ArgError(std::string("'x' has dtype ") + DtypeName(t) + ", which no kernel takes", norm);
  }
}

// The kernel that the 'kernel' attribute names, in the registry (registry.h).
inline ffi::Error CheckKernelAttrs(int32_t kernel, int32_t block_size, const KernelFacts** out,
                                   NormKind norm = NormKind::kLayerNorm) {
  *out = FindKernel(kernel);
  if (*out == nullptr) {
    return ArgError("'kernel' is " + std::to_string(kernel) + " but expected a kernel id from " +
                        std::to_string(MinKernelId()) + " to " + std::to_string(MaxKernelId()) +
                        " (see jax_lnbwd.KERNELS)",
                    norm);
  }
  if (block_size < 0) return ArgError("'block_size' is " + std::to_string(block_size) + " but expected >= 0", norm);
  return ffi::Error::Success();
}

// Whether the kernel takes this call (dtype, block size, segments, C, the device's shared
// memory): the one check of its limits, through the registry. Python asks the same at trace time.
inline ffi::Error CheckKernelLimits(const KernelFacts& k, int32_t block_size, const LayernormBwdShape& shape,
                                    Dtype dtype, const RefusalLimits& device) {
  const std::string why = KernelRefusal(k, {dtype, shape.C, block_size, shape.segments, shape.weight_rows}, device);
  if (!why.empty()) return ArgError(why, shape.norm);
  return ffi::Error::Success();
}

// Target v2's residual gradient: with has_residual, 'dresidual' is [rows, C] of x's dtype (the
// caller aliases it to dx); without, a placeholder with no elements (its shape and dtype are not
// looked at).
inline ffi::Error CheckResidual(const ffi::AnyBuffer& dresidual, bool has_residual, const ffi::AnyBuffer& x,
                                NormKind norm = NormKind::kLayerNorm) {
  if (!has_residual) {
    if (dresidual.element_count() != 0) {
      return ArgError("'dresidual' has shape " + ShapeStr(dresidual.dimensions()) +
                          " but has_residual is false: expected a placeholder with no elements, e.g. (0,)",
                      norm);
    }
    return ffi::Error::Success();
  }
  const auto xd = x.dimensions();
  if (!HasDims(dresidual, {2, xd[0], xd[1]})) {
    return ArgError("'dresidual' has shape " + ShapeStr(dresidual.dimensions()) + " but expected " + ShapeStr(xd) +
                        " (x's shape) with has_residual",
                    norm);
  }
  if (dresidual.element_type() != x.element_type()) {
    return ArgError(std::string("'dresidual' has dtype ") + DtypeName(dresidual.element_type()) + " but expected " +
                        DtypeName(x.element_type()) + " (x's dtype)",
                    norm);
  }
  return ffi::Error::Success();
}

// Target v2's additions run in kernels 11 and 12 (and the CPU reference for every id); llm.c's
// kernels 1-10 compute in the data's dtype only and write dx without adding anything.
inline ffi::Error CheckV2Kernel(int32_t kernel, const LayernormBwdShape& shape, bool has_residual) {
  if (kernel < 1 || kernel > 10 || !(shape.weight_f32 || has_residual)) return ffi::Error::Success();
  return ArgError("kernel " + std::to_string(kernel) + " does not support " +
                  (shape.weight_f32 ? std::string("a float32 weight beside 16-bit x (mixed precision)")
                                    : std::string("an added residual gradient ('dresidual')")) +
                  "; kernels 11 and 12 do");
}

// Target rmsnorm_bwd runs in kernels 11 and 12 only (and the CPU reference for every id):
// llm.c's kernels 1-10 compute layernorm's dx and read a mean that RMSNorm does not have.
inline ffi::Error CheckRmsnormKernel(int32_t kernel) {
  if (kernel < 1 || kernel > 10) return ffi::Error::Success();
  return ArgError("kernel " + std::to_string(kernel) +
                      " (llm.c's) does not support rmsnorm: it computes layernorm only; kernels 11 and 12 do",
                  NormKind::kRmsNorm);
}

// RMSNorm's weight offset (the 1 of Gemma's 1 + w): any finite number.
inline ffi::Error CheckOffset(double offset, NormKind norm) {
  if (std::isfinite(offset)) return ffi::Error::Success();
  return ArgError("'offset' is " + std::to_string(offset) + " but expected a finite number", norm);
}

// Each target's checks, in the order both of its handlers run them (after them the CPU handler
// checks the kernel against the default device limits, the CUDA handler against this GPU's).
// Target layernorm_bwd v2: v1's buffers with a float32 weight allowed, the residual gradient,
// and the kernel's support for those two.
inline ffi::Error CheckLayernormBwdV2Target(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                            const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean,
                                            const ffi::AnyBuffer& rstd, const ffi::AnyBuffer& dresidual,
                                            const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dweight,
                                            const ffi::AnyBuffer& dbias, int32_t kernel, bool has_residual,
                                            LayernormBwdShape* shape) {
  if (auto e = CheckLayernormBwdArgs(dy, x, weight, mean, rstd, dx, dweight, dbias, shape, /*allow_f32_weight=*/true);
      e.failure()) {
    return e;
  }
  if (auto e = CheckResidual(dresidual, has_residual, x); e.failure()) return e;
  return CheckV2Kernel(kernel, *shape, has_residual);
}

// Target rmsnorm_bwd: v2's buffers without mean and dbias, kernels 11 and 12, a finite offset.
inline ffi::Error CheckRmsnormBwdTarget(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& rstd,
                                        const ffi::AnyBuffer& dresidual, const ffi::AnyBuffer& dx,
                                        const ffi::AnyBuffer& dweight, int32_t kernel, bool has_residual,
                                        double offset, LayernormBwdShape* shape) {
  constexpr NormKind kRms = NormKind::kRmsNorm;
  if (auto e = CheckNormBwdArgs(kRms, dy, x, weight, nullptr, rstd, dx, dweight, nullptr, shape,
                                /*allow_f32_weight=*/true);
      e.failure()) {
    return e;
  }
  if (auto e = CheckResidual(dresidual, has_residual, x, kRms); e.failure()) return e;
  if (auto e = CheckRmsnormKernel(kernel); e.failure()) return e;
  return CheckOffset(offset, kRms);
}

}  // namespace lnbwd
