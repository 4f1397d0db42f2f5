// The fused forward's handler symbols, for module.cc: the CPU ones always, the CUDA ones only in
// a CUDA build (declared in both; defined in layernorm_fwd_cuda.cc when built). Add*: the
// residual variant (target jax_lnbwd_add_layernorm_fwd_v1); AddBias*: the residual variant with
// x's own bias (target jax_lnbwd_add_layernorm_fwd_v2).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddLayernormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddBiasLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdAddBiasLayernormFwdCuda);
