// The Hopper (sm_90) pieces of kernel 12's rings: mbarriers and bulk copies (cp.async.bulk,
// "TMA") of row pieces into shared memory. Used by kernel12_bulk_copy_ring.cu,
// kernel12_row_chunks.cu and kernel12_wide_rows.cu.
#pragma once

#include <cstdint>

namespace lnbwd {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A phase completes after `count` arrivals (and, for the copy barriers, once every byte that
// was announced to them has landed).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// The barrier of a buffer that issue_row fills needs two arrivals per phase: the issuing
// thread's (which announces the bytes of the bulk copies) and the cp.async unit's.
constexpr uint32_t kRowCopyArrivals = 2;

// One arrival, with release semantics: this thread's earlier shared-memory reads happen before
// whatever the waiter does next (such as refilling the buffer).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// PTX requires an mbarrier to be invalidated before its memory serves any other purpose, such
// as the shared memory of the next block that runs on this SM.
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Wait until the barrier's phase `parity` has completed (all expected bytes have landed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Announce `bytes` more to land on the barrier, as this thread's arrival (the phase then waits
// for the arrival count and for every announced byte).
__device__ __forceinline__ void mbar_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory into
// this block's shared memory; the barrier counts its bytes down as they land.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Orders this thread's earlier ordinary shared-memory accesses (and those a barrier made visible
// to it) before the copy engine's next writes to the same memory.
__device__ __forceinline__ void fence_before_bulk_copy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Copy `bytes` of a row of dy and of x into a buffer, and the row's mean and rstd beside it;
// the barrier's phase completes when all four have landed.
//
// mean and rstd ride with the row because a row cannot start without them: loaded when the row
// starts, they would put one DRAM round trip on every row's critical path, and under this
// kernel's own traffic (a ring of rows in flight on every SM) that round trip takes
// microseconds. They are 4 or 8 bytes, too small for the bulk engine, so two cp.async carry
// them, and cp.async.mbarrier.arrive.noinc makes their completion the barrier's second arrival
// (noinc: mbar_init already counts it).
//
// The fence orders the earlier ordinary reads of this buffer (made visible to the issuing thread
// by a barrier) before the copy engine's writes to it.
template <typename S>
__device__ __forceinline__ void issue_row(uint64_t* bar, void* dst_dy, void* dst_x, S* dst_stats, const void* src_dy,
                                          const void* src_x, const S* src_mean, const S* src_rstd, uint32_t bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst_stats)), "l"(src_mean), "n"(sizeof(S))
               : "memory");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst_stats + 1)), "l"(src_rstd),
               "n"(sizeof(S))
               : "memory");
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
  fence_before_bulk_copy();
  mbar_arrive_expect_bytes(bar, 2 * bytes);
  bulk_copy_to_shared(dst_dy, src_dy, bytes, bar);
  bulk_copy_to_shared(dst_x, src_x, bytes, bar);
}
#endif

}  // namespace lnbwd
