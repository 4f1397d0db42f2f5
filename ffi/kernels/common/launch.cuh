// Host-side helpers shared by the launchers: dtype dispatch, vector-width choice and the
// workspace layout (see kWorkspaceHeaderBytes in layernorm_bwd.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "api.h"
#include "common/occupancy.h"
#include "common/partials_finalize.h"
#include "common/partials_sum.cuh"
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
cudaError_t dispatch_types(const LayernormBwdParams& p, F&& f) {
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
bool can_vectorize(const LayernormBwdParams& p) {
  constexpr int vec = 16 / sizeof(T);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.C % vec == 0 && aligned(p.dx) && aligned(p.dy) && aligned(p.x) && aligned(p.weight) &&
         aligned(p.dweight) && aligned(p.dbias) && (!p.dresidual || aligned(p.dresidual));
}

// How many per-block partial slots (2 * C accumulators each) fit in the workspace XLA gave us.
template <typename T>
int64_t partial_slots(const LayernormBwdParams& p) {
  if (p.workspace_bytes < kWorkspaceHeaderBytes) return 0;
  return static_cast<int64_t>((p.workspace_bytes - kWorkspaceHeaderBytes) / (2 * p.C * sizeof(acc_t<T>)));
}

// Blocks per segment for a persistent grid of about `want` blocks that each take `rows_per_block`
// rows per step: the grid is split evenly over the segments (at least one block each), and
// never uses more blocks than a segment has rows for, or than the workspace has slots.
template <typename T>
cudaError_t blocks_per_segment(const LayernormBwdParams& p, int64_t want, int rows_per_block, int64_t* out) {
  if (p.segments < 1 || p.rows % p.segments != 0) return cudaErrorInvalidValue;
  int64_t bps = std::max<int64_t>(1, want / p.segments);
  bps = std::min<int64_t>(bps, ceil_div<int64_t>(p.rows / p.segments, rows_per_block));
  bps = std::min<int64_t>(bps, partial_slots<T>(p) / p.segments);
  if (bps < 1 || bps * p.segments > INT32_MAX) return cudaErrorInvalidValue;
  *out = bps;
  return cudaSuccess;
}

template <typename T>
acc_t<T>* partials_of(const LayernormBwdParams& p) {
  return reinterpret_cast<acc_t<T>*>(static_cast<char*>(p.workspace) + kWorkspaceHeaderBytes);
}

inline unsigned int* flag_of(const LayernormBwdParams& p) { return static_cast<unsigned int*>(p.workspace); }

// An attribute of the current device (the one XLA's stream belongs to).
inline cudaError_t device_attribute(cudaDeviceAttr attr, int* out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(out, attr, dev);
}

inline cudaError_t sm_count(int* out) { return device_attribute(cudaDevAttrMultiProcessorCount, out); }
inline cudaError_t max_dynamic_smem(int* out) { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, out); }
inline cudaError_t compute_capability_major(int* out) {
  return device_attribute(cudaDevAttrComputeCapabilityMajor, out);
}

#define LNBWD_RETURN_IF_CUDA_ERROR(expr)          \
  do {                                            \
    cudaError_t lnbwd_err_ = (expr);              \
    if (lnbwd_err_ != cudaSuccess) return lnbwd_err_; \
  } while (0)

// How many blocks per SM a persistent grid asks for (see launch_with_partials).
enum class BlocksPerSm {
  kOccupancy,              // as many as fit at once (the occupancy calculator); none is an error
  kOccupancyAtLeastOne,    // as many as fit at once, and at least one
  kOne,                    // one (where the kernel's shared memory allows no more)
};

// The signature of the kernels that write per-block partial sums of dbias/dweight into the
// workspace: (dx, partials, dy, x, weight, dresidual, mean, rstd, rows_per_segment,
// blocks_per_segment, weight_stride, C, finish, extra...); weight has type O (dispatch_types),
// dresidual is null unless the kernel was compiled to add it. Each ends with
//   if (finish.dweight) finish_partials_in_grid(finish, partials, blocks_per_segment, C, warps, smem);
// with at least grid_finish_smem bytes of dynamic shared memory free by then.
template <typename T, typename O, typename... Extra>
using PartialsKernel = void (*)(T*, acc_t<T>*, const T*, const T*, const O*, const T*, const stat_t<T>*,
                                const stat_t<T>*, int64_t, int, int64_t, int, GridFinish<T, O>, Extra...);

