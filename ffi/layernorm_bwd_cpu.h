// The CPU handler symbol, for module.cc.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCpu);
