// Kernel 12's path for rows too wide for its per-group ring (fp32 rows of 12288 and 16384, where
// even two buffers of a whole row of dy and x do not fit in shared memory): a block works on one
// row at a time, and the bulk copy engine streams the row through a ring of NB chunk buffers
// twice, once per pass.
//
//   pass 1: chunks 0..P-1 of the row: s1 = sum g_i, s2 = sum g_i (x_i - mean), g_i = w_i dy_i;
//           reduced over the block (shuffles, then the warps' pairs in warp order);
//   pass 2: chunks 0..P-1 again: dx_i, and dbias_i += dy_i, dweight_i += dy_i xhat_i in
//           registers (the element math of row_math.cuh, as in the row ring).
//
// The second read of a chunk comes from L2: a block has one row (at most 128 KB of dy and x) in
// flight, so all blocks together hold a few tens of MB, which the 50-60 MB L2 keeps. DRAM sees
// dy and x once. The copies of pass 2 and of the next row's pass 1 are issued while the block
// computes, so the ring never drains between the passes or between rows.
//
// RMSNorm (norm.centered = 0; norm_weight.cuh): mean = 0, k0 = 0, the weight staged as
// offset + weight_i (the launcher passes rstd as mean: a valid address, multiplied by 0).
//
// Roles: 512 consumer threads (16 warps) compute; one more warp's lane 0 is the producer, which
// only issues copies. Each buffer has two mbarriers: "full" (the copy has landed; the producer's
// arrival announces the bytes, the cp.async unit's brings the row's mean and rstd) and "empty"
// (each of the 512 consumer threads arrives once it has read the chunk). The producer waits on
// "empty" before refilling a buffer, the consumers wait on "full" before reading it.
//
// Work split: consumer thread t owns the columns (j * 512 + t) * VEC for j < NV, so its sums
// stay in registers for the whole kernel; chunk c holds j in [c * NVC, (c + 1) * NVC). At the
// end each thread writes its columns of the block's partial slot; the slots are then added in
// slot order (launch_with_partials, backward/launch.cuh). Deterministic.
#include "backward/tma_ring/bulk_copy.cuh"
#include "backward/launch.cuh"
#include "backward/norm_weight.cuh"
#include "backward/tma_ring/kernel12.h"
#include "backward/partials_finalize.h"
#include "backward/tma_ring/row_math.cuh"
#include "common/row_reduce.cuh"

