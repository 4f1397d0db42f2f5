// Kernel 12's ring of row chunks: one block's walk over its share of a tensor of small rows, from
// the first chunk's bulk copy to the block's partial slot (the design: kernel12_row_chunks.cu),
// and kernel12_chunks, the kernel that runs it over a tensor's segments. Two launches use that
// kernel: a tensor's (kernel12_row_chunks.cu) and one a set of QK-norm's two (kernel12_chunk_sets.cu).
#pragma once

#include <type_traits>

#include "backward/launch.cuh"
#include "backward/norm_weight.cuh"
#include "backward/tma_ring/bulk_copy.cuh"
#include "backward/tma_ring/kernel12.h"

namespace lnbwd {

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

// One block's share of `rows` rows: the chunks first, first + bps, first + 2 bps, ... of
// THREADS / TPR * RPG rows each; its [dbias | dweight] sums go to `slot` (2 * C accumulators).
// Returns the shared memory that holds the warps' sums, free for the grid's finish.
// dresidual may be dx's own buffer (aliased): the ring reads a chunk of it before any thread
// writes that chunk's dx, and no other chunk shares its rows.
// TPR: threads per row group; RPG: rows each group takes per chunk (a chunk is RPG * groups
// rows, row r * groups + g of it for group g, so a warp's rows are adjacent in the buffer).
template <typename T, typename O, bool RESID, int VEC, bool RMS, int THREADS, int TPR, int RPG>
__device__ __forceinline__ acc_t<T>* kernel12_chunk_rows(T* dx, acc_t<T>* __restrict__ slot, const T* __restrict__ dy,
                                                         const T* __restrict__ x, const O* __restrict__ weight,
                                                         const T* dresidual, const stat_t<T>* __restrict__ mean,
                                                         const stat_t<T>* __restrict__ rstd, int64_t rows,
                                                         int64_t first, int bps, int C, NormArgs<acc_t<T>> norm,
                                                         int nb) {
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
  const int64_t chunks = ceil_div<int64_t>(rows, kChunkRows);

  // The weight first (its loads must not queue behind the ring's), widened to the accumulator
  // type with RMSNorm's offset added, into shared memory, where both passes of every row read
  // it ready to use (in registers it would cost the 64 a thread that two blocks an SM allow).
  for (int c = threadIdx.x; c < C; c += blockDim.x) wt[c] = to_acc(weight[c]) + norm.offset;

  // Thread 0 initializes the barriers; the fence makes that visible to the copy engine, the
  // block's barrier (which also publishes wt) to the block. Then it starts the first nb chunks.
  auto issue = [&](int b, int64_t c) {
    const int64_t r0 = c * kChunkRows;
    const int64_t n = rows - r0 < kChunkRows ? rows - r0 : kChunkRows;
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
      if (row < rows) {
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
      const bool mine = row < rows && has_col;
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
    A* own = warp_sums + static_cast<size_t>(threadIdx.x / 32) * 2 * C;
    *reinterpret_cast<AV*>(own + col) = db;   // zeros for RMS
    *reinterpret_cast<AV*>(own + C + col) = dw;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (int w = 0; w < kWarps; ++w) {
      sb += warp_sums[static_cast<size_t>(w) * 2 * C + c];
      sw += warp_sums[static_cast<size_t>(w) * 2 * C + C + c];
    }
    __stcg(slot + c, sb);       // .cg: kept in L2 for the finalize that reads it next
    __stcg(slot + C + c, sw);
  }
  return warp_sums;
}
#endif

namespace {

// (PartialsKernel, launch.cuh.) Segment s's blocks walk its rows as one tensor
// (kernel12_chunk_rows.cuh), each writing its own slot.
template <typename T, typename O, bool RESID, int VEC, bool RMS, int THREADS, int TPR, int RPG>
__global__ void __launch_bounds__(THREADS, kernel12_chunk_blocks_per_sm(THREADS))
kernel12_chunks(T* dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy, const T* __restrict__ x,
                const O* __restrict__ weight, const T* dresidual, const stat_t<T>* __restrict__ mean,
                const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment, int blocks_per_segment,
                int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish, int nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int64_t row0 = segment * rows_per_segment;   // the segment's first row
  if constexpr (RESID) dresidual += row0 * C;
  acc_t<T>* warp_sums = kernel12_chunk_rows<T, O, RESID, VEC, RMS, THREADS, TPR, RPG>(
      dx + row0 * C, partials + static_cast<size_t>(blockIdx.x) * 2 * C, dy + row0 * C, x + row0 * C,
      weight + segment * weight_stride, dresidual, mean + row0, rstd + row0, rows_per_segment,
      blockIdx.x % blocks_per_segment, blocks_per_segment, C, norm, nb);
  wait_for_earlier_grid();   // QK-norm's second set: its finalize reads the first set's slots too
  if (finish.dweight) finish_partials_in_grid(finish, partials, blocks_per_segment, C, THREADS / 32, warp_sums);
#endif
}

}  // namespace

}  // namespace lnbwd
