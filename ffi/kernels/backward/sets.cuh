// QK-norm's backward: two sets of head rows (attention's q heads and k heads,
// common/head_rows.h), each with its own dweight, then one finalize_partials launch for both
// dweights. Two ways of launching the sets' blocks, which share their plan and the finalize
// (run_sets_grid):
//   * one grid over both sets (launch_sets_grid): kernel11_sets (registers/kernel11_sets.cu:
//     kernel 11's row loop);
//   * one launch a set (SetsGrid::kApart): kernel12_chunks (tma_ring/kernel12_chunk_sets.cu:
//     kernel 12's ring of row chunks, the kernel of a tensor's backward), each launch on the
//     whole grid, which streamed faster than one grid of the ring over both sets
//     (docs/kernel12.md).
// norm_bwd_sets (sets.cu) picks.
//
// One grid: blocks are dealt to the sets in proportion to their rows (grouped-query attention has
// 4 to 8 times more q heads than k heads), so that the two sets' blocks finish together; a set
// with rows gets at least one block. The partial slots are two segments of gridDim.x slots each,
// set s's at [s * gridDim.x, (s + 1) * gridDim.x): a block writes its sums to its slot in its
// set's segment and zeros to its slot in the other, so that finalize_partials adds each set's
// slots as it adds any two segments'. Apart: launch s writes segment s whole, a slot a block.
#pragma once

#include <algorithm>

#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "common/head_rows.h"
#include "common/occupancy.h"

namespace lnbwd {

// One set of rows: its own buffers, rows and layout (common/head_rows.h).
template <typename T, typename O>
struct BwdSet {
  T* dx;
  const T* dy;
  const T* x;
  const O* weight;
  const stat_t<T>* mean;   // rstd for RMSNorm (read, multiplied by 0)
  const stat_t<T>* rstd;
  int64_t rows;
  HeadRows heads;
};
template <typename T, typename O>
struct BwdSets {
  BwdSet<T, O> set[2];
  int blocks0;   // blocks [0, blocks0) walk set 0's rows
};

// What both sets must share, and what the sets' kernels cannot take (sets.cu).
bool bwd_sets_ok(const NormBwdParams& a, const NormBwdParams& b);

// A block's set (0 or 1) and its slot in the other set's segment, which it fills with zeros
// (2 * C accumulators) before its own rows.
template <typename A>
__device__ __forceinline__ int set_of_block(A* partials, int blocks0, int C) {
  const int k = blockIdx.x >= static_cast<unsigned>(blocks0);
  A* other = partials + (static_cast<size_t>(1 - k) * gridDim.x + blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) __stcg(other + c, A(0));
  return k;
}

// A set's buffers as the sets' kernels take them. Contiguous sets reach the kernels as one head a
// token (token_stride = C).
template <typename T, typename O>
BwdSet<T, O> bwd_set_of(const NormBwdParams& p) {
  const bool rms = p.norm == NormKind::kRmsNorm;
  BwdSet<T, O> s;
  s.dx = static_cast<T*>(p.dx);
  s.dy = static_cast<const T*>(p.dy);
  s.x = static_cast<const T*>(p.x);
  s.weight = static_cast<const O*>(p.weight);
  s.mean = static_cast<const stat_t<T>*>(rms ? p.rstd : p.mean);
  s.rstd = static_cast<const stat_t<T>*>(p.rstd);
  s.rows = p.rows;
  s.heads = p.heads.heads > 0 ? p.heads : HeadRows{1, p.C};
  return s;
}

// How the sets' blocks are launched.
enum class SetsGrid {
  kOneGrid,   // one grid over both sets: `blocks` blocks dealt to the sets by their rows
  kApart,     // one launch a set, each of `blocks` blocks over its own set's rows
};

// The grid both ways of launching plan, and the finalize both end with. `blocks` blocks: as many
// as fit at once (kernel, threads, smem), no more than the rows have steps of rows_per_block
// rows (both sets' together for one grid, the larger set's apart: each launch has the same
// blocks, since each fills a whole segment of slots) and no more than the workspace has pairs of
// slots (a block, or a block of each launch, has one in each set's segment). Fills the plan;
// with a.plan_only launches nothing (norm_bwd_sets_workspace_bytes). Otherwise calls
// launch(blocks, norm, lim), which launches the sets' kernels (lim: the device's limits, read
// here once), then the finalize.
template <typename T, typename Launch>
cudaError_t run_sets_grid(const NormBwdParams& a, const NormBwdParams& b, SetsGrid grid, const void* kernel,
                          int threads, size_t smem, int rows_per_block, int kernel_id, const char* path,
                          cudaStream_t stream, Launch&& launch) {
  LaunchPlan own;
  LaunchPlan& plan = a.plan ? *a.plan : own;
  plan.kernel = kernel_id;
  plan.path = path;
  plan.threads = threads;
  plan.smem = smem;
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(a.device, &lim));
  if (smem > lim.smem_optin) return cudaErrorInvalidConfiguration;
  int resident = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(resident_units(a.device, kernel, threads, smem, 1, &resident));
  if (resident < 1) return cudaErrorInvalidConfiguration;
  const int need = grid == SetsGrid::kApart ? 1 : (a.rows > 0) + (b.rows > 0);
  const int64_t steps_a = ceil_div<int64_t>(a.rows, rows_per_block);
  const int64_t steps_b = ceil_div<int64_t>(b.rows, rows_per_block);
  int64_t blocks = static_cast<int64_t>(resident) * lim.sms;
  blocks = std::min(blocks, grid == SetsGrid::kApart ? std::max(steps_a, steps_b) : steps_a + steps_b);
  blocks = std::min(blocks, partial_slots<T>(a) / 2);
  if (blocks < std::max(need, 1) || blocks > INT32_MAX / 2) return cudaErrorInvalidValue;
  plan.blocks = blocks;   // a launch's grid (apart: each of the two)
  plan.slots = 2 * blocks;
  plan.cooperative = false;
  plan.workspace_bytes =
      kWorkspaceHeaderBytes + static_cast<size_t>(plan.slots) * 2 * static_cast<size_t>(a.C) * sizeof(acc_t<T>);
  if (a.plan_only) return cudaSuccess;

