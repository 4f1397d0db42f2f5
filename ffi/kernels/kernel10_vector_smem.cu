// Kernel 10 of llm.c's dev/cuda/layernorm_backward.cu: "vectorized shared memory".
//
// Technique (kept from the seed): one warp per row, 16-byte loads, and the dweight/dbias sums of
// a block kept in shared memory in natural column order. For every 32*VEC-column slice of a row,
// warps 1..W-1 park their per-lane partials in a staging area, warp 0 adds them in a fixed order
// and folds the result into the block's shared-memory sums. At the end every block writes its
// sums to its own slot of an fp32 scratch buffer, and the last block to finish (found with an
// atomic counter) adds the slots in block order. No float atomics: the result is deterministic.
//
// Repairs relative to the seed, each of which made the seed wrong or crash:
//  * dx, dweight and dbias are written, not accumulated: XLA's output buffers are uninitialized.
//  * Any C >= 1. The seed issued 16-byte loads at row starts that are misaligned unless
//    C * sizeof(T) % 16 == 0; the launcher now picks VEC = 1 (scalar accesses) in that case.
//  * Every warp of a block runs the same number of row iterations (rows past the end contribute
//    zeros). In the seed, warps whose rows ran out left the loop while the others still waited
//    at the __syncthreads() inside it, so barriers paired up wrongly and warp 0 read stale
//    staging data.
//  * The "is this the last block" flag lives in static shared memory. The seed placed it just
//    past the dynamic shared allocation, which at block size 32 (no staging area) is out of
//    bounds: the crash seen on an H200.
//  * __threadfence() between writing the partial slot and incrementing the counter, and again
//    in the last block before reading the other blocks' slots.
//  * The counter is zeroed by the launcher with cudaMemsetAsync on the caller's stream, and the
//    scratch comes from XLA: no cudaMalloc, no cudaMemset on the legacy stream.
//  * Large C: the launcher opts in to more than 48 KB of dynamic shared memory.
//  * xhat is computed centered, (x - mean) * rstd. The seed expanded b = mean(g * xhat) into
//    rstd * (mean(g * x) - mean * mean(g)), which cancels catastrophically when |mean| >> std.
//  * 64-bit row offsets: row * C overflows int32 beyond 2^31 elements.
#include "dispatch.cuh"

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

  for (int i = threadIdx.x; i < rounded_C; i += blockDim.x) {
    dbias_sh[i] = A(0);
    dweight_sh[i] = A(0);
  }
  __syncthreads();

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

  // Each block writes its sums to its own slot; the last block to finish adds the slots.
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    slot[i] = dbias_sh[i];
    slot[C + i] = dweight_sh[i];
  }
  __threadfence();   // our slot is visible device-wide before the counter says we are done
  __syncthreads();
  if (threadIdx.x == 0) is_last_block = atomicAdd(flag, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();   // order the reads of other blocks' slots after their increments

  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (unsigned int blk = 0; blk < gridDim.x; ++blk) {   // block order: deterministic
      sb += __ldcg(partials + static_cast<size_t>(blk) * 2 * C + i);
      sw += __ldcg(partials + static_cast<size_t>(blk) * 2 * C + C + i);
    }
    dbias[i] = from_acc<T>(sb);
    dweight[i] = from_acc<T>(sw);
  }
}

template <typename T, int VEC>
size_t smem_bytes(int64_t C, int block_size) {
  const int64_t per_iter = 32 * VEC;
  const int64_t rounded_C = ceil_div<int64_t>(C, per_iter) * per_iter;
  return static_cast<size_t>(2 * rounded_C + 2 * (block_size / 32 - 1) * per_iter) * sizeof(acc_t<T>);
}

template <typename T, int VEC>
cudaError_t launch(const LayernormBwdParams& p, int block_size, cudaStream_t stream) {
  const int warps = block_size / 32;
  int sms = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  // The seed's grid: 1024 / block_size blocks per SM. More blocks than rows / warps would idle,
  // and we cannot use more blocks than the workspace has partial slots.
  int64_t grid = static_cast<int64_t>(1024 / block_size) * sms;
  grid = std::min<int64_t>(grid, ceil_div<int64_t>(p.rows, warps));
  grid = std::min<int64_t>(grid, partial_slots<T>(p));
  if (grid < 1) return cudaErrorInvalidValue;

  const size_t smem = smem_bytes<T, VEC>(p.C, block_size);
  auto kernel = kernel10<T, VEC>;
  LNBWD_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(flag_of(p), 0, sizeof(unsigned int), stream));
  kernel<<<static_cast<unsigned int>(grid), block_size, smem, stream>>>(
      static_cast<T*>(p.dx), static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), partials_of<T>(p),
      flag_of(p), static_cast<const T*>(p.dy), static_cast<const T*>(p.x), static_cast<const T*>(p.weight),
      static_cast<const stat_t<T>*>(p.mean), static_cast<const stat_t<T>*>(p.rstd), p.rows, static_cast<int>(p.C));
  return cudaGetLastError();
}

}  // namespace

size_t layernorm_bwd_kernel10_smem_bytes(Dtype dtype, int64_t C, int block_size) {
  size_t out = 0;
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    out = smem_bytes<T, 1>(C, block_size);   // the scalar path needs the least; vector adds padding
    out = std::max(out, smem_bytes<T, 16 / sizeof(T)>(C, block_size));
    return cudaSuccess;
  });
  return out;
}

cudaError_t layernorm_bwd_kernel10(const LayernormBwdParams& p, cudaStream_t stream) {
  const int block_size = p.block_size ? p.block_size : 512;
  if (block_size < 32 || block_size > 512 || block_size % 32 != 0) return cudaErrorInvalidConfiguration;
  int max_smem = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(max_dynamic_smem(&max_smem));
  if (layernorm_bwd_kernel10_smem_bytes(p.dtype, p.C, block_size) > static_cast<size_t>(max_smem)) {
    return cudaErrorInvalidConfiguration;
  }
  return dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int vec = 16 / sizeof(T);
    return can_vectorize<T>(p) ? launch<T, vec>(p, block_size, stream) : launch<T, 1>(p, block_size, stream);
  });
}

}  // namespace lnbwd
