// Kernel 3 of llm.c's dev/cuda/layernorm_backward.cu: "persistent blocks with atomics".
//
// Technique (kept from llm.c): kernel 2's warp per row and fp32 shared-memory sums, on a
// persistent grid: 1024 / block_size blocks per SM, each warp walking rows
//   w, w + warps_in_grid, w + 2 * warps_in_grid, ...
// so a block folds many rows into its shared sums and touches global memory for dweight/dbias
// once, at the end. That final add goes straight into dweight/dbias in the output dtype with
// atomicAddX: for bf16/fp16 a 16-bit atomic add done as a 32-bit bf16x2/half2 atomicAdd on the
// aligned word holding the element, with zero added to the other half. Pass 2 reads the row with
// streaming loads (__ldcs): it is the row's last use.
//
// Precision (kept, hence precise=False): in bf16 every block's fp32 sum is rounded to bf16 and
// added to a bf16 running sum, rounding again at each of the hundreds of block additions, so
// dweight can miss llm.c's own bf16 check. fp32 and fp16 lose less. Not deterministic:
// float atomics (shared and global) add in an order that varies run to run.
//
// Repairs relative to llm.c:
//  * dweight/dbias are zeroed with cudaMemsetAsync on the caller's stream before the blocks'
//    atomics accumulate into them (XLA's output buffers are uninitialized).
//  * atomicAddX adds zero to the other 16-bit half of the element's 32-bit word. For the first
//    and last element of dweight/dbias that half can lie outside the array (in another XLA
//    buffer: llm.c turned a -0.0 there into +0.0 and raced with its owner). Those elements
//    now use a 16-bit atomicAdd.
//  * dx is written, not accumulated; g = weight * dy is rounded once (mul_rn) in both passes, so
//    C = 1 gives dx = 0 exactly; 64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6144) is opted in to; C up to 29056 fits Hopper.

#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_persistent_warps.cuh"

namespace lnbwd {
namespace {

__device__ __forceinline__ void atomic_add_x(float* base, int i, int C, float v) {
  (void)C;
  atomicAdd(base + i, v);
}

// base[i] += v for a 16-bit T (T2 its pair type), via the 32-bit word that holds base[i].
template <typename T, typename T2>
__device__ __forceinline__ void atomic_add_pair(T* base, int i, int C, T v) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base + i);
  const bool high = (addr & 0x3) != 0;   // base[i] is the upper half of its word
  const int other = high ? i - 1 : i + 1;
  if (other < 0 || other >= C) {         // the word's other half is not ours to touch
    atomicAdd(base + i, v);
    return;
  }
  const T zero = from_acc<T>(0.0f);
  T2 add;
  add.x = high ? zero : v;
  add.y = high ? v : zero;
  atomicAdd(reinterpret_cast<T2*>(addr & ~uintptr_t(0x3)), add);
}
__device__ __forceinline__ void atomic_add_x(__nv_bfloat16* base, int i, int C, __nv_bfloat16 v) {
  atomic_add_pair<__nv_bfloat16, __nv_bfloat162>(base, i, C, v);
}
__device__ __forceinline__ void atomic_add_x(__half* base, int i, int C, __half v) {
  atomic_add_pair<__half, __half2>(base, i, C, v);
}

template <typename T>
__global__ void __launch_bounds__(1024)
kernel3(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, const T* __restrict__ dy,
        const T* __restrict__ x, const T* __restrict__ weight, const float* __restrict__ mean,
        const float* __restrict__ rstd, int64_t rows, int C) {
  extern __shared__ float shared[];   // [dbias sums | dweight sums], C floats each
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  // Every warp's rows, into the block's shared sums (llmc_persistent_warps.cuh).
  persistent_warps_to_block_sums(dx, dy, x, weight, mean, rstd, rows, C, dbias_sh, dweight_sh);

  // The block's sums, rounded to T, added to the running sums in dweight/dbias.
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    atomic_add_x(dbias, i, C, from_acc<T>(dbias_sh[i]));
    atomic_add_x(dweight, i, C, from_acc<T>(dweight_sh[i]));
  }
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  int64_t grid = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(persistent_grid(p, 1024 / l.block_size, l.block_size, &grid));
  auto kernel = kernel3<T>;
  LNBWD_RETURN_IF_CUDA_ERROR(opt_in_smem(kernel, l.smem_bytes));
  // The blocks' atomics add into dweight/dbias, so they must start at zero.
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dweight, 0, p.C * sizeof(T), stream));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(p.dbias, 0, p.C * sizeof(T), stream));
  kernel<<<static_cast<unsigned int>(grid), l.block_size, l.smem_bytes, stream>>>(
      static_cast<T*>(p.dx), static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), static_cast<const T*>(p.dy),
      static_cast<const T*>(p.x), static_cast<const T*>(p.weight), static_cast<const float*>(p.mean),
      static_cast<const float*>(p.rstd), p.rows, static_cast<int>(p.C));
  return cudaGetLastError();
}

}  // namespace

cudaError_t norm_bwd_kernel3(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(3, p, &l));
  return dispatch_llmc_dtypes<3, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
