// CPU handlers of the fused forward targets: the same math as the CUDA kernels, written plainly.
// For each row of C elements, in fp32 (fp64 for float64 x):
//   mean = (1/C) sum x_i,  var = (1/C) sum (x_i - mean)^2  (centered, two passes),
//   rstd = 1 / sqrt(var + eps),  y_i = ((x_i - mean) * rstd) * weight_i + bias_i, rounded once.
// weight/bias may be absent ((0, C)), shared ((1, C)), or one row per segment ((S, C)), and for
// bf16/fp16 x they may be float32 (used as they are, never rounded to 16 bits).
// The residual variants (add_layernorm_fwd, add_rmsnorm_fwd) first write s_i = x_i + residual_i,
// summed in fp32 (fp64) and rounded once to x's dtype, and normalize that rounded row.
// RMSNorm (NormKind::kRmsNorm) is the same code with mean = 0 (no mean taken or written), no
// bias, and the weight used as offset + weight_i (in the accumulator type):
// rstd = 1 / sqrt((1/C) sum x_i^2 + eps), y_i = (x_i * rstd) * (offset + w_i).
// The row's math is cpu::NormFwdRow (cpu_rows.h), which QK-norm's handler runs too.
#include <cstdint>

#include "checks/forward.h"
#include "handlers/cpu_rows.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"

namespace lnbwd {
namespace {

using cpu::BF16;
using cpu::F16;
using cpu::F32;
using cpu::F64;

// D: x's dtype; Q: the parameters' dtype (cpu_rows.h); A: the accumulator (fp32, or fp64 for
// fp64 x). residual and s: nullptr (the plain forward), or both (the residual variant). RMSNorm
// (norm): mean_out and bias null, and offset added to the weight. Each row: cpu::NormFwdRow.
template <typename D, typename Q, typename A>
void Impl(NormKind norm, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
          const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s, ffi::AnyBuffer* mean_out,
          ffi::AnyBuffer& rstd_out, double eps_in, const NormFwdShape& shape, const ffi::AnyBuffer* x_bias,
          double offset_in) {
  const int64_t rows = shape.rows, C = shape.C;
  const auto* xs = static_cast<const typename D::S*>(x.untyped_data());
  const auto* res = residual ? static_cast<const typename D::S*>(residual->untyped_data()) : nullptr;
  auto* ss = s ? static_cast<typename D::S*>(s->untyped_data()) : nullptr;
  const auto* ws = static_cast<const typename Q::S*>(weight.untyped_data());
  const auto* bs = bias ? static_cast<const typename Q::S*>(bias->untyped_data()) : nullptr;
  auto* ys = static_cast<typename D::S*>(y.untyped_data());
  auto* means = mean_out ? static_cast<A*>(mean_out->untyped_data()) : nullptr;
  auto* rstds = static_cast<A*>(rstd_out.untyped_data());
  const A eps = static_cast<A>(eps_in);
  const bool centered = norm == NormKind::kLayerNorm;
  const A offset = centered ? A(0) : static_cast<A>(offset_in);   // layernorm has none
  // Rows per parameter row (a segment): row r uses parameter row r / div.
  const int64_t w_div = shape.weight_rows > 0 ? rows / shape.weight_rows : 1;
  const int64_t b_div = shape.bias_rows > 0 ? rows / shape.bias_rows : 1;
  const auto* xbs = x_bias ? static_cast<const typename Q::S*>(x_bias->untyped_data()) : nullptr;
  const int64_t xb_div = shape.x_bias_rows > 0 ? rows / shape.x_bias_rows : 1;
  for (int64_t r = 0; r < rows; ++r) {
    const auto* xr = xs + r * C;
    if (res) {   // the row normalized is s = (x [+ x_bias]) + residual in A, rounded once to x's dtype
      const auto* xbr = xbs ? xbs + (r / xb_div) * C : nullptr;
      for (int64_t i = 0; i < C; ++i) {
        A v = static_cast<A>(D::Load(xr[i]));
        if (xbr) v += static_cast<A>(Q::Load(xbr[i]));
        ss[r * C + i] = D::Store(v + static_cast<A>(D::Load(res[r * C + i])));
      }
      xr = ss + r * C;
    }
    const auto* wr = shape.weight_rows > 0 ? ws + (r / w_div) * C : nullptr;
    const auto* br = shape.bias_rows > 0 ? bs + (r / b_div) * C : nullptr;
    A mean, rstd;
    cpu::NormFwdRow<D, Q>(centered, xr, wr, br, ys + r * C, C, eps, offset, &mean, &rstd);
    if (centered) means[r] = mean;
    rstds[r] = rstd;
  }
}

// Runs Impl for x's dtype and the parameters' (checked by the caller). RMSNorm: bias and mean
// null, and its offset.
ffi::Error Dispatch(NormKind norm, const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
                    const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s, ffi::AnyBuffer* mean,
                    ffi::AnyBuffer& rstd, double eps, const NormFwdShape& shape, const char* fn,
                    const ffi::AnyBuffer* x_bias, double offset) {
  using T = ffi::DataType;
  const bool f32_params = shape.param_dtype == T::F32;
  auto run = [&](auto impl) { impl(norm, x, residual, weight, bias, y, s, mean, rstd, eps, shape, x_bias, offset); };
  switch (x.element_type()) {
    case T::F32: run(Impl<F32, F32, float>); break;
    case T::F64: run(Impl<F64, F64, double>); break;
    case T::BF16: f32_params ? run(Impl<BF16, F32, float>) : run(Impl<BF16, BF16, float>); break;
    case T::F16: f32_params ? run(Impl<F16, F32, float>) : run(Impl<F16, F16, float>); break;
    default:
      return ArgError(std::string("'x' has dtype ") + DtypeName(x.element_type()) + ", which has no CPU implementation",
                      fn);
  }
  return ffi::Error::Success();
}

ffi::Error LayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  NormFwdShape shape;
  const char* fn = "layernorm_fwd";
  if (auto e = CheckLayernormFwdArgs(x, weight, bias, *y, *mean, *rstd, eps, &shape, fn); e.failure()) return e;
  return Dispatch(NormKind::kLayerNorm, x, nullptr, weight, &bias, *y, nullptr, &*mean, *rstd, eps, shape, fn,
                  nullptr, 0.0);
}

ffi::Error AddLayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                              ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  NormFwdShape shape;
  if (auto e = CheckAddLayernormFwdArgs(x, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape); e.failure()) {
    return e;
  }
  return Dispatch(NormKind::kLayerNorm, x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape,
                  "add_layernorm_fwd", nullptr, 0.0);
}

