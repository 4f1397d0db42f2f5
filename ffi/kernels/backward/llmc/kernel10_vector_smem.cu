// Kernel 10 of llm.c's dev/cuda/layernorm_backward.cu: "vectorized shared memory".
//
// Technique (kept from llm.c): one warp per row, 16-byte loads, and the dweight/dbias sums of
// a block kept in shared memory in natural column order. For every 32*VEC-column slice of a row,
// warps 1..W-1 park their per-lane partials in a staging area, warp 0 adds them in a fixed order
// and folds the result into the block's shared-memory sums. At the end every block writes its
// sums to its own slot of an fp32 scratch buffer, and the last block to finish (found with an
// atomic counter) adds the slots in block order. No float atomics: the result is deterministic.
//
// Repairs relative to llm.c, each of which made llm.c wrong or crash:
//  * dx, dweight and dbias are written, not accumulated: XLA's output buffers are uninitialized.
//  * Any C >= 1. llm.c issued 16-byte loads at row starts that are misaligned unless
//    C * sizeof(T) % 16 == 0; the launcher now picks VEC = 1 (scalar accesses) in that case.
//  * Every warp of a block runs the same number of row iterations (rows past the end contribute
//    zeros). In llm.c, warps whose rows ran out left the loop while the others still waited
//    at the __syncthreads() inside it, so barriers paired up wrongly and warp 0 read stale
//    staging data.
//  * The "is this the last block" flag lives in static shared memory. llm.c placed it just
//    past the dynamic shared allocation, which at block size 32 (no staging area) is out of
//    bounds: the crash seen on an H200.
//  * __threadfence() between writing the partial slot and incrementing the counter, and again
//    in the last block before reading the other blocks' slots.
//  * The counter is zeroed by the launcher with cudaMemsetAsync on the caller's stream, and the
//    scratch comes from XLA: no cudaMalloc, no cudaMemset on the legacy stream.
//  * Large C: the launcher opts in to more than 48 KB of dynamic shared memory; a C whose sums
//    and staging area do not fit is refused (by the registry with a message, by the driver at
//    the opt-in otherwise), as are block sizes other than the powers of two from 32 to 512
//    (llmc_limits.h, as for kernels 1-9).
//  * xhat is computed centered, (x - mean) * rstd. llm.c expanded b = mean(g * xhat) into
//    rstd * (mean(g * x) - mean * mean(g)), which cancels catastrophically when |mean| >> std.
//  * 64-bit row offsets: row * C overflows int32 beyond 2^31 elements.
#include "backward/llmc/llmc_common.cuh"
#include "backward/llmc/llmc_device.cuh"

namespace lnbwd {
namespace {

template <typename T, int VEC>
__global__ void __launch_bounds__(512, 2)
kernel10(T* __restrict__ dx, T* __restrict__ dweight, T* __restrict__ dbias,
         acc_t<T>* __restrict__ partials, unsigned int* __restrict__ flag,
         const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ weight,
         const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd,
         int64_t rows, int C) {
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int per_iter = 32 * VEC;                  // columns one warp covers per step
  const int iters = ceil_div(C, per_iter);
  const int rounded_C = iters * per_iter;         // so the last step needs no bounds check in smem

  // Shared memory: [dbias sums | dweight sums] (rounded_C each), then the staging area of warps
  // 1..W-1 (warp 0 never stages, so it needs no room): (W-1) * 32 lanes * VEC accumulators, twice.
  extern __shared__ __align__(32) unsigned char smem[];
  A* dbias_sh = reinterpret_cast<A*>(smem);
  A* dweight_sh = dbias_sh + rounded_C;
  AV* dbias_stage = reinterpret_cast<AV*>(dweight_sh + rounded_C);
  AV* dweight_stage = dbias_stage + (warps - 1) * 32;
  __shared__ bool is_last_block;

  zero_block_sums(dbias_sh, dweight_sh, rounded_C);
  __syncthreads();   // sums zeroed before warp 0 adds to them

  // All warps of the block take the same number of steps, because the loop body has barriers.
  const int64_t rows_per_step = static_cast<int64_t>(gridDim.x) * warps;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * warps; first < rows; first += rows_per_step) {
    const int64_t row = first + warp;
    const bool row_ok = row < rows;               // uniform across the warp
    const T* dy_r = dy + row * C;
    const T* x_r = x + row * C;
    T* dx_r = dx + row * C;
    const A mean_r = row_ok ? A(mean[row]) : A(0);
    const A rstd_r = row_ok ? A(rstd[row]) : A(0);

    // Pass 1: the two row reductions, a = mean(g) and b = mean(g * xhat), with g = weight * dy.
    A sum_g = A(0), sum_g_xc = A(0);
    if (row_ok) {
      for (int col = lane * VEC; col < C; col += per_iter) {
        const V dyv = load(reinterpret_cast<const V*>(dy_r + col));
        const V xv = load(reinterpret_cast<const V*>(x_r + col));
        const V wv = load(reinterpret_cast<const V*>(weight + col));
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A g = mul_rn(to_acc(wv[k]), to_acc(dyv[k]));
          sum_g += g;
          sum_g_xc += g * (to_acc(xv[k]) - mean_r);   // centered; rstd is applied once below
        }
      }
    }
    const A a = warp_sum(sum_g) / A(C);
    const A b = warp_sum(sum_g_xc) * rstd_r / A(C);

