// Early return on a CUDA error, for host code that returns cudaError_t.
#pragma once

#include <cuda_runtime_api.h>

#define LNBWD_RETURN_IF_CUDA_ERROR(expr)              \
  do {                                                \
    cudaError_t lnbwd_err_ = (expr);                  \
    if (lnbwd_err_ != cudaSuccess) return lnbwd_err_; \
  } while (0)
