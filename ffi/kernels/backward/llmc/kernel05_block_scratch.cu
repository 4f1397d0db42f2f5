// Kernel 5 of llm.c's dev/cuda/layernorm_backward.cu: "per-block fp32 scratch".
//
// Technique (kept from llm.c): kernel 3's persistent grid of warps (a warp per row, fp32 sums
// of dbias/dweight in shared memory), but no float atomics in global memory. Each block writes
// its 2*C shared sums to its own fp32 slot of a scratch buffer, then counts itself done with an
// atomicAdd on an unsigned int counter (the only global atomic). The block that gets
// gridDim.x - 1 back is the last one: every other slot is complete, so it adds the slots column
// by column in fp32 and writes dweight/dbias once, in the output dtype. One block per SM, as in
// llm.c ("1024 threads is best anyway"), so there are at most as many slots as SMs.
//
// Not deterministic: within a block, the warps' shared-memory float atomics add in an order that
// varies run to run (the slots themselves are added in block order).
//
// Repairs relative to llm.c:
//  * The slots and the counter are in the workspace XLA gives (the slot layout of
//    backward/launch.cuh: slot b holds [dbias | dweight], C floats each). Only the counter is zeroed, with
//    cudaMemsetAsync on the caller's stream; every slot is written before anyone reads it. llm.c
//    zeroed its whole scratch with cudaMemset on the legacy default stream.
//  * The grid never has more blocks than the workspace has slots, nor than the rows have warps.
//  * The last block fences (__threadfence) after seeing the count and before reading the other
//    blocks' slots, and reads them from L2 (__ldcg), where the other SMs' writes are.
//  * dweight/dbias are written: llm.c added to them (XLA's outputs are uninitialized). dx is
//    written, not accumulated.
//  * g = weight * dy is rounded once (mul_rn) in both passes, so C = 1 gives dx = 0 exactly;
//    64-bit row offsets and slot offsets.
//  * More than 48 KB of shared memory (C > 6143) is opted in to; C up to 29055 fits Hopper.

#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_persistent_warps.cuh"

namespace lnbwd {
namespace {

template <typename T>
__global__ void __launch_bounds__(1024)
kernel5(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, float* __restrict__ scratch,
        unsigned int* __restrict__ counter, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums | flag]: 2 * C + 1 floats
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  unsigned int* is_last = reinterpret_cast<unsigned int*>(shared + 2 * C);
  // Every warp's rows, into the block's shared sums (llmc_persistent_warps.cuh).
  persistent_warps_to_block_sums(dx, dy, x, weight, mean, rstd, rows, C, dbias_sh, dweight_sh);

  // The block's sums to its own slot; then count the block done. The last block to finish adds
  // the slots, in block order, and writes dweight/dbias.
  write_block_slot(scratch, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;
  add_slots_in_block_order(dweight, dbias, scratch, C);
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  // One block per SM, as in llm.c ("1024 threads is best anyway").
  return launch_last_block_kernel<T>(kernel5<T>, LlmcSums::kSlotPerBlock, p, 1, l.block_size, l.smem_bytes, stream);
}

}  // namespace

cudaError_t norm_bwd_kernel5(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(5, p, &l));
  return dispatch_llmc_dtypes<5, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
