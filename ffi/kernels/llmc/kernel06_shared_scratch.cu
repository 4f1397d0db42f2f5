// Kernel 6 of llm.c's dev/cuda/layernorm_backward.cu: "a single shared fp32 scratch".
//
// Technique (kept from the seed, "based on kernels 3 & 5"): kernel 3's persistent grid of warps
// (a warp per row, fp32 sums of dbias/dweight in shared memory, 1024 / block_size blocks per
// SM); at the end every block adds its sums with global fp32 atomicAdd into ONE scratch row of
// 2*C floats shared by all blocks (kernel 5 needs a slot per block; this scratch does not grow
// with the grid), then counts itself done on an unsigned int counter. The last block to count
// converts the scratch to dweight/dbias in the output dtype: accumulation stays in fp32 all the
// way, unlike kernel 3's bf16 atomics ("BF16 atomics are potentially much slower... and this is
// more precise!"). Not deterministic: the float atomics add in an order that varies run to run.
//
// Repairs relative to the seed:
//  * The scratch row and the counter are in the workspace XLA gives (counter in the header,
//    scratch in the first partial slot), zeroed with one cudaMemsetAsync on the caller's stream
//    (they are contiguous). The seed used cudaMemset on the legacy default stream.
//  * Fences: each block's thread fences (__threadfence) after its atomics and before the block
//    is counted done, and the last block fences again before reading the scratch, which it
//    reads from L2 (__ldcg). The seed had no fence, so the last block could see the count before
//    other blocks' adds.
//  * dx is written, not accumulated (XLA's outputs are uninitialized).
//  * g = weight * dy is rounded once (mul_rn) in both passes, so C = 1 gives dx = 0 exactly;
//    64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6143) is opted in to; C up to 29055 fits Hopper.

#include "llmc/llmc_common.cuh"
#include "llmc/llmc_persistent_warps.cuh"

namespace lnbwd {
namespace {

// The fastest block size on the H200 at 8192x1600, bf16 and fp32 (tests/cuda/harness.cu blocks).
constexpr int kDefaultBlockSize = 1024;

template <typename T>
__global__ void __launch_bounds__(1024)
kernel6(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, float* __restrict__ scratch,
        unsigned int* __restrict__ counter, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums | flag]: 2 * C + 1 floats
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  unsigned int* is_last = reinterpret_cast<unsigned int*>(shared + 2 * C);
  // Every warp's rows, into the block's shared sums (seed_persistent_warps.cuh).
  persistent_warps_to_block_sums(dx, dy, x, weight, mean, rstd, rows, C, dbias_sh, dweight_sh);

  // The block's sums into the one fp32 scratch row; then count the block done. The last block to
  // finish converts the scratch, which now holds every block's sums, to dweight/dbias.
  add_block_sums_to_row(scratch, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;
  write_scratch_row(dweight, dbias, scratch, C);
}

template <typename T>
cudaError_t launch(const LayernormBwdParams& p, const LlmcKernelLimits& l, cudaStream_t stream) {
  return launch_last_block_kernel<T>(kernel6<T>, LlmcSums::kSharedRow, p,
                                     1024 / l.block_size, l.block_size, l.smem_bytes, stream);
}

}  // namespace

LlmcKernelLimits layernorm_bwd_kernel6_limits(Dtype dtype, int64_t C, int block_size) {
  LlmcKernelLimits l = seed_limits<float, __nv_bfloat16, __half>(dtype, block_size, kDefaultBlockSize, 1024);
  l.smem_bytes = static_cast<size_t>(2 * C + 1) * sizeof(float);
  return l;
}

cudaError_t layernorm_bwd_kernel6(const LayernormBwdParams& p, cudaStream_t stream) {
  const LlmcKernelLimits l = layernorm_bwd_kernel6_limits(p.dtype, p.C, p.block_size);
  LNBWD_RETURN_IF_CUDA_ERROR(check_seed_limits(l, p));
  return dispatch_dtypes<float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
