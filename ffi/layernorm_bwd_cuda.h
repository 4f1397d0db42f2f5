// The CUDA handler symbols (targets v1 and v2), for module.cc (present only when built with CUDA).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdV2Cuda);
