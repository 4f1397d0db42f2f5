// Kernel 12's small rows (Hopper, sm_90): rows of a few hundred bytes (at most a warp of 16-byte
// vectors: bf16/fp16 C <= 256, fp32 C <= 128), streamed into shared memory a chunk of many
// consecutive rows at a time.
//
// Why: a small row is held by a group of a few threads, so kernel 11's way of keeping rows in
// flight (each thread loads its next row into registers before reducing the current one) costs
// registers per byte in flight, and registers are what caps an SM's warps: its 16-bit small rows
// ran 16 warps an SM, half their stalls waiting on global loads. Here the bytes in flight cost
// shared memory instead. Rows are contiguous, so a chunk of consecutive rows of a tensor is one
// contiguous span, and one bulk copy (cp.async.bulk, "TMA") moves it, one instruction for 8 KB.
// A thread keeps one 16-byte vector of a row in registers, which leaves room for more warps.
//
// Work split. A block is THREADS threads (kernel12_chunk_threads: 512 for 16-bit rows, two blocks
// an SM; 256 for fp32, three) in kGroups row groups of TPR threads (the narrowest power of two
// from kMinRowThreads that holds a row in one vector a thread); thread t of a group owns the
// columns [t * VEC, (t + 1) * VEC) of every row, so its dbias/dweight sums stay in registers. A
// chunk is RPG * kGroups consecutive rows (RPG rows a group: the pick takes one), row
// r * kGroups + g of it for group g, so a warp's rows are adjacent in the buffer and its
// shared-memory loads contiguous. Block b of a segment's B blocks takes the segment's chunks b,
// b + B, b + 2B, ... (the last chunk of a segment may be short).
//
// The ring: nb buffers, each one chunk of dy and of x (and of dresidual, RESID), each with two
// mbarriers. `full` completes when thread 0 has announced the chunk's bytes and they have all
// landed; `empty` completes when every thread of the block is done with the chunk (one arrival a
// thread). Thread 0 refills a buffer once its `empty` phase has completed: at the start of the
// block's chunk k it waits for chunk k - 1 to be done with and copies chunk k - 1 + nb into its
// buffer, so nb - 1 chunks are on their way while the block computes on one, and the SM's other
// blocks have theirs in flight too. mean and rstd are too few bytes for a bulk copy (and a short
// chunk's need not be a multiple of 16): each group loads the pairs of its rows of the block's
// next chunk as it starts a chunk, a chunk's time ahead of their use.
//
// Per row (g_i = (offset + weight_i) dy_i, xhat_i = (x_i - mean) rstd, centered), as kernel 11's
// small rows (kernel11_body.cuh):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean): the thread's vector, then xor-shuffles
//           within the group;
//   pass 2: dx_i = g_i rstd - (xhat_i b' + a') with a' = s1/C rstd and b' = s2 rstd/C rstd,
//           straight to global memory; dbias_i += dy_i, dweight_i += dy_i xhat_i in registers.
// The weight row is widened once per block, with RMSNorm's offset added, into shared memory.
// RMS (RMSNorm, fixed when compiled): no mean, no s1 term, no dbias sums (the slot's dbias half
// is written as zeros). At the end the warp's groups, which own the same columns, add their sums
// by xor-shuffles across groups (a fixed order), the block adds its warps' sums in warp order
// into its partial slot, and the slots are added in slot order (launch_with_partials,
// backward/launch.cuh). Deterministic.
#include "backward/launch.cuh"
#include "backward/norm_weight.cuh"
#include "backward/partials_finalize.h"
#include "backward/tma_ring/bulk_copy.cuh"
#include "backward/tma_ring/kernel12.h"

#include <type_traits>

