// The nanobind module: the list of (target name, handler capsule, platform) that
// jax_lnbwd/_ffi.py registers with XLA at import, and the kernel registry (registry_module.cc);
// in a CUDA build also the device limits and the workspace size of kernels 11 and 12
// (jax_lnbwd/kernels.py asks them at trace time).
//
// Target names carry a version because they are baked into exported programs: a new handler
// signature gets a new name, and old names stay registered.
#include <nanobind/nanobind.h>

#include "layernorm_bwd_cpu.h"
#include "layernorm_fwd.h"
#ifndef JAX_LNBWD_WITH_CUDA
#define JAX_LNBWD_WITH_CUDA 0
#endif
#if JAX_LNBWD_WITH_CUDA
#include <stdexcept>
#include <string>

#include <nanobind/stl/string.h>

#include "kernels/api.h"
#include "launch_errors.h"
#include "layernorm_bwd_cuda.h"
#endif

namespace nb = nanobind;

namespace lnbwd {
void BindRegistry(nb::module_& m);   // registry_module.cc
}

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#if JAX_LNBWD_WITH_CUDA
lnbwd::Dtype DtypeFromName(const std::string& name) {
  if (name == "float32") return lnbwd::Dtype::kF32;
  if (name == "bfloat16") return lnbwd::Dtype::kBF16;
  if (name == "float16") return lnbwd::Dtype::kF16;
  if (name == "float64") return lnbwd::Dtype::kF64;
  throw std::invalid_argument("layernorm_bwd: dtype '" + name + "' is not float32, bfloat16, float16 or float64");
}

void ThrowIfCudaError(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error("layernorm_bwd: " + what + " failed: " + cudaGetErrorString(err));
}

nb::dict LimitsDict(int device) {
  lnbwd::DeviceLimits l;
  ThrowIfCudaError(lnbwd::device_limits(device, &l), "reading the limits of CUDA device " + std::to_string(device));
  nb::dict d;
  d["device"] = l.device;
  d["compute_capability"] = nb::make_tuple(l.cc_major, l.cc_minor);
  d["sms"] = l.sms;
  d["smem_optin"] = l.smem_optin;
  d["clusters"] = l.clusters;
  d["cooperative"] = l.cooperative;
  d["test_caps"] = l.test_caps;
  return d;
}

nb::dict PlanDict(int kernel, const std::string& dtype, int64_t rows, int64_t C, int64_t segments, int device) {
  lnbwd::LaunchPlan plan;
  const cudaError_t err =
      lnbwd::layernorm_bwd_workspace_bytes(kernel, DtypeFromName(dtype), rows, C, segments, device, &plan);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    lnbwd::DeviceLimits lim;
    if (lnbwd::device_limits(device, &lim) != cudaSuccess) {
      (void)cudaGetLastError();
      lim = lnbwd::DeviceLimits{};
    }
    throw std::runtime_error(lnbwd::LaunchFailure(kernel, rows, C, dtype, segments, plan, lim, err));
  }
  nb::dict d;
  d["kernel"] = plan.kernel;
  d["path"] = std::string(plan.path);
  d["threads"] = plan.threads;
  d["smem"] = plan.smem;
  d["cluster"] = plan.cluster;
  d["blocks"] = plan.blocks;
  d["slots"] = plan.slots;
  d["cooperative"] = plan.cooperative;
  d["workspace_bytes"] = plan.workspace_bytes;
  return d;
}
#endif

}  // namespace

NB_MODULE(_jax_lnbwd, m) {
  m.def("registrations", []() {
    nb::list out;
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v1", Capsule(JaxLnbwdLayernormBwdCpu), "cpu"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v2", Capsule(JaxLnbwdLayernormBwdV2Cpu), "cpu"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_fwd_v1", Capsule(JaxLnbwdLayernormFwdCpu), "cpu"));
    out.append(nb::make_tuple("jax_lnbwd_add_layernorm_fwd_v1", Capsule(JaxLnbwdAddLayernormFwdCpu), "cpu"));
    out.append(nb::make_tuple("jax_lnbwd_add_layernorm_fwd_v2", Capsule(JaxLnbwdAddBiasLayernormFwdCpu), "cpu"));
#if JAX_LNBWD_WITH_CUDA
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v1", Capsule(JaxLnbwdLayernormBwdCuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v2", Capsule(JaxLnbwdLayernormBwdV2Cuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_fwd_v1", Capsule(JaxLnbwdLayernormFwdCuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_add_layernorm_fwd_v1", Capsule(JaxLnbwdAddLayernormFwdCuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_add_layernorm_fwd_v2", Capsule(JaxLnbwdAddBiasLayernormFwdCuda), "CUDA"));
#endif
    return out;
  });
  m.attr("with_cuda") = bool(JAX_LNBWD_WITH_CUDA);
  lnbwd::BindRegistry(m);
#if JAX_LNBWD_WITH_CUDA
  // The limits kernel choice follows on CUDA device `device` (api.h, DeviceLimits).
  m.def("device_limits", &LimitsDict, nb::arg("device"));
  // The launch kernel 11 or 12 would make, and the workspace it uses (layernorm_bwd_workspace_bytes).
  m.def("launch_plan", &PlanDict, nb::arg("kernel"), nb::arg("dtype"), nb::arg("rows"), nb::arg("C"),
        nb::arg("segments"), nb::arg("device"));
#endif
}
