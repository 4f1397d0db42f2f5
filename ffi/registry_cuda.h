// The registry's RefusalLimits (registry.h) of a CUDA device: its shared memory as the launchers
// see it (device_limits, ffi/kernels/common/device_limits.h, where the test-only
// JAX_LNBWD_TEST_DEVICE_LIMITS caps apply too). Used by the module (jax_lnbwd.KERNELS' refusals at
// trace time) and the CUDA check tools; CUDA build only. The handler converts the limits it already
// holds.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/common/device_limits.h"
#include "registry.h"

namespace lnbwd {

inline cudaError_t QueryRefusalLimits(int device, RefusalLimits* out) {
  DeviceLimits l;
  const cudaError_t err = device_limits(device, &l);
  if (err != cudaSuccess) return err;
  *out = RefusalLimits{static_cast<int64_t>(l.smem_optin), "this GPU"};
  return cudaSuccess;
}

}  // namespace lnbwd
