// What llm.c's kernels 1-10 can run, written once: their launchers (backward/llmc/kernelNN_*.cu)
// check it before they launch, and the host-side kernel registry (ffi/registry.cc) turns it into
// the refusals that the FFI handlers and jax_lnbwd.KERNELS report. Plain C++ (no CUDA header), so
// that the CPU-only build compiles it too.
//
// Each of these kernels keeps the fp32 sums of dbias and dweight for all C columns of a block in
// shared memory, so C is bounded by the shared memory a block may have on the GPU (the device
// limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, is the caller's to pass in).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtype.h"

namespace lnbwd {

// The fixed facts of one llm.c kernel. Block sizes are the powers of two from one warp (32) to
// max_block_size; block_size 0 asks for default_block_size. The defaults are the fastest block
// size at llm.c's own shape (8192 rows of 1600, or 1536 for kernels 8-9) on an H200, as
// `tools/tune blocks` measures them.
struct LlmcKernelFacts {
  unsigned dtypes;   // dtype_bit()s of the dtypes the kernel is built for
  int default_block_size;
  int max_block_size;
};

inline constexpr unsigned kLlmcThreeDtypes = dtype_bit(Dtype::kF32) | dtype_bit(Dtype::kBF16) | dtype_bit(Dtype::kF16);

// Indexed by kernel id (entry 0 unused).
inline constexpr LlmcKernelFacts kLlmcFacts[11] = {
    {0, 0, 0},
    {dtype_bit(Dtype::kF32), 32, 1024},                     // 1: naive (fp32 only, as in llm.c)
    {kLlmcThreeDtypes, 1024, 1024},                         // 2: smem_reduce
    {kLlmcThreeDtypes, 1024, 1024},                         // 3: persistent_atomics
    {dtype_bit(Dtype::kBF16), 1024, 1024},                  // 4: atomic_cas_bf16 (bf16 only)
    {kLlmcThreeDtypes, 1024, 1024},                         // 5: block_scratch
    {kLlmcThreeDtypes, 1024, 1024},                         // 6: shared_scratch
    {kLlmcThreeDtypes, 1024, 1024},                         // 7: no_cooperative_groups
    {kLlmcThreeDtypes, 1024, 1024},                         // 8: x128
    {kLlmcThreeDtypes, 512, 1024},                          // 9: block_reduce (512 allows a wider C than 1024)
    {kLlmcThreeDtypes | dtype_bit(Dtype::kF64), 512, 512},  // 10: vector_smem (__launch_bounds__(512, 2))
};

constexpr bool llmc_is_kernel(int kernel) { return kernel >= 1 && kernel <= 10; }

// What every llm.c kernel computes: layernorm's backward in the data's dtype. None runs RMSNorm
// (it reads a mean and writes dbias), and none takes what NormBwdParams adds beside it: a
// float32 weight beside 16-bit data (weight_f32) or a residual gradient added to dx (dresidual).
// The registry's rmsnorm and v2_operands facts of kernels 1-10 are these.
inline constexpr bool kLlmcRunsRmsnorm = false;
inline constexpr bool kLlmcTakesV2Operands = false;

// Kernels 8 and 9 step over a row in whole warps of 16-byte vectors: C must be a multiple of
// 32 * (16 / itemsize), 128 for fp32 and 256 for bf16/fp16. The others take any C >= 1.
constexpr int64_t llmc_c_multiple(int kernel, Dtype dtype) {
  return kernel == 8 || kernel == 9 ? 32 * (16 / dtype_item_bytes(dtype)) : 1;
}

// Kernel 10's shared memory with `vec` elements per access: the [dbias | dweight] sums over C
// rounded up to whole warp steps of 32 * vec columns, then the staging area of warps 1..W-1
// (32 lanes x vec accumulators each, twice).
constexpr size_t llmc_kernel10_smem(int acc_bytes, int vec, int64_t C, int block_size) {
  const int64_t per_iter = 32 * static_cast<int64_t>(vec);
  const int64_t rounded_C = (C + per_iter - 1) / per_iter * per_iter;
  return static_cast<size_t>(2 * rounded_C + 2 * (block_size / 32 - 1) * per_iter) * static_cast<size_t>(acc_bytes);
}

// Dynamic shared memory per block (bytes) for C columns at `block_size` threads: the fp32 sums
// of dbias and dweight (2*C floats, kernels 2-4), plus the last-block flag (kernels 5-8), plus
// kernel 9's staging area of two floats per thread. Kernel 10 picks 16-byte or scalar accesses
// at launch (from C and alignment): its limit is the larger of the two needs. Kernel 1 keeps
// nothing in shared memory.
constexpr size_t llmc_smem_bytes(int kernel, Dtype dtype, int64_t C, int block_size) {
  const size_t f = sizeof(float);
  switch (kernel) {
    case 2: case 3: case 4: return static_cast<size_t>(2 * C) * f;
    case 5: case 6: case 7: case 8: return static_cast<size_t>(2 * C + 1) * f;
    case 9: return static_cast<size_t>(2 * C + 2 * static_cast<int64_t>(block_size) + 1) * f;
    case 10: {
      const int acc = dtype_acc_bytes(dtype), vec = 16 / dtype_item_bytes(dtype);
      const size_t scalar = llmc_kernel10_smem(acc, 1, C, block_size), vector = llmc_kernel10_smem(acc, vec, C, block_size);
      return scalar > vector ? scalar : vector;
    }
    default: return 0;
  }
}

// Everything a launcher or the registry asks about one call of llm.c kernel `kernel`.
struct LlmcLimits {
  bool dtype_ok;           // the kernel is built for this dtype
  int block_size;          // the block size it would run: the one asked for, or its default for 0
  bool block_size_ok;      // a power of two from 32 to the kernel's max_block_size
  int64_t c_multiple;      // C must be a multiple of this (1: any C >= 1)
  size_t smem_bytes;       // dynamic shared memory per block for this C and block size
};

constexpr LlmcLimits llmc_limits(int kernel, Dtype dtype, int64_t C, int block_size) {
  const LlmcKernelFacts f = kLlmcFacts[llmc_is_kernel(kernel) ? kernel : 0];
  LlmcLimits l{};
  l.dtype_ok = (f.dtypes & dtype_bit(dtype)) != 0;
  l.block_size = block_size == 0 ? f.default_block_size : block_size;
  l.block_size_ok = l.block_size >= 32 && l.block_size <= f.max_block_size && (l.block_size & (l.block_size - 1)) == 0;
  l.c_multiple = llmc_c_multiple(kernel, dtype);
  l.smem_bytes = llmc_smem_bytes(kernel, dtype, C, l.block_size);
  return l;
}

}  // namespace lnbwd
