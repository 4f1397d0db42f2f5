// The nanobind module _jax_lnbwd, the one door between Python and the C++ side:
//   registrations()          (target name, handler capsule, platform) for every FFI target of
//                            targets.h, which jax_lnbwd/ops/ffi.py registers with XLA at import;
//   targets()                {key: target name} of every FFI target (targets.h), from which
//                            jax_lnbwd/norms.py takes the names its ops call;
//   kernels(), kernel_refusal(), visible_device_limits(), default_device_limits
//                            the kernel registry (registry.h): jax_lnbwd/kernels.py builds
//                            jax_lnbwd.KERNELS from kernels() and asks kernel_refusal() at trace
//                            time, with the limits of the GPU (visible_device_limits(), CUDA
//                            build) or the documented defaults;
//   device_limits(), launch_plan()   CUDA build only: the device limits and the launch (and
//                            workspace size) of kernels 11 and 12, which jax_lnbwd/kernels.py
//                            asks at trace time;
//   with_cuda                whether this build has the CUDA handlers.
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "handlers/handlers.h"
#include "kernels/common/head_rows.h"
#include "registry.h"
#include "targets.h"
#ifndef JAX_LNBWD_WITH_CUDA
#define JAX_LNBWD_WITH_CUDA 0
#endif
#if JAX_LNBWD_WITH_CUDA
#include <stdexcept>

#include <cuda_runtime_api.h>

#include "errors/launch_errors.h"
#include "kernels/backward/api.h"
#include "registry_cuda.h"
#endif

namespace nb = nanobind;

namespace lnbwd {
namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// jax's dtype name -> Dtype, for kernel_refusal and launch_plan.
Dtype ParseDtype(const std::string& name) {
  for (Dtype d : kAllDtypes) {
    if (name == dtype_name(d)) return d;
  }
  throw nb::value_error(("unknown dtype '" + name + "' (float32, bfloat16, float16, float64)").c_str());
}

// --- The kernel registry ---------------------------------------------------------------------

nb::dict RefusalLimitsDict(const RefusalLimits& l) {
  nb::dict out;
  out["max_smem_per_block"] = l.max_smem_per_block;
  out["source"] = std::string(l.source);
  return out;
}

nb::dict KernelDict(const KernelFacts& k) {
  nb::list dtypes, sizes;
  for (Dtype d : kAllDtypes) {
    if (TakesDtype(k, d)) dtypes.append(std::string(dtype_name(d)));
  }
  for (int bs : BlockSizes(k)) sizes.append(bs);
  nb::dict out;
  out["id"] = k.id;
  out["name"] = std::string(k.name);
  out["description"] = std::string(k.description);
  out["dtypes"] = nb::tuple(dtypes);
  out["block_sizes"] = nb::tuple(sizes);
  out["default_block_size"] = k.default_block_size;
  out["deterministic"] = k.deterministic;
  out["precise"] = k.precise;
  out["segments"] = k.segments;
  out["device_limited"] = k.device_limited;
  out["rmsnorm"] = k.rmsnorm;
  out["v2_operands"] = k.v2_operands;
  out["constraints"] = std::string(k.constraints);
  return out;
}

// The smallest limits over the visible GPUs (a program traced once may run on any of them), or
// None where there is no GPU to ask (or no CUDA in this build).
nb::object VisibleDeviceLimits() {
#if JAX_LNBWD_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    cudaGetLastError();   // clear the runtime's error state: no GPU is not an error here
    return nb::none();
  }
  RefusalLimits out{};
  for (int dev = 0; dev < count; ++dev) {
    RefusalLimits l{};
    if (QueryRefusalLimits(dev, &l) != cudaSuccess) {
      cudaGetLastError();
      return nb::none();
    }
    if (dev == 0 || l.max_smem_per_block < out.max_smem_per_block) out = l;
  }
  return RefusalLimitsDict(out);
#else
  return nb::none();
#endif
}

// --- The CUDA build's device limits and launch plans -----------------------------------------

#if JAX_LNBWD_WITH_CUDA
nb::dict DeviceLimitsDict(int device) {
  DeviceLimits l;
  if (const cudaError_t err = device_limits(device, &l); err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("device_limits: reading the limits of CUDA device " + std::to_string(device) +
                             " failed: " + cudaGetErrorString(err));
  }
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

// A launch plan's fields (LaunchPlan, kernels/backward/api.h).
nb::dict PlanFields(const LaunchPlan& plan) {
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

// `op` names the function the user called, for the error: the op whose workspace is planned
// (e.g. "rmsnorm_bwd"), or launch_plan itself.
nb::dict PlanDict(int kernel, const std::string& dtype, int64_t rows, int64_t C, int64_t segments, int device,
                  const std::string& op) {
  LaunchPlan plan;
  const cudaError_t err = norm_bwd_workspace_bytes(kernel, ParseDtype(dtype), rows, C, segments, device, &plan);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    DeviceLimits lim;
    if (device_limits(device, &lim) != cudaSuccess) {
      (void)cudaGetLastError();
      lim = DeviceLimits{};
    }
    throw std::runtime_error(LaunchFailure(op, kernel, rows, C, dtype, segments, plan, lim, err));
  }
  return PlanFields(plan);
}

// The launch QK-norm's backward makes for q's rows_q and k's rows_k rows of D (fused: the fused
// projection's, whose rows are tokens * heads; else q and k of their own), and its workspace
// (norm_bwd_sets_workspace_bytes).
nb::dict QkPlanDict(const std::string& dtype, int64_t rows_q, int64_t rows_k, int64_t D, int device, bool fused) {
  LaunchPlan plan;
  const cudaError_t err = norm_bwd_sets_workspace_bytes(ParseDtype(dtype), rows_q, rows_k, D, fused, device, &plan);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("qk_norm: no one-launch backward for rows of D=" + std::to_string(D) + " " + dtype +
                             " (q rows " + std::to_string(rows_q) + ", k rows " + std::to_string(rows_k) +
                             "): " + cudaGetErrorString(err) + "; rows must be 16-byte aligned and at most " +
                             std::to_string(kHeadRowsMaxBytes) + " bytes");
  }
  return PlanFields(plan);
}
#endif

}  // namespace
}  // namespace lnbwd

