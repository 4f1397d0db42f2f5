// The per-element math of kernel 12's two passes over a row, shared by its row ring
// (kernel12_bulk_copy_ring.cu) and its wide-row path (kernel12_wide_rows.cu). With
// g_i = weight_i * dy_i and xhat_i = (x_i - mean) * rstd (centered, never E[x^2] - E[x]^2):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean), summed over the row;
//   pass 2: dx_i = (g_i - s1/C - xhat_i s2 rstd/C) rstd, computed as g_i rstd + (xhat_i k1 + k0)
//           with the per-row k0 = -(s1/C) rstd and k1 = -(s2 rstd/C) rstd: two FMAs. 1/C is
//           computed once per kernel, so a row's constants cost multiplies, not two divisions. The FMA
//           leaves the rounding error of g_i rstd where the exact answer is 0, at C = 1; kernel
//           12 never sees C = 1 (its C is a multiple of the vector width);
//           dbias_i += dy_i, dweight_i += dy_i xhat_i;
//           with a residual gradient r (add_layernorm's backward), dx_i + r_i, rounded once.
// RMSNorm: the callers pass mean = 0 and s1 = 0 (k0 = 0), and a weight of offset + weight_i.
// Each pass widens its vectors of dy and x whole (to_acc of a Packed, vec.cuh: bf16 two
// elements per 32-bit word, one instruction each) before the per-element math.
#pragma once

#include "common/vec.cuh"

namespace lnbwd {

// Pass 1 for one vector of a row: adds its g_i to s1 and g_i (x_i - mean) to s2.
template <typename T, int VEC>
__device__ __forceinline__ void add_row_sums(const Packed<T, VEC>& dy, const Packed<T, VEC>& x,
                                             const Packed<acc_t<T>, VEC>& w, acc_t<T> mean, acc_t<T>& s1,
                                             acc_t<T>& s2) {
  const Packed<acc_t<T>, VEC> dv = to_acc(dy), xf = to_acc(x);
#pragma unroll
  for (int q = 0; q < VEC; ++q) {
    const acc_t<T> g = mul_rn(w[q], dv[q]);
    s1 += g;
    s2 += g * (xf[q] - mean);
  }
}

// The per-row constants of pass 2 from the row's sums; inv_c = 1/C.
template <typename A>
struct RowCoefficients {
  A k0, k1;
  __device__ __forceinline__ RowCoefficients(A s1, A s2, A rstd, A inv_c)
      : k0(-(s1 * inv_c) * rstd), k1(-(s2 * rstd * inv_c) * rstd) {}
};

// Pass 2 for one vector of a row: returns dx and adds dy into db and dy * xhat into dw. RESID:
// *res, the residual stream's gradient, is added to dx in acc_t before dx is rounded once.
template <typename T, int VEC, bool RESID = false>
__device__ __forceinline__ Packed<T, VEC> dx_and_add_sums(const Packed<T, VEC>& dy, const Packed<T, VEC>& x,
                                                          const Packed<acc_t<T>, VEC>& w, acc_t<T> mean,
                                                          acc_t<T> rstd, const RowCoefficients<acc_t<T>>& k,
                                                          Packed<acc_t<T>, VEC>& db, Packed<acc_t<T>, VEC>& dw,
                                                          const Packed<T, VEC>* res = nullptr) {
  Packed<T, VEC> dx;
  const Packed<acc_t<T>, VEC> dv = to_acc(dy), xf = to_acc(x);
  Packed<acc_t<T>, VEC> rv;
  if constexpr (RESID) rv = to_acc(*res);
#pragma unroll
  for (int q = 0; q < VEC; ++q) {
    const acc_t<T> d = dv[q];
    const acc_t<T> xhat = (xf[q] - mean) * rstd;
    acc_t<T> v = fma(mul_rn(w[q], d), rstd, fma(xhat, k.k1, k.k0));
    if constexpr (RESID) v += rv[q];
    dx[q] = from_acc<T>(v);
    db[q] += d;
    dw[q] += d * xhat;
  }
  return dx;
}

}  // namespace lnbwd
