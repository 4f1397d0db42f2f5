// The handler symbols of every FFI target (targets.h), for module.cc, which pairs each with its
// target name and platform: JaxLnbwd<Handler>Cpu and JaxLnbwd<Handler>Cuda. The CPU handlers are
// always built (handlers/forward_cpu.cc, handlers/backward_cpu.cc); the CUDA ones are declared
// here in every build and defined (handlers/forward_cuda.cc, handlers/backward_cuda.cc) only in a
// CUDA build.
#pragma once

#include "targets.h"
#include "xla/ffi/api/api.h"

#define LNBWD_DECLARE_HANDLERS(Handler, key, name)          \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cpu);   \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cuda);
LNBWD_TARGETS(LNBWD_DECLARE_HANDLERS)
#undef LNBWD_DECLARE_HANDLERS