NB_MODULE(_jax_lnbwd, m) {
  using lnbwd::Capsule;
  // One line of targets.h, one registration per platform and one entry of targets().
#define LNBWD_REGISTER_CPU(Handler, key, name) out.append(nb::make_tuple(name, Capsule(JaxLnbwd##Handler##Cpu), "cpu"));
#define LNBWD_REGISTER_CUDA(Handler, key, name) \
  out.append(nb::make_tuple(name, Capsule(JaxLnbwd##Handler##Cuda), "CUDA"));
#define LNBWD_TARGET_ENTRY(Handler, key, name) out[key] = name;
  m.def("registrations", []() {
    nb::list out;
    LNBWD_TARGETS(LNBWD_REGISTER_CPU)
#if JAX_LNBWD_WITH_CUDA
    LNBWD_TARGETS(LNBWD_REGISTER_CUDA)
#endif
    return out;
  }, "(target name, handler capsule, platform) of every FFI target.");
  m.def("targets", []() {
    nb::dict out;
    LNBWD_TARGETS(LNBWD_TARGET_ENTRY)
    return out;
  }, "{key: versioned target name} of every FFI target.");
#undef LNBWD_REGISTER_CPU
#undef LNBWD_REGISTER_CUDA
#undef LNBWD_TARGET_ENTRY
  m.attr("with_cuda") = bool(JAX_LNBWD_WITH_CUDA);

  // The kernel registry.
  m.def("kernels", []() {
    nb::list out;
    for (const lnbwd::KernelFacts& k : lnbwd::AllKernels()) out.append(lnbwd::KernelDict(k));
    return out;
  }, "The kernel registry: one dict per kernel id, in id order.");
  m.def("kernel_refusal",
        [](int kernel, const std::string& dtype, int64_t C, int block_size, int64_t max_smem_per_block,
           const std::string& source) -> nb::object {
          const lnbwd::KernelFacts* k = lnbwd::FindKernel(kernel);
          if (k == nullptr) throw nb::value_error(("no kernel " + std::to_string(kernel)).c_str());
          const std::string why = lnbwd::KernelRefusal(*k, {lnbwd::ParseDtype(dtype), C, block_size},
                                                       lnbwd::RefusalLimits{max_smem_per_block, source.c_str()});
          if (why.empty()) return nb::none();
          return nb::str(why.c_str());
        },
        nb::arg("kernel"), nb::arg("dtype"), nb::arg("C"), nb::arg("block_size"), nb::arg("max_smem_per_block"),
        nb::arg("source"), "None if the kernel takes one segment of this (C, dtype, block_size), else why not.");
  m.def("visible_device_limits", &lnbwd::VisibleDeviceLimits,
        "The GPUs' limits the kernels depend on, or None without a GPU.");
  m.attr("default_device_limits") = lnbwd::RefusalLimitsDict(lnbwd::kDefaultRefusalLimits);

#if JAX_LNBWD_WITH_CUDA
  // The limits kernel choice follows on CUDA device `device` (DeviceLimits,
  // kernels/common/device_limits.h).
  m.def("device_limits", &lnbwd::DeviceLimitsDict, nb::arg("device"));
  // The launch kernel 11 or 12 would make, and the workspace it uses (norm_bwd_workspace_bytes):
  // rmsnorm_bwd runs the same launch, so its workspace is sized by this too. A failure names `op`.
  m.def("launch_plan", &lnbwd::PlanDict, nb::arg("kernel"), nb::arg("dtype"), nb::arg("rows"), nb::arg("C"),
        nb::arg("segments"), nb::arg("device"), nb::arg("op") = "launch_plan");
  // The launch and workspace of QK-norm's one-launch backward (norm_bwd_sets_workspace_bytes).
  m.def("qk_launch_plan", &lnbwd::QkPlanDict, nb::arg("dtype"), nb::arg("rows_q"), nb::arg("rows_k"), nb::arg("D"),
        nb::arg("device"), nb::arg("fused") = false);
#endif
  // The widest row QK-norm's one-launch kernels hold, in bytes (kernels/common/head_rows.h); they
  // also need rows of a multiple of 16 bytes. jax_lnbwd runs other rows as two norm calls.
  m.attr("head_rows_max_bytes") = lnbwd::kHeadRowsMaxBytes;
}
