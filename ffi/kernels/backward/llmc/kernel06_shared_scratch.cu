// Kernel 6 of llm.c's dev/cuda/layernorm_backward.cu: "a single shared fp32 scratch".
//
// Technique (kept from llm.c, "based on kernels 3 & 5"): kernel 3's persistent grid of warps
// (a warp per row, fp32 sums of dbias/dweight in shared memory, 1024 / block_size blocks per
// SM); at the end every block adds its sums with global fp32 atomicAdd into ONE scratch row of
// 2*C floats shared by all blocks (kernel 5 needs a slot per block; this scratch does not grow
// with the grid), then counts itself done on an unsigned int counter. The last block to count
// converts the scratch to dweight/dbias in the output dtype: accumulation stays in fp32 all the
// way, unlike kernel 3's bf16 atomics ("BF16 atomics are potentially much slower... and this is
// more precise!"). Not deterministic: the float atomics add in an order that varies run to run.
//
// Repairs relative to llm.c:
//  * The scratch row and the counter are in the workspace XLA gives (counter in the header,
//    scratch in the first partial slot), zeroed with one cudaMemsetAsync on the caller's stream
//    (they are contiguous). llm.c used cudaMemset on the legacy default stream.
//  * Fences: each block's thread fences (__threadfence) after its atomics and before the block
//    is counted done, and the last block fences again before reading the scratch, which it
//    reads from L2 (__ldcg). llm.c had no fence, so the last block could see the count before
//    other blocks' adds.
//  * dx is written, not accumulated (XLA's outputs are uninitialized).
//  * g = weight * dy is rounded once (mul_rn) in both passes, so C = 1 gives dx = 0 exactly;
//    64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6143) is opted in to; C up to 29055 fits Hopper.

#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_persistent_warps.cuh"

namespace lnbwd {
namespace {

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
  // Every warp's rows, into the block's shared sums (llmc_persistent_warps.cuh).
  persistent_warps_to_block_sums(dx, dy, x, weight, mean, rstd, rows, C, dbias_sh, dweight_sh);

  // The block's sums into the one fp32 scratch row; then count the block done. The last block to
  // finish converts the scratch, which now holds every block's sums, to dweight/dbias.
  add_block_sums_to_row(scratch, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;
  write_scratch_row(dweight, dbias, scratch, C);
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  return launch_last_block_kernel<T>(kernel6<T>, LlmcSums::kSharedRow, p,
                                     1024 / l.block_size, l.block_size, l.smem_bytes, stream);
}

}  // namespace

cudaError_t norm_bwd_kernel6(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(6, p, &l));
  return dispatch_llmc_dtypes<6, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
