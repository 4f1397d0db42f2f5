// Host-side helpers shared by the launchers: dtype dispatch, vector-width choice and the
// workspace layout (see kWorkspaceHeaderBytes in layernorm_bwd.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "layernorm_bwd.h"
#include "vec.cuh"

namespace lnbwd {

// Calls f(T{}) with the C++ type of p.dtype. An unknown dtype is an error, never a default.
template <typename F>
cudaError_t dispatch_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kF32: return f(float{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    case Dtype::kF16: return f(__half{});
    case Dtype::kF64: return f(double{});
  }
  return cudaErrorInvalidValue;
}

// 16-byte accesses need every row to start on a 16-byte boundary: C * sizeof(T) % 16 == 0 and
// 16-byte aligned base pointers. Otherwise the kernels fall back to one element per access.
template <typename T>
bool can_vectorize(const LayernormBwdParams& p) {
  constexpr int vec = 16 / sizeof(T);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.C % vec == 0 && aligned(p.dx) && aligned(p.dy) && aligned(p.x) && aligned(p.weight) &&
         aligned(p.dweight) && aligned(p.dbias);
}

// How many per-block partial slots (2 * C accumulators each) fit in the workspace XLA gave us.
template <typename T>
int64_t partial_slots(const LayernormBwdParams& p) {
  if (p.workspace_bytes < kWorkspaceHeaderBytes) return 0;
  return static_cast<int64_t>((p.workspace_bytes - kWorkspaceHeaderBytes) / (2 * p.C * sizeof(acc_t<T>)));
}

// Blocks per segment for a persistent grid of about `want` blocks that each take `rows_per_block`
// rows per step: the grid is split evenly over the segments (at least one block each), and
// never uses more blocks than a segment has rows for, or than the workspace has slots.
template <typename T>
cudaError_t blocks_per_segment(const LayernormBwdParams& p, int64_t want, int rows_per_block, int64_t* out) {
  if (p.segments < 1 || p.rows % p.segments != 0) return cudaErrorInvalidValue;
  int64_t bps = std::max<int64_t>(1, want / p.segments);
  bps = std::min<int64_t>(bps, ceil_div<int64_t>(p.rows / p.segments, rows_per_block));
  bps = std::min<int64_t>(bps, partial_slots<T>(p) / p.segments);
  if (bps < 1 || bps * p.segments > INT32_MAX) return cudaErrorInvalidValue;
  *out = bps;
  return cudaSuccess;
}

template <typename T>
acc_t<T>* partials_of(const LayernormBwdParams& p) {
  return reinterpret_cast<acc_t<T>*>(static_cast<char*>(p.workspace) + kWorkspaceHeaderBytes);
}

inline unsigned int* flag_of(const LayernormBwdParams& p) { return static_cast<unsigned int*>(p.workspace); }

inline cudaError_t sm_count(int* out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev);
}

inline cudaError_t max_dynamic_smem(int* out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
}

#define LNBWD_RETURN_IF_CUDA_ERROR(expr)          \
  do {                                            \
    cudaError_t lnbwd_err_ = (expr);              \
    if (lnbwd_err_ != cudaSuccess) return lnbwd_err_; \
  } while (0)

}  // namespace lnbwd