    // Pass 2: dx, and this row's contribution to dbias and dweight. The row was just read, so
    // these loads mostly hit L1/L2; they are streaming loads because nothing reads them again.
    for (int it = 0; it < iters; ++it) {
      const int col = it * per_iter + lane * VEC;
      const bool ok = row_ok && col < C;
      V dyv, xv, wv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) { dyv[k] = T(0); xv[k] = T(0); wv[k] = T(0); }
      if (ok) {
        dyv = load_cs(reinterpret_cast<const V*>(dy_r + col));
        xv = load_cs(reinterpret_cast<const V*>(x_r + col));
        wv = load(reinterpret_cast<const V*>(weight + col));
      }
      AV db, dw;
      V dxv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A d = to_acc(dyv[k]);
        const A xhat = (to_acc(xv[k]) - mean_r) * rstd_r;
        db[k] = d;
        dw[k] = d * xhat;
        dxv[k] = from_acc<T>((mul_rn(to_acc(wv[k]), d) - a - xhat * b) * rstd_r);
      }

      // Cross-warp reduction through shared memory, in a fixed order (warp 1, 2, ...).
      if (warp != 0) {
        dbias_stage[(warp - 1) * 32 + lane] = db;
        dweight_stage[(warp - 1) * 32 + lane] = dw;
      }
      __syncthreads();   // staging complete before warp 0 reads it
      if (warp == 0) {
        for (int j = 1; j < warps; ++j) {
          const AV sb = dbias_stage[(j - 1) * 32 + lane];
          const AV sw = dweight_stage[(j - 1) * 32 + lane];
#pragma unroll
          for (int k = 0; k < VEC; ++k) { db[k] += sb[k]; dw[k] += sw[k]; }
        }
        AV* bsum = reinterpret_cast<AV*>(dbias_sh + col);
        AV* wsum = reinterpret_cast<AV*>(dweight_sh + col);
        AV bs = *bsum, ws = *wsum;
#pragma unroll
        for (int k = 0; k < VEC; ++k) { bs[k] += db[k]; ws[k] += dw[k]; }
        *bsum = bs;
        *wsum = ws;
      }
      __syncthreads();   // warp 0 has read the staging area before anyone overwrites it
      if (ok) store_cg(reinterpret_cast<V*>(dx_r + col), dxv);
    }
  }

  // Each block writes its sums to its own slot (the row loop's last barrier ordered warp 0's last
  // additions before these reads); the last block to finish adds the slots, in block order.
  write_block_slot(partials, dbias_sh, dweight_sh, C);
  if (!last_block_to_finish(flag, &is_last_block)) return;
  add_slots_in_block_order(dweight, dbias, partials, C);
}

template <typename T, int VEC>
size_t smem_bytes(int64_t C, int block_size) {
  return llmc_kernel10_smem(sizeof(acc_t<T>), VEC, C, block_size);   // llmc_limits.h
}

template <typename T, int VEC>
cudaError_t launch(const NormBwdParams& p, int block_size, cudaStream_t stream) {
  // llm.c's grid: 1024 / block_size blocks per SM, never more blocks than the rows have warps,
  // nor than the workspace has partial slots.
  return launch_last_block_kernel<T>(kernel10<T, VEC>, LlmcSums::kSlotPerBlock, p, 1024 / block_size, block_size,
                                     smem_bytes<T, VEC>(p.C, block_size), stream);
}

}  // namespace

cudaError_t norm_bwd_kernel10(const NormBwdParams& p, cudaStream_t stream) {
  LlmcLimits l;
  LNBWD_RETURN_IF_CUDA_ERROR(check_llmc_limits(10, p, &l));
  return dispatch_llmc_dtypes<10, float, __nv_bfloat16, __half, double>(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int vec = 16 / sizeof(T);
    return can_vectorize<T>(p) ? launch<T, vec>(p, l.block_size, stream) : launch<T, 1>(p, l.block_size, stream);
  });
}

}  // namespace lnbwd
