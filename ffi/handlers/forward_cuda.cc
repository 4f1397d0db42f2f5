// CUDA handlers of the fused forward targets (targets.h): check the buffers, map dtypes, and hand
// plain pointers to the launcher in ffi/kernels/forward/, with the target's norm kind. No math here.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "checks/forward.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"
#include "kernels/forward/api.h"

namespace lnbwd {
namespace {

// Launches the forward of `norm` on checked buffers; residual and s nullptr for the plain
// forward, x_bias nullptr without x's own bias; bias and mean nullptr for RMSNorm (with its
// offset). Zero rows launch nothing: there is nothing to read or write.
ffi::Error Launch(cudaStream_t stream, NormKind norm, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                  const ffi::AnyBuffer& weight, const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s,
                  ffi::AnyBuffer* mean, ffi::AnyBuffer& rstd, double eps, const NormFwdShape& shape,
                  const ffi::AnyBuffer* x_bias, double offset, const char* fn) {
  NormFwdParams p = {};
  if (auto e = ToKernelDtype("x", x.element_type(), &p.dtype, fn); e.failure()) return e;
  if (auto e = ToKernelDtype("weight", shape.param_dtype, &p.param_dtype, fn); e.failure()) return e;
  if (shape.rows == 0) return ffi::Error::Success();
  p.y = y.untyped_data();
  p.mean = mean ? mean->untyped_data() : nullptr;
  p.rstd = rstd.untyped_data();
  p.x = x.untyped_data();
  p.weight = shape.weight_rows > 0 ? weight.untyped_data() : nullptr;
  p.bias = bias && shape.bias_rows > 0 ? bias->untyped_data() : nullptr;
  p.rows = shape.rows;
  p.C = shape.C;
  p.weight_rows = shape.weight_rows;
  p.bias_rows = shape.bias_rows;
  p.eps = eps;
  p.path = FwdPath::kAuto;
  p.tpr = 0;
  p.residual = residual ? residual->untyped_data() : nullptr;
  p.s = s ? s->untyped_data() : nullptr;
  p.x_bias = x_bias ? x_bias->untyped_data() : nullptr;
  p.x_bias_rows = shape.x_bias_rows;
  p.norm = norm;
  p.offset = offset;
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(norm_fwd(p, stream));
  return ffi::Error::Success();
}

ffi::Error LayernormFwdCuda(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps,
                            cudaStream_t stream) {
  const char* fn = "layernorm_fwd";
  NormFwdShape shape;
  if (auto e = CheckLayernormFwdArgs(x, weight, bias, *y, *mean, *rstd, eps, &shape, fn); e.failure()) return e;
  return Launch(stream, NormKind::kLayerNorm, x, nullptr, weight, &bias, *y, nullptr, &*mean, *rstd, eps, shape,
                nullptr, 0.0, fn);
}

// The residual variant: the same launcher with residual and s set (one kernel reads x and
// residual once and writes y, s, mean and rstd).
ffi::Error AddLayernormFwdCuda(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                               ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps,
                               cudaStream_t stream) {
  NormFwdShape shape;
  if (auto e = CheckAddLayernormFwdArgs(x, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape); e.failure()) {
    return e;
  }
  return Launch(stream, NormKind::kLayerNorm, x, &residual, weight, &bias, *y, &*s, &*mean, *rstd, eps, shape,
                nullptr, 0.0, "add_layernorm_fwd");
}

// The residual variant with x's own bias: s = (x + x_bias) + residual, in one kernel.
ffi::Error AddBiasLayernormFwdCuda(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                                   ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                   ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> mean,
                                   ffi::Result<ffi::AnyBuffer> rstd, double eps, cudaStream_t stream) {
  NormFwdShape shape;
  if (auto e = CheckAddBiasLayernormFwdArgs(x, x_bias, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape);
      e.failure()) {
    return e;
  }
  return Launch(stream, NormKind::kLayerNorm, x, &residual, weight, &bias, *y, &*s, &*mean, *rstd, eps, shape,
                &x_bias, 0.0, "add_layernorm_fwd");
}

// RMSNorm: the same launcher and kernels, with mean and bias null.
ffi::Error RmsnormFwdCuda(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset, cudaStream_t stream) {
  const char* fn = "rmsnorm_fwd";
  NormFwdShape shape;
  if (auto e = CheckRmsnormFwdArgs(x, weight, *y, *rstd, eps, offset, &shape, fn); e.failure()) return e;
  return Launch(stream, NormKind::kRmsNorm, x, nullptr, weight, nullptr, *y, nullptr, nullptr, *rstd, eps, shape,
                nullptr, offset, fn);
}

// The residual variant: s = (x [+ x_bias]) + residual, rounded once, and the rmsnorm of s.
ffi::Error AddRmsnormFwdCuda(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                             ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset, cudaStream_t stream) {
  NormFwdShape shape;
  if (auto e = CheckAddRmsnormFwdArgs(x, x_bias, residual, weight, *y, *s, *rstd, eps, offset, &shape); e.failure()) {
    return e;
  }
  return Launch(stream, NormKind::kRmsNorm, x, &residual, weight, nullptr, *y, &*s, nullptr, *rstd, eps, shape,
                shape.x_bias_rows > 0 ? &x_bias : nullptr, offset, "add_rmsnorm_fwd");
}

}  // namespace
}  // namespace lnbwd

// The forward targets' CUDA handler symbols: each target's operands (handlers/operands.h), then
// XLA's stream, bound to its implementation above. Command-buffer compatible: the handlers only
// launch kernels on XLA's stream, never synchronize or allocate, and keep no state between calls.
#define LNBWD_CUDA_HANDLER(Handler, key, name)                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cuda, lnbwd::Handler##Cuda,                          \
                                lnbwd::Handler##Operands().Ctx<xla::ffi::PlatformStream<cudaStream_t>>(), \
                                {xla::ffi::Traits::kCmdBufferCompatible});
LNBWD_FORWARD_TARGETS(LNBWD_CUDA_HANDLER)
#undef LNBWD_CUDA_HANDLER
