// The handler symbols of every FFI target, for module.cc, which pairs each with its target name
// and platform. The CPU handlers are always built (handlers/backward_cpu.cc,
// handlers/forward_cpu.cc); the CUDA ones are declared here in every build and defined
// (handlers/backward_cuda.cc, handlers/forward_cuda.cc) only in a CUDA build.
//
// Backward: targets jax_lnbwd_layernorm_bwd_v1 and _v2 (v2: a float32 weight beside 16-bit x,
// and the residual gradient dresidual).
// Forward: jax_lnbwd_layernorm_fwd_v1; Add*: the residual variant (target
// jax_lnbwd_add_layernorm_fwd_v1); AddBias*: the residual variant with x's own bias (target
// jax_lnbwd_add_layernorm_fwd_v2).
#pragma once

#include "xla/ffi/api/api.h"

// Backward.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdV2Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdV2Cuda);

// Forward.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddLayernormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddBiasLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddBiasLayernormFwdCuda);

// RMSNorm: jax_lnbwd_rmsnorm_fwd_v1, jax_lnbwd_add_rmsnorm_fwd_v1 (the residual variant, x_bias
// optional) and jax_lnbwd_rmsnorm_bwd_v1, on the same kernels (NormKind, kernels/norm_kind.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdRmsnormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdRmsnormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddRmsnormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddRmsnormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdRmsnormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdRmsnormBwdCuda);
