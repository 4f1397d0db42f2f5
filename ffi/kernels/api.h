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
//
// Mixed precision (weight_f32): x, dy and dx are bf16 or fp16 while weight, dweight and dbias are
// float32. g_i = weight_i * dy_i is then formed in fp32 from the float32 weight itself (never
// rounded to 16 bits), and the fp32 sums are stored as float32.
//
// Residual gradient (dresidual): dx_i = (layernorm's dx_i, in fp32) + dresidual_i, rounded once.
// dresidual may be dx itself (the FFI caller aliases it to the output): each element is read
// once, by the thread that then writes the same element of dx.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace lnbwd {

enum class Dtype { kF32, kBF16, kF16, kF64 };

// Every kernel writes its outputs (never accumulates into them: XLA's buffers are uninitialized).
struct LayernormBwdParams {
  void* dx;             // [rows, C] dtype
  void* dweight;        // [segments, C] dtype (float32 when weight_f32)
  void* dbias;          // [segments, C] dtype (float32 when weight_f32)
  const void* dy;       // [rows, C] dtype
  const void* x;        // [rows, C] dtype
  const void* weight;   // [C] dtype (float32 when weight_f32), or [segments, C] when weight_stride == C
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
  // Kernels 11 and 12 only: the seed kernels 1-10 ignore these two, so the FFI glue refuses them there.
  const void* dresidual = nullptr;  // [rows, C] dtype, added to dx; null: nothing added
  bool weight_f32 = false;  // weight, dweight, dbias are float32 while dtype is kBF16 or kF16
};

// The workspace starts with a header of this many bytes (completion flags, zeroed by the
// launcher with cudaMemsetAsync on the caller's stream); per-block fp32 (fp64 for kF64)
// partial sums of dbias and dweight follow, 2 * C accumulators per partial slot.
// jax_lnbwd/_ffi.py mirrors this layout when it sizes the workspace at trace time.
constexpr size_t kWorkspaceHeaderBytes = 256;

// Seed kernels 1-10: llm.c's kernels, repaired, each keeping its technique (see the comment at
// the top of ffi/kernels/kernel0N_*.cu and kernel10_vector_smem.cu). They sum over all rows:
// segments must be 1 and weight_stride 0. A launcher returns cudaErrorInvalidValue for a dtype
// it is not built for or segments it cannot do, and cudaErrorInvalidConfiguration for a block
// size, C or shared-memory need it cannot run; layernorm_bwd_kernelN_limits tells a caller
// which, before it launches (jax_lnbwd/kernels.py applies the same rules at trace time).
struct LlmcKernelLimits {
  bool dtype_ok;            // the kernel is built for this dtype
  int block_size;           // the block size it would run: the one asked for, or its default for 0
  int default_block_size;
  int max_block_size;       // it runs the powers of two from 32 to max_block_size
  bool block_size_ok;       // block_size is one of those
  int64_t c_multiple;       // C must be a multiple of this (1: any C >= 1)
  size_t smem_bytes;        // dynamic shared memory per block for this C and block size
};

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
LlmcKernelLimits layernorm_bwd_kernel1_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel2_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel3_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel4_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel5_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel6_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel7_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel8_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel9_limits(Dtype dtype, int64_t C, int block_size);
LlmcKernelLimits layernorm_bwd_kernel10_limits(Dtype dtype, int64_t C, int block_size);

// Seed kernels 1-10 by id - 1: the launcher and its limits (the FFI glue and the standalone CUDA
// harness, tests/cuda/harness.cu, both dispatch through this table).
struct LlmcKernel {
  cudaError_t (*launch)(const LayernormBwdParams&, cudaStream_t);
  LlmcKernelLimits (*limits)(Dtype, int64_t, int);
};
inline constexpr LlmcKernel kLlmcKernels[] = {
    {layernorm_bwd_kernel1, layernorm_bwd_kernel1_limits}, {layernorm_bwd_kernel2, layernorm_bwd_kernel2_limits},
    {layernorm_bwd_kernel3, layernorm_bwd_kernel3_limits}, {layernorm_bwd_kernel4, layernorm_bwd_kernel4_limits},
    {layernorm_bwd_kernel5, layernorm_bwd_kernel5_limits}, {layernorm_bwd_kernel6, layernorm_bwd_kernel6_limits},
    {layernorm_bwd_kernel7, layernorm_bwd_kernel7_limits}, {layernorm_bwd_kernel8, layernorm_bwd_kernel8_limits},
    {layernorm_bwd_kernel9, layernorm_bwd_kernel9_limits}, {layernorm_bwd_kernel10, layernorm_bwd_kernel10_limits},
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
