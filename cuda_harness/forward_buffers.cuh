// The forward's standalone programs' buffers and dtype bytes (tests/cuda/forward_check.cu, the
// check, and tools/tune/forward_tune.cu, the configuration sweep): exact-size device buffers, and
// host values to and from a dtype's storage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "check_cuda.h"
#include "forward/api.h"

// A header of single-file programs (forward_check.cu, forward_tune.cu): one translation unit each.
using namespace lnbwd;

// Sizes and names from ffi/kernels/dtype.h.
static size_t item_bytes(Dtype d) { return dtype_item_bytes(d); }
static size_t stat_bytes(Dtype d) { return dtype_acc_bytes(d); }
static const char* path_name(FwdPath p) {
  return p == FwdPath::kAuto ? "auto" : p == FwdPath::kRegisters ? "registers" : p == FwdPath::kSharedMemory ? "smem" : "global";
}

// Host values <-> storage bytes of a dtype (bf16/f16 rounded to nearest even by cuda_*.h).
static void store(Dtype d, void* base, size_t i, double v) {
  switch (d) {
    case Dtype::kF32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case Dtype::kF64: static_cast<double*>(base)[i] = v; break;
    case Dtype::kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
    case Dtype::kF16: static_cast<__half*>(base)[i] = __float2half_rn(static_cast<float>(v)); break;
  }
}
static double load(Dtype d, const void* base, size_t i) {
  switch (d) {
    case Dtype::kF32: return static_cast<const float*>(base)[i];
    case Dtype::kF64: return static_cast<const double*>(base)[i];
    case Dtype::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case Dtype::kF16: return __half2float(static_cast<const __half*>(base)[i]);
  }
  return NAN;
}

// One device buffer of exactly `bytes` (+ `lead` bytes before the pointer handed out).
struct DeviceBuffer {
  void* base = nullptr;
  void* ptr = nullptr;
  DeviceBuffer(size_t bytes, size_t lead = 0) {
    CHECK_CUDA(cudaMalloc(&base, std::max<size_t>(bytes + lead, 1)));
    ptr = static_cast<char*>(base) + lead;
  }
  ~DeviceBuffer() { cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};
