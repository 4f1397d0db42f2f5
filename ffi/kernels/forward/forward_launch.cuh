// Host-side helpers shared by the forward's launchers (forward_rows.cu, forward_wide.cu): the
// (x dtype, parameter dtype) dispatch, the typed kernel arguments, and the launch entry points
// that forward_launch.cu's norm_fwd chooses between.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/head_rows.h"
#include "forward/api.h"
#include "forward/forward_math.cuh"

namespace lnbwd {

#define LNBWD_FWD_RETURN_IF_ERROR(expr)               \
  do {                                                \
    cudaError_t lnbwd_fwd_err_ = (expr);              \
    if (lnbwd_fwd_err_ != cudaSuccess) return lnbwd_fwd_err_; \
  } while (0)

// Calls f(T{}, P{}) with x's C++ type T and the parameters' P: (float, float), (double, double),
// (bf16, bf16), (bf16, float), (half, half), (half, float). Any other pair is an error, never a
// default. Without parameters, P = T (param_dtype is not read).
template <typename F>
cudaError_t dispatch_fwd_types(const NormFwdParams& p, F&& f) {
  const bool params = p.weight != nullptr || p.bias != nullptr || p.x_bias != nullptr;
  const bool f32_params = params && p.param_dtype == Dtype::kF32;
  if (params && p.param_dtype != p.dtype && !f32_params) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case Dtype::kF32: return f(float{}, float{});
    case Dtype::kF64: return f(double{}, double{});
    case Dtype::kBF16: return f32_params ? f(__nv_bfloat16{}, float{}) : f(__nv_bfloat16{}, __nv_bfloat16{});
    case Dtype::kF16: return f32_params ? f(__half{}, float{}) : f(__half{}, __half{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(kind, T{}, P{}, vec, res), each a type: the norm kind (the kernels take it as a template
// parameter; forward_math.cuh says why), x's and the parameters' types, the vector width the
// configuration chose (16 bytes of T, or one element) and whether the residual variant runs
// (residual and s set). Both launchers instantiate their kernels through it, so the variants a
// launch can reach are listed once.
template <typename F>
cudaError_t dispatch_fwd_variant(const NormFwdParams& p, const NormFwdConfig& cfg, F&& f) {
  return dispatch_fwd_types(p, [&](auto t, auto pt) -> cudaError_t {
    constexpr int kVec = 16 / sizeof(decltype(t));
    auto with_kind = [&](auto kind) -> cudaError_t {
      auto with_res = [&](auto res) -> cudaError_t {
        if (cfg.vec == kVec) return f(kind, t, pt, std::integral_constant<int, kVec>{}, res);
        if (cfg.vec == 1) return f(kind, t, pt, std::integral_constant<int, 1>{}, res);
        return cudaErrorInvalidValue;
      };
      return p.residual != nullptr ? with_res(std::true_type{}) : with_res(std::false_type{});
    };
    if (p.norm == NormKind::kRmsNorm) return with_kind(std::integral_constant<NormKind, NormKind::kRmsNorm>{});
    if (p.norm == NormKind::kLayerNorm) return with_kind(std::integral_constant<NormKind, NormKind::kLayerNorm>{});
    return cudaErrorInvalidValue;
  });
}

// Rows per parameter row (param_row's div), 0 where one parameter row serves every row.
inline int64_t param_div(int64_t rows, int64_t param_rows) { return param_rows > 1 ? rows / param_rows : 0; }

template <typename T, typename P>
FwdArgs<T, P> fwd_args(const NormFwdParams& p) {
  FwdArgs<T, P> a;
  a.y = static_cast<T*>(p.y);
  a.mean = static_cast<stat_t<T>*>(p.mean);
  a.rstd = static_cast<stat_t<T>*>(p.rstd);
  a.x = static_cast<const T*>(p.x);
  a.weight = static_cast<const P*>(p.weight);
  a.bias = static_cast<const P*>(p.bias);
  a.rows = p.rows;
  a.C = static_cast<int>(p.C);
  a.weight_div = param_div(p.rows, p.weight_rows);
  a.bias_div = param_div(p.rows, p.bias_rows);
  a.eps = static_cast<acc_t<T>>(p.eps);
  // RMSNorm's kernels add it to the weight; -0.0 where there is none (kernel_offset, norm_kind.h).
  a.offset = static_cast<acc_t<T>>(kernel_offset(p.norm, p.offset));
  a.residual = static_cast<const T*>(p.residual);
  a.s = static_cast<T*>(p.s);
  a.x_bias = static_cast<const P*>(p.x_bias);
  a.x_bias_div = param_div(p.rows, p.x_bias_rows);
  return a;
}

// A set's rows as the head-row kernels walk them: contiguous rows are one head a token.
inline HeadRows head_layout(const NormFwdParams& p) {
  return p.heads.heads > 0 ? p.heads : HeadRows{1, p.C};
}

// Two sets of head rows for forward_rows_sets (forward_rows.cu): blocks [0, blocks0) take set 0.
template <typename T, typename P>
struct FwdSets {
  FwdArgs<T, P> set[2];
  HeadRows heads[2];
  unsigned int blocks0;
};

// The two kernels' launchers, for a configuration from norm_fwd_pick.
cudaError_t norm_fwd_rows(const NormFwdParams& p, const NormFwdConfig& cfg, cudaStream_t stream);
cudaError_t norm_fwd_wide(const NormFwdParams& p, const NormFwdConfig& cfg, cudaStream_t stream);
// The sets' launcher (forward_sets.cu picks cfg and blocks0; a's configuration serves both).
cudaError_t norm_fwd_rows_sets(const NormFwdParams& a, const NormFwdParams& b, const NormFwdConfig& cfg,
                               unsigned int blocks0, cudaStream_t stream);

// Limits of the register path, written once (forward_launch.cu's pick reads them, the kernels'
// __launch_bounds__ and variant lists are built from them).
constexpr int kFwdMaxNv = 8;              // vectors of 16 bytes per thread: 32 registers of row data
constexpr int kFwdMaxRowThreads = 512;    // threads per row: __launch_bounds__(512) allows 128 registers
constexpr int kFwdBlockThreads = 128;     // a block holds 128 / tpr row groups (at least one)
constexpr int kFwdWideThreads = 1024;     // the wide path's block: one row at a time
// Small rows (forward_rows.cu, on row groups narrower than a warp, of kMinRowThreads
// (common/vec.cuh) to 16 threads): a thread holds at most kFwdSmallMaxNv vectors (the variants
// compiled for them).
constexpr int kFwdSmallMaxNv = 4;

// The lean register budget (forward_rows.cu's forward_rows_lean). An SM holds 64K registers; a
// 128-thread block at 72 registers per thread takes 9K of them, so 7 blocks (28 warps) fit,
// against 5 (20 warps) at the 82-88 the compiler picks by itself for plain rows of 7 vectors.
// More warps hold more rows' loads in flight. Only those variants get the cap: below 7 vectors
// the compiler stays near 72 or under by itself, the residual variant holds two rows while it
// adds them, and fp64 (two registers an element, also for the statistics) would spill.
constexpr int kFwdLeanRowRegs = 72;
constexpr bool fwd_row_lean(int nv, bool residual, int item_bytes) {
  return !residual && nv == kFwdMaxNv - 1 && item_bytes < 8;
}

// The pair budget (forward_rows.cu's forward_rows_pair): plain rows in blocks of
// kFwdMaxRowThreads threads, two blocks per SM. The pick takes that many threads only for rows of
// more than kFwdMaxRowThreads / 2 * kFwdMaxNv vectors, so NV > kFwdMaxNv / 2 (a forced row group
// of 512 threads with fewer vectors runs the other kernels).
constexpr bool fwd_row_pair(int nv, bool residual) { return !residual && nv > kFwdMaxNv / 2; }

}  // namespace lnbwd