namespace lnbwd {
namespace {

constexpr int kConsumers = 512;
constexpr int kConsumerWarps = kConsumers / 32;
constexpr int kThreads = kConsumers + 32;   // plus the producer warp
constexpr int kNB = 4;                      // ring buffers (chunks in flight)

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

// NV vectors of VEC elements per consumer thread per row, NVC of them per chunk. O: the type of
// weight, dweight and dbias (T, or float beside 16-bit T); RESID: dresidual is added to dx.
template <typename T, typename O, bool RESID, int VEC, int NV, int NVC>
__global__ void __launch_bounds__(kThreads, 1)
kernel12_wide(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const O* __restrict__ weight, const T* dresidual,
              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment,
              int blocks_per_segment, int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  using A = acc_t<T>;
  using S = stat_t<T>;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  using Pair = Packed<A, 2>;
  constexpr int kChunk = kConsumers * NVC * VEC;   // elements per chunk
  constexpr int kMaxChunks = NV / NVC;
  const int chunks = ceil_div(C, kChunk);
  const A inv_c = A(1) / A(C);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Shared memory: [weight row as acc_t | NB x (dy chunk, x chunk) | full[NB] | empty[NB] |
  // (mean, rstd)[NB] | exchange[2][16] (s1, s2) pairs]. Each piece starts on a 16-byte boundary.
  extern __shared__ __align__(128) unsigned char smem[];
  A* w_sh = reinterpret_cast<A*>(smem);
  T* ring = reinterpret_cast<T*>(smem + round_up<size_t>(static_cast<size_t>(C) * sizeof(A), 16));
  auto buf_dy = [&](int b) { return ring + static_cast<size_t>(b) * 2 * kChunk; };
  auto buf_x = [&](int b) { return ring + (static_cast<size_t>(b) * 2 + 1) * kChunk; };
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + static_cast<size_t>(kNB) * 2 * kChunk);
  uint64_t* empty = full + kNB;
  S* stats = reinterpret_cast<S*>(empty + kNB);
  Pair* exchange = reinterpret_cast<Pair*>(stats + 2 * kNB);

  // Blocks [s * bps, (s + 1) * bps) work on segment s only.
  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int64_t rows = (segment + 1) * rows_per_segment;
  weight += segment * weight_stride;
  const int64_t first = segment * rows_per_segment + blockIdx.x % blocks_per_segment;
  const int64_t stride = blocks_per_segment;

  if (threadIdx.x == 0) {
    for (int b = 0; b < kNB; ++b) {
      mbar_init(&full[b], kRowCopyArrivals);
      mbar_init(&empty[b], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The weight row, converted to acc_t once (offset + weight for RMSNorm); the barrier also
  // publishes the mbarriers.
  for (int c = threadIdx.x * VEC; c < C; c += kThreads * VEC) {
    *reinterpret_cast<AV*>(w_sh + c) = weight_in_acc(load_vec<VEC>(weight + c), norm.offset);
  }
  __syncthreads();

  if (warp == kConsumerWarps) {
    // The producer walks the same sequence of chunks as the consumers: per row, pass 1's chunks
    // then pass 2's. The i-th copy goes to buffer i % NB once the consumers have released the
    // chunk that was there (the (i / NB - 1)-th phase of its "empty" barrier).
    if (lane == 0) {
      int64_t i = 0;
      for (int64_t row = first; row < rows; row += stride) {
        for (int pass = 0; pass < 2; ++pass) {
          for (int c = 0; c < chunks; ++c, ++i) {
            const int b = static_cast<int>(i % kNB);
            if (i >= kNB) mbar_wait(&empty[b], static_cast<uint32_t>((i / kNB - 1) & 1));
            const int64_t start = row * C + static_cast<int64_t>(c) * kChunk;
            const int n = min(kChunk, C - c * kChunk);
            issue_row(&full[b], buf_dy(b), buf_x(b), &stats[2 * b], dy + start, x + start, mean + row, rstd + row,
                      static_cast<uint32_t>(n * sizeof(T)));
          }
        }
      }
    }
    __syncwarp();
  } else {
    const int t = threadIdx.x;
    AV db[NV], dw[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
#pragma unroll
      for (int q = 0; q < VEC; ++q) { db[j][q] = A(0); dw[j][q] = A(0); }
    }
    int64_t i = 0;    // chunks consumed so far (the producer's i)
    int parity = 0;   // which exchange buffer this row uses
    // Wait for chunk i, and release it after `use`: every consumer thread arrives once it has
    // read what it needs. (One arrival per warp after __syncwarp would also be correct, but
    // compute-sanitizer's racecheck then reports the other lanes' reads as racing the refill.)
    auto consume = [&](auto&& use) {
      const int b = static_cast<int>(i % kNB);
      mbar_wait(&full[b], static_cast<uint32_t>((i / kNB) & 1));
      use(b);
      mbar_arrive(&empty[b]);
      ++i;
    };
    for (int64_t row = first; row < rows; row += stride) {
      A m = A(0), s = A(0), s1 = A(0), s2 = A(0);
      // The chunk loops are unrolled to kMaxChunks so that j, the index into the sums, is a
      // compile-time constant (registers cannot be indexed at run time).
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c < chunks) {
          consume([&](int b) {
            m = norm.centered * A(stats[2 * b]);   // RMSNorm: no mean
            s = A(stats[2 * b + 1]);
#pragma unroll
            for (int jj = 0; jj < NVC; ++jj) {
              const int within = (jj * kConsumers + t) * VEC;
              if (c * kChunk + within < C) {
                add_row_sums<T, VEC>(*reinterpret_cast<const V*>(buf_dy(b) + within),
                                     *reinterpret_cast<const V*>(buf_x(b) + within),
                                     *reinterpret_cast<const AV*>(w_sh + c * kChunk + within), m, s1, s2);
              }
            }
          });
        }
      }
      // The block's sums: warps post their pairs, every thread adds them in warp order
      // (row_reduce.cuh), on the consumers' barrier (the producer warp does not take part). Two
      // exchange buffers alternate between rows: one is overwritten only after the next row's
      // barrier, when every thread has read it.
      s1 = warp_sum(s1);
      s2 = warp_sum(s2);
      exchange_row_sums(exchange + parity * kConsumerWarps, kConsumerWarps, warp, lane, s1, s2,
                        [] { consumers_sync(); });
      parity ^= 1;
      const RowCoefficients<A> coef(norm.centered * s1, s2, s, inv_c);   // RMSNorm: k0 = 0

#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c < chunks) {
          // The chunk's residual gradient goes out before the wait for the chunk; each element is
          // read by the thread that then writes it as dx (dresidual may be dx's buffer, aliased).
          V rv[NVC];
          if constexpr (RESID) {
#pragma unroll
            for (int jj = 0; jj < NVC; ++jj) {
              const int col = c * kChunk + (jj * kConsumers + t) * VEC;
              if (col < C) rv[jj] = load_cs(reinterpret_cast<const V*>(dresidual + row * C + col));
            }
          }
          consume([&](int b) {
#pragma unroll
            for (int jj = 0; jj < NVC; ++jj) {
              const int j = c * NVC + jj;
              const int within = (jj * kConsumers + t) * VEC;
              const int col = c * kChunk + within;
              if (col < C) {
                const V dxv = dx_and_add_sums<T, VEC, RESID>(*reinterpret_cast<const V*>(buf_dy(b) + within),
                                                             *reinterpret_cast<const V*>(buf_x(b) + within),
                                                             *reinterpret_cast<const AV*>(w_sh + col), m, s, coef,
                                                             db[j], dw[j], &rv[jj]);
                store_cs(reinterpret_cast<V*>(dx + row * C + col), dxv);   // written once, not re-read here
              }
            }
          });
        }
      }
    }
    // Each column of the block's partial slot belongs to one thread: plain stores, no sums, in
    // 16-byte pieces.
    constexpr int kPiece = 16 / sizeof(A);
    using Piece = Packed<A, kPiece>;
    A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * kConsumers + t) * VEC;
      if (col < C) {
#pragma unroll
        for (int h = 0; h < VEC; h += kPiece) {
          Piece pb, pw;
#pragma unroll
          for (int q = 0; q < kPiece; ++q) { pb[q] = db[j][h + q]; pw[q] = dw[j][h + q]; }
          store_cg(reinterpret_cast<Piece*>(slot + col + h), pb);
          store_cg(reinterpret_cast<Piece*>(slot + C + col + h), pw);
        }
      }
    }
  }
  // Every copy that was issued has been waited for; retire the barriers (see mbar_inval).
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int b = 0; b < kNB; ++b) {
      mbar_inval(&full[b]);
      mbar_inval(&empty[b]);
    }
  }
  // The consumer warps add; the producer warp only passes the barriers. (As far as the hardware
  // goes it could add too: __syncthreads orders its writes before warp 0's reads. But with it
  // adding, racecheck reported those writes and reads as racing, 2 reports on the H200, none
  // without; the likely cause is that it passed none of the consumers' named barriers.)
  if (finish.dweight) {
    finish_partials_in_grid(finish, partials, blocks_per_segment, C, kConsumerWarps, reinterpret_cast<A*>(smem));
  }
