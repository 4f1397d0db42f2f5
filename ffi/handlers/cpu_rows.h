// The per-row math of the CPU handlers, written once: the norms' forward (forward_cpu.cc), their
// backward (backward_cpu.cc) and QK-norm's (qk_norm_cpu.cc) differ only in where their rows lie
// and what they do around them (residual sums, segments, heads), so each walks its own rows and
// hands every row to the functions below: a pointer to its C contiguous elements, the weight's
// row (C elements), the sizes. The norm kind is a plain argument (RMSNorm is layernorm with
// mean = 0, no bias, no mean term in dx, and an offset added to the weight).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "handlers/cpu_floats.h"

namespace lnbwd::cpu {

// Each dtype XLA hands us: its storage type S, its accumulator A (fp32, or fp64 for float64) and
// the conversions between them (16-bit values rounded to nearest even, as on the GPU).
struct F32 { using S = float; using A = float;
  static A Load(S v) { return v; } static S Store(A v) { return v; } };
struct F64 { using S = double; using A = double;
  static A Load(S v) { return v; } static S Store(A v) { return v; } };
struct BF16 { using S = uint16_t; using A = float;
  static A Load(S v) { return Bf16ToFloat(v); } static S Store(A v) { return FloatToBf16(v); } };
struct F16 { using S = uint16_t; using A = float;
  static A Load(S v) { return HalfToFloat(v); } static S Store(A v) { return FloatToHalf(v); } };

// One row of the forward, in A = D's accumulator (D: the data's type; Q: the parameters', D's or
// F32 beside BF16/F16 data):
//   mean = (1/C) sum x_i (0 unless centered),  var = (1/C) sum (x_i - mean)^2 (two passes),
//   rstd = 1 / sqrt(var + eps),  y_i = ((x_i - mean) * rstd) * w_i + b_i, rounded once.
// w and b may be null (absent). offset is added to the weight, only where it is not 0 (a weight
// of -0 stays -0); the caller passes 0 for layernorm. y may be x itself (in place): each element
// is read before the same element of y is written. Writes mean (0 when not centered) and rstd.
template <typename D, typename Q>
void NormFwdRow(bool centered, const typename D::S* x, const typename Q::S* w, const typename Q::S* b,
                typename D::S* y, int64_t C, typename D::A eps, typename D::A offset, typename D::A* mean_out,
                typename D::A* rstd_out) {
  using A = typename D::A;
  static_assert(std::is_same_v<A, typename Q::A>, "data and parameters accumulate in the same type");
  A mean = 0;   // RMSNorm: no mean, so the squares below are about 0
  if (centered) {
    A sum = 0;
    for (int64_t i = 0; i < C; ++i) sum += D::Load(x[i]);
    mean = sum / static_cast<A>(C);
  }
  A squares = 0;
  for (int64_t i = 0; i < C; ++i) {
    const A d = static_cast<A>(D::Load(x[i])) - mean;
    squares += d * d;
  }
  const A rstd = A(1) / std::sqrt(squares / static_cast<A>(C) + eps);
  for (int64_t i = 0; i < C; ++i) {
    A v = (static_cast<A>(D::Load(x[i])) - mean) * rstd;
    if (w) {
      const A wi = static_cast<A>(Q::Load(w[i]));
      v *= offset != A(0) ? wi + offset : wi;   // as loaded where there is no offset (-0 stays -0)
    }
    if (b) v += static_cast<A>(Q::Load(b[i]));
    y[i] = D::Store(v);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

// One row of the backward, in A (D: the data's type, of dy, x, dx, dres; P: the parameters',
// D's or F32 beside BF16/F16 data), given the row's saved mean (0 when not centered) and rstd:
//   xhat_i = (x_i - mean) * rstd,  g_i = (offset + w_i) * dy_i,
//   a = mean(g) (0 when not centered: no mean was subtracted),  b = mean(g * xhat),
//   dx_i = (g_i - a - xhat_i * b) * rstd [+ dres_i, added in A], rounded once;
// and adds the row's dy_i * xhat_i to dweight[i] and, where dbias is not null, dy_i to dbias[i]
// (the caller's sums, in A). offset is added only where it is not 0 (layernorm's weight is used
// exactly as stored). dres may be null, or dx itself; dy may be dx itself (in place): each
// element is read before the same element of dx is written.
template <typename D, typename P>
void NormBwdRow(bool centered, const typename D::S* dy, const typename D::S* x, const typename P::S* w,
                typename D::A mean, typename D::A rstd, const typename D::S* dres, typename D::S* dx,
                typename D::A* dweight, typename D::A* dbias, int64_t C, typename D::A offset) {
  using A = typename D::A;
  static_assert(std::is_same_v<A, typename P::A>, "data and parameters accumulate in the same type");
  auto weight = [&](int64_t i) { return offset != A(0) ? P::Load(w[i]) + offset : P::Load(w[i]); };
  const A m = centered ? mean : A(0), s = rstd;
  // Pass 1: a = mean(g), b = mean(g * xhat), with g = weight * dy and xhat = (x - mean) * rstd.
  A sum_g = 0, sum_g_xhat = 0;
  for (int64_t i = 0; i < C; ++i) {
    const A g = weight(i) * D::Load(dy[i]);
    sum_g += g;
    sum_g_xhat += g * ((D::Load(x[i]) - m) * s);
  }
  // RMSNorm subtracted no mean, so dx has no term for its gradient: a = 0.
  const A a = centered ? sum_g / A(C) : A(0), b = sum_g_xhat / A(C);
  // Pass 2: dx = (g - a - xhat * b) * rstd (+ dres); dweight += dy * xhat; dbias += dy.
  for (int64_t i = 0; i < C; ++i) {
    const A d = D::Load(dy[i]);
    const A xhat = (D::Load(x[i]) - m) * s;
    A v = (weight(i) * d - a - xhat * b) * s;
    if (dres) v += D::Load(dres[i]);
    dx[i] = D::Store(v);
    dweight[i] += d * xhat;
    if (dbias) dbias[i] += d;
  }
}

}  // namespace lnbwd::cpu
