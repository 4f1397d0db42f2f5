// The kernel registry (registry.h) as the nanobind module shows it to Python: jax_lnbwd/kernels.py
// builds jax_lnbwd.KERNELS from kernels() and asks kernel_refusal() at trace time, with the
// limits of the GPU (device_limits(), CUDA build) or the documented defaults.
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "registry.h"
#ifndef JAX_LNBWD_WITH_CUDA
#define JAX_LNBWD_WITH_CUDA 0
#endif
#if JAX_LNBWD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "device_limits_cuda.h"
#endif

namespace nb = nanobind;

namespace lnbwd {
namespace {

Dtype ParseDtype(const std::string& name) {
  for (Dtype d : kAllDtypes) {
    if (name == dtype_name(d)) return d;
  }
  throw nb::value_error(("unknown dtype '" + name + "' (float32, bfloat16, float16, float64)").c_str());
}

nb::dict LimitsDict(const RefusalLimits& l) {
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
  return LimitsDict(out);
#else
  return nb::none();
#endif
}

}  // namespace

void BindRegistry(nb::module_& m) {
  m.def("kernels", []() {
    nb::list out;
    for (const KernelFacts& k : AllKernels()) out.append(KernelDict(k));
    return out;
  }, "The kernel registry: one dict per kernel id, in id order.");
  m.def("kernel_refusal",
        [](int kernel, const std::string& dtype, int64_t C, int block_size, int64_t max_smem_per_block,
           const std::string& source) -> nb::object {
          const KernelFacts* k = FindKernel(kernel);
          if (k == nullptr) throw nb::value_error(("no kernel " + std::to_string(kernel)).c_str());
          const std::string why =
              KernelRefusal(*k, {ParseDtype(dtype), C, block_size}, RefusalLimits{max_smem_per_block, source.c_str()});
          if (why.empty()) return nb::none();
          return nb::str(why.c_str());
        },
        nb::arg("kernel"), nb::arg("dtype"), nb::arg("C"), nb::arg("block_size"), nb::arg("max_smem_per_block"),
        nb::arg("source"), "None if the kernel takes one segment of this (C, dtype, block_size), else why not.");
  m.def("visible_device_limits", &VisibleDeviceLimits, "The GPUs' limits the kernels depend on, or None without a GPU.");
  m.attr("default_device_limits") = LimitsDict(kDefaultRefusalLimits);
}

}  // namespace lnbwd
