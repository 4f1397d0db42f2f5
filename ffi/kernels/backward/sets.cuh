// QK-norm's backward in one launch: two sets of head rows (attention's q heads and k heads,
// common/head_rows.h), each with its own dweight, walked by one persistent grid, then one
// finalize_partials launch for both dweights. What the sets' kernels share: kernel11_sets
// (registers/kernel11_sets.cu: kernel 11's row loop) and kernel12_chunk_sets
// (tma_ring/kernel12_chunk_sets.cu: kernel 12's ring of row chunks, sm_90); norm_bwd_sets
// (sets.cu) picks kernel 11's and says why.
//
// Blocks are dealt to the sets in proportion to their rows (grouped-query attention has 4 to 8
// times more q heads than k heads), so that the two sets' blocks finish together; a set with
// rows gets at least one block. The partial slots are two segments of gridDim.x slots each, set
// s's at [s * gridDim.x, (s + 1) * gridDim.x): a block writes its sums to its slot in its set's
// segment and zeros to its slot in the other, so that finalize_partials adds each set's slots as
// it adds any two segments'.
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

// Launches a sets kernel, kernel<<<blocks, threads, smem>>>(partials, sets, C, norm, extra...),
// on as many blocks as fit at once, no more than the sets have steps of rows_per_block rows and
// no more than the workspace has pairs of slots (a block has one in each set's segment); then
// the finalize. With a.plan_only nothing is launched (norm_bwd_sets_workspace_bytes); a.plan, if
// set, receives the decisions. Contiguous sets reach the kernel as one head a token
// (token_stride = C).
template <typename T, typename O, typename... Extra, typename... Args>
cudaError_t launch_sets_grid(const NormBwdParams& a, const NormBwdParams& b,
                             void (*kernel)(acc_t<T>*, BwdSets<T, O>, int, NormArgs<acc_t<T>>, Extra...), int threads,
                             size_t smem, int rows_per_block, int kernel_id, const char* path, cudaStream_t stream,
                             Args... extra) {
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
  LNBWD_RETURN_IF_CUDA_ERROR(
      resident_units(a.device, reinterpret_cast<const void*>(kernel), threads, smem, 1, &resident));
  if (resident < 1) return cudaErrorInvalidConfiguration;
  const int need = (a.rows > 0) + (b.rows > 0);
  int64_t blocks = static_cast<int64_t>(resident) * lim.sms;
  blocks = std::min(blocks, ceil_div<int64_t>(a.rows, rows_per_block) + ceil_div<int64_t>(b.rows, rows_per_block));
  blocks = std::min(blocks, partial_slots<T>(a) / 2);
  if (blocks < std::max(need, 1) || blocks > INT32_MAX / 2) return cudaErrorInvalidValue;
  const double share = static_cast<double>(a.rows) / static_cast<double>(a.rows + b.rows);
  const int64_t blocks0 = std::clamp<int64_t>(static_cast<int64_t>(share * blocks + 0.5), a.rows > 0 ? 1 : 0,
                                              blocks - (b.rows > 0 ? 1 : 0));
  plan.blocks = blocks;
  plan.slots = 2 * blocks;
  plan.cooperative = false;
  plan.workspace_bytes =
      kWorkspaceHeaderBytes + static_cast<size_t>(plan.slots) * 2 * static_cast<size_t>(a.C) * sizeof(acc_t<T>);
  if (a.plan_only) return cudaSuccess;

  BwdSets<T, O> s;
  int i = 0;
  for (const NormBwdParams* p : {&a, &b}) {
    const bool rms = p->norm == NormKind::kRmsNorm;
    s.set[i].dx = static_cast<T*>(p->dx);
    s.set[i].dy = static_cast<const T*>(p->dy);
    s.set[i].x = static_cast<const T*>(p->x);
    s.set[i].weight = static_cast<const O*>(p->weight);
    s.set[i].mean = static_cast<const stat_t<T>*>(rms ? p->rstd : p->mean);
    s.set[i].rstd = static_cast<const stat_t<T>*>(p->rstd);
    s.set[i].rows = p->rows;
    s.set[i].heads = p->heads.heads > 0 ? p->heads : HeadRows{1, p->C};   // contiguous: a head a token
    ++i;
  }
  s.blocks0 = static_cast<int>(blocks0);
  const NormArgs<acc_t<T>> norm = {acc_t<T>(a.norm == NormKind::kRmsNorm ? 0 : 1),
                                    static_cast<acc_t<T>>(kernel_offset(a.norm, a.offset))};
  kernel<<<static_cast<unsigned int>(blocks), threads, smem, stream>>>(partials_of<T>(a), s, static_cast<int>(a.C),
                                                                      norm, extra...);
  LNBWD_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  // Both dweights: segments of `blocks` slots each, into a.dweight's two rows.
  NormBwdParams f = a;
  f.segments = 2;
  f.dbias = nullptr;
  f.dresidual = nullptr;
  return finalize_partials_launch(f, lim, static_cast<int>(blocks), stream);
}

}  // namespace lnbwd
