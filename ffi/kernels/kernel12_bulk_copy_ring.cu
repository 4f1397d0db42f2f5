// Kernel 12 (Hopper, sm_90): rows streamed into shared memory by the bulk copy engine
// (cp.async.bulk, "TMA"), several rows ahead of the threads that use them.
//
// Why: layernorm backward is memory-bound, so speed is bytes in flight. Kernel 11 keeps rows in
// registers, and registers cap how many rows an SM can have in flight (a few). Here the copy
// engine moves whole rows (one instruction per row and tensor, no registers) into a ring of
// shared-memory buffers, so each row group always has the next NB-1 rows on their way while it
// computes on the current one.
//
// Work split (as kernel 11): a block holds `groups` row groups of `tpr` threads; group g walks
// rows blockIdx*groups + g, + grid*groups, ... within its segment; thread t owns the columns
// col(j) = (j * tpr + t) * VEC, j < NV, for every row, so its dweight/dbias sums stay in
// registers (no atomics, no shared-memory traffic) until the end.
//
// The ring, per group: NB buffers, each one row of dy and one row of x, each with an mbarrier
// ("full"). The group's leader thread starts the copy of row k into buffer k % NB and tells the
// barrier how many bytes to expect; the copy engine counts them down; the group's threads wait
// on the barrier's phase (k / NB) & 1. A buffer is refilled only after every thread of the
// group has finished with the row in it: the leader refills buffer (k-1) % NB right after the
// group's barrier of row k, which every thread reaches only after finishing row k-1.
//
// Per row (g_i = weight_i * dy_i, xhat_i = (x_i - mean) * rstd, centered):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean): shuffles, then across the group's warps;
//   pass 2: dx_i = (g_i - s1/C - xhat_i s2 rstd/C) rstd, straight to global memory;
//           dbias_i += dy_i, dweight_i += dy_i xhat_i in registers.
// At the end the groups' sums meet in shared memory (in group order) and the block writes its
// partial slot; finalize_partials adds the slots in slot order. Deterministic.
#include "dispatch.cuh"
#include "kernel12.h"
#include "partials_finalize.h"

namespace lnbwd {
namespace {

// Threads per block. A thread keeps 2 * NV * VEC sums in registers; up to 32 bytes of them
// (8 fp32) fit the 64 registers a 1024-thread block allows, more needs the 128 of a 512-thread
// block (the compiler's report shows spills otherwise).
constexpr int max_threads(size_t sum_bytes) { return sum_bytes <= 32 ? 1024 : 512; }
constexpr int kMaxGroups = 15;               // named barriers 1..15
constexpr size_t kSmemBudget = 200 * 1024;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void group_sync(int id, int count) {
  if (count == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// Wait until the barrier's phase `parity` has completed (all expected bytes have landed).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Copy one row of dy and one of x into a buffer; the barrier completes when both have landed.
// The fence orders the group's earlier ordinary reads of this buffer (made visible to the
// leader by the group barrier) before the copy engine's writes to it.
__device__ __forceinline__ void issue_row(uint64_t* bar, void* dst_dy, void* dst_x, const void* src_dy,
                                          const void* src_x, uint32_t bytes) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(2 * bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst_dy)),
      "l"(src_dy), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst_x)),
      "l"(src_x), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

template <typename T, int VEC, int NV, int NB>
__global__ void __launch_bounds__(max_threads(NV * VEC * sizeof(acc_t<T>)), 1)
kernel12_ring(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const T* __restrict__ weight, const stat_t<T>* __restrict__ mean,
              const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment, int blocks_per_segment,
              int64_t weight_stride, int C, int tpr, int groups) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int lane = threadIdx.x % 32;
  const int warps_per_row = tpr / 32;
  const int warp_in_row = t / 32;
  const bool leader = t == 0;
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(T);