template <typename T>
constexpr size_t grid_finish_smem(int threads) {
  return 2 * static_cast<size_t>(threads) * kFinishMaxVec<T> * sizeof(acc_t<T>);
}

// Launches such a kernel on a persistent grid: `threads` threads and `smem` bytes of dynamic
// shared memory per block, blocks_per_segment blocks per segment for about `per_sm` blocks on
// each SM, no more than there are steps of `rows_per_block` rows and no more than the workspace
// has partial slots. Then dweight and dbias are summed from the slots, in one of two ways:
//  * the grid fits on the GPU at once (the usual case: it was sized to): a cooperative launch,
//    whose blocks meet at a grid-wide barrier and sum the slots themselves;
//  * it does not (more segments than resident blocks): a plain launch, then finalize_partials.
// Both sum in a fixed order, so either is deterministic; a given shape always takes the same one.
//
// cluster > 1: the blocks come in thread-block clusters of that many (kernel 12's split rows,
// whose cluster's blocks share each row and write one slot between them). The grid is then
// counted in clusters: as many as fit at once (the GPU's GPCs place them), a whole number of
// them per segment, one partial slot each; blocks_per_segment stays a count of blocks.
template <typename T, typename O, typename... Extra, typename... Args>
cudaError_t launch_with_partials(const LayernormBwdParams& p, PartialsKernel<T, O, Extra...> kernel, int threads,
                                 size_t smem, BlocksPerSm per_sm_rule, int rows_per_block, int cluster,
                                 cudaStream_t stream, Args... extra) {
  smem = std::max(smem, grid_finish_smem<T>(threads));
  int resident = 0;   // blocks per SM, or clusters on the GPU
  LNBWD_RETURN_IF_CUDA_ERROR(resident_units(reinterpret_cast<const void*>(kernel), threads, smem, cluster, &resident));
  // Units: blocks, or clusters of `cluster` blocks; `fit` of them are resident at once.
  int64_t want = 0, fit = 0;
  if (cluster > 1) {
    if (resident < 1) return cudaErrorInvalidConfiguration;
    want = fit = resident;
  } else {
    int sms = 0;
    LNBWD_RETURN_IF_CUDA_ERROR(sm_count(&sms));
    int per_sm = per_sm_rule == BlocksPerSm::kOne ? 1 : resident;
    if (per_sm < 1) {
      if (per_sm_rule == BlocksPerSm::kOccupancy) return cudaErrorInvalidConfiguration;
      per_sm = 1;
    }
    want = static_cast<int64_t>(per_sm) * sms;
    fit = static_cast<int64_t>(resident) * sms;
  }
  int64_t units = 0;   // per segment
  LNBWD_RETURN_IF_CUDA_ERROR(blocks_per_segment<T>(p, want, rows_per_block, &units));
  const int64_t bps = units * cluster;
  if (bps * p.segments > INT32_MAX) return cudaErrorInvalidValue;
  const bool in_grid = units * p.segments <= fit;
  cudaLaunchAttribute attrs[2];
  int n_attrs = 0;
  if (cluster > 1) attrs[n_attrs++] = cluster_dimension(cluster);
  GridFinish<T, O> finish;
  if (in_grid) {
    finish.dweight = static_cast<O*>(p.dweight);
    finish.dbias = static_cast<O*>(p.dbias);
    finish.segments = static_cast<int>(p.segments);
    finish.vec = finish_vec<T>(p.C, p.segments, bps * p.segments);
    attrs[n_attrs].id = cudaLaunchAttributeCooperative;
    attrs[n_attrs].val.cooperative = 1;
    ++n_attrs;
  }
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
      static_cast<const stat_t<T>*>(p.mean),
      static_cast<const stat_t<T>*>(p.rstd), p.rows / p.segments, static_cast<int>(bps), p.weight_stride,
      static_cast<int>(p.C), finish, extra...));
  return in_grid ? cudaSuccess : finalize_partials_launch(p, static_cast<int>(units), stream);
}

}  // namespace lnbwd
