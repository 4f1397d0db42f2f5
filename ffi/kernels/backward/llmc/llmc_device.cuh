// Device routines shared by llm.c's kernels 2-10 (kernel0N_*.cu, kernel10_vector_smem.cu): the
// lines that several of them had written out identically, now written once. What makes each
// kernel what it is (its grid, its warp reduction, how a block's sums leave shared memory) stays
// in its own file. Every routine is inlined: each kernel does the same floating-point operations,
// in the same order, as when these lines stood in it.
//
// The block's sums of dbias and dweight live in shared memory as two arrays, dbias_sh and
// dweight_sh; a partial slot or scratch row in the workspace holds [dbias | dweight], C
// accumulators each (see kWorkspaceHeaderBytes in layernorm_bwd.h).
#pragma once

#include "common/vec.cuh"

namespace lnbwd {

// Zeroes the block's n sums of dbias and of dweight. The caller's barrier must follow before any
// warp adds to them.
template <typename A>
__device__ __forceinline__ void zero_block_sums(A* dbias_sh, A* dweight_sh, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    dbias_sh[i] = A(0);
    dweight_sh[i] = A(0);
  }
}

// *p, read with a streaming load (__ldcs, "evict first") when kStream.
template <bool kStream, typename T>
__device__ __forceinline__ T load_elem(const T* p) {
  if constexpr (kStream) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

// One row of the backward by one warp, the layout of kernels 2-7: lane `lane` takes the columns
// lane, lane + step, lane + 2 * step, ... with step the warp size (so each load instruction of the
// warp reads 32 neighbouring elements), and row_sum is the sum across the warp. Both are the
// kernel's own: warp.size() (an unsigned 32) and cg::reduce in kernels 2-6, kWarpSize (an int 32)
// and warp_sum's shuffles in kernel 7; the type of step is kept because a signed and an unsigned
// step unroll differently. With kStreamPass2, pass 2 reads dy and x with streaming loads (__ldcs):
// it is the row's last use (kernels 3-7; kernel 2 reads them plainly, as llm.c did).
// No barrier inside, so the warps of a block may call it for different numbers of rows.
template <bool kStreamPass2, typename T, typename Step, typename RowSum>
__device__ __forceinline__ void warp_row_to_shared_sums(int64_t row, int lane, Step step, RowSum row_sum, T* dx,
                                                        const T* dy, const T* x, const T* weight, const float* mean,
                                                        const float* rstd, int C, float* dbias_sh,
                                                        float* dweight_sh) {
  const T* dy_r = dy + row * C;
  const T* x_r = x + row * C;
  T* dx_r = dx + row * C;
  const float mean_r = mean[row];
  const float rstd_r = rstd[row];

  // Pass 1: a = mean(g), b = mean(g * xhat), g = weight * dy, xhat = (x - mean) * rstd.
  float sum_g = 0.0f, sum_g_xhat = 0.0f;
  for (int i = lane; i < C; i += step) {
    const float xhat = (to_acc(x_r[i]) - mean_r) * rstd_r;
    const float g = mul_rn(to_acc(weight[i]), to_acc(dy_r[i]));
    sum_g += g;
    sum_g_xhat += g * xhat;
  }
  const float a = row_sum(sum_g) / C;
  const float b = row_sum(sum_g_xhat) / C;

  // Pass 2: dx = (g - a - xhat * b) * rstd, and the row's share of dbias and dweight added to the
  // block's sums with shared-memory atomicAdd (only the block's own warps contend for them).
  for (int i = lane; i < C; i += step) {
    const float d = to_acc(load_elem<kStreamPass2>(dy_r + i));
    const float xhat = (to_acc(load_elem<kStreamPass2>(x_r + i)) - mean_r) * rstd_r;
    atomicAdd(&dbias_sh[i], d);
    atomicAdd(&dweight_sh[i], d * xhat);
    dx_r[i] = from_acc<T>((mul_rn(to_acc(weight[i]), d) - a - xhat * b) * rstd_r);
  }
}

// Pass 1 of a row with 16-byte loads (kernels 8 and 9): lane `lane` reads VEC = 16 / sizeof(T)
// neighbouring columns from lane * VEC on, then the next 32 * VEC further, and so on; it adds its
// g = weight * dy and g * xhat (xhat = (x - mean) * rstd) to sum_g and sum_g_xhat, which the
// caller then sums across the warp. C must be a multiple of VEC and the rows 16-byte aligned.
template <typename T>
__device__ __forceinline__ void x128_row_sums(const T* dy_r, const T* x_r, const T* weight, float mean_r,
                                              float rstd_r, int lane, int C, float& sum_g, float& sum_g_xhat) {
  constexpr int VEC = 16 / sizeof(T);
  using V = Packed<T, VEC>;
  for (int col = lane * VEC; col < C; col += 32 * VEC) {
    const V dyv = load(reinterpret_cast<const V*>(dy_r + col));
    const V xv = load(reinterpret_cast<const V*>(x_r + col));
    const V wv = load(reinterpret_cast<const V*>(weight + col));
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float xhat = (to_acc(xv[k]) - mean_r) * rstd_r;
      const float g = mul_rn(to_acc(wv[k]), to_acc(dyv[k]));
      sum_g += g;
      sum_g_xhat += g * xhat;
    }
  }
}

