// Kernel 12 internals shared with the CUDA check (tests/cuda/check.cu) and the tuning tools
// (tools/tune/), which run configurations directly. The FFI glue uses backward/api.h only.
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

#include "backward/api.h"
#include "common/vec.cuh"

namespace lnbwd {

// Threads per block. A thread keeps 2 * NV * VEC sums, its weight columns and one row of dy and
// x in registers; up to 32 bytes of sums (8 fp32) fit the 64 registers a 1024-thread block
// allows, more needs the 128 of a 512-thread block (else the compiler reports spills).
constexpr int kernel12_max_threads(size_t sum_bytes) { return sum_bytes <= 32 ? 1024 : 512; }
constexpr int kKernel12MaxGroups = 15;   // row groups per block: named barriers 1..15
// Rows a group takes at least where rows are few (kernel12_bulk_copy_ring.cu's launch says why).
constexpr int kKernel12MinRowsPerGroup = 2;
// Bytes of dy and x an SM should have on their way while its groups compute: below this, a
// third ring buffer pays; above, more buffers only queue (measured, docs/kernel12.md).
constexpr size_t kKernel12InFlightBytes = 56 * 1024;
// Small rows (kernel12_row_chunks.cu): threads per block for items of `item_bytes`, and the
// blocks an SM the registers must allow. A 16-bit row's vector is 8 elements, whose work hides
// the shared-memory loads' latency only with 32 warps an SM: two blocks of 512 (64 registers a
// thread). fp32 rows run three blocks of 256 (80 registers; 24 warps), which measured faster.
constexpr int kernel12_chunk_threads(int item_bytes) { return item_bytes == 2 ? 512 : 256; }
constexpr int kernel12_chunk_blocks_per_sm(int threads) { return threads == 512 ? 2 : 3; }
// QK-norm's two sets (kernel12_chunk_sets.cu): the second set's launch is programmatic, its
// blocks starting in the first set's tail, where a row is at most this many bytes (a 16-bit
// head_dim of 64). There a set streams in the least time, so the tail between the two grids is
// the largest share of it; at longer rows the overlap measured no gain (docs/kernel12.md).
constexpr size_t kKernel12SetsOverlapRowBytes = 128;
// Their dynamic shared memory, as the launch sizes it and the kernel lays it out: [the weight row,
// C accumulators, to a 128-byte boundary | the ring: nb buffers x `tensors` chunks of
// chunk_bytes, whose memory the end's per-warp [dbias | dweight] sums reuse | full[nb] |
// empty[nb]]. The ring's bytes are the larger of the two uses.
__host__ __device__ inline size_t kernel12_chunk_weight_bytes(int64_t C, size_t acc) {
  return round_up<size_t>(static_cast<size_t>(C) * acc, 128);
}
__host__ __device__ inline size_t kernel12_chunk_ring_bytes(size_t chunk_bytes, int nb, int tensors, int warps,
                                                            int64_t C, size_t acc) {
  const size_t buffers = static_cast<size_t>(nb) * tensors * chunk_bytes;
  const size_t warp_sums = static_cast<size_t>(warps) * 2 * C * acc;
  return buffers > warp_sums ? buffers : warp_sums;
}

// Split rows exist for the types whose sums are fp32 (the pair a group sends is two floats).
template <typename T>
constexpr bool kCanSplit = std::is_same_v<acc_t<T>, float>;

struct Kernel12Config {
  int nv = 1;       // 16-byte vectors per thread per row
  int nb = 2;       // ring buffers per row group (rows ahead of the one computed: nb - 1, nb in regs mode)
  int tpr = 32;     // threads per row group (a multiple of 32)
  int groups = 1;   // row groups per block
  bool regs = false;  // copy each row to registers once (else both passes read shared memory)
  bool raw_weight = false;  // shared-memory mode: stage the weight as T, not acc_t (16-bit only)
  int split = 1;    // blocks sharing each row (2: a cluster of two, half a row each; not fp64)
  bool chunks = false;  // small rows: a ring buffer is nv * groups consecutive rows (nv per
                        // group, a row held by tpr threads of one vector each), a bulk copy per
                        // tensor; nb buffers per block, not per group
};

// Configurations that fit (16-byte aligned rows of C elements); empty if none. weight_f32 (a
// float32 weight beside 16-bit data) leaves out the configurations that stage the weight as T.
std::vector<Kernel12Config> kernel12_candidates(Dtype dtype, int64_t C, const DeviceLimits& lim,
                                                bool weight_f32 = false);
bool kernel12_pick(Dtype dtype, int64_t C, const DeviceLimits& lim, Kernel12Config* cfg, bool weight_f32 = false);
// Dynamic shared memory of one block of this configuration, C being the columns of a row that
// one block takes (C / split); item and acc the bytes of T and acc_t<T>.
size_t kernel12_smem_bytes(const Kernel12Config& cfg, int64_t C, size_t item, size_t acc);
cudaError_t norm_bwd_kernel12_config(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream);

// Small rows, a whole chunk of them per ring buffer (the kernel: kernel12_row_chunks.cu; the
// rest: kernel12_config.cu): the configurations (nb buffers of one block-wide chunk; empty where
// the row needs more than a warp of 16-byte vectors, or for fp64), the pick, and the dynamic
// shared memory of a block (resid: dresidual rides in the ring too).
std::vector<Kernel12Config> kernel12_chunk_candidates(Dtype dtype, int64_t C, const DeviceLimits& lim);
bool kernel12_chunk_pick(Dtype dtype, int64_t C, const DeviceLimits& lim, Kernel12Config* cfg);
size_t kernel12_chunk_smem_bytes(const Kernel12Config& cfg, int64_t C, size_t item, size_t acc, bool resid);
cudaError_t norm_bwd_kernel12_chunks(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream);
// Calls f(std::integral_constant<int, TPR>{}) for the ring of row chunks' group width tpr (4 to
// 32 threads, one 16-byte vector each of a row), the template argument the kernels need;
// cudaErrorInvalidValue for any other.
template <typename F>
cudaError_t with_chunk_tpr(int tpr, F&& f) {
  switch (tpr) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}
// QK-norm's two sets of rows (backward/sets.cuh) on the ring of row chunks, configuration cfg,
// one launch a set (kernel12_chunk_sets.cu; norm_bwd_sets picks it for rows it takes).
cudaError_t norm_bwd_kernel12_chunk_sets(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg,
                                         cudaStream_t stream);

// Rows too wide for the per-group ring: one row per block, streamed in chunks, once per pass
// (kernel12_wide_rows.cu). fp32, bf16 and fp16 with C up to 16384.
bool kernel12_wide_fits(Dtype dtype, int64_t C, const DeviceLimits& lim);
// Whether this build has sm_90 code for kernel 12 that `device` runs (kernel_code_arch).
bool kernel12_has_code(int device);
cudaError_t norm_bwd_kernel12_wide(const NormBwdParams& p, cudaStream_t stream);

}  // namespace lnbwd