  // Shared memory: [weight row, converted to the accumulator type once per block | ring buffers:
  // groups x NB x (dy row, x row) | mbarriers | reduction exchange]. Every piece starts on a
  // 16-byte boundary (C * sizeof(T) % 16 == 0).
  extern __shared__ __align__(128) unsigned char smem[];
  A* w_sh = reinterpret_cast<A*>(smem);
  unsigned char* ring = smem + static_cast<size_t>(C) * sizeof(A);
  auto buf_dy = [&](int q, int b) { return reinterpret_cast<T*>(ring + ((size_t)q * NB + b) * 2 * row_bytes); };
  auto buf_x = [&](int q, int b) { return reinterpret_cast<T*>(ring + (((size_t)q * NB + b) * 2 + 1) * row_bytes); };
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + (size_t)groups * NB * 2 * row_bytes);
  A* exchange = reinterpret_cast<A*>(full + groups * NB) + g * 2 * warps_per_row * 2;

  // Segments: blocks [s * bps, (s + 1) * bps) work on segment s only.
  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int64_t rows = (segment + 1) * rows_per_segment;
  weight += segment * weight_stride;
  const int64_t stride = static_cast<int64_t>(blocks_per_segment) * groups;
  const int64_t first = segment * rows_per_segment + static_cast<int64_t>(blockIdx.x % blocks_per_segment) * groups + g;

  for (int c = threadIdx.x; c < C; c += blockDim.x) w_sh[c] = to_acc(weight[c]);
  if (leader) {
    for (int b = 0; b < NB; ++b) mbar_init(&full[g * NB + b]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();   // barriers initialized and weight staged before anyone uses them
  if (leader) {
    for (int b = 0; b < NB; ++b) {
      const int64_t r = first + b * stride;
      if (r < rows) issue_row(&full[g * NB + b], buf_dy(g, b), buf_x(g, b), dy + r * C, x + r * C, row_bytes);
    }
  }

  AV db[NV], dw[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) { db[j][k] = A(0); dw[j][k] = A(0); }
  }

  int parity = 0;   // which exchange buffer this row uses
  int64_t k = 0;    // how many rows this group has processed
  for (int64_t row = first; row < rows; row += stride, ++k) {
    const int b = static_cast<int>(k % NB);
    mbar_wait(&full[g * NB + b], static_cast<uint32_t>((k / NB) & 1));
    const T* dy_s = buf_dy(g, b);
    const T* x_s = buf_x(g, b);
    const A m = A(mean[row]);
    const A s = A(rstd[row]);

    A s1 = A(0), s2 = A(0);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const V dyv = *reinterpret_cast<const V*>(dy_s + col);
        const V xv = *reinterpret_cast<const V*>(x_s + col);
        const AV wv = *reinterpret_cast<const AV*>(w_sh + col);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const A gi = mul_rn(wv[q], to_acc(dyv[q]));
          s1 += gi;
          s2 += gi * (to_acc(xv[q]) - m);
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (warps_per_row > 1) {
      // Two exchange buffers alternate between rows (see kernel 11).
      A* ex = exchange + parity * warps_per_row * 2;
      if (lane == 0) {
        ex[warp_in_row * 2] = s1;
        ex[warp_in_row * 2 + 1] = s2;
      }
      group_sync(1 + g, tpr);
      s1 = A(0);
      s2 = A(0);
      for (int w = 0; w < warps_per_row; ++w) {
        s1 += ex[w * 2];
        s2 += ex[w * 2 + 1];
      }
      parity ^= 1;
    } else {
      group_sync(1 + g, tpr);
    }
    // Every thread of the group is past row k-1 now: refill its buffer with row k-1+NB.
    if (leader && k >= 1) {
      const int64_t r = row + (NB - 1) * stride;
      const int rb = static_cast<int>((k - 1) % NB);
      if (r < rows) issue_row(&full[g * NB + rb], buf_dy(g, rb), buf_x(g, rb), dy + r * C, x + r * C, row_bytes);
    }
    const A a = s1 / A(C);
    const A neg_b_s = -(s2 * s / A(C)) * s;

#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const V dyv = *reinterpret_cast<const V*>(dy_s + col);
        const V xv = *reinterpret_cast<const V*>(x_s + col);
        const AV wv = *reinterpret_cast<const AV*>(w_sh + col);
        V dxv;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          // dx = (g - a - xhat b) rstd = (g - a) rstd + xhat (-b rstd), with per-row constants
          // folded; g - a is exactly 0 when C = 1, so dx is exactly 0 there.
          const A d = to_acc(dyv[q]);
          const A xhat = (to_acc(xv[q]) - m) * s;
          dxv[q] = from_acc<T>(fma(xhat, neg_b_s, (mul_rn(wv[q], d) - a) * s));
          db[j][q] += d;
          dw[j][q] = fma(d, xhat, dw[j][q]);
        }
        store_cs(reinterpret_cast<V*>(dx + row * C + col), dxv);   // written once, not re-read here
      }
    }
  }

  // The groups' sums meet in shared memory (the ring is idle now: every copy that was issued
  // has been waited for), then are added in group order into this block's partial slot.
  __syncthreads();
  A* sums = reinterpret_cast<A*>(ring);   // [groups][2][C]
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < C) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) {
        sums[(static_cast<size_t>(g) * 2) * C + col + q] = db[j][q];
        sums[(static_cast<size_t>(g) * 2 + 1) * C + col + q] = dw[j][q];
      }
    }
  }
  __syncthreads();
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (int q = 0; q < groups; ++q) {
      sb += sums[(static_cast<size_t>(q) * 2) * C + c];
      sw += sums[(static_cast<size_t>(q) * 2 + 1) * C + c];
    }
    __stcg(slot + c, sb);
    __stcg(slot + C + c, sw);
  }