// Adds the block's sums into the one fp32 scratch row, [dbias | dweight], that all blocks share
// (kernels 2, 6, 7, 8), with global atomicAdd: once per block and column instead of once per row
// and column.
__device__ __forceinline__ void add_block_sums_to_row(float* scratch, const float* dbias_sh, const float* dweight_sh,
                                                      int C) {
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    atomicAdd(&scratch[i], dbias_sh[i]);
    atomicAdd(&scratch[C + i], dweight_sh[i]);
  }
}

// Writes the block's sums to its own partial slot, slot blockIdx.x (kernels 5, 9, 10): no
// atomics, and nothing needs zeroing first.
template <typename A>
__device__ __forceinline__ void write_block_slot(A* partials, const A* dbias_sh, const A* dweight_sh, int C) {
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    slot[i] = dbias_sh[i];
    slot[C + i] = dweight_sh[i];
  }
}

// Called by every thread of the block once the block's sums are in the workspace (its slot, or
// its atomics into the scratch row): counts the block done on the workspace counter, and returns
// true in the last block to finish, for which every other block's sums are complete; it then
// reads them from L2 (__ldcg), where the other SMs' writes are. is_last is a flag in shared memory.
template <typename Flag>
__device__ __forceinline__ bool last_block_to_finish(unsigned int* counter, Flag* is_last) {
  __threadfence();   // this thread's sums are visible device-wide before the counter says we are done
  __syncthreads();   // all of the block's threads have written (and fenced) their part
  if (threadIdx.x == 0) *is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();   // every thread sees the answer
  if (!*is_last) return false;
  __threadfence();   // order the reads of the other blocks' sums after their increments
  return true;
}

// In the last block: adds the gridDim.x partial slots column by column, in block order (so the
// sums do not depend on which block finished when), and writes dweight/dbias in T (kernels 5, 10).
template <typename T, typename A>
__device__ __forceinline__ void add_slots_in_block_order(T* dweight, T* dbias, const A* partials, int C) {
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (unsigned int blk = 0; blk < gridDim.x; ++blk) {
      sb += __ldcg(partials + static_cast<size_t>(blk) * 2 * C + i);
      sw += __ldcg(partials + static_cast<size_t>(blk) * 2 * C + C + i);
    }
    dbias[i] = from_acc<T>(sb);
    dweight[i] = from_acc<T>(sw);
  }
}

// In the last block: converts the scratch row, which holds all blocks' sums, to dweight/dbias in
// T (kernels 6, 7).
template <typename T>
__device__ __forceinline__ void write_scratch_row(T* dweight, T* dbias, const float* scratch, int C) {
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    dbias[i] = from_acc<T>(__ldcg(scratch + i));
    dweight[i] = from_acc<T>(__ldcg(scratch + C + i));
  }
}

}  // namespace lnbwd
