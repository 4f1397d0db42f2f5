// Kernel 2 of llm.c's dev/cuda/layernorm_backward.cu: "shared-memory reductions".
//
// Technique (kept from llm.c): one warp per row. Cooperative groups tile the block into
// 32-thread tiles; the lanes of a tile stride over the row's columns, so each load instruction
// of a warp reads 32 neighbouring elements (coalesced), and the two row sums are reduced across
// the lanes with cg::reduce (warp shuffles). The row's contributions to dbias and dweight go
// into the block's fp32 sums in shared memory (2*C floats) with shared-memory atomicAdd, which
// only the block's own warps contend for. At the end each block adds its sums to one fp32
// scratch row in global memory (global atomicAdd, once per block instead of once per row), and a
// second tiny kernel converts the scratch to dweight/dbias in the output dtype. The grid has
// one warp per row: ceil(rows / warps per block) blocks.
//
// Repairs relative to llm.c:
//  * The scratch row is the first partial slot of the workspace XLA gives, zeroed with
//    cudaMemsetAsync on the caller's stream. llm.c cudaMalloc'ed and cudaFree'd it on every
//    call (an allocation and a device synchronization inside an XLA op; neither can be captured
//    in a CUDA graph) and zeroed it with cudaMemset on the legacy default stream.
//  * No early return. llm.c's warps past the last row returned before the block's barriers:
//    the shared sums their threads should have zeroed (and later added to the scratch) were left
//    as garbage and dropped, and __syncthreads ran with part of the block exited, which CUDA
//    leaves undefined. Now such warps skip the row work and join every barrier.
//  * dx is written, not accumulated: llm.c's dinp + dval read XLA's uninitialized output.
//  * g = weight * dy is rounded once (mul_rn) in both passes, so C = 1 gives dx = 0 exactly.
//  * 64-bit row offsets, and a grid computed in 64 bits (llm.c's 32 * N overflowed int).
//  * More than 48 KB of shared memory (C > 6144) is opted in to; C up to 29056 fits Hopper.
// Not deterministic: float atomics (shared and global) add in an order that varies run to run.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {
namespace {

namespace cg = cooperative_groups;


template <typename T>
__global__ void __launch_bounds__(1024)
kernel2(T* __restrict__ dx, float* __restrict__ scratch, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums], C floats each
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * warp.meta_group_size() + warp.meta_group_rank();

  zero_block_sums(dbias_sh, dweight_sh, C);
  __syncthreads();   // sums zeroed before any warp adds to them

  // The warp's row (llmc_device.cuh): pass 1 sums g = weight * dy and g * xhat over each lane's
  // columns, row_sum adds them across the tile (cg::reduce: warp shuffles) into a = mean(g) and
  // b = mean(g * xhat); pass 2 writes dx and adds dy and dy * xhat to the block's shared sums.
  auto row_sum = [&](float v) { return cg::reduce(warp, v, cg::plus<float>{}); };
  if (row < rows) {   // uniform across the warp
    warp_row_to_shared_sums<false>(row, warp.thread_rank(), warp.size(), row_sum, dx, dy, x, weight, mean, rstd, C,
                                   dbias_sh, dweight_sh);
  }
  __syncthreads();   // every warp's shared atomics done before the block's sums are read

  // The block's sums into the one fp32 scratch row, with global atomics (once per block, not per
  // row); copy_to_dweight_dbias converts the scratch once every block is done.
  add_block_sums_to_row(scratch, dbias_sh, dweight_sh, C);
}

// Converts the fp32 scratch row (all blocks' sums) to dweight/dbias in the output dtype.
template <typename T>
__global__ void copy_to_dweight_dbias(T* __restrict__ dweight, T* __restrict__ dbias, const float* __restrict__ scratch,
                                      int C) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < C; i += blockDim.x * gridDim.x) {
    dbias[i] = from_acc<T>(scratch[i]);
    dweight[i] = from_acc<T>(scratch[C + i]);
  }
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  if (partial_slots<T>(p) < 1) return cudaErrorInvalidValue;   // the scratch row is slot 0
  const int64_t grid = ceil_div<int64_t>(p.rows, l.block_size / 32);   // one warp per row
  if (grid > INT32_MAX) return cudaErrorInvalidConfiguration;
  float* scratch = partials_of<T>(p);   // slot layout: [dbias | dweight]
  const int C = static_cast<int>(p.C);
  auto kernel = kernel2<T>;
  LNBWD_RETURN_IF_CUDA_ERROR(opt_in_smem(kernel, l.smem_bytes));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(scratch, 0, 2 * p.C * sizeof(float), stream));
  kernel<<<static_cast<unsigned int>(grid), l.block_size, l.smem_bytes, stream>>>(
      static_cast<T*>(p.dx), scratch, static_cast<const T*>(p.dy), static_cast<const T*>(p.x),
      static_cast<const T*>(p.weight), static_cast<const float*>(p.mean), static_cast<const float*>(p.rstd), p.rows, C);
  LNBWD_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  const int copy_threads = 256;
  copy_to_dweight_dbias<T><<<static_cast<unsigned int>(ceil_div(C, copy_threads)), copy_threads, 0, stream>>>(
      static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), scratch, C);
  return cudaGetLastError();
}

}  // namespace

cudaError_t norm_bwd_kernel2(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(2, p, &l));
  return dispatch_llmc_dtypes<2, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
