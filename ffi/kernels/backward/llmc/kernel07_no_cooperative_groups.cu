// Kernel 7 of llm.c's dev/cuda/layernorm_backward.cu: kernel 6 "without cooperative groups".
//
// Technique (kept from llm.c): exactly kernel 6 (persistent warps, fp32 sums in shared
// memory, one fp32 scratch row in global memory filled with atomicAdd by every block, the last
// block to finish converts it to dweight/dbias), written with plain CUDA instead of cooperative
// groups: the warp is threadIdx.x / 32, its lane threadIdx.x % 32, and the row sums are reduced
// with warp_sum, a butterfly of __shfl_xor_sync (llm.c's warpReduceSum). llm.c also
// dropped templates and compiled once per floatX; here the kernel is a template over the element
// type only, so that one library serves fp32, bf16 and fp16. Not deterministic: the float
// atomics add in an order that varies run to run.
//
// Repairs relative to llm.c (the same as kernel 6):
//  * The scratch row and the counter are in the workspace XLA gives (counter in the header,
//    scratch in the first partial slot), zeroed with one cudaMemsetAsync on the caller's stream
//    (they are contiguous). llm.c used cudaMemset on the legacy default stream.
//  * Fences: each thread fences (__threadfence) after its atomics and before the block is
//    counted done, and the last block fences again before reading the scratch, which it reads
//    from L2 (__ldcg). llm.c had no fence.
//  * dx is written, not accumulated (XLA's outputs are uninitialized).
//  * g = weight * dy is rounded once (mul_rn) in both passes, so C = 1 gives dx = 0 exactly;
//    64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6143) is opted in to; C up to 29055 fits Hopper.
#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {
namespace {

constexpr int kWarpSize = 32;

template <typename T>
__global__ void __launch_bounds__(1024)
kernel7(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, float* __restrict__ scratch,
        unsigned int* __restrict__ counter, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums | flag]: 2 * C + 1 floats
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  unsigned int* is_last = reinterpret_cast<unsigned int*>(shared + 2 * C);
  const int warp_id = threadIdx.x / kWarpSize;
  const int warps_in_block = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  zero_block_sums(dbias_sh, dweight_sh, C);
  __syncthreads();   // sums zeroed before any warp adds to them

  // Each warp's rows (llmc_device.cuh): pass 1 sums g = weight * dy and g * xhat over each lane's
  // columns, warp_sum adds them across the warp (a butterfly of __shfl_xor_sync) into a = mean(g)
  // and b = mean(g * xhat); pass 2 reads the row again with streaming loads, writes dx and adds dy
  // and dy * xhat to the block's shared sums. No barrier inside the row loop, so warps may take
  // different numbers of rows.
  const int64_t warps_in_grid = static_cast<int64_t>(gridDim.x) * warps_in_block;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps_in_block + warp_id; row < rows; row += warps_in_grid) {
    warp_row_to_shared_sums<true>(row, lane, kWarpSize, warp_sum<float>, dx, dy, x, weight, mean, rstd, C, dbias_sh,
                                  dweight_sh);
  }
  __syncthreads();   // every warp's shared atomics done before the block's sums are read

  // The block's sums into the one fp32 scratch row; then count the block done. The last block to
  // finish converts the scratch, which now holds every block's sums, to dweight/dbias.
  add_block_sums_to_row(scratch, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;
  write_scratch_row(dweight, dbias, scratch, C);
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  return launch_last_block_kernel<T>(kernel7<T>, LlmcSums::kSharedRow, p,
                                     1024 / l.block_size, l.block_size, l.smem_bytes, stream);
}

}  // namespace

cudaError_t norm_bwd_kernel7(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(7, p, &l));
  return dispatch_llmc_dtypes<7, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