namespace lnbwd {

namespace {

// One 16-byte vector of a ring buffer, as one 16-byte load. (A plain load of the packed type
// that is widened right away reaches the PTX as one load per element: nvcc splits the vector
// into its fields first.) volatile keeps it after the wait on the buffer's barrier.
template <typename V, typename T>
__device__ __forceinline__ V shared_vec(const T* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return same_bytes<V>(v);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Thread 0 starts the copies of a chunk (`bytes` of each tensor from `first_element` on) into the
// buffers dst, whose barrier is `full`. The fence orders the block's reads of the buffers' last
// chunk, which their `empty` barrier made visible to this thread, before the copy engine's writes.
template <typename T, bool RESID>
__device__ __forceinline__ void issue_chunk(uint64_t* full, T* const (&dst)[3], const T* dy, const T* x,
                                            const T* dresidual, int64_t first_element, uint32_t bytes) {
  fence_before_bulk_copy();
  mbar_arrive_expect_bytes(full, (RESID ? 3 : 2) * bytes);
  bulk_copy_to_shared(dst[0], dy + first_element, bytes, full);
  bulk_copy_to_shared(dst[1], x + first_element, bytes, full);
  if constexpr (RESID) bulk_copy_to_shared(dst[2], dresidual + first_element, bytes, full);
}
#endif

// (PartialsKernel, launch.cuh.) dresidual may be dx's own buffer (aliased): the ring reads a
// chunk of it before any thread writes that chunk's dx, and no other chunk shares its rows.
// TPR: threads per row group; RPG: rows each group takes per chunk (a chunk is RPG * groups
// rows, row r * groups + g of it for group g, so a warp's rows are adjacent in the buffer).
template <typename T, typename O, bool RESID, int VEC, bool RMS, int THREADS, int TPR, int RPG>
__global__ void __launch_bounds__(THREADS, kernel12_chunk_blocks_per_sm(THREADS))
kernel12_chunks(T* dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy, const T* __restrict__ x,
                const O* __restrict__ weight, const T* dresidual, const stat_t<T>* __restrict__ mean,
                const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment, int blocks_per_segment,
                int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish, int nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  constexpr int kTensors = RESID ? 3 : 2;
  constexpr int kGroups = THREADS / TPR;
  constexpr int kChunkRows = kGroups * RPG;
  constexpr int kWarps = THREADS / 32;
  const int g = threadIdx.x / TPR;
  const int lane = threadIdx.x % 32;
  const int col = (threadIdx.x % TPR) * VEC;   // this thread's columns of every row
  const bool has_col = col < C;                // a row narrower than its group leaves lanes idle

  // Shared memory (kernel12.h, kernel12_chunk_ring_bytes): [the weight row wt | nb buffers x
  // kTensors chunks of kChunkRows * C elements (at the end, the warps' sums) | full[nb] | empty[nb]].
  extern __shared__ __align__(128) unsigned char smem[];
  A* wt = reinterpret_cast<A*>(smem);
  unsigned char* ring = smem + kernel12_chunk_weight_bytes(C, sizeof(A));
  const size_t chunk_elems = static_cast<size_t>(kChunkRows) * C;
  const size_t ring_bytes = kernel12_chunk_ring_bytes(chunk_elems * sizeof(T), nb, kTensors, kWarps, C, sizeof(A));
  auto buffer = [&](int b, int tensor) {
    return reinterpret_cast<T*>(ring) + (static_cast<size_t>(b) * kTensors + tensor) * chunk_elems;
  };
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + ring_bytes);
  uint64_t* empty = full + nb;

  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int bps = blocks_per_segment;
  const int64_t chunks = ceil_div<int64_t>(rows_per_segment, kChunkRows);
  const int64_t first = blockIdx.x % bps;   // this block's first chunk; then every bps-th
  weight += segment * weight_stride;
  // From here on, rows count from the segment's first row.
  dy += segment * rows_per_segment * C;
  x += segment * rows_per_segment * C;
  dx += segment * rows_per_segment * C;
  if constexpr (RESID) dresidual += segment * rows_per_segment * C;
  mean += segment * rows_per_segment;
  rstd += segment * rows_per_segment;

  // The weight first (its loads must not queue behind the ring's), widened to the accumulator
  // type with RMSNorm's offset added, into shared memory, where both passes of every row read
  // it ready to use (in registers it would cost the 64 a thread that two blocks an SM allow).
  for (int c = threadIdx.x; c < C; c += blockDim.x) wt[c] = to_acc(weight[c]) + norm.offset;

  // Thread 0 initializes the barriers; the fence makes that visible to the copy engine, the
  // block's barrier (which also publishes wt) to the block. Then it starts the first nb chunks.
  auto issue = [&](int b, int64_t c) {
    const int64_t r0 = c * kChunkRows;
    const int64_t n = rows_per_segment - r0 < kChunkRows ? rows_per_segment - r0 : kChunkRows;
    T* const dst[3] = {buffer(b, 0), buffer(b, 1), buffer(b, kTensors - 1)};
    issue_chunk<T, RESID>(&full[b], dst, dy, x, dresidual, r0 * C, static_cast<uint32_t>(n * C * sizeof(T)));
  };
  if (threadIdx.x == 0) {
    for (int b = 0; b < nb; ++b) {
      mbar_init(&full[b], 1);
      mbar_init(&empty[b], THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int b = 0; b < nb && first + b * static_cast<int64_t>(bps) < chunks; ++b) issue(b, first + b * bps);
  }

  AV db, dw;   // this thread's columns' sums (RMS: no dbias)
#pragma unroll
  for (int k = 0; k < VEC; ++k) { db[k] = A(0); dw[k] = A(0); }
  const A inv_c = A(1) / A(C);

  // The (mean, rstd) of this group's rows of a chunk, loaded a chunk ahead of their use. row0:
  // the group's first row of the current chunk (its others follow every kGroups rows); step:
  // from one of the block's chunks to its next.
  const int64_t step = static_cast<int64_t>(bps) * kChunkRows;
  int64_t row0 = first * kChunkRows + g;
  A m[RPG], s[RPG];
  auto load_stats = [&](int64_t base, A (&mm)[RPG], A (&ss)[RPG]) {
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      const int64_t row = base + r * kGroups;
      mm[r] = A(0);
      ss[r] = A(0);
      if (row < rows_per_segment) {
        if constexpr (!RMS) mm[r] = A(mean[row]);
        ss[r] = A(rstd[row]);
      }
    }
  };
  load_stats(row0, m, s);
  // The k-th chunk this block takes is in buffer b = k % nb, that buffer's use k / nb, whose
  // barriers' phases have the parity (k / nb) & 1; prev_b and prev_phase are the previous chunk's.
  int b = 0, prev_b = -1;
  uint32_t phase = 0, prev_phase = 0;
  for (int64_t c = first; c < chunks; c += bps, row0 += step) {
    // Refill the previous chunk's buffer with the chunk nb on from it, once every warp is done
    // with it (its `empty` phase completes).
    if (threadIdx.x == 0 && prev_b >= 0) {
      const int64_t next = c + static_cast<int64_t>(nb - 1) * bps;
      if (next < chunks) {
        mbar_wait(&empty[prev_b], prev_phase);
        issue(prev_b, next);
      }
    }
    A next_m[RPG], next_s[RPG];
    load_stats(row0 + step, next_m, next_s);
    mbar_wait(&full[b], phase);

#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      const int64_t row = row0 + r * kGroups;
      // A short last chunk has no row for some groups; they still take part in the shuffles
      // (all of the warp's lanes do, so no lane waits on another that skipped them), with zeros.
      const bool mine = row < rows_per_segment && has_col;
      const size_t at = static_cast<size_t>(r * kGroups + g) * C + col;   // the row's place in the buffer
      // Pass 1, then the group's sums by shuffles among its own lanes.
      A s1 = A(0), s2 = A(0);
      AV dv, xa;
      if (mine) {
        dv = to_acc(shared_vec<V>(buffer(b, 0) + at));
        xa = to_acc(shared_vec<V>(buffer(b, 1) + at));
        const AV wv = *reinterpret_cast<const AV*>(wt + col);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const A gi = mul_rn(wv[q], dv[q]);
          s1 += gi;
          s2 += gi * (RMS ? xa[q] : xa[q] - m[r]);
        }
      }
#pragma unroll
      for (int offset = TPR / 2; offset > 0; offset /= 2) {
        if constexpr (!RMS) s1 += __shfl_xor_sync(0xffffffffu, s1, offset);   // RMS: s1 feeds only the mean's term
        s2 += __shfl_xor_sync(0xffffffffu, s2, offset);
      }
      const A a_s = RMS ? A(0) : s1 * inv_c * s[r];
      const A b_s = s2 * s[r] * inv_c * s[r];
      // Pass 2: dx (g_i rstd rounded on its own, as kernel 11 does) and the column sums.
      if (mine) {
        const AV wv = *reinterpret_cast<const AV*>(wt + col);
        V rv;
        if constexpr (RESID) rv = shared_vec<V>(buffer(b, 2) + at);
        V dxv;
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const A d = dv[q];
          const A xhat = (RMS ? xa[q] : xa[q] - m[r]) * s[r];
          A v = mul_rn(mul_rn(wv[q], d), s[r]);
          if constexpr (RMS) v -= xhat * b_s;
          else v -= xhat * b_s + a_s;
          if constexpr (RESID) v += to_acc(rv[q]);
          dxv[q] = from_acc<T>(v);
          if constexpr (!RMS) db[q] += d;
          dw[q] += d * xhat;
        }
        store_cs(reinterpret_cast<V*>(dx + row * C + col), dxv);   // written once
      }
    }
    // This thread is done with the buffer: its reads happen before the refill (release). Every
    // thread arrives (the barrier counts THREADS): racecheck credits an arrival with the arriving
    // thread's own reads only, so one arrival a warp after __syncwarp would leave the other lanes'
    // reads racing, as it sees them, with the refill's bulk copy.
    mbar_arrive(&empty[b]);
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      m[r] = next_m[r];
      s[r] = next_s[r];
    }
    prev_b = b;
    prev_phase = phase;
    if (++b == nb) {
      b = 0;
      phase ^= 1u;
    }
  }

  // Every chunk this block copied has been waited for, so no copy is in flight: past the
  // barrier, thread 0 retires the mbarriers and the ring's memory takes the warps' sums.
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int q = 0; q < nb; ++q) {
      mbar_inval(&full[q]);
      mbar_inval(&empty[q]);
    }
  }
  // The warp's groups own the same columns: xor-shuffles across groups (offsets TPR .. 16),
  // every lane taking part, then the first group posts the warp's [dbias | dweight] row.