ffi::Error AddBiasLayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                                  ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> mean,
                                  ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  NormFwdShape shape;
  if (auto e = CheckAddBiasLayernormFwdArgs(x, x_bias, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape);
      e.failure()) {
    return e;
  }
  return Dispatch(NormKind::kLayerNorm, x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape,
                  "add_layernorm_fwd", &x_bias, 0.0);
}

ffi::Error RmsnormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  NormFwdShape shape;
  const char* fn = "rmsnorm_fwd";
  if (auto e = CheckRmsnormFwdArgs(x, weight, *y, *rstd, eps, offset, &shape, fn); e.failure()) return e;
  return Dispatch(NormKind::kRmsNorm, x, nullptr, weight, nullptr, *y, nullptr, nullptr, *rstd, eps, shape, fn,
                  nullptr, offset);
}

// s = (x [+ x_bias]) + residual, rounded once; then the rmsnorm of s. x_bias (0, C): absent.
ffi::Error AddRmsnormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                            ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  NormFwdShape shape;
  if (auto e = CheckAddRmsnormFwdArgs(x, x_bias, residual, weight, *y, *s, *rstd, eps, offset, &shape); e.failure()) {
    return e;
  }
  return Dispatch(NormKind::kRmsNorm, x, &residual, weight, nullptr, *y, &(*s), nullptr, *rstd, eps, shape,
                  "add_rmsnorm_fwd", shape.x_bias_rows > 0 ? &x_bias : nullptr, offset);
}

}  // namespace
}  // namespace lnbwd

// The forward targets' CPU handler symbols: each target's operands (handlers/operands.h) bound
// to its implementation above.
#define LNBWD_CPU_HANDLER(Handler, key, name) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cpu, lnbwd::Handler##Cpu, lnbwd::Handler##Operands());
LNBWD_FORWARD_TARGETS(LNBWD_CPU_HANDLER)
#undef LNBWD_CPU_HANDLER