#endif
}

template <typename T>
constexpr int kVec = 16 / sizeof(T);
// Vectors per consumer thread per row (the sums: 2 * NV * VEC fp32, 64 registers at most) and
// per chunk (16 KB of dy and 16 KB of x per chunk).
template <typename T>
constexpr int kNV = sizeof(T) == 4 ? 8 : 4;
constexpr int kNVC = 2;

size_t smem_bytes(int64_t C, size_t item, size_t acc, int chunk) {
  return round_up<size_t>(C * acc, 16) + kNB * 2 * chunk * item + 2 * kNB * 8 + 2 * kNB * acc +
         2 * kConsumerWarps * 2 * acc;
}

}  // namespace

bool kernel12_wide_fits(Dtype dtype, int64_t C, const DeviceLimits& lim) {
  if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16) return false;
  const size_t item = dtype == Dtype::kF32 ? 4 : 2;
  const int vec = static_cast<int>(16 / item);
  const int nv = item == 4 ? kNV<float> : kNV<__nv_bfloat16>;
  return C % vec == 0 && C <= static_cast<int64_t>(kConsumers) * nv * vec &&
         smem_bytes(C, item, 4, kConsumers * kNVC * vec) <= lim.smem_optin;
}

cudaError_t norm_bwd_kernel12_wide(const NormBwdParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(p.device, &lim));
  if (p.plan) {
    p.plan->kernel = 12;
    p.plan->path = "wide rows";
  }
  if (!kernel12_wide_fits(p.dtype, p.C, lim)) return cudaErrorInvalidConfiguration;
  return dispatch_types(p, [&](auto tag, auto o, auto resid) -> cudaError_t {
    using T = decltype(tag);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    if constexpr (sizeof(T) == 8) {
      return cudaErrorInvalidValue;
    } else {
      if (!can_vectorize<T>(p)) return cudaErrorInvalidValue;
      constexpr int vec = kVec<T>;
      // One block per SM (the shared memory allows no more), one row per step.
      return launch_with_partials<T, O>(p, kernel12_wide<T, O, R, vec, kNV<T>, kNVC>, kThreads,
                                     smem_bytes(p.C, sizeof(T), sizeof(acc_t<T>), kConsumers * kNVC * vec),
                                     BlocksPerSm::kOne, 1, 1, stream);
    }
  });
}

}  // namespace lnbwd
