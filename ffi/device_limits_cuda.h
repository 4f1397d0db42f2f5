// The registry's DeviceLimits (registry.h) of a CUDA device, asked of the CUDA runtime. Used by
// the CUDA handler (the device of XLA's stream) and by the module (jax_lnbwd.KERNELS' refusals
// at trace time); CUDA build only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "registry.h"

namespace lnbwd {

inline cudaError_t QueryDeviceLimits(int device, DeviceLimits* out) {
  int smem = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  *out = DeviceLimits{smem, "this GPU"};
  return cudaSuccess;
}

// The current device's limits (the device XLA runs the call on).
inline cudaError_t QueryCurrentDeviceLimits(DeviceLimits* out) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return QueryDeviceLimits(device, out);
}

}  // namespace lnbwd
