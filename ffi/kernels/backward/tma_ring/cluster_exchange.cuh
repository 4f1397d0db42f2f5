// The Hopper (sm_90) pieces of kernel 12's split rows (kernel12_bulk_copy_ring.cu): two blocks
// of a thread-block cluster each take half of every row, and after each row's first pass a
// group sends its half's two sums to the same group of the other block, straight into that
// block's shared memory (distributed shared memory, "DSMEM").
//
// The send is st.async: a store into the other block's shared memory that also counts its bytes
// down on an mbarrier there, so the receiver waits on its own barrier as it waits for a bulk copy
// (bulk_copy.cuh), and nobody spins on remote memory.
#pragma once

#include <cstdint>

#include "backward/tma_ring/bulk_copy.cuh"

namespace lnbwd {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// This block's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every block of the cluster arrives and waits: a __syncthreads over the
// cluster, whose release/acquire also makes shared-memory writes (mbarrier inits included)
// visible to the other blocks.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A barrier over the blocks that share rows: the block's own (__syncthreads), or with split rows
// (SPLIT > 1) the cluster's.
template <int SPLIT>
__device__ __forceinline__ void sync_row_sharers() {
  if constexpr (SPLIT > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
}

// The receiver's side of one phase of a pair barrier (mbar_init count 1): this thread's
// arrival, announcing the 8 bytes that the other block's send will count down.
__device__ __forceinline__ void mbar_expect_pair(uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 8;" ::"r"(smem_addr(bar)) : "memory");
}

// Stores (a, b) at `dst` and counts 8 bytes down on `bar`, both given as addresses in this block's
// shared memory and taken at the same offsets in block `rank` of the cluster (mapa).
__device__ __forceinline__ void send_pair(float* dst, uint64_t* bar, uint32_t rank, float a, float b) {
  uint32_t remote_dst, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_dst) : "r"(smem_addr(dst)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(remote_dst),
               "f"(a), "f"(b), "r"(remote_bar)
               : "memory");
}
#endif

}  // namespace lnbwd
