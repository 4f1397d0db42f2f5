// How many blocks of a kernel fit on the GPU at once, asked of the driver once per kernel and
// launch shape and then remembered. A persistent launch needs the number on every call, and
// the driver's occupancy calculator and cudaFuncSetAttribute are host work the GPU waits for
// when the kernel is short.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace lnbwd {

// Opts `kernel` in to `smem` bytes of dynamic shared memory per block on the current device and
// sets *out to how many blocks (cluster == 1) per SM, or clusters of `cluster` blocks on the
// whole GPU, fit at once with `threads` threads and `smem` bytes each (0: none fits). Safe to
// call from several threads.
cudaError_t resident_units(const void* kernel, int threads, size_t smem, int cluster, int* out);

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