#pragma unroll
  for (int offset = TPR; offset < 32; offset *= 2) {
#pragma unroll
    for (int q = 0; q < VEC; ++q) {
      if constexpr (!RMS) db[q] += __shfl_xor_sync(0xffffffffu, db[q], offset);
      dw[q] += __shfl_xor_sync(0xffffffffu, dw[q], offset);
    }
  }
  A* warp_sums = reinterpret_cast<A*>(ring);
  if (lane < TPR && has_col) {
    A* mine = warp_sums + static_cast<size_t>(threadIdx.x / 32) * 2 * C;
    *reinterpret_cast<AV*>(mine + col) = db;   // zeros for RMS
    *reinterpret_cast<AV*>(mine + C + col) = dw;
  }
  __syncthreads();
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (int w = 0; w < kWarps; ++w) {
      sb += warp_sums[static_cast<size_t>(w) * 2 * C + c];
      sw += warp_sums[static_cast<size_t>(w) * 2 * C + C + c];
    }
    __stcg(slot + c, sb);       // .cg: kept in L2 for the finalize that reads it next
    __stcg(slot + C + c, sw);
  }
  if (finish.dweight) finish_partials_in_grid(finish, partials, blocks_per_segment, C, kWarps, warp_sums);
#endif
}

template <typename T, typename O, bool RESID, int VEC, bool RMS, int TPR, int RPG>
cudaError_t launch(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kThreads = kernel12_chunk_threads(sizeof(T));
  if (cfg.tpr * cfg.groups != kThreads) return cudaErrorInvalidValue;
  if (p.plan) {
    p.plan->kernel = 12;
    p.plan->path = "ring of row chunks (small rows)";
  }
  return launch_with_partials<T, O>(p, kernel12_chunks<T, O, RESID, VEC, RMS, kThreads, TPR, RPG>, kThreads,
                                    kernel12_chunk_smem_bytes(cfg, p.C, sizeof(T), sizeof(acc_t<T>), RESID),
                                    BlocksPerSm::kOccupancy, cfg.groups * cfg.nv, 1, stream, cfg.nb);
}