#endif
}

size_t smem_bytes(const Kernel12Config& cfg, int64_t C, size_t item, size_t acc) {
  const size_t row = C * item;
  const size_t weight = C * acc;
  const size_t ring = std::max(static_cast<size_t>(cfg.groups) * cfg.nb * 2 * row,
                               static_cast<size_t>(cfg.groups) * 2 * C * acc);   // reused for the sums
  return weight + ring + static_cast<size_t>(cfg.groups) * cfg.nb * 8 +
         static_cast<size_t>(cfg.groups) * 2 * (cfg.tpr / 32) * 2 * acc;
}

template <typename T, int VEC, int NV, int NB>
cudaError_t launch(const LayernormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  auto kernel = kernel12_ring<T, VEC, NV, NB>;
  const int threads = cfg.tpr * cfg.groups;
  const size_t smem = smem_bytes(cfg, p.C, sizeof(T), sizeof(acc_t<T>));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int sms = 0, per_sm = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(sm_count(&sms));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  int64_t bps = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(blocks_per_segment<T>(p, static_cast<int64_t>(per_sm) * sms, cfg.groups, &bps));
  kernel<<<static_cast<unsigned int>(bps * p.segments), threads, smem, stream>>>(
      static_cast<T*>(p.dx), partials_of<T>(p), static_cast<const T*>(p.dy), static_cast<const T*>(p.x),
      static_cast<const T*>(p.weight), static_cast<const stat_t<T>*>(p.mean),
      static_cast<const stat_t<T>*>(p.rstd), p.rows / p.segments, static_cast<int>(bps), p.weight_stride,
      static_cast<int>(p.C), cfg.tpr, cfg.groups);
  LNBWD_RETURN_IF_CUDA_ERROR(cudaGetLastError());
  return finalize_partials_launch(p, static_cast<int>(bps), stream);
}

