// CUDA handlers of the fused forward targets (jax_lnbwd_layernorm_fwd_v1, its residual variant
// jax_lnbwd_add_layernorm_fwd_v1, and that with x's own bias, jax_lnbwd_add_layernorm_fwd_v2): check the buffers, map dtypes, and hand plain
// pointers to the launcher in ffi/kernels/forward/. No math here.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "checks/forward.h"
#include "handlers/handlers.h"
#include "kernels/forward/api.h"

namespace lnbwd {
namespace {

Dtype ToKernelDtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return Dtype::kBF16;
    case ffi::DataType::F16: return Dtype::kF16;
    case ffi::DataType::F64: return Dtype::kF64;
    default: return Dtype::kF32;   // CheckLayernormFwdArgs admitted only float32 besides these
  }
}

// The launcher's parameters for checked buffers; residual and s nullptr for the plain forward,
// x_bias nullptr without x's own bias; bias and mean nullptr for RMSNorm (with its offset).
LayernormFwdParams Params(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
                          const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s, ffi::AnyBuffer* mean,
                          ffi::AnyBuffer& rstd, double eps, const LayernormFwdShape& shape,
                          const ffi::AnyBuffer* x_bias = nullptr, double offset = 0.0) {
  LayernormFwdParams p = {};
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
  p.dtype = ToKernelDtype(x.element_type());
  p.param_dtype = ToKernelDtype(shape.param_dtype);
  p.eps = eps;
  p.path = FwdPath::kAuto;
  p.tpr = 0;
  p.residual = residual ? residual->untyped_data() : nullptr;
  p.s = s ? s->untyped_data() : nullptr;
  p.x_bias = x_bias ? x_bias->untyped_data() : nullptr;
  p.x_bias_rows = shape.x_bias_rows;
  p.norm = mean ? NormKind::kLayerNorm : NormKind::kRmsNorm;
  p.offset = offset;
  return p;
}

ffi::Error LayernormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                            ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckLayernormFwdArgs(x, weight, bias, *y, *mean, *rstd, eps, &shape); e.failure()) return e;
  if (shape.rows == 0) return ffi::Error::Success();   // nothing to read or write: no launch
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(
      layernorm_fwd(Params(x, nullptr, weight, &bias, *y, nullptr, &*mean, *rstd, eps, shape), stream));
  return ffi::Error::Success();
}

// The residual variant: the same launcher with residual and s set (one kernel reads x and
// residual once and writes y, s, mean and rstd).
ffi::Error AddLayernormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                               ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                               ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckAddLayernormFwdArgs(x, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape); e.failure()) {
    return e;
  }
  if (shape.rows == 0) return ffi::Error::Success();
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(
      layernorm_fwd(Params(x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape), stream));
  return ffi::Error::Success();
}

// The residual variant with x's own bias: s = (x + x_bias) + residual, in one kernel.
ffi::Error AddBiasLayernormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_bias,
                                   ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                                   ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                                   ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckAddBiasLayernormFwdArgs(x, x_bias, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape);
      e.failure()) {
    return e;
  }
  if (shape.rows == 0) return ffi::Error::Success();
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(
      layernorm_fwd(Params(x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape, &x_bias), stream));
  return ffi::Error::Success();
}

// RMSNorm: the same launcher and kernels, with mean and bias null (NormKind::kRmsNorm).
ffi::Error RmsnormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  LayernormFwdShape shape;
  if (auto e = CheckRmsnormFwdArgs(x, weight, *y, *rstd, eps, offset, &shape); e.failure()) return e;
  if (shape.rows == 0) return ffi::Error::Success();
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(layernorm_fwd(
      Params(x, nullptr, weight, nullptr, *y, nullptr, nullptr, *rstd, eps, shape, nullptr, offset), stream));
  return ffi::Error::Success();
}

// The residual variant: s = (x [+ x_bias]) + residual, rounded once, and the rmsnorm of s.
ffi::Error AddRmsnormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                             ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                             ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  LayernormFwdShape shape;
  if (auto e = CheckAddRmsnormFwdArgs(x, x_bias, residual, weight, *y, *s, *rstd, eps, offset, &shape); e.failure()) {
    return e;
  }
  if (shape.rows == 0) return ffi::Error::Success();
  LNBWD_FFI_RETURN_IF_CUDA_ERROR(layernorm_fwd(Params(x, &residual, weight, nullptr, *y, &(*s), nullptr, *rstd, eps,
                                                      shape, shape.x_bias_rows > 0 ? &x_bias : nullptr, offset),
                                               stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace lnbwd

// Command-buffer compatible: the handlers only launch kernels on XLA's stream, never
// synchronize or allocate, and keep no state between calls.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdLayernormFwdCuda, lnbwd::LayernormFwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
        .Attr<double>("eps"),         // added to the variance, in the statistics' dtype
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddLayernormFwdCuda, lnbwd::AddLayernormFwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: x + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps"),         // added to the variance, in the statistics' dtype
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddBiasLayernormFwdCuda, lnbwd::AddBiasLayernormFwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x_bias [1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] x_bias's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: (x + x_bias) + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps"),         // added to the variance, in the statistics' dtype
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdRmsnormFwdCuda, lnbwd::RmsnormFwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: (x * rstd) * (offset + weight)
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x): 1 / sqrt(mean(x^2) + eps)
        .Attr<double>("eps")          // added to mean(x^2), in the statistics' dtype
        .Attr<double>("offset"),      // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddRmsnormFwdCuda, lnbwd::AddRmsnormFwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x_bias [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype when both are present
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the rmsnorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: (x [+ x_bias]) + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps")          // added to mean(s^2), in the statistics' dtype
        .Attr<double>("offset"),      // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
    {xla::ffi::Traits::kCmdBufferCompatible});
