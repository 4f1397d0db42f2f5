// Kernel 4 of llm.c's dev/cuda/layernorm_backward.cu: "atomicCAS bf16".
//
// Technique (kept from llm.c): kernel 3 (persistent grid, a warp per row, fp32 sums in shared
// memory), with the final per-block add into bf16 dweight/dbias done by hand as a
// compare-and-swap loop on pairs of columns. A pair of bf16 is one 32-bit word: read it from L2
// (__ldcg, since other SMs update it), add the block's two sums in bf16x2, and atomicCAS the
// word from the value read to the sum; if another block changed the word in between, atomicCAS
// returns what it found instead, and the add is retried on that value.
//
// Precision (kept, hence precise=False): like kernel 3, every block's sum is rounded to bf16 and
// added to a bf16 running sum, rounding again at each of the hundreds of block additions, so
// dweight can miss llm.c's own check. Not deterministic: the order of the blocks' adds
// (and the shared-memory float atomics) varies from run to run. bf16 only, as in llm.c.
//
// Repairs relative to llm.c:
//  * dweight/dbias are zeroed with cudaMemsetAsync on the caller's stream before the blocks add
//    into them (XLA's output buffers are uninitialized).
//  * Odd C: llm.c's pair loop (i < C/2) never added the last column; it now gets the same
//    compare-and-swap loop on its own 16 bits.
//  * dx is written, not accumulated; g = weight * dy is rounded once (mul_rn) in both passes, so
//    C = 1 gives dx = 0 exactly; 64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6144) is opted in to; C up to 29056 fits Hopper.
// The pairs are 32-bit words, so dweight and dbias must be 4-byte aligned (XLA's buffers are):
// the launcher returns cudaErrorMisalignedAddress otherwise.

#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_persistent_warps.cuh"

namespace lnbwd {
namespace {

static_assert(kLlmcFacts[4].dtypes == dtype_bit(Dtype::kBF16), "kernel 4 is built for bfloat16 only");

__device__ __forceinline__ unsigned int bits_of(__nv_bfloat162 v) {
  unsigned int u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
__device__ __forceinline__ __nv_bfloat162 bf162_of(unsigned int u) {
  __nv_bfloat162 v;
  memcpy(&v, &u, sizeof(u));
  return v;
}

// *word += add in bf16x2, as a compare-and-swap loop.
__device__ __forceinline__ void cas_add(__nv_bfloat162* word, __nv_bfloat162 add) {
  unsigned int* w = reinterpret_cast<unsigned int*>(word);
  unsigned int assumed = bits_of(__ldcg(word));
  unsigned int found = atomicCAS(w, assumed, bits_of(__hadd2(bf162_of(assumed), add)));
  while (found != assumed) {   // another block changed it between our read and our swap
    assumed = found;
    found = atomicCAS(w, assumed, bits_of(__hadd2(bf162_of(assumed), add)));
  }
}

// *addr += add for one bf16, as a 16-bit compare-and-swap loop.
__device__ __forceinline__ void cas_add(__nv_bfloat16* addr, __nv_bfloat16 add) {
  unsigned short* a = reinterpret_cast<unsigned short*>(addr);
  unsigned short assumed = __bfloat16_as_ushort(__ldcg(addr));
  unsigned short found = atomicCAS(a, assumed, __bfloat16_as_ushort(__hadd(__ushort_as_bfloat16(assumed), add)));
  while (found != assumed) {
    assumed = found;
    found = atomicCAS(a, assumed, __bfloat16_as_ushort(__hadd(__ushort_as_bfloat16(assumed), add)));
  }
}

__global__ void __launch_bounds__(1024)
kernel4(__nv_bfloat16* __restrict__ dx, __nv_bfloat16* __restrict__ dweight, __nv_bfloat16* __restrict__ dbias,
        const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ x,
        const __nv_bfloat16* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd,
        int64_t rows, int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums], C floats each
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  // Every warp's rows, into the block's shared sums (llmc_persistent_warps.cuh).
  persistent_warps_to_block_sums(dx, dy, x, weight, mean, rstd, rows, C, dbias_sh, dweight_sh);

  // The block's sums, rounded to bf16, added pair by pair to dweight/dbias.
  __nv_bfloat162* dbias2 = reinterpret_cast<__nv_bfloat162*>(dbias);
  __nv_bfloat162* dweight2 = reinterpret_cast<__nv_bfloat162*>(dweight);
  for (int i = threadIdx.x; i < C / 2; i += blockDim.x) {
    cas_add(dbias2 + i, __floats2bfloat162_rn(dbias_sh[2 * i], dbias_sh[2 * i + 1]));
    cas_add(dweight2 + i, __floats2bfloat162_rn(dweight_sh[2 * i], dweight_sh[2 * i + 1]));
  }
  if (C % 2 != 0 && threadIdx.x == 0) {   // the last column has no partner
    cas_add(dbias + C - 1, __float2bfloat16_rn(dbias_sh[C - 1]));
    cas_add(dweight + C - 1, __float2bfloat16_rn(dweight_sh[C - 1]));
  }
}

}  // namespace

cudaError_t norm_bwd_kernel4(const NormBwdParams& p, cudaStream_t stream) {
  using T = __nv_bfloat16;
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(4, p, &l));
  if (reinterpret_cast<uintptr_t>(p.dweight) % 4 != 0 || reinterpret_cast<uintptr_t>(p.dbias) % 4 != 0) {
    return cudaErrorMisalignedAddress;
  }
  int64_t grid = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(persistent_grid(p, 1024 / l.block_size, l.block_size, &grid));
  LNBWD_RETURN_IF_CUDA_ERROR(opt_in_smem(kernel4, l.smem_bytes));
  // The blocks add into dweight/dbias, so they must start at zero.
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dweight, 0, p.C * sizeof(T), stream));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dbias, 0, p.C * sizeof(T), stream));
  kernel4<<<static_cast<unsigned int>(grid), l.block_size, l.smem_bytes, stream>>>(
      static_cast<T*>(p.dx), static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), static_cast<const T*>(p.dy),
      static_cast<const T*>(p.x), static_cast<const T*>(p.weight), static_cast<const float*>(p.mean),
      static_cast<const float*>(p.rstd), p.rows, static_cast<int>(p.C));
  return cudaGetLastError();
}

}  // namespace lnbwd
