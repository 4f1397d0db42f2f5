// Host-side pieces shared by the launchers of seed kernels 1-10 (kernel0N_*.cu,
// kernel10_vector_smem.cu; their shared device routines are in seed_device.cuh): dtype dispatch
// that instantiates only the dtypes a kernel is built for, the rules every launcher checks
// (LlmcKernelLimits, see layernorm_bwd.h), the persistent grid of the seed, and the opt-in to
// more than 48 KB of dynamic shared memory.
#pragma once

#include <cstdint>

#include "common/launch.cuh"

namespace lnbwd {

template <typename T> constexpr Dtype dtype_of();
template <> constexpr Dtype dtype_of<float>() { return Dtype::kF32; }
template <> constexpr Dtype dtype_of<__nv_bfloat16>() { return Dtype::kBF16; }
template <> constexpr Dtype dtype_of<__half>() { return Dtype::kF16; }
template <> constexpr Dtype dtype_of<double>() { return Dtype::kF64; }

// Calls f(T{}) with the C++ type of `dtype` when it is one of Ts (the dtypes the kernel is built
// for), else returns cudaErrorInvalidValue. Only the Ts are instantiated: each dtype costs a
// full compile of the kernel for every architecture.
template <typename... Ts, typename F>
cudaError_t dispatch_dtypes(Dtype dtype, F&& f) {
  cudaError_t out = cudaErrorInvalidValue;
  (void)((dtype == dtype_of<Ts>() ? (out = f(Ts{}), true) : false) || ...);
  return out;
}

// Limits of a kernel built for dtypes Ts whose block sizes are the powers of two from 32 (one
// warp) to max_block_size; block_size 0 means default_block_size. The caller fills in
// c_multiple and smem_bytes, which depend on the kernel.
template <typename... Ts>
LlmcKernelLimits seed_limits(Dtype dtype, int block_size, int default_block_size, int max_block_size) {
  LlmcKernelLimits l;
  l.dtype_ok = ((dtype == dtype_of<Ts>()) || ...);
  l.block_size = block_size == 0 ? default_block_size : block_size;
  l.default_block_size = default_block_size;
  l.max_block_size = max_block_size;
  l.block_size_ok = l.block_size >= 32 && l.block_size <= max_block_size && (l.block_size & (l.block_size - 1)) == 0;
  l.c_multiple = 1;
  l.smem_bytes = 0;
  return l;
}

// What every seed launcher checks before it launches, so that a kernel never runs on a problem
// it would get wrong: the dtype and the segments (cudaErrorInvalidValue), the block size, C and
// the shared memory (cudaErrorInvalidConfiguration).
inline cudaError_t check_seed_limits(const LlmcKernelLimits& l, const LayernormBwdParams& p) {
  if (!l.dtype_ok || p.segments != 1 || p.weight_stride != 0 || p.rows < 1 || p.C < 1) return cudaErrorInvalidValue;
  if (!l.block_size_ok || p.C % l.c_multiple != 0) return cudaErrorInvalidConfiguration;
  int max_smem = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(max_dynamic_smem(&max_smem));
  if (l.smem_bytes > static_cast<size_t>(max_smem)) return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

// The seed's persistent grid: blocks_per_sm blocks on every SM, but never more blocks than the
// rows have warps for (one warp per row: an extra block would only add zeros).
inline cudaError_t persistent_grid(const LayernormBwdParams& p, int blocks_per_sm, int block_size, int64_t* grid) {
  int sms = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  *grid = std::min<int64_t>(static_cast<int64_t>(blocks_per_sm) * sms, ceil_div<int64_t>(p.rows, block_size / 32));
  return cudaSuccess;
}

// A launch with more than 48 KB of dynamic shared memory needs the kernel's opt-in first (up to
// cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KB on Hopper, which check_seed_limits enforces).
template <typename Kernel>
cudaError_t opt_in_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// How seed kernels 5-10 hand their block sums to the last block to finish
// (last_block_to_finish in seed_device.cuh): each block writes its own partial slot (kernels 5,
// 9, 10), or all blocks add into one shared fp32 scratch row, slot 0 (kernels 6, 7, 8).
enum class LlmcSums { kSlotPerBlock, kSharedRow };

// Launches one of seed kernels 5-10, which all take (dx, dweight, dbias, scratch, counter, dy, x,
// weight, mean, rstd, rows, C): blocks_per_sm blocks on every SM (fewer when the rows have fewer
// warps; with a slot per block, no more than the workspace has slots), after zeroing what the
// kernel counts on being zero.
template <typename T, typename Kernel>
cudaError_t launch_last_block_kernel(Kernel kernel, LlmcSums sums, const LayernormBwdParams& p, int blocks_per_sm,
                                     int block_size, size_t smem, cudaStream_t stream) {
  if (sums == LlmcSums::kSharedRow && partial_slots<T>(p) < 1) return cudaErrorInvalidValue;   // the row is slot 0
  int64_t grid = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(persistent_grid(p, blocks_per_sm, block_size, &grid));
  if (sums == LlmcSums::kSlotPerBlock) {
    grid = std::min<int64_t>(grid, partial_slots<T>(p));   // one slot per block
    if (grid < 1) return cudaErrorInvalidValue;
  }
  LNBWD_RETURN_IF_CUDA_ERROR(opt_in_smem(kernel, smem));
  // A slot per block: only the counter (every slot is written before it is read). A shared row:
  // the counter (header) and the row (slot 0) are contiguous, so one memset zeroes both.
  const size_t zeroed = sums == LlmcSums::kSlotPerBlock ? sizeof(unsigned int)
                                                        : kWorkspaceHeaderBytes + 2 * p.C * sizeof(acc_t<T>);
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.workspace, 0, zeroed, stream));
  kernel<<<static_cast<unsigned int>(grid), block_size, smem, stream>>>(
      static_cast<T*>(p.dx), static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), partials_of<T>(p), flag_of(p),
      static_cast<const T*>(p.dy), static_cast<const T*>(p.x), static_cast<const T*>(p.weight),
      static_cast<const stat_t<T>*>(p.mean), static_cast<const stat_t<T>*>(p.rstd), p.rows, static_cast<int>(p.C));
  return cudaGetLastError();
}

}  // namespace lnbwd
