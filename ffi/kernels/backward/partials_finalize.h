// Sums the per-block partial slots of the workspace into dweight and dbias (fixed order);
// `slots` is the number of slots per segment.
#pragma once

#include "backward/api.h"

namespace lnbwd {

// Launched on the stream right after the kernel that writes the slots (launch_with_partials,
// launch.cuh); on sm_90 with programmatic dependent launch, so it may start before that kernel
// ends and waits for it on the GPU.
cudaError_t finalize_partials_launch(const NormBwdParams& p, const DeviceLimits& lim, int slots,
                                     cudaStream_t stream);

// Whether a launch on `stream` may carry the programmatic-serialization attribute (sm_90, and a
// driver whose stream capture records the dependency; partials_finalize.cu).
bool dependent_launch_ok(const DeviceLimits& lim, cudaStream_t stream);

// The configuration of a cudaLaunchKernelEx launch of `grid` blocks of `block` threads with
// `smem` bytes of dynamic shared memory on `stream`; `programmatic` adds the programmatic-
// serialization attribute (pass what dependent_launch_ok answered, or false).
cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool programmatic);

#ifdef __CUDACC__
// Called by a kernel whose partials finalize_partials sums, once per thread, at its start: from
// the moment every block of the grid has called it, the finalize kernel may launch and wait on
// the GPU for this grid to finish, so its launch overlaps this grid's work (see
// partials_finalize.cu). A no-op before sm_90.
__device__ __forceinline__ void allow_finalize_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Called by a kernel that may be launched programmatically after another writer of the same
// finalize's slots (QK-norm's second set, kernel12_chunk_sets.cu), once per thread, after its
// last write: the block ends only once that earlier grid has ended and its writes are visible, so
// that the finalize, which waits for this grid alone, finds both grids' slots written. A no-op
// for a grid launched plainly, and before sm_90.
__device__ __forceinline__ void wait_for_earlier_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#endif

}  // namespace lnbwd
