// The nanobind module: the list of (target name, handler capsule, platform) that
// jax_lnbwd/_ffi.py registers with XLA at import.
//
// Target names carry a version because they are baked into exported programs: a new handler
// signature gets a new name, and old names stay registered.
#include <nanobind/nanobind.h>

#include "layernorm_bwd_cpu.h"
#ifndef JAX_LNBWD_WITH_CUDA
#define JAX_LNBWD_WITH_CUDA 0
#endif
#if JAX_LNBWD_WITH_CUDA
#include "layernorm_bwd_cuda.h"
#endif

namespace nb = nanobind;

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
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v2", Capsule(JaxLnbwdLayernormBwdV2Cpu), "cpu"));
#if JAX_LNBWD_WITH_CUDA
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v1", Capsule(JaxLnbwdLayernormBwdCuda), "CUDA"));
    out.append(nb::make_tuple("jax_lnbwd_layernorm_bwd_v2", Capsule(JaxLnbwdLayernormBwdV2Cuda), "CUDA"));
#endif
    return out;
  });
  m.attr("with_cuda") = bool(JAX_LNBWD_WITH_CUDA);
}
