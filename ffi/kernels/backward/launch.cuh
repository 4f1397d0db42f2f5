// Host-side helpers shared by the backward launchers: dtype dispatch, vector-width choice, the
// workspace layout (see kWorkspaceHeaderBytes in backward/api.h) and the persistent launch with
// partial sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "backward/api.h"
#include "common/device_limits.h"
#include "common/occupancy.h"
#include "backward/norm_weight.cuh"
#include "backward/partials_finalize.h"
#include "backward/partials_sum.cuh"
#include "common/vec.cuh"

namespace lnbwd {

// Bytes of one element of `dtype`.
inline int dtype_bytes(Dtype dtype) { return dtype == Dtype::kF64 ? 8 : dtype == Dtype::kF32 ? 4 : 2; }

// Calls f(T{}) with the C++ type of p.dtype. An unknown dtype is an error, never a default.
template <typename F>
cudaError_t dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kF32: return f(float{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    case Dtype::kF16: return f(__half{});
    case Dtype::kF64: return f(double{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(T{}, O{}, R{}) with the data's C++ type T, the type O of weight, dweight and dbias (T,
// or float beside 16-bit data when p.weight_f32: mixed precision) and R =
// std::bool_constant<p.dresidual != nullptr> (a residual gradient added to dx). The launchers
// compile each combination as its own kernel, so the plain one (O = T, no residual) is the same
// code as before these options existed. An impossible combination is an error.
template <typename F>
cudaError_t dispatch_types(const NormBwdParams& p, F&& f) {
  return dispatch_dtype(p.dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    auto with = [&](auto o) -> cudaError_t {
      if (p.dresidual) return f(t, o, std::true_type{});
      return f(t, o, std::false_type{});
    };
    if (!p.weight_f32) return with(t);
    if constexpr (sizeof(T) == 2) return with(float{});
    return cudaErrorInvalidValue;   // weight_f32 is for bf16/fp16 data only
  });
}

// 16-byte accesses need every row to start on a 16-byte boundary: C * sizeof(T) % 16 == 0 and
// 16-byte aligned base pointers. Otherwise the kernels fall back to one element per access.
template <typename T>
bool can_vectorize(const NormBwdParams& p) {
  constexpr int vec = 16 / sizeof(T);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.C % vec == 0 && aligned(p.dx) && aligned(p.dy) && aligned(p.x) && aligned(p.weight) &&
         aligned(p.dweight) && aligned(p.dbias) && (!p.dresidual || aligned(p.dresidual));
}

// The same for p.dtype's C++ type: whether a launcher that picks its kernel before dispatching
// on the type may take the 16-byte path.
inline bool can_vectorize(const NormBwdParams& p) {
  bool vectorized = false;
  dispatch_dtype(p.dtype, [&](auto t) {
    vectorized = can_vectorize<decltype(t)>(p);
    return cudaSuccess;
  });
  return vectorized;
}

// How many per-block partial slots (2 * C accumulators each) fit in the workspace XLA gave us.
template <typename T>
int64_t partial_slots(const NormBwdParams& p) {
  if (p.workspace_bytes < kWorkspaceHeaderBytes) return 0;
  return static_cast<int64_t>((p.workspace_bytes - kWorkspaceHeaderBytes) / (2 * p.C * sizeof(acc_t<T>)));
}

// Blocks per segment for a persistent grid of about `want` blocks that each take `rows_per_block`
// rows per step: the grid is split evenly over the segments (at least one block each), and
// never uses more blocks than a segment has rows for, or than the workspace has slots.
template <typename T>
cudaError_t blocks_per_segment(const NormBwdParams& p, int64_t want, int rows_per_block, int64_t* out) {
  if (p.segments < 1 || p.rows % p.segments != 0) return cudaErrorInvalidValue;
  int64_t bps = std::max<int64_t>(1, want / p.segments);
  bps = std::min<int64_t>(bps, ceil_div<int64_t>(p.rows / p.segments, rows_per_block));
  bps = std::min<int64_t>(bps, partial_slots<T>(p) / p.segments);
  if (bps < 1 || bps * p.segments > INT32_MAX) return cudaErrorInvalidValue;
  *out = bps;
  return cudaSuccess;
}

template <typename T>
acc_t<T>* partials_of(const NormBwdParams& p) {
  return reinterpret_cast<acc_t<T>*>(static_cast<char*>(p.workspace) + kWorkspaceHeaderBytes);
}

inline unsigned int* flag_of(const NormBwdParams& p) { return static_cast<unsigned int*>(p.workspace); }

// The kernels' NormArgs (norm_weight.cuh) for p's norm kind and offset.
template <typename T>
NormArgs<acc_t<T>> norm_args_of(const NormBwdParams& p) {
  return {acc_t<T>(p.norm == NormKind::kRmsNorm ? 0 : 1), static_cast<acc_t<T>>(kernel_offset(p.norm, p.offset))};
}

// The current device's SM count and shared-memory opt-in, as device_limits reports them (the
// llm.c kernels' launchers; kernels 11 and 12 ask device_limits for p.device).
inline cudaError_t sm_count(int* out) {
  DeviceLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(-1, &l));
  *out = l.sms;
  return cudaSuccess;
}
inline cudaError_t max_dynamic_smem(int* out) {
  DeviceLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(-1, &l));
  *out = static_cast<int>(l.smem_optin);
  return cudaSuccess;
}

// How many blocks per SM a persistent grid asks for (see launch_with_partials).
enum class BlocksPerSm {
  kOccupancy,              // as many as fit at once (the occupancy calculator); none is an error
  kOccupancyAtLeastOne,    // as many as fit at once, and at least one
  kOne,                    // one (where the kernel's shared memory allows no more)
};

// The signature of the kernels that write per-block partial sums of dbias/dweight into the
// workspace: (dx, partials, dy, x, weight, dresidual, mean, rstd, rows_per_segment,
// blocks_per_segment, weight_stride, C, offset, finish, extra...); weight has type O
// (dispatch_types), dresidual is null unless the kernel was compiled to add it. norm
// (NormArgs, norm_weight.cuh) tells RMSNorm per launch: centered = 0 makes mean 0 and drops the
// mean's gradient term (s1/C, k0), offset is added to the weight. RMSNorm's p.mean is null, so
// the kernels get rstd in its place (a valid address, multiplied by 0). They still write the
// dbias half of their slots (the slot layout is layernorm's); the finalize skips dbias when it
// is null. Each ends with
//   if (finish.dweight) finish_partials_in_grid(finish, partials, blocks_per_segment, C, warps, smem);
// with at least grid_finish_smem bytes of dynamic shared memory free by then.
template <typename T, typename O, typename... Extra>
using PartialsKernel = void (*)(T*, acc_t<T>*, const T*, const T*, const O*, const T*, const stat_t<T>*,
                                const stat_t<T>*, int64_t, int, int64_t, int, NormArgs<acc_t<T>>,
                                GridFinish<T, O>, Extra...);

template <typename T>
constexpr size_t grid_finish_smem(int threads) {
  return 2 * static_cast<size_t>(threads) * kFinishMaxVec<T> * sizeof(acc_t<T>);
}

// Launches such a kernel on a persistent grid: `threads` threads and `smem` bytes of dynamic
// shared memory per block, blocks_per_segment blocks per segment for about `per_sm` blocks on
// each SM, no more than there are steps of `rows_per_block` rows and no more than the workspace
// has partial slots. Every block writes its slot and ends; then finalize_partials, on the same
// stream, sums each segment's slots in slot order into dweight and dbias (deterministic).
//
// Why two kernels and no grid-wide barrier: a grid that waits for all its blocks can only run
// when all of them are resident at once, so one SM held by a kernel on another stream (an NCCL
// collective beside the backward, another process under MPS) would hold the whole backward back
// for as long as it runs. Here nothing waits for a block that has not started: blocks that find
// no room start as others finish. The finalize kernel is launched with programmatic dependent
// launch on sm_90 (partials_finalize.cu), so its launch overlaps this grid instead of following it.
// JAX_LNBWD_COOPERATIVE_FINISH=1 (device_limits.h) instead launches the grid cooperatively where
// the whole of it fits at once, and its blocks sum the slots after a grid-wide barrier.
//
// cluster > 1: the blocks come in thread-block clusters of that many (kernel 12's split rows,
// whose cluster's blocks share each row and write one slot between them). The grid is then
// counted in clusters: as many as fit at once (the GPU's GPCs place them), a whole number of
// them per segment, one partial slot each; blocks_per_segment stays a count of blocks.
//
// Everything is decided before anything is launched; with p.plan_only nothing is (the launch is
// planned for norm_bwd_workspace_bytes). p.plan, if set, receives the decisions.
template <typename T, typename O, typename... Extra, typename... Args>
cudaError_t launch_with_partials(const NormBwdParams& p, PartialsKernel<T, O, Extra...> kernel, int threads,
                                 size_t smem, BlocksPerSm per_sm_rule, int rows_per_block, int cluster,
                                 cudaStream_t stream, Args... extra) {
  // p.norm is the kind (the kernels get it as NormArgs::centered below); its buffers must agree
  // with it: RMSNorm has no mean and no dbias (the finalize writes dbias where it is set),
  // layernorm has both.
  const bool rms = p.norm == NormKind::kRmsNorm;
  if ((!rms && p.norm != NormKind::kLayerNorm) || rms != (p.mean == nullptr) || rms != (p.dbias == nullptr)) {
    return cudaErrorInvalidValue;
  }
  LaunchPlan own;
  LaunchPlan& plan = p.plan ? *p.plan : own;
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(p.device, &lim));
  const bool cooperative_wanted = lim.cooperative && cooperative_finish_opt_in();
  if (cooperative_wanted) smem = std::max(smem, grid_finish_smem<T>(threads));
  plan.threads = threads;
  plan.smem = smem;
  plan.cluster = cluster;
  if (smem > lim.smem_optin || (cluster > 1 && !lim.clusters)) return cudaErrorInvalidConfiguration;
  int resident = 0;   // blocks per SM, or clusters on the GPU
  LNBWD_RETURN_IF_CUDA_ERROR(
      resident_units(p.device, reinterpret_cast<const void*>(kernel), threads, smem, cluster, &resident));
  // Units: blocks, or clusters of `cluster` blocks; `fit` of them are resident at once.
  int64_t want = 0, fit = 0;
  if (cluster > 1) {
    // The driver counts clusters on the whole GPU; lim.sms may be fewer SMs (test caps).
    fit = std::min<int64_t>(resident, lim.sms / cluster);
    if (fit < 1) return cudaErrorInvalidConfiguration;
    want = fit;
  } else {
    int per_sm = per_sm_rule == BlocksPerSm::kOne ? 1 : resident;
    if (per_sm < 1) {
      if (per_sm_rule == BlocksPerSm::kOccupancy) return cudaErrorInvalidConfiguration;
      per_sm = 1;
    }
    want = static_cast<int64_t>(per_sm) * lim.sms;
    fit = static_cast<int64_t>(resident) * lim.sms;
  }
  int64_t units = 0;   // per segment
  LNBWD_RETURN_IF_CUDA_ERROR(blocks_per_segment<T>(p, want, rows_per_block, &units));
  const int64_t bps = units * cluster;
  if (bps * p.segments > INT32_MAX) return cudaErrorInvalidValue;
  const bool in_grid = cooperative_wanted && units * p.segments <= fit;
  plan.blocks = bps * p.segments;
  plan.slots = units * p.segments;
  plan.cooperative = in_grid;
  plan.workspace_bytes =
      kWorkspaceHeaderBytes + static_cast<size_t>(plan.slots) * 2 * static_cast<size_t>(p.C) * sizeof(acc_t<T>);
  if (p.plan_only) return cudaSuccess;

  cudaLaunchAttribute attrs[2];
  int n_attrs = 0;
  if (cluster > 1) attrs[n_attrs++] = cluster_dimension(cluster);
  GridFinish<T, O> finish;   // dweight null: the blocks only write their slots
  if (in_grid) {
    finish.dweight = static_cast<O*>(p.dweight);
    finish.dbias = static_cast<O*>(p.dbias);
    finish.segments = static_cast<int>(p.segments);
    finish.vec = finish_vec<T>(p.C, p.segments, bps * p.segments);
    attrs[n_attrs].id = cudaLaunchAttributeCooperative;
    attrs[n_attrs].val.cooperative = 1;
    ++n_attrs;
  }
  const NormArgs<acc_t<T>> norm = norm_args_of<T>(p);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(bps * p.segments));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n_attrs;
  LNBWD_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(
      &cfg, kernel, static_cast<T*>(p.dx), partials_of<T>(p), static_cast<const T*>(p.dy),
      static_cast<const T*>(p.x), static_cast<const O*>(p.weight), static_cast<const T*>(p.dresidual),
      static_cast<const stat_t<T>*>(rms ? p.rstd : p.mean),
      static_cast<const stat_t<T>*>(p.rstd), p.rows / p.segments, static_cast<int>(bps), p.weight_stride,
      static_cast<int>(p.C), norm, finish, extra...));
  return in_grid ? cudaSuccess : finalize_partials_launch(p, lim, static_cast<int>(units), stream);
}

}  // namespace lnbwd
