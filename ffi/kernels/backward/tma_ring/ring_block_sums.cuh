// The end of kernel 12's row ring (kernel12_bulk_copy_ring.cu): the block's dbias/dweight sums,
// each column's added over the row groups in group order, into the block's partial slot [2][C]
// (dbias, then dweight). The slots are then added in slot order (launch_with_partials,
// backward/launch.cuh), so the result does not depend on timing. The groups' sums meet in shared
// memory in one of two layouts:
//  * Whole rows: each group stores its sums into its own ring buffers (2 * Cb accumulators fit
//    in NB >= 2 rows of dy and x), which are idle once every thread of the group is past its last
//    row, so a group that finishes early stores them while the others still compute; the block
//    then adds 16 bytes of each sum per thread and step.
//  * Split rows keep a block-wide layout [groups][2][Cb] over the weight row and the ring: with
//    the per-group one, nvcc scheduled their row loop worse. The two blocks of a cluster fill the
//    two halves of one slot.
#pragma once

#include <cstddef>

#include "common/vec.cuh"

namespace lnbwd {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Whole rows, once every thread of the group is past its last row: the thread's sums into the
// group's first ring buffers, own = [2][Cb] (dbias sums, then dweight sums).
template <int VEC, int NV, typename A>
__device__ __forceinline__ void store_group_sums(A* own, const Packed<A, VEC> (&db)[NV],
                                                 const Packed<A, VEC> (&dw)[NV], int tpr, int t, int Cb) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < Cb) {
      *reinterpret_cast<Packed<A, VEC>*>(own + col) = db[j];
      *reinterpret_cast<Packed<A, VEC>*>(own + Cb + col) = dw[j];
    }
  }
}

// Whole rows, after the block's barrier: each column over the groups' rings (buf_dy(q, b): the
// dy row of ring buffer b of group q) into the block's slot. Cb is a multiple of VEC, so of the
// 16-byte chunk too. The group loop is unrolled so that several groups' loads are in flight at
// once; the additions still run in group order.
template <typename A, int NB, typename BufDy>
__device__ __forceinline__ void write_block_sums_from_rings(const BufDy& buf_dy, size_t row_bytes, A* partials, int C,
                                                            int Cb, int groups) {
  using Chunk = Packed<A, 16 / sizeof(A)>;
  constexpr int kChunk = Chunk::size;
  const size_t group_stride = static_cast<size_t>(NB) * 2 * row_bytes / sizeof(A);   // one group's ring
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x * kChunk; c < Cb; c += blockDim.x * kChunk) {
    Chunk sb, sw;
#pragma unroll
    for (int v = 0; v < kChunk; ++v) { sb[v] = A(0); sw[v] = A(0); }
    const A* sums = reinterpret_cast<const A*>(buf_dy(0, 0)) + c;
#pragma unroll 4
    for (int q = 0; q < groups; ++q) {
      const Chunk b = *reinterpret_cast<const Chunk*>(sums + q * group_stride);
      const Chunk w = *reinterpret_cast<const Chunk*>(sums + q * group_stride + Cb);
#pragma unroll
      for (int v = 0; v < kChunk; ++v) { sb[v] += b[v]; sw[v] += w[v]; }
    }
    store_cg(reinterpret_cast<Chunk*>(slot + c), sb);
    store_cg(reinterpret_cast<Chunk*>(slot + C + c), sw);
  }
}

// Split rows, once no block of the cluster uses its ring any more: the thread's sums into the
// block-wide layout `sums`, the block's barrier, then each column over the groups into this
// block's half of the cluster's slot (columns from col0).
template <int SPLIT, int VEC, int NV, typename A>
__device__ __forceinline__ void write_block_sums_split(A* sums, const Packed<A, VEC> (&db)[NV],
                                                       const Packed<A, VEC> (&dw)[NV], A* partials, int C, int Cb,
                                                       int col0, int g, int groups, int tpr, int t) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < Cb) {
      *reinterpret_cast<Packed<A, VEC>*>(sums + (static_cast<size_t>(g) * 2) * Cb + col) = db[j];
      *reinterpret_cast<Packed<A, VEC>*>(sums + (static_cast<size_t>(g) * 2 + 1) * Cb + col) = dw[j];
    }
  }
  __syncthreads();
  A* slot = partials + static_cast<size_t>(blockIdx.x / SPLIT) * 2 * C + col0;
  for (int c = threadIdx.x; c < Cb; c += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (int q = 0; q < groups; ++q) {
      sb += sums[(static_cast<size_t>(q) * 2) * Cb + c];
      sw += sums[(static_cast<size_t>(q) * 2 + 1) * Cb + c];
    }
    __stcg(slot + c, sb);
    __stcg(slot + C + c, sw);
  }
}
#endif

}  // namespace lnbwd
