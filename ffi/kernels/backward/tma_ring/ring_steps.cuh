// The steps of kernel 12's row ring (kernel12_bulk_copy_ring.cu): its setup and what it does
// per row, in the order the kernel takes them. Thread t of a row group of tpr threads owns the
// columns
//   col(j) = (j * tpr + t) * VEC,  j < NV,  col < Cb
// of every row its group works on (Cb: the block's share of a row). Per row, with
// g_i = weight_i * dy_i and xhat_i = (x_i - mean) * rstd (centered; row_math.cuh):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean): the thread's columns, shuffles within the
//           warp, then across the group's warps (and, split rows, the other block's half);
//   pass 2: dx_i = (g_i - s1/C - xhat_i s2 rstd/C) rstd, straight to global memory;
//           dbias_i += dy_i, dweight_i += dy_i xhat_i in registers.
// The passes read a row through the kernel's accessors dy_at(j, col), x_at(j, col) and
// w_at(j, col): registers in register mode (REGS, the row copied out of its ring buffer once),
// else the ring buffer and the staged weight row (fewer registers, more shared-memory loads).
//
// The steps take plain values, pointers, arrays and the kernel's own lambdas, and keep the
// kernel's expressions. nvcc 13 compiles this kernel differently (other registers, spills and
// instruction counts) when the shared-memory layout is gathered into a struct, when the
// accessor lambdas are replaced by functions, or when the loop over the warps' sums or pass 2
// moves into a function, so those stay in the kernel. Check a change here against the PTX or
// the -Xptxas -v figures of every variant.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backward/norm_weight.cuh"
#include "backward/tma_ring/row_math.cuh"
#include "common/vec.cuh"
#include "backward/tma_ring/bulk_copy.cuh"
#include "backward/tma_ring/cluster_exchange.cuh"

namespace lnbwd {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The weight loads go out first, before the ring's first copies: issued after them, they would
// queue behind every SM's first rows (tens of MB) and hold the whole block at the barrier that
// publishes the weight for microseconds. Register mode loads the thread's own columns;
// shared-memory mode stages the row with the whole block (at most NV loads a thread, since
// tpr * NV * VEC >= Cb).
template <int VEC, int NV, bool REGS, typename O>
__device__ __forceinline__ void load_weight(Packed<O, VEC> (&w_raw)[NV], const O* weight, int tpr, int t, int Cb) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (REGS ? j * tpr + t : j * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * VEC;
    if (col < Cb) w_raw[j] = load_vec<VEC>(weight + col);
  }
}

// The leader's setup of its group's barriers: a ring buffer's phase completes after the
// leader's arrival and the copy engine's (kRowCopyArrivals) once the announced bytes have landed;
// a peer barrier's (split rows) after the leader's announcement of the 8 bytes that the other
// block sends (mbar_expect_pair). The fence makes the initialization visible to the copy engine
// and the cluster; the caller's barrier then publishes it to the block.
template <int NB, int SPLIT>
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, int g, uint64_t* peer_bar) {
  for (int b = 0; b < NB; ++b) mbar_init(&full[g * NB + b], kRowCopyArrivals);
  if (SPLIT > 1) {
    mbar_init(&peer_bar[0], 1);
    mbar_init(&peer_bar[1], 1);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The leader's teardown once nobody waits on the barriers any more: PTX wants an mbarrier
// invalidated before its memory serves another purpose (the next block on this SM).
template <int NB, int SPLIT>
__device__ __forceinline__ void retire_ring_barriers(uint64_t* full, int g, uint64_t* peer_bar) {
  for (int b = 0; b < NB; ++b) mbar_inval(&full[g * NB + b]);
  if (SPLIT > 1) {
    mbar_inval(&peer_bar[0]);
    mbar_inval(&peer_bar[1]);
  }
}

// While the first rows are in flight: the weight, converted to acc_t once here rather than in
// every pass of every row (with RMSNorm's offset added: weight_in_acc), goes to registers
// (register mode) or to shared memory w_sh, which the caller's barrier publishes; W = T stages a
// 16-bit weight unconverted, half the bytes (the passes add the offset as they convert it). The
// thread's dbias/dweight sums start at 0. (These stores come a barrier after the mbarriers'
// initialization: staged before it, they drew racecheck warnings against mbarrier.init.)
template <typename T, int VEC, int NV, bool REGS, typename O, typename W>
__device__ __forceinline__ void stage_weight_and_clear_sums(const Packed<O, VEC> (&w_raw)[NV],
                                                            Packed<acc_t<T>, VEC> (&wv)[NV], W* w_sh,
                                                            Packed<acc_t<T>, VEC> (&db)[NV],
                                                            Packed<acc_t<T>, VEC> (&dw)[NV], int tpr, int t, int Cb,
                                                            acc_t<T> offset) {
  using A = acc_t<T>;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (REGS ? j * tpr + t : j * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * VEC;
    if (col < Cb) {
      if (REGS) {
        wv[j] = weight_in_acc(w_raw[j], offset);
      } else if constexpr (std::is_same_v<W, A>) {
        *reinterpret_cast<Packed<A, VEC>*>(w_sh + col) = weight_in_acc(w_raw[j], offset);
      } else if constexpr (std::is_same_v<O, T>) {
        *reinterpret_cast<Packed<T, VEC>*>(w_sh + col) = w_raw[j];
      }
    }
#pragma unroll
    for (int q = 0; q < VEC; ++q) { db[j][q] = A(0); dw[j][q] = A(0); }
  }
}

// The residual gradient of the thread's columns of a row (RESID), loaded before the row's wait
// so that its DRAM round trip overlaps the wait and pass 1. Each element is read by the thread
// that then writes it as dx (dresidual may be dx's own buffer, aliased).
template <int VEC, int NV, typename T>
__device__ __forceinline__ void load_residual(Packed<T, VEC> (&rv)[NV], const T* dresidual_row, int tpr, int t,
                                              int Cb) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < Cb) rv[j] = load_cs(reinterpret_cast<const Packed<T, VEC>*>(dresidual_row + col));
  }
}