  LNBWD_RETURN_IF_CUDA_ERROR(launch(static_cast<int>(blocks), norm_args_of<T>(a), lim));
  // Both dweights: segments of `blocks` slots each, into a.dweight's two rows.
  NormBwdParams f = a;
  f.segments = 2;
  f.dbias = nullptr;
  f.dresidual = nullptr;
  return finalize_partials_launch(f, lim, static_cast<int>(blocks), stream);
}

// One grid over both sets: kernel<<<blocks, threads, smem>>>(partials, sets, C, norm, extra...),
// blocks [0, blocks0) on set 0 (blocks dealt by the sets' rows, at least one for a set with rows).
template <typename T, typename O, typename... Extra, typename... Args>
cudaError_t launch_sets_grid(const NormBwdParams& a, const NormBwdParams& b,
                             void (*kernel)(acc_t<T>*, BwdSets<T, O>, int, NormArgs<acc_t<T>>, Extra...), int threads,
                             size_t smem, int rows_per_block, int kernel_id, const char* path, cudaStream_t stream,
                             Args... extra) {
  return run_sets_grid<T>(
      a, b, SetsGrid::kOneGrid, reinterpret_cast<const void*>(kernel), threads, smem, rows_per_block, kernel_id, path,
      stream, [&](int blocks, NormArgs<acc_t<T>> norm, const DeviceLimits&) -> cudaError_t {
        const double share = static_cast<double>(a.rows) / static_cast<double>(a.rows + b.rows);
        BwdSets<T, O> s;
        s.set[0] = bwd_set_of<T, O>(a);
        s.set[1] = bwd_set_of<T, O>(b);
        s.blocks0 = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(share * blocks + 0.5),
                                                         a.rows > 0 ? 1 : 0, blocks - (b.rows > 0 ? 1 : 0)));
        kernel<<<static_cast<unsigned int>(blocks), threads, smem, stream>>>(partials_of<T>(a), s,
                                                                            static_cast<int>(a.C), norm, extra...);
        return cudaGetLastError();
      });
}

}  // namespace lnbwd
