// Host-side helpers around device_limits (api.h): the cooperative-finish opt-in and a scope that
// makes a device current.
#pragma once

#include <cuda_runtime_api.h>

#include "common/status.h"

namespace lnbwd {

// JAX_LNBWD_COOPERATIVE_FINISH=1 (read once per process): where the device allows cooperative
// launch and the whole persistent grid fits on it at once, kernels 11 and 12 sum their partial
// slots inside the grid after a grid-wide barrier instead of in a finalize kernel. Off by
// default: a cooperative grid cannot start until every SM it needs is free, so a kernel on
// another stream (a collective, another process under MPS) that holds one SM holds the whole
// backward back for as long as it runs.
bool cooperative_finish_opt_in();

// Makes `device` current for the scope (the runtime's occupancy and function-attribute calls act
// on the current device), and restores the previous one. -1, or the current device: no change.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace lnbwd