// Compiled (NV, NB) variants. Registers per thread: 2 * NV * VEC fp32 sums plus one vector of
// each input at a time, so NV * VEC <= 32 elements (see max_threads).
template <typename T, int VEC>
cudaError_t launch_variant(const LayernormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kMaxNV = 32 / VEC;
  const int key = cfg.nv * 10 + cfg.nb;
  switch (key) {
    case 12: return launch<T, VEC, 1, 2>(p, cfg, stream);
    case 13: return launch<T, VEC, 1, 3>(p, cfg, stream);
    case 22: return launch<T, VEC, 2, 2>(p, cfg, stream);
    case 23: return launch<T, VEC, 2, 3>(p, cfg, stream);
    case 42: if constexpr (kMaxNV >= 4) return launch<T, VEC, 4, 2>(p, cfg, stream); break;
    case 43: if constexpr (kMaxNV >= 4) return launch<T, VEC, 4, 3>(p, cfg, stream); break;
    case 82: if constexpr (kMaxNV >= 8) return launch<T, VEC, 8, 2>(p, cfg, stream); break;
    case 83: if constexpr (kMaxNV >= 8) return launch<T, VEC, 8, 3>(p, cfg, stream); break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

std::vector<Kernel12Config> kernel12_candidates(Dtype dtype, int64_t C) {
  const int item = dtype == Dtype::kF64 ? 8 : (dtype == Dtype::kF32 ? 4 : 2);
  const int vec = 16 / item;
  const size_t acc = dtype == Dtype::kF64 ? 8 : 4;
  std::vector<Kernel12Config> out;
  if (C % vec != 0) return out;
  const int64_t nvec = C / vec;
  for (int nv : {1, 2, 4, 8}) {
    if (nv * vec > 32) continue;
    for (int nb : {3, 2}) {
      Kernel12Config cfg;
      cfg.nv = nv;
      cfg.nb = nb;
      const int64_t tpr = 32 * ceil_div<int64_t>(nvec, 32 * nv);
      const int block_max = max_threads(nv * vec * acc);
      if (tpr > block_max) continue;
      cfg.tpr = static_cast<int>(tpr);
      cfg.groups = std::min(block_max / cfg.tpr, kMaxGroups);
      while (cfg.groups > 0 && smem_bytes(cfg, C, item, acc) > kSmemBudget) --cfg.groups;
      if (cfg.groups == 0) continue;
      out.push_back(cfg);
    }
  }
  return out;
}

bool kernel12_pick(Dtype dtype, int64_t C, Kernel12Config* cfg) {
  const std::vector<Kernel12Config> all = kernel12_candidates(dtype, C);
  if (all.empty()) return false;
  const int vec = dtype == Dtype::kF64 ? 2 : (dtype == Dtype::kF32 ? 4 : 8);
  const int64_t nvec = C / vec;
  // Prefer most rows in flight per block (groups * (nb - 1)), then fewer idle vector slots.
  auto score = [&](const Kernel12Config& c) {
    const double util = static_cast<double>(nvec) / (static_cast<double>(c.tpr) * c.nv);
    return (util >= 0.7 ? 1000.0 : 0.0) + 10.0 * c.groups * (c.nb - 1) + util;
  };
  *cfg = all[0];
  for (const Kernel12Config& c : all) {
    if (score(c) > score(*cfg)) *cfg = c;
  }
  return true;
}

cudaError_t layernorm_bwd_kernel12_config(const LayernormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    constexpr int vec = 16 / sizeof(T);
    if (!can_vectorize<T>(p)) return cudaErrorInvalidValue;
    return launch_variant<T, vec>(p, cfg, stream);
  });
}

cudaError_t layernorm_bwd_kernel12(const LayernormBwdParams& p, cudaStream_t stream) {
  int dev = 0, major = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(cudaGetDevice(&dev));
  LNBWD_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  bool vectorized = false;
  dispatch_dtype(p.dtype, [&](auto t) {
    vectorized = can_vectorize<decltype(t)>(p);
    return cudaSuccess;
  });
  Kernel12Config cfg;
  // The bulk copy engine needs sm_90 and 16-byte aligned rows; otherwise kernel 11 does the job.
  if (major >= 9 && vectorized && kernel12_pick(p.dtype, p.C, &cfg)) return layernorm_bwd_kernel12_config(p, cfg, stream);
  return layernorm_bwd_kernel11(p, stream);
}

}  // namespace lnbwd
