// Host-side pieces shared by the launchers of llm.c's kernels 1-10 (backward/llmc/kernelNN_*.cu;
// their shared device routines are in llmc_device.cuh): dtype dispatch that instantiates only the
// dtypes a kernel is built for, the check every launcher makes before it launches (the limits
// themselves are in llmc_limits.h), llm.c's persistent grid, and the opt-in to more than 48 KB of
// dynamic shared memory.
#pragma once

#include <cstdint>

#include "backward/launch.cuh"
#include "backward/llmc/llmc_limits.h"

namespace lnbwd {

template <typename T> constexpr Dtype dtype_of();
template <> constexpr Dtype dtype_of<float>() { return Dtype::kF32; }
template <> constexpr Dtype dtype_of<__nv_bfloat16>() { return Dtype::kBF16; }
template <> constexpr Dtype dtype_of<__half>() { return Dtype::kF16; }
template <> constexpr Dtype dtype_of<double>() { return Dtype::kF64; }

// Calls f(T{}) with the C++ type of `dtype` when it is one of Ts, the dtypes llm.c kernel
// `kKernel` is built for (llmc_limits.h, checked at compile time), else returns
// cudaErrorInvalidValue. Only the Ts are instantiated: each dtype costs a full compile of the
// kernel for every architecture.
template <int kKernel, typename... Ts, typename F>
cudaError_t dispatch_llmc_dtypes(Dtype dtype, F&& f) {
  static_assert(kLlmcFacts[kKernel].dtypes == (dtype_bit(dtype_of<Ts>()) | ...),
                "the dtypes instantiated differ from the kernel's dtypes in llmc_limits.h");
  cudaError_t out = cudaErrorInvalidValue;
  (void)((dtype == dtype_of<Ts>() ? (out = f(Ts{}), true) : false) || ...);
  return out;
}

// What every llm.c launcher checks before it launches, so that a kernel never runs on a problem
// it would get wrong: the dtype, the segments, and RMSNorm, a float32 weight or a residual
// gradient where llmc_limits.h says the kernels take none (the FFI glue refuses them first)
// (cudaErrorInvalidValue), the block size and C
// (cudaErrorInvalidConfiguration). Arithmetic only: the callers asked the registry first, and
// a shared-memory need beyond the device's is refused by the driver at the opt-in (opt_in_smem)
// before anything is launched. Sets *l to the kernel's limits for p.
inline cudaError_t check_llmc_limits(int kernel, const NormBwdParams& p, LlmcLimits* l) {
  *l = llmc_limits(kernel, p.dtype, p.C, p.block_size);
  if (!l->dtype_ok || p.segments != 1 || p.weight_stride != 0 || p.rows < 1 || p.C < 1) return cudaErrorInvalidValue;
  if (p.norm == NormKind::kRmsNorm && !kLlmcRunsRmsnorm) return cudaErrorInvalidValue;
  if ((p.weight_f32 || p.dresidual != nullptr) && !kLlmcTakesV2Operands) return cudaErrorInvalidValue;
  if (!l->block_size_ok || p.C % l->c_multiple != 0) return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

// llm.c's persistent grid: blocks_per_sm blocks on every SM, but never more blocks than the
// rows have warps for (one warp per row: an extra block would only add zeros).
inline cudaError_t persistent_grid(const NormBwdParams& p, int blocks_per_sm, int block_size, int64_t* grid) {
  int sms = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  *grid = std::min<int64_t>(static_cast<int64_t>(blocks_per_sm) * sms, ceil_div<int64_t>(p.rows, block_size / 32));
  return cudaSuccess;
}

// A launch with more than 48 KB of dynamic shared memory needs the kernel's opt-in first, up to
// cudaDevAttrMaxSharedMemoryPerBlockOptin (227 KB on Hopper); the driver refuses more
// (cudaErrorInvalidValue), so a C too wide for the GPU never launches.
template <typename Kernel>
cudaError_t opt_in_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  if (bytes > static_cast<size_t>(INT_MAX)) return cudaErrorInvalidValue;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  // A refusal is an answer, not a failure of the context: clear the runtime's last error, which
  // the next launch's cudaGetLastError would otherwise report as its own.
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

// How llm.c's kernels 5-10 hand their block sums to the last block to finish
// (last_block_to_finish in llmc_device.cuh): each block writes its own partial slot (kernels 5,
// 9, 10), or all blocks add into one shared fp32 scratch row, slot 0 (kernels 6, 7, 8).
enum class LlmcSums { kSlotPerBlock, kSharedRow };

// Launches one of llm.c's kernels 5-10, which all take (dx, dweight, dbias, scratch, counter, dy, x,
// weight, mean, rstd, rows, C): blocks_per_sm blocks on every SM (fewer when the rows have fewer
// warps; with a slot per block, no more than the workspace has slots), after zeroing what the
// kernel counts on being zero.
template <typename T, typename Kernel>
cudaError_t launch_last_block_kernel(Kernel kernel, LlmcSums sums, const NormBwdParams& p, int blocks_per_sm,
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
