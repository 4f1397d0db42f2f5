// The CUDA handler symbol, for module.cc (present only when built with CUDA).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCuda);
