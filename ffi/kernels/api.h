// The launcher API of the layernorm backward kernels: plain pointers, sizes and a stream.
// This header is shared by the kernels (compiled by nvcc) and the XLA FFI glue (compiled by the
// host compiler). It never includes an XLA header and every launcher returns a cudaError_t.
//
// The math, for one row of C elements, with mean and rstd saved by the forward pass:
//   xhat_i = (x_i - mean) * rstd                 (centered: never E[x^2] - E[x]^2)
//   g_i    = weight_i * dy_i
//   a      = (1/C) * sum_i g_i
//   b      = (1/C) * sum_i g_i * xhat_i
//   dx_i   = (g_i - a - xhat_i * b) * rstd
// and, summed over all rows,
//   dweight_i = sum_rows dy_i * xhat_i,   dbias_i = sum_rows dy_i.
//
// Segments (for per-example gradients under vmap): the rows may be split into S equal,
// contiguous segments, each with its own dweight/dbias row (and optionally its own weight row).
// S = 1 is the plain op.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "dtype.h"

namespace lnbwd {

// Every kernel writes its outputs (never accumulates into them: XLA's buffers are uninitialized).
struct LayernormBwdParams {
  void* dx;             // [rows, C] dtype
  void* dweight;        // [segments, C] dtype
  void* dbias;          // [segments, C] dtype
  const void* dy;       // [rows, C] dtype
  const void* x;        // [rows, C] dtype
  const void* weight;   // [C] dtype, or [segments, C] when weight_stride == C
  const void* mean;     // [rows] float32 (float64 when dtype is kF64)
  const void* rstd;     // [rows] float32 (float64 when dtype is kF64)
  int64_t rows;
  int64_t C;
  int64_t segments;       // >= 1, divides rows
  int64_t weight_stride;  // 0: one weight row shared by all segments; C: one weight row per segment
  Dtype dtype;
  int block_size;       // threads per block; 0 picks the kernel's best
  void* workspace;      // scratch from XLA: a header (flags) then per-block partial sums
  size_t workspace_bytes;
};

// The workspace starts with a header of this many bytes (completion flags, zeroed by the
// launcher with cudaMemsetAsync on the caller's stream); per-block fp32 (fp64 for kF64)
// partial sums of dbias and dweight follow, 2 * C accumulators per partial slot.
// jax_lnbwd/kernels.py (workspace_bytes) sizes the workspace at trace time with this layout.
constexpr size_t kWorkspaceHeaderBytes = 256;

// llm.c's kernels 1-10, repaired, each keeping its technique (see the comment at the top of
// ffi/kernels/llmc/kernelNN_*.cu). They sum over all rows: segments must be 1 and weight_stride
// 0. What each accepts (dtypes, block sizes, C, shared memory) is in llmc/llmc_limits.h, which
// the host-side registry (ffi/registry.h) reads too: callers ask the registry before they launch.
// A launcher still refuses what it cannot run, without launching: cudaErrorInvalidValue for a
// dtype it is not built for, segments it cannot do or more shared memory than the GPU has (the
// driver's answer to the opt-in), cudaErrorInvalidConfiguration for a block size or C it cannot run.
cudaError_t layernorm_bwd_kernel1(const LayernormBwdParams& p, cudaStream_t stream);   // naive
cudaError_t layernorm_bwd_kernel2(const LayernormBwdParams& p, cudaStream_t stream);   // smem reduce
cudaError_t layernorm_bwd_kernel3(const LayernormBwdParams& p, cudaStream_t stream);   // persistent + atomics
cudaError_t layernorm_bwd_kernel4(const LayernormBwdParams& p, cudaStream_t stream);   // atomicCAS bf16
cudaError_t layernorm_bwd_kernel5(const LayernormBwdParams& p, cudaStream_t stream);   // per-block scratch
cudaError_t layernorm_bwd_kernel6(const LayernormBwdParams& p, cudaStream_t stream);   // one shared scratch
cudaError_t layernorm_bwd_kernel7(const LayernormBwdParams& p, cudaStream_t stream);   // no cooperative groups
cudaError_t layernorm_bwd_kernel8(const LayernormBwdParams& p, cudaStream_t stream);   // x128 vectors
cudaError_t layernorm_bwd_kernel9(const LayernormBwdParams& p, cudaStream_t stream);   // block reduce
cudaError_t layernorm_bwd_kernel10(const LayernormBwdParams& p, cudaStream_t stream);  // vector smem

// llm.c's kernels 1-10 by id - 1 (the FFI glue and the CUDA check and tuning tools dispatch
// through this table).
using LayernormBwdLauncher = cudaError_t (*)(const LayernormBwdParams&, cudaStream_t);
inline constexpr LayernormBwdLauncher kLlmcLaunchers[] = {
    layernorm_bwd_kernel1, layernorm_bwd_kernel2, layernorm_bwd_kernel3, layernorm_bwd_kernel4,
    layernorm_bwd_kernel5, layernorm_bwd_kernel6, layernorm_bwd_kernel7, layernorm_bwd_kernel8,
    layernorm_bwd_kernel9, layernorm_bwd_kernel10,
};

// Kernel 11: rows kept in registers between the two passes, per-block fp32 partial sums of
// dweight/dbias added up in a fixed order (see kernel11_rows_in_registers.cu).
// Any C >= 1, any number of segments; block shape is chosen from C (p.block_size is ignored).
cudaError_t layernorm_bwd_kernel11(const LayernormBwdParams& p, cudaStream_t stream);

// Kernel 12: rows streamed into a shared-memory ring by the bulk copy engine (sm_90), sums in
// registers, per-block partials as kernel 11 (see kernel12_bulk_copy_ring.cu). Falls back to
// kernel 11 for misaligned rows, rows too wide for the ring, and GPUs before sm_90.
cudaError_t layernorm_bwd_kernel12(const LayernormBwdParams& p, cudaStream_t stream);

}  // namespace lnbwd
