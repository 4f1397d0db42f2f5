// The text of a failed launch of kernels 1-12, shared by the CUDA handler (which returns it as an
// ffi::Error) and the nanobind module (which raises it when the workspace is planned at trace
// time): which kernel and path, the problem, what the launch asked of the GPU and what the GPU
// allows, e.g.
//   layernorm_bwd: kernel 12, path 'ring' failed for x of shape (8, 32768) bfloat16 in 1 segment
//   on device 0 (sm_90, 132 SMs, 232448 bytes of shared memory per block, clusters yes,
//   cooperative launch yes): cudaErrorInvalidValue: invalid argument; the launch asked for 512
//   threads and 262912 bytes of dynamic shared memory per block, clusters of 2 blocks
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "kernels/backward/api.h"

namespace lnbwd {

inline std::string DeviceStr(const DeviceLimits& lim) {
  return "device " + std::to_string(lim.device) + " (sm_" + std::to_string(lim.cc_major) +
         std::to_string(lim.cc_minor) + ", " + std::to_string(lim.sms) + " SMs, " + std::to_string(lim.smem_optin) +
         " bytes of shared memory per block, clusters " + (lim.clusters ? "yes" : "no") + ", cooperative launch " +
         (lim.cooperative ? "yes" : "no") + (lim.test_caps ? "; set by JAX_LNBWD_TEST_DEVICE_LIMITS" : "") + ")";
}

inline std::string ProblemStr(int64_t rows, int64_t C, const std::string& dtype, int64_t segments) {
  return "x of shape (" + std::to_string(rows) + ", " + std::to_string(C) + ") " + dtype + " in " +
         std::to_string(segments) + (segments == 1 ? " segment" : " segments");
}

// `op` names the function the user called (BwdOpName, or the module's launch_plan). `lim` may be
// unknown (device < 0) when reading it was what failed.
inline std::string LaunchFailure(const std::string& op, int kernel, int64_t rows, int64_t C, const std::string& dtype,
                                 int64_t segments, const LaunchPlan& plan, const DeviceLimits& lim, cudaError_t err) {
  std::string what = "kernel " + std::to_string(kernel);
  if (plan.kernel != 0 && plan.kernel != kernel) what += " (running as kernel " + std::to_string(plan.kernel) + ")";
  if (*plan.path) what += std::string(", path '") + plan.path + "'";
  std::string msg = op + ": " + what + " failed for " + ProblemStr(rows, C, dtype, segments) + " on " +
                    (lim.device >= 0 ? DeviceStr(lim) : std::string("the GPU")) + ": " + cudaGetErrorName(err) +
                    ": " + cudaGetErrorString(err);
  if (plan.threads > 0) {
    msg += "; the launch asked for " + std::to_string(plan.threads) + " threads and " + std::to_string(plan.smem) +
           " bytes of dynamic shared memory per block" +
           (plan.cluster > 1 ? ", clusters of " + std::to_string(plan.cluster) + " blocks" : std::string()) +
           (plan.blocks > 0 ? ", " + std::to_string(plan.blocks) + " blocks" : std::string()) +
           (plan.cooperative ? ", cooperative" : "");
  }
  if ((err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidKernelImage) && lim.device >= 0) {
    const std::string arch = std::to_string(lim.cc_major) + std::to_string(lim.cc_minor);
    msg += "; this build has no code for sm_" + arch + ": rebuild with CMAKE_CUDA_ARCHITECTURES (or CUDAARCHS) including " +
           arch;
  }
  return msg;
}

}  // namespace lnbwd