// Register mode: the thread's columns of the row, out of its ring buffer into registers.
template <int VEC, int NV, typename T, typename BufDy, typename BufX>
__device__ __forceinline__ void copy_row_to_registers(Packed<T, VEC> (&dyv)[NV], Packed<T, VEC> (&xv)[NV],
                                                      const BufDy& buf_dy, const BufX& buf_x, int g, int b, int tpr,
                                                      int t, int Cb) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < Cb) {
      dyv[j] = *reinterpret_cast<const Packed<T, VEC>*>(buf_dy(g, b) + col);
      xv[j] = *reinterpret_cast<const Packed<T, VEC>*>(buf_x(g, b) + col);
    }
  }
}

// Pass 1 over the thread's columns: adds its g_i to s1 and g_i (x_i - mean) to s2.
template <typename T, int VEC, int NV, typename DyAt, typename XAt, typename WAt>
__device__ __forceinline__ void add_thread_row_sums(const DyAt& dy_at, const XAt& x_at, const WAt& w_at,
                                                    acc_t<T> mean, int tpr, int t, int Cb, acc_t<T>& s1,
                                                    acc_t<T>& s2) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < Cb) {
      add_row_sums<T, VEC>(dy_at(j, col), x_at(j, col), w_at(j, col), mean, s1, s2);
    }
  }
}

// Split rows, after the group's reduction: the row's sums are this block's half plus the other
// block's. The leader sends ours (send_half_sums) and announces theirs; everyone waits for theirs
// and adds them (add_other_half_sums). a + b == b + a in floating point, so both blocks get the
// same bits. The caller alternates two slots between rows (`peer`, with `peer_phase` its
// barrier's phase): a slot is reused two rows later, when the other block has this block's sums
// of the row in between, so it is past reading the slot's last pair.
template <typename A>
__device__ __forceinline__ void send_half_sums(Packed<A, 2>* peer_sum, uint64_t* peer_bar, int peer, int rank, A s1,
                                               A s2) {
  send_pair(reinterpret_cast<float*>(&peer_sum[peer]), &peer_bar[peer], rank ^ 1, s1, s2);
  mbar_expect_pair(&peer_bar[peer]);
}

template <typename A>
__device__ __forceinline__ void add_other_half_sums(const Packed<A, 2>* peer_sum, uint64_t* peer_bar, int peer,
                                                    uint32_t peer_phase, A& s1, A& s2) {
  mbar_wait(&peer_bar[peer], peer_phase);
  const Packed<A, 2> other = peer_sum[peer];
  s1 += other[0];
  s2 += other[1];
}

#endif

}  // namespace lnbwd
