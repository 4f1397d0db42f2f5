// The CPU handler symbols (targets v1 and v2), for module.cc.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwdLayernormBwdV2Cpu);