template <typename T, typename O, bool RESID, int VEC, bool RMS>
cudaError_t launch_tpr(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  auto rows = [&](auto tpr) -> cudaError_t {
    constexpr int kTpr = decltype(tpr)::value;
    if (cfg.nv == 1) return launch<T, O, RESID, VEC, RMS, kTpr, 1>(p, cfg, stream);
    if (cfg.nv == 2) return launch<T, O, RESID, VEC, RMS, kTpr, 2>(p, cfg, stream);
    return cudaErrorInvalidValue;
  };
  switch (cfg.tpr) {
    case 4: return rows(std::integral_constant<int, 4>{});
    case 8: return rows(std::integral_constant<int, 8>{});
    case 16: return rows(std::integral_constant<int, 16>{});
    case 32: return rows(std::integral_constant<int, 32>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t norm_bwd_kernel12_chunks(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  if (!cfg.chunks) return cudaErrorInvalidValue;
  return dispatch_types(p, [&](auto t, auto o, auto resid) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    constexpr int vec = 16 / sizeof(T);
    if constexpr (sizeof(T) == 8) {
      return cudaErrorInvalidValue;
    } else {
      if (!can_vectorize<T>(p) || cfg.tpr * vec < p.C) return cudaErrorInvalidValue;   // launch_tpr: tpr <= 32
      if (p.norm == NormKind::kRmsNorm) return launch_tpr<T, O, R, vec, true>(p, cfg, stream);
      return launch_tpr<T, O, R, vec, false>(p, cfg, stream);
    }
  });
}

}  // namespace lnbwd
