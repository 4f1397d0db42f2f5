// CPU handlers of the fused forward targets: the same math as the CUDA kernels, written plainly.
// For each row of C elements, in fp32 (fp64 for float64 x):
//   mean = (1/C) sum x_i,  var = (1/C) sum (x_i - mean)^2  (centered, two passes),
//   rstd = 1 / sqrt(var + eps),  y_i = ((x_i - mean) * rstd) * weight_i + bias_i, rounded once.
// weight/bias may be absent ((0, C)), shared ((1, C)), or one row per segment ((S, C)), and for
// bf16/fp16 x they may be float32 (used as they are, never rounded to 16 bits).
// The residual variant (jax_lnbwd_add_layernorm_fwd_v1) first writes s_i = x_i + residual_i,
// summed in fp32 (fp64) and rounded once to x's dtype, and normalizes that rounded row.
// RMSNorm (jax_lnbwd_rmsnorm_fwd_v1, jax_lnbwd_add_rmsnorm_fwd_v1) is the same code with
// mean = 0 (no mean taken or written), no bias, and the weight used as offset + weight_i (in the
// accumulator type): rstd = 1 / sqrt((1/C) sum x_i^2 + eps), y_i = (x_i * rstd) * (offset + w_i).
#include <cmath>
#include <cstdint>

#include "checks/forward.h"
#include "handlers/cpu_floats.h"
#include "handlers/handlers.h"

namespace lnbwd {
namespace {

// Storage type S of each dtype and its conversion to the accumulator (float, or double).
struct F32 { using S = float; static float Load(S v) { return v; } static S Store(float v) { return v; } };
struct F64 { using S = double; static double Load(S v) { return v; } static S Store(double v) { return v; } };
struct BF16 { using S = uint16_t; static float Load(S v) { return Bf16ToFloat(v); } static S Store(float v) { return FloatToBf16(v); } };
struct F16 { using S = uint16_t; static float Load(S v) { return HalfToFloat(v); } static S Store(float v) { return FloatToHalf(v); } };

// D: x's dtype; Q: the parameters' dtype; A: the accumulator (fp32, or fp64 for fp64 x).
// residual and s: nullptr (the plain forward), or both (the residual variant). mean_out null:
// RMSNorm (bias is then absent too, and offset is added to the weight).
template <typename D, typename Q, typename A>
void Impl(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
          const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s, ffi::AnyBuffer* mean_out,
          ffi::AnyBuffer& rstd_out, double eps_in, const LayernormFwdShape& shape, const ffi::AnyBuffer* x_bias,
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
  const A offset = means ? A(0) : static_cast<A>(offset_in);   // layernorm has none
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
    A mean = 0;   // RMSNorm: no mean, so the squares below are about 0
    if (means) {
      A sum = 0;
      for (int64_t i = 0; i < C; ++i) sum += D::Load(xr[i]);
      mean = sum / static_cast<A>(C);
    }
    A squares = 0;
    for (int64_t i = 0; i < C; ++i) {
      const A d = static_cast<A>(D::Load(xr[i])) - mean;
      squares += d * d;
    }
    const A rstd = A(1) / std::sqrt(squares / static_cast<A>(C) + eps);
    const auto* wr = shape.weight_rows > 0 ? ws + (r / w_div) * C : nullptr;
    const auto* br = shape.bias_rows > 0 ? bs + (r / b_div) * C : nullptr;
    for (int64_t i = 0; i < C; ++i) {
      A v = (static_cast<A>(D::Load(xr[i])) - mean) * rstd;
      if (wr) {
        const A w = static_cast<A>(Q::Load(wr[i]));
        v *= offset != A(0) ? w + offset : w;   // as loaded where there is no offset (-0 stays -0)
      }
      if (br) v += static_cast<A>(Q::Load(br[i]));
      ys[r * C + i] = D::Store(v);
    }
    if (means) means[r] = mean;
    rstds[r] = rstd;
  }
}

// Runs Impl for x's dtype and the parameters' (checked by the caller). bias and mean null:
// RMSNorm, with its offset.
ffi::Error Dispatch(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual, const ffi::AnyBuffer& weight,
                    const ffi::AnyBuffer* bias, ffi::AnyBuffer& y, ffi::AnyBuffer* s, ffi::AnyBuffer* mean,
                    ffi::AnyBuffer& rstd, double eps, const LayernormFwdShape& shape, const char* fn,
                    const ffi::AnyBuffer* x_bias = nullptr, double offset = 0.0) {
  using T = ffi::DataType;
  const bool f32_params = shape.param_dtype == T::F32;
  auto run = [&](auto impl) { impl(x, residual, weight, bias, y, s, mean, rstd, eps, shape, x_bias, offset); };
  switch (x.element_type()) {
    case T::F32: run(Impl<F32, F32, float>); break;
    case T::F64: run(Impl<F64, F64, double>); break;
    case T::BF16: f32_params ? run(Impl<BF16, F32, float>) : run(Impl<BF16, BF16, float>); break;
    case T::F16: f32_params ? run(Impl<F16, F32, float>) : run(Impl<F16, F16, float>); break;
    default:
      return FwdArgError(std::string("'x' has dtype ") + DtypeName(x.element_type()) + ", which has no CPU implementation",
                         fn);
  }
  return ffi::Error::Success();
}

ffi::Error LayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> mean,
                           ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckLayernormFwdArgs(x, weight, bias, *y, *mean, *rstd, eps, &shape); e.failure()) return e;
  return Dispatch(x, nullptr, weight, &bias, *y, nullptr, &*mean, *rstd, eps, shape, "layernorm_fwd");
}

