// How many blocks of a kernel fit on the GPU at once, asked of the driver once per kernel and
// launch shape and then remembered. A persistent launch needs the number on every call, and
// the driver's occupancy calculator and cudaFuncSetAttribute are host work the GPU waits for
// when the kernel is short.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace lnbwd {

// Opts `kernel` in to `smem` bytes of dynamic shared memory per block on `device` (-1: the
// current one) and sets *out to how many blocks (cluster == 1) per SM, or clusters of `cluster`
// blocks on the whole GPU, fit at once with `threads` threads and `smem` bytes each (0: none
// fits). Safe to call from several threads.
cudaError_t resident_units(int device, const void* kernel, int threads, size_t smem, int cluster, int* out);

// The architecture `kernel`'s code on `device` was compiled for, as 10 * major + minor: the
// lower of the machine code's and the PTX's (cudaFuncGetAttributes' binaryVersion and
// ptxVersion). A body guarded by __CUDA_ARCH__ >= 900 is there only if this is >= 90: a build
// without sm_90 code runs its sm_80 machine code on an H100, where such a body is empty.
// cudaErrorNoKernelImageForDevice: the build has no code this device can run.
cudaError_t kernel_code_arch(int device, const void* kernel, int* arch);

// The launch attribute that groups a grid's blocks into thread-block clusters of `cluster`
// blocks along x (what the occupancy question and the launch itself both need).
inline cudaLaunchAttribute cluster_dimension(int cluster) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned int>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

}  // namespace lnbwd
