// Device helpers of the fused forward shared by its two kernels (forward_rows.cu: a row per warp
// or row group, in registers; forward_wide.cu: a row per block, in shared or global memory):
// the kernels' arguments, the parameter loads, the output of one vector, and the sum over the
// warps that share a row.
#pragma once

#include <type_traits>

#include "common/row_reduce.cuh"
#include "common/vec.cuh"
#include "forward/api.h"

namespace lnbwd {

// The kernels' arguments, typed. P is the parameters' storage type: T, or float for 16-bit T.
// The norm kind is the kernels' template parameter K, not a field: layernorm's kernels compile
// to exactly the instructions they had before RMSNorm joined them, and RMSNorm's carry no mean
// pass. The bf16 forward is close to its issue limit (about a thousand instructions per row of
// 1600 per warp), so an add per element that layernorm does not need costs it time.
template <typename T, typename P>
struct FwdArgs {
  T* y;
  stat_t<T>* mean;      // nullptr for RMSNorm (not read by its kernels)
  stat_t<T>* rstd;
  const T* x;
  const P* weight;      // nullptr: scale 1
  const P* bias;        // nullptr: shift 0
  int64_t rows;
  int C;
  int64_t weight_div;   // rows per weight row: row r uses weight row r / weight_div (0: one row for all)
  int64_t bias_div;
  acc_t<T> eps;
  acc_t<T> offset;      // RMSNorm's: added to the weight (offset + w); unread by layernorm's kernels
  // The residual variant only (the kernels' RES flag; unread otherwise): s = x + residual.
  const T* residual;
  T* s;
  const P* x_bias;      // nullptr: none; else s = (x + x_bias) + residual
  int64_t x_bias_div;
};

// The parameter row of `row`, or nullptr when the parameter is absent. div = 0 means one row for
// all (fwd_args): the common case skips a 64-bit division per row, which sits on the path from a
// row's sums to its stores.
template <typename P>
__device__ __forceinline__ const P* param_row(const P* p, int64_t row, int64_t div, int C) {
  if (p == nullptr) return nullptr;
  return div == 0 ? p : p + (row / div) * C;
}

// VEC parameters starting at p, widened to the accumulator type A. Loaded in 16-byte pieces (an
// fp32 weight next to 8 bf16 elements is 32 bytes: two loads), through the ordinary cached path:
// every row reads the same C parameters, so after the first rows they come from L1.
template <typename A, typename P, int VEC>
__device__ __forceinline__ Packed<A, VEC> load_params(const P* p) {
  constexpr int kPiece = (16 / static_cast<int>(sizeof(P))) < VEC ? 16 / static_cast<int>(sizeof(P)) : VEC;
  static_assert(VEC % kPiece == 0, "a vector is a whole number of 16-byte pieces");
  Packed<A, VEC> out;
#pragma unroll
  for (int c = 0; c < VEC / kPiece; ++c) {
    const Packed<P, kPiece> v = load(reinterpret_cast<const Packed<P, kPiece>*>(p + c * kPiece));
#pragma unroll
    for (int k = 0; k < kPiece; ++k) out[c * kPiece + k] = static_cast<A>(to_acc(v[k]));
  }
  return out;
}

// s = x + r for one vector: each sum in the accumulator type, rounded once to T. For 16-bit T
// this is the correctly rounded 16-bit sum (fp32 has at least 2p + 2 bits for p-bit bf16 and
// fp16, so rounding twice changes nothing): what jnp's `x + r` gives for x and r of one dtype.
template <typename T, int VEC>
__device__ __forceinline__ Packed<T, VEC> add_round(const Packed<T, VEC>& x, const Packed<T, VEC>& r) {
  const Packed<acc_t<T>, VEC> xf = to_acc(x), rf = to_acc(r);
  Packed<T, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = from_acc<T>(xf[k] + rf[k]);
  return out;
}

// s = (x + xb) + r for one vector, xb the x_bias parameters at its columns (already in the
// accumulator type): both adds in the accumulator type, rounded once to T.
template <typename T, int VEC>
__device__ __forceinline__ Packed<T, VEC> add_bias_round(const Packed<T, VEC>& x, const Packed<acc_t<T>, VEC>& xb,
                                                         const Packed<T, VEC>& r) {
  const Packed<acc_t<T>, VEC> xf = to_acc(x), rf = to_acc(r);
  Packed<T, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = from_acc<T>((xf[k] + xb[k]) + rf[k]);
  return out;
}

// Widening of pass PASS (1, 2 or 3) of the register path: to_acc's values. For bf16 each pass
// widens through byte permutes with its own selectors (which differ only in which zero byte
// they copy). Written once as to_acc, nvcc would compute the widened row once and keep it live
// across both row sums: 64 fp32 registers for 8 vectors instead of 32 packed ones, 128
// registers a thread, and too few warps per SM for the loads in flight. Distinct expressions
// are widened again in each pass (one PRMT per element, what to_acc costs too).
template <int PASS, typename T, int N>
__device__ __forceinline__ Packed<acc_t<T>, N> widen(const Packed<T, N>& v) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && N % 2 == 0) {
    static_assert(PASS >= 1 && PASS <= 3, "three passes");
    // Bytes 0-3 are the pair's, 4-7 zeros: the low element is bytes (x0, x1) over two zero
    // bytes, the high one bytes (x2, x3) over two.
    constexpr uint32_t kLow = PASS == 1 ? 0x1054u : PASS == 2 ? 0x1044u : 0x1055u;
    constexpr uint32_t kHigh = PASS == 1 ? 0x3254u : PASS == 2 ? 0x3244u : 0x3255u;
    Packed<float, N> out;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      uint32_t pair;
      memcpy(&pair, &v.v[i], sizeof(pair));
      out[i] = __uint_as_float(__byte_perm(pair, 0u, kLow));
      out[i + 1] = __uint_as_float(__byte_perm(pair, 0u, kHigh));
    }
    return out;
  } else {
    return to_acc(v);
  }
}