ffi::Error AddLayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                              ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckAddLayernormFwdArgs(x, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape); e.failure()) {
    return e;
  }
  return Dispatch(x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape, "add_layernorm_fwd");
}

ffi::Error AddBiasLayernormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual,
                                  ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> s, ffi::Result<ffi::AnyBuffer> mean,
                                  ffi::Result<ffi::AnyBuffer> rstd, double eps) {
  LayernormFwdShape shape;
  if (auto e = CheckAddBiasLayernormFwdArgs(x, x_bias, residual, weight, bias, *y, *s, *mean, *rstd, eps, &shape);
      e.failure()) {
    return e;
  }
  return Dispatch(x, &residual, weight, &bias, *y, &(*s), &*mean, *rstd, eps, shape, "add_layernorm_fwd", &x_bias);
}

ffi::Error RmsnormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  LayernormFwdShape shape;
  if (auto e = CheckRmsnormFwdArgs(x, weight, *y, *rstd, eps, offset, &shape); e.failure()) return e;
  return Dispatch(x, nullptr, weight, nullptr, *y, nullptr, nullptr, *rstd, eps, shape, "rmsnorm_fwd", nullptr, offset);
}

// s = (x [+ x_bias]) + residual, rounded once; then the rmsnorm of s. x_bias (0, C): absent.
ffi::Error AddRmsnormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer x_bias, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s,
                            ffi::Result<ffi::AnyBuffer> rstd, double eps, double offset) {
  LayernormFwdShape shape;
  if (auto e = CheckAddRmsnormFwdArgs(x, x_bias, residual, weight, *y, *s, *rstd, eps, offset, &shape); e.failure()) {
    return e;
  }
  return Dispatch(x, &residual, weight, nullptr, *y, &(*s), nullptr, *rstd, eps, shape, "add_rmsnorm_fwd",
                  shape.x_bias_rows > 0 ? &x_bias : nullptr, offset);
}

}  // namespace
}  // namespace lnbwd

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdLayernormFwdCpu, lnbwd::LayernormFwdCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
        .Attr<double>("eps")          // added to the variance, in the statistics' dtype
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddLayernormFwdCpu, lnbwd::AddLayernormFwdCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] weight's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: x + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps")          // added to the variance, in the statistics' dtype
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddBiasLayernormFwdCpu, lnbwd::AddBiasLayernormFwdCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x_bias [1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype
        .Arg<xla::ffi::AnyBuffer>()   // bias [0 (absent), 1 or segments, C] x_bias's dtype
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the layernorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: (x + x_bias) + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x), of s
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps")          // added to the variance, in the statistics' dtype
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdRmsnormFwdCpu, lnbwd::RmsnormFwdCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: (x * rstd) * (offset + weight)
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x): 1 / sqrt(mean(x^2) + eps)
        .Attr<double>("eps")          // added to mean(x^2), in the statistics' dtype
        .Attr<double>("offset")       // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdAddRmsnormFwdCpu, lnbwd::AddRmsnormFwdCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x_bias [0 (absent), 1 or segments, C] dtype, or float32 for 16-bit x
        .Arg<xla::ffi::AnyBuffer>()   // residual [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [0 (absent), 1 or segments, C] x_bias's dtype when both are present
        .Ret<xla::ffi::AnyBuffer>()   // y [rows, C] dtype: the rmsnorm of s
        .Ret<xla::ffi::AnyBuffer>()   // s [rows, C] dtype: (x [+ x_bias]) + residual, rounded once to dtype
        .Ret<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x), of s
        .Attr<double>("eps")          // added to mean(s^2), in the statistics' dtype
        .Attr<double>("offset")       // added to the weight, in the accumulator type (Gemma: 1); ignored without weight
);
