// Kernel 8 of llm.c's dev/cuda/layernorm_backward.cu: "x128 vectorized".
//
// Technique (kept from llm.c): kernel 7 (persistent warps without cooperative groups, fp32
// sums in shared memory, one fp32 scratch row filled with global atomics, last block converts),
// with every global access 16 bytes wide: a lane loads VEC = 16 / sizeof(T) neighbouring
// elements at once (llm.c's x128: LDG.128/STG.128, the widest access a thread can issue), so
// one step of a warp covers 32 * VEC columns.
//
// Shared-memory order. The sums cannot be updated 16 bytes at a time (shared atomics are 32-bit),
// and if lane L added its VEC elements at columns L*VEC .. L*VEC+VEC-1, the 32 lanes' addresses
// would be VEC floats apart: a VEC-way bank conflict on every atomic. So within each step's
// 32*VEC columns the sums are kept transposed: element k of lane L lives at L + 32*k, which makes
// the 32 lanes hit 32 consecutive floats (32 different banks) for every k. The scratch row in
// global memory uses the same order, and the last block transposes back when it writes
// dweight/dbias, again 16 bytes at a time.
//
// This needs C to be a multiple of 32 * VEC (128 for fp32, 256 for bf16/fp16): llm.c's
// steps are C / (32 * VEC) rounded down, so other C lost their last columns (dx never written,
// dweight/dbias short): silently wrong. Such C are refused (cudaErrorInvalidConfiguration, and
// in Python at trace time). 16-byte accesses also need 16-byte aligned buffers (XLA's are):
// cudaErrorMisalignedAddress otherwise. Not deterministic: the float atomics add in an order
// that varies run to run.
//
// Repairs relative to llm.c:
//  * dx is written, not accumulated (llm.c loaded dinp to add to it), and the last block
//    writes dweight/dbias instead of adding to them: XLA's outputs are uninitialized.
//  * The scratch row and the counter are in the workspace XLA gives (counter in the header,
//    scratch in the first partial slot), zeroed with one cudaMemsetAsync on the caller's stream
//    (they are contiguous). llm.c used cudaMemset on the legacy default stream.
//  * Fences before the block is counted done and in the last block before it reads the scratch
//    (from L2, __ldcg); llm.c had none.
//  * g = weight * dy is rounded once (mul_rn) in both passes; 64-bit row offsets.
//  * The grid never has more blocks than the rows have warps (idle blocks would only add zeros).
//  * More than 48 KB of shared memory (C > 6143) is opted in to; C up to 29055 fits Hopper.
//  * __launch_bounds__(1024) instead of llm.c's (1024, 2), under which it spills registers.
#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {
namespace {

constexpr int kWarpSize = 32;

// Up to 1024 threads per block. llm.c also asked for two such blocks per SM, which caps a
// thread at 32 registers and makes this kernel spill to local memory; its grid never puts more
// than 1024 threads on an SM anyway (1024 / block_size blocks per SM).
template <typename T>
__global__ void __launch_bounds__(1024)
kernel8(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias, float* __restrict__ scratch,
        unsigned int* __restrict__ counter, const T* __restrict__ dy, const T* __restrict__ x,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
        int C) {
  constexpr int VEC = 16 / sizeof(T);
  using V = Packed<T, VEC>;
  extern __shared__ float shared[];   // [dbias sums | dweight sums | flag]: 2 * C + 1 floats
  float* dbias_sh = shared;
  float* dweight_sh = shared + C;
  unsigned int* is_last = reinterpret_cast<unsigned int*>(shared + 2 * C);
  const int warp_id = threadIdx.x / kWarpSize;
  const int warps_in_block = blockDim.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int per_step = kWarpSize * VEC;   // columns a warp covers per step
  const int steps = C / per_step;         // exact: the launcher refuses other C

  zero_block_sums(dbias_sh, dweight_sh, C);
  __syncthreads();   // sums zeroed before any warp adds to them

  // No barrier inside the row loop, so warps may take different numbers of rows.
  const int64_t warps_in_grid = static_cast<int64_t>(gridDim.x) * warps_in_block;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps_in_block + warp_id; row < rows; row += warps_in_grid) {
    const T* dy_r = dy + row * C;
    const T* x_r = x + row * C;
    T* dx_r = dx + row * C;
    const float mean_r = mean[row];
    const float rstd_r = rstd[row];

    // Pass 1: a = mean(g), b = mean(g * xhat), g = weight * dy, xhat = (x - mean) * rstd, each lane
    // summing over its 16-byte vectors (x128_row_sums in llmc_device.cuh), then across the warp.
    float sum_g = 0.0f, sum_g_xhat = 0.0f;
    x128_row_sums(dy_r, x_r, weight, mean_r, rstd_r, lane, C, sum_g, sum_g_xhat);
    const float a = warp_sum(sum_g) / C;
    const float b = warp_sum(sum_g_xhat) / C;

    // Pass 2: dx = (g - a - xhat * b) * rstd, and the row's share of dbias and dweight in the
    // transposed shared-memory order (element k of lane L at L + 32 * k within the step).
    for (int s = 0; s < steps; ++s) {
      const int col = s * per_step + lane * VEC;
      const int sh = s * per_step + lane;
      const V dyv = load_cs(reinterpret_cast<const V*>(dy_r + col));
      const V xv = load_cs(reinterpret_cast<const V*>(x_r + col));
      const V wv = load(reinterpret_cast<const V*>(weight + col));
      V dxv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = to_acc(dyv[k]);
        const float xhat = (to_acc(xv[k]) - mean_r) * rstd_r;
        atomicAdd(&dbias_sh[sh + k * kWarpSize], d);
        atomicAdd(&dweight_sh[sh + k * kWarpSize], d * xhat);
        dxv[k] = from_acc<T>((mul_rn(to_acc(wv[k]), d) - a - xhat * b) * rstd_r);
      }
      store_cg(reinterpret_cast<V*>(dx_r + col), dxv);   // cached in L2 for the next kernel, not in L1
    }
  }
  __syncthreads();   // every warp's shared atomics done before the block's sums are read

  // The block's sums into the one fp32 scratch row, in the same transposed order; then count the
  // block done.
  add_block_sums_to_row(scratch, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(counter, is_last)) return;

  // The last block transposes back and converts, a warp per step, 16 bytes per lane.
  for (int s = warp_id; s < steps; s += warps_in_block) {
    const int col = s * per_step + lane * VEC;
    const int sh = s * per_step + lane;
    V db, dw;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      db[k] = from_acc<T>(__ldcg(scratch + sh + k * kWarpSize));
      dw[k] = from_acc<T>(__ldcg(scratch + C + sh + k * kWarpSize));
    }
    *reinterpret_cast<V*>(dbias + col) = db;
    *reinterpret_cast<V*>(dweight + col) = dw;
  }
}

template <typename T>
cudaError_t launch(const NormBwdParams& p, const LlmcLimits& l, cudaStream_t stream) {
  if (!can_vectorize<T>(p)) return cudaErrorMisalignedAddress;
  return launch_last_block_kernel<T>(kernel8<T>, LlmcSums::kSharedRow, p,
                                     1024 / l.block_size, l.block_size, l.smem_bytes, stream);
}

}  // namespace

cudaError_t norm_bwd_kernel8(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(8, p, &l));
  return dispatch_llmc_dtypes<8, float, __nv_bfloat16, __half>(p.dtype, [&](auto t) { return launch<decltype(t)>(p, l, stream); });
}

}  // namespace lnbwd