// Sum of a vector's elements, in order (from the first element, not from 0 + v[0]: an add the
// compiler may not drop, as 0 + (-0) is +0).
template <typename A, int N>
__device__ __forceinline__ A sum_of(const Packed<A, N>& v) {
  A s = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) s += v[k];
  return s;
}

// Sum of squared deviations (x_k - mean)^2 of a vector: pass 2's share of the variance.
template <typename A, int N>
__device__ __forceinline__ A squares_about(const Packed<A, N>& v, A mean) {
  A s = A(0);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const A d = v[k] - mean;
    s += d * d;
  }
  return s;
}

// Pass 2's share for norm kind K: layernorm's squared deviations about the mean, RMSNorm's
// plain squares x_k^2 (it has no mean).
template <NormKind K, typename A, int N>
__device__ __forceinline__ A squares_of(const Packed<A, N>& v, A mean) {
  if constexpr (K == NormKind::kLayerNorm) {
    return squares_about(v, mean);
  } else {
    A s = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k] * v[k];
    return s;
  }
}

// y for one vector at column `col`, in the accumulator type, rounded once to T:
//   layernorm (K = kLayerNorm): ((x - mean) * rstd) * w + b
//   RMSNorm   (K = kRmsNorm):   (x * rstd) * (offset + w)      (no bias: b is null)
// w and b are the parameter rows, or nullptr (absent): a uniform branch, the same for every
// thread of the launch. RMSNorm's offset + w is added unconditionally; where the caller gave
// no offset it is -0.0 (kernel_offset, norm_kind.h), which leaves w exactly as loaded.
// xf: the vector widened to the accumulator type.
template <NormKind K, typename T, typename P, int VEC>
__device__ __forceinline__ Packed<T, VEC> normalize(const Packed<acc_t<T>, VEC>& xf, acc_t<T> mean, acc_t<T> rstd,
                                                    const P* w, const P* b, uint32_t col, acc_t<T> offset) {
  using A = acc_t<T>;
  Packed<A, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if constexpr (K == NormKind::kLayerNorm) {
      out[k] = (xf[k] - mean) * rstd;
    } else {
      out[k] = xf[k] * rstd;
    }
  }
  if (w != nullptr) {
    const Packed<A, VEC> wf = load_params<A, P, VEC>(w + col);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if constexpr (K == NormKind::kLayerNorm) {
        out[k] *= wf[k];
      } else {
        out[k] *= wf[k] + offset;
      }
    }
  }
  if constexpr (K == NormKind::kLayerNorm) {
    if (b != nullptr) {
      const Packed<A, VEC> bf = load_params<A, P, VEC>(b + col);
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[k] += bf[k];
    }
  }
  Packed<T, VEC> y;
#pragma unroll
  for (int k = 0; k < VEC; ++k) y[k] = from_acc<T>(out[k]);
  return y;
}

// The sum of v over the `warps` warps that share a row: shuffles within each warp (warp_sum),
// then lane 0 of each warp posts its sum to ex[warp], `sync()` (a barrier of exactly those
// warps) makes the posts visible, and every thread adds them in warp order. The order is fixed,
// so every thread gets the same bits, run after run.
//
// Why `ex` may be overwritten: a row takes two sums (mean, then variance), and callers give the
// two sums two different buffers. A thread posts into a buffer only after passing the barrier
// of the sum before, which every thread reaches only after reading that buffer's last use.
template <typename A, typename Sync>
__device__ __forceinline__ A row_sum(A v, A* ex, int warps, int warp, int lane, Sync&& sync) {
  v = warp_sum(v);
  if (warps == 1) return v;
  if (lane == 0) ex[warp] = v;
  sync();
  v = A(0);
  for (int w = 0; w < warps; ++w) v += ex[w];
  return v;
}

// rstd from the sum of squared deviations: 1 / sqrt(var + eps), IEEE sqrt and division (not
// rsqrt's approximation: one per row, and the C++ reference computes the same). For RMSNorm
// `squares` is sum x_i^2, so this is 1 / sqrt(mean(x^2) + eps).
template <typename A>
__device__ __forceinline__ A rstd_of(A squares, int C, A eps) {
  return A(1) / sqrt(squares / A(C) + eps);
}

}  // namespace lnbwd
