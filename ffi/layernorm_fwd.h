// The fused forward's handler symbols, for module.cc: the CPU one always, the CUDA one only in
// a CUDA build (declared in both; defined in layernorm_fwd_cuda.cc when built).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormFwdCuda);
