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
#endif

}  // namespace lnbwd
