// The last step of reducing a row's two sums (s1, s2) over the several warps that share the row:
// each warp has already summed its lanes (warp_sum); here the warps' pairs meet through shared
// memory. group_sync serves kernels 11 and 12; exchange_row_sums serves their wide-row paths
// (kernel11_wide_rows.cu, kernel12_wide_rows.cu). The row-group paths (kernel11_rows_in_registers.cu,
// kernel12_bulk_copy_ring.cu) write the same steps out in place: with nvcc 13 any call there
// changed their code enough to cost some variants registers or spills (checked with -Xptxas -v).
#pragma once

#include "common/vec.cuh"

namespace lnbwd {

// Synchronizes the `count` threads of one row group on hardware barrier `id` (1..15; 0 is
// __syncthreads), without stopping the other groups of the block (which __syncthreads would).
// A group of a single warp needs only __syncwarp.
__device__ __forceinline__ void group_sync(int id, int count) {
  if (count == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
  }
}

// Across the warps of a row: lane 0 of each warp posts its (s1, s2) pair to ex[warp], `sync()`
// (a barrier of exactly the threads that share `ex`) makes every pair visible, then every thread
// adds the `warps` pairs in warp order, one 8-byte (16-byte for fp64) load each. The order is the
// same everywhere, so all threads agree bit for bit. On entry s1 and s2 are the warp's sums, on
// return the row's. The caller picks `ex` and says why it is free to overwrite: the callers
// alternate two buffers between rows, so that a buffer is overwritten only after the next row's
// barrier, by which time every thread has read it.
template <typename A, typename Sync>
__device__ __forceinline__ void exchange_row_sums(Packed<A, 2>* ex, int warps, int warp, int lane, A& s1, A& s2,
                                                  Sync&& sync) {
  if (lane == 0) {
    Packed<A, 2> mine;
    mine[0] = s1;
    mine[1] = s2;
    ex[warp] = mine;
  }
  sync();
  s1 = A(0);
  s2 = A(0);
  for (int w = 0; w < warps; ++w) {
    const Packed<A, 2> p = ex[w];
    s1 += p[0];
    s2 += p[1];
  }
}

}  // namespace lnbwd
