// The row loop of llm.c's kernels 3-6 (kernel03_*.cu .. kernel06_*.cu), which differ only in how a
// block's sums leave shared memory afterwards. Apart from llmc_device.cuh because it needs
// cooperative groups, which kernels 7-10 do without.
#pragma once

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {

// Kernels 3-6: the persistent grid's warps (cooperative groups' 32-thread tiles) take rows w,
// w + warps_in_grid, w + 2 * warps_in_grid, ... (w the warp's index in the grid), each through
// warp_row_to_shared_sums: pass 1 sums g = weight * dy and g * xhat over each lane's columns,
// cg::reduce adds them across the tile into a = mean(g) and b = mean(g * xhat); pass 2 reads the
// row again with streaming loads, writes dx and adds dy and dy * xhat to the block's shared sums,
// which are zeroed first. No barrier inside the row loop, so warps may take different numbers of
// rows. Returns after the barrier that ends every warp's shared atomics: the caller reads the
// block's sums next.
template <typename T>
__device__ __forceinline__ void persistent_warps_to_block_sums(T* dx, const T* dy, const T* x, const T* weight,
                                                               const float* mean, const float* rstd, int64_t rows,
                                                               int C, float* dbias_sh, float* dweight_sh) {
  namespace cg = cooperative_groups;
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);

  zero_block_sums(dbias_sh, dweight_sh, C);
  __syncthreads();   // sums zeroed before any warp adds to them

  auto row_sum = [&](float v) { return cg::reduce(warp, v, cg::plus<float>{}); };
  const int64_t warps_in_grid = static_cast<int64_t>(gridDim.x) * warp.meta_group_size();
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warp.meta_group_size() + warp.meta_group_rank(); row < rows;
       row += warps_in_grid) {
    warp_row_to_shared_sums<true>(row, warp.thread_rank(), warp.size(), row_sum, dx, dy, x, weight, mean, rstd, C,
                                  dbias_sh, dweight_sh);
  }
  __syncthreads();   // every warp's shared atomics done before the block's sums are read
}

}  // namespace lnbwd
