// Kernel 11's path for rows too wide to keep in registers (C beyond about 25000; see
// kernel11_candidates): one block of 1024 threads per row at a time, two passes over the row.
//
//   pass 1: s1 = sum g_i and s2 = sum g_i * (x_i - mean), g_i = weight_i * dy_i, reduced over
//           the block (warp shuffles, then the 32 warp sums in warp order through shared memory);
//   pass 2: reads the row again, writes dx_i = (g_i - s1/C - xhat_i * s2*rstd/C) * rstd, and adds
//           dy_i and dy_i * xhat_i into the block's partial slot in the workspace.
// RMSNorm (norm.centered = 0; norm_weight.cuh): mean = 0, no s1/C term, g_i = (offset + w_i) dy_i.
//
// The second read usually hits L2: the rows in flight (one per block) are a few MB in all, far
// below the 50-60 MB L2, and pass 1 uses ordinary loads so the lines stay; pass 2 uses streaming
// loads because nothing reads them again. DRAM traffic stays close to one read of dy and x, at
// the price of twice the L2 reads. The partial slot is owned by the block and each of its
// columns by one thread, so the read-modify-write needs no atomics and is deterministic.
#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/norm_weight.cuh"
#include "backward/partials_finalize.h"
#include "common/row_reduce.cuh"

namespace lnbwd {
namespace {

constexpr int kThreads = 1024;

// O: the type of weight, dweight and dbias (T, or float beside 16-bit T); RESID: dresidual is
// added to dx (dispatch_types, launch.cuh).
template <typename T, typename O, bool RESID, int VEC>
__global__ void __launch_bounds__(kThreads)
kernel11_wide(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const O* __restrict__ weight, const T* dresidual,
              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment,
              int blocks_per_segment, int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish) {
  using A = acc_t<T>;
  allow_finalize_launch();
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  __shared__ Packed<A, 2> exchange[2][kThreads / 32];   // two buffers of (s1, s2) pairs, alternating rows
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  A* db_slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  A* dw_slot = db_slot + C;

  for (int col = threadIdx.x * VEC; col < C; col += kThreads * VEC) {
    AV zero;
#pragma unroll
    for (int k = 0; k < VEC; ++k) zero[k] = A(0);
    *reinterpret_cast<AV*>(db_slot + col) = zero;
    *reinterpret_cast<AV*>(dw_slot + col) = zero;
  }

  // Blocks [s * bps, (s + 1) * bps) work on segment s only (see kernel11_rows_in_registers.cu).
  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int64_t rows = (segment + 1) * rows_per_segment;
  weight += segment * weight_stride;
  int parity = 0;
  for (int64_t row = segment * rows_per_segment + blockIdx.x % blocks_per_segment; row < rows;
       row += blocks_per_segment) {
    const T* dy_r = dy + row * C;
    const T* x_r = x + row * C;
    const A m = norm.centered * A(mean[row]);   // RMSNorm: no mean
    const A s = A(rstd[row]);

    A s1 = A(0), s2 = A(0);
    for (int col = threadIdx.x * VEC; col < C; col += kThreads * VEC) {
      const V dyv = load(reinterpret_cast<const V*>(dy_r + col));
      const V xv = load(reinterpret_cast<const V*>(x_r + col));
      const AV wv = weight_in_acc(load_vec<VEC>(weight + col), norm.offset);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A gi = mul_rn(wv[k], to_acc(dyv[k]));
        s1 += gi;
        s2 += gi * (to_acc(xv[k]) - m);
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    exchange_row_sums(exchange[parity], kThreads / 32, warp, lane, s1, s2, [] {
      __syncthreads();   // all warp sums posted; the other buffer is free for the next row
    });
    parity ^= 1;
    const A a = (norm.centered * s1) / A(C);   // RMSNorm: no mean term
    const A b = s2 * s / A(C);

    for (int col = threadIdx.x * VEC; col < C; col += kThreads * VEC) {
      const V dyv = load_cs(reinterpret_cast<const V*>(dy_r + col));
      const V xv = load_cs(reinterpret_cast<const V*>(x_r + col));
      const AV wv = weight_in_acc(load_vec<VEC>(weight + col), norm.offset);
      V rv;   // the residual gradient, read once by the thread that writes this dx (maybe aliased)
      if constexpr (RESID) rv = load_cs(reinterpret_cast<const V*>(dresidual + row * C + col));
      AV db = *reinterpret_cast<AV*>(db_slot + col);
      AV dw = *reinterpret_cast<AV*>(dw_slot + col);
      V dxv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A d = to_acc(dyv[k]);
        const A xhat = (to_acc(xv[k]) - m) * s;
        A v = (mul_rn(wv[k], d) - a - xhat * b) * s;
        if constexpr (RESID) v += to_acc(rv[k]);
        dxv[k] = from_acc<T>(v);
        db[k] += d;
        dw[k] += d * xhat;
      }
      *reinterpret_cast<AV*>(db_slot + col) = db;
      *reinterpret_cast<AV*>(dw_slot + col) = dw;
      store_cs(reinterpret_cast<V*>(dx + row * C + col), dxv);
    }
  }
  extern __shared__ __align__(16) unsigned char smem[];   // only for the grid's finish
  if (finish.dweight) finish_partials_in_grid(finish, partials, blocks_per_segment, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
}

template <typename T, typename O, bool RESID, int VEC>
cudaError_t launch(const NormBwdParams& p, cudaStream_t stream) {
  if (p.plan) {
    p.plan->kernel = 11;
    p.plan->path = "wide rows";
  }
  return launch_with_partials<T, O>(p, kernel11_wide<T, O, RESID, VEC>, kThreads, 0, BlocksPerSm::kOccupancyAtLeastOne, 1, 1,
                                 stream);
}

}  // namespace

cudaError_t norm_bwd_kernel11_wide(const NormBwdParams& p, cudaStream_t stream) {
  return dispatch_types(p, [&](auto t, auto o, auto resid) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    constexpr int vec = 16 / sizeof(T);
    return can_vectorize<T>(p) ? launch<T, O, R, vec>(p, stream) : launch<T, O, R, 1>(p, stream);
  });
}

}  // namespace lnbwd
