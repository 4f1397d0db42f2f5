// The fused forward's path for rows too wide for the register path (more than kFwdMaxNv
// vectors for each of kFwdMaxRowThreads threads: bf16 rows beyond 32768 elements, fp32 beyond
// 16384): a block of 1024 threads per row.
//
//   kSharedMemory: pass 1 reads the row from DRAM once, sums it, and keeps it in dynamic shared
//                  memory (C * sizeof(T) bytes, up to the device's opt-in limit); passes 2 and
//                  3 read it from there. Each thread reads back only the vectors it wrote
//                  itself, so the row copy needs no barrier; only the two block sums do.
//   kGlobal:       rows even wider than shared memory: passes 2 and 3 read the row again from
//                  global memory. Pass 1 and 2 use cached loads, so the re-reads come mostly
//                  from L2 (a row per block in flight is a few MB on the whole GPU), and pass
//                  3 a streaming load, as nothing reads the row after it.
// The math is the register path's (forward_rows.cu): mean, centered variance, then
// y_i = ((x_i - mean) rstd) w_i + b_i, in fp32 (fp64 for fp64); for RMSNorm (K = kRmsNorm) no
// mean, rstd from sum x_i^2, y_i = (x_i rstd) (offset + w_i).
//
// RES (the residual variant): pass 1 reads x and residual once (streaming: neither is read
// again), forms s = x + residual rounded to T (add_round; (x + x_bias) + residual with x's own
// bias, add_bias_round) and stores it; the row the passes
// work on is s. kSharedMemory keeps s in shared memory as it keeps x; kGlobal re-reads s from
// the output just written. Each thread re-reads only the vectors it stored itself, so that
// needs no barrier (a thread sees its own stores). The RES = false instantiations are the
// plain forward, unchanged.
#include <algorithm>

#include "common/occupancy.h"
#include "forward/forward_launch.cuh"

namespace lnbwd {
namespace {

template <NormKind K, typename T, typename P, int VEC, bool IN_SMEM, bool RES>
__global__ void __launch_bounds__(kFwdWideThreads)
forward_wide(FwdArgs<T, P> a) {
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  extern __shared__ __align__(16) unsigned char smem[];
  V* held = reinterpret_cast<V*>(smem);              // the row, for IN_SMEM
  // The warps' sums: layernorm's mean's and variance's; RMSNorm's one sum a row alternates
  // between the two by row parity (why: forward_rows.cu, at its exchange buffers).
  __shared__ A exchange[2][kFwdWideThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  const int C = a.C;
  const int nvec = C / VEC;   // VEC divides C (VEC = 1 otherwise)
  auto sync = [] { __syncthreads(); };

  int64_t parity = 0;   // the block's rows so far, mod 2
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x, parity ^= 1) {
    const V* x = reinterpret_cast<const V*>(a.x + row * C);
    V* sum_row = nullptr;   // RES: s's row, written in pass 1 (and re-read by kGlobal)
    if constexpr (RES) {
      sum_row = reinterpret_cast<V*>(a.s + row * C);
      x = sum_row;          // passes 2 and 3 read the row from here (kGlobal)
    }

    // Pass 1: the mean; the row goes to shared memory on the way. RMSNorm reads the row here
    // too, but takes no mean (pass 2 sums x_i^2).
    A s = A(0);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      V v;
      if constexpr (RES) {
        const V* xr = reinterpret_cast<const V*>(a.x + row * C);
        const V* rr = reinterpret_cast<const V*>(a.residual + row * C);
        const P* xb = param_row(a.x_bias, row, a.x_bias_div, C);   // uniform branch below
        v = xb == nullptr ? add_round(load_cs(xr + i), load_cs(rr + i))
                          : add_bias_round(load_cs(xr + i), load_params<A, P, VEC>(xb + i * VEC), load_cs(rr + i));
        sum_row[i] = v;
      } else {
        v = IN_SMEM ? load_cs(x + i) : load(x + i);
      }
      if (IN_SMEM) held[i] = v;
      if constexpr (K == NormKind::kLayerNorm) s += sum_of(to_acc(v));
    }
    A mean = A(0);
    if constexpr (K == NormKind::kLayerNorm) mean = row_sum(s, exchange[0], warps, warp, lane, sync) / A(C);

    // Pass 2: the centered variance.
    A q = A(0);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      q += squares_of<K>(to_acc(IN_SMEM ? held[i] : load(x + i)), mean);
    }
    A* ex_q = K == NormKind::kLayerNorm ? exchange[1] : exchange[parity];
    const A rstd = rstd_of(row_sum(q, ex_q, warps, warp, lane, sync), C, a.eps);

    // Pass 3: y.
    const P* w = param_row(a.weight, row, a.weight_div, C);
    const P* b = param_row(a.bias, row, a.bias_div, C);
    V* y = reinterpret_cast<V*>(a.y + row * C);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      const V v = IN_SMEM ? held[i] : load_cs(x + i);
      y[i] = normalize<K, T, P, VEC>(to_acc(v), mean, rstd, w, b, i * VEC, a.offset);
    }
    if (threadIdx.x == 0) {
      if constexpr (K == NormKind::kLayerNorm) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
}

template <NormKind K, typename T, typename P, int VEC, bool RES>
cudaError_t launch(const FwdArgs<T, P>& a, const NormFwdConfig& cfg, cudaStream_t stream) {
  const unsigned int blocks = cfg.blocks;
  if (cfg.path == FwdPath::kGlobal) {
    forward_wide<K, T, P, VEC, false, RES><<<blocks, cfg.threads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  // Opts the kernel in to the row's shared memory (remembered per device and kernel, so the
  // driver is asked once) and checks that a block of it fits at all.
  auto kernel = forward_wide<K, T, P, VEC, true, RES>;
  int fit = 0;
  LNBWD_FWD_RETURN_IF_ERROR(resident_units(-1, reinterpret_cast<const void*>(kernel), cfg.threads, cfg.smem_bytes, 1, &fit));
  if (fit < 1) return cudaErrorInvalidConfiguration;
  kernel<<<blocks, cfg.threads, cfg.smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t norm_fwd_wide(const NormFwdParams& p, const NormFwdConfig& cfg, cudaStream_t stream) {
  if (cfg.path != FwdPath::kSharedMemory && cfg.path != FwdPath::kGlobal) return cudaErrorInvalidValue;
  return dispatch_fwd_variant(p, cfg, [&](auto kind, auto t, auto pt, auto vec, auto res) -> cudaError_t {
    using T = decltype(t);
    using P = decltype(pt);
    constexpr NormKind K = decltype(kind)::value;
    return launch<K, T, P, decltype(vec)::value, decltype(res)::value>(fwd_args<T, P>(p), cfg, stream);
  });
}

}  // namespace lnbwd
