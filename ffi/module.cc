// The nanobind module: the list of (target name, handler capsule, platform) that
// jax_lnbwd/_ffi.py registers with XLA at import, and the kernel registry (registry_module.cc).
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

}  // namespace

NB_MODULE(_jax_lnbwd, m) {
  m.def("registrations", []() {
    nb::list out;
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v1", Capsule(JaxLnbwdLayernormBwdCpu), "cpu"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_fwd_v1", Capsule(JaxLnbwdLayernormFwdCpu), "cpu"));
#if JAX_LNBWD_WITH_CUDA
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v1", Capsule(JaxLnbwdLayernormBwdCuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_fwd_v1", Capsule(JaxLnbwdLayernormFwdCuda), "CUDA"));
#endif
    return out;
  });
  m.attr("with_cuda") = bool(JAX_LNBWD_WITH_CUDA);
  lnbwd::BindRegistry(m);
}
