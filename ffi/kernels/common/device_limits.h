// A GPU's limits as the launchers need them (DeviceLimits, read by device_limits), and host-side
// helpers around them: the cooperative-finish opt-in and a scope that makes a device current.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "common/status.h"

namespace lnbwd {

// What the launchers need to know of a GPU, read from the device (common/device_limits.cu) and
// remembered per device. Kernel choice and configuration follow these, never constants of one
// GPU: e.g. 227 KB of shared memory per block on H100/H200, 163 KB on A100, 99 KB on
// sm_86/89/120.
// Test-only: the environment variable JAX_LNBWD_TEST_DEVICE_LIMITS, e.g.
// "smem=101376,clusters=0,cooperative=0,sms=8", replaces smem and sms and can switch clusters
// and cooperative launch off, so that one GPU runs the choices of smaller ones. It is read once
// per process; a malformed value makes device_limits return cudaErrorInvalidValue.
struct DeviceLimits {
  int device = -1;
  int cc_major = 0;          // compute capability
  int cc_minor = 0;
  int sms = 0;               // multiprocessors: persistent grids are sized from this
  size_t smem_optin = 0;     // shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)
  bool clusters = false;     // thread-block clusters (sm_90 on)
  bool cooperative = false;  // cooperative launch
  bool test_caps = false;    // JAX_LNBWD_TEST_DEVICE_LIMITS changed any of the above
};
cudaError_t device_limits(int device, DeviceLimits* out);

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
