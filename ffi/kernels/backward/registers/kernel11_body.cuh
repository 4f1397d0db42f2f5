// Kernel 11's row loop (kernel11_body), shared by its two kernels: kernel11_rows
// (kernel11_rows_in_registers.cu, our default backward) and kernel11_sets (kernel11_sets.cu,
// QK-norm's two sets of head rows in one launch).
//
// Kernel 11, our default: each row is read from DRAM exactly once and kept in registers between
// the two passes; dx is written once; dweight/dbias go through per-block fp32 partial sums and
// a finalize pass. Deterministic: no float atomics anywhere.
//
// Work split. A block holds `groups` row groups of `tpr` threads (tpr a multiple of 32, or for
// SMALL rows a power of two from kMinRowThreads to 16: several groups to a warp). A group
// owns one row at a time; thread t of a group owns NV vectors of VEC elements, at columns
//   col(j) = (j * tpr + t) * VEC,  j = 0..NV-1,
// so for every j the group's loads cover one contiguous, fully coalesced span of the row.
// Block b of a segment's B blocks (a persistent grid sized from the SM count) owns rows b, b + B,
// b + 2B, ..., dealt to its groups in turn: group g walks rows b + g*B, then + groups*B, ...
// Blocks' row counts then differ by at most one, and each thread keeps owning the same columns
// for every row.
//
// Per row, with g_i = weight_i * dy_i and xhat_i = (x_i - mean) * rstd (centered):
//   pass 1 (registers only): s1 = sum g_i, s2 = sum g_i * (x_i - mean), reduced over the group:
//          warp shuffles, then across the group's warps through shared memory;
//   pass 2 (same registers):  dx_i = (g_i - s1/C - xhat_i * s2*rstd/C) * rstd,
//          dbias_i += dy_i and dweight_i += dy_i * xhat_i in the group's shared-memory sums.
// RMSNorm (norm.centered = 0; norm_weight.cuh): mean = 0 and a = 0 (no mean was subtracted, so
// its gradient term is gone), and g_i = (offset + weight_i) * dy_i; the same code, told per launch.
// Because a thread owns its columns, its shared-memory sums need no atomics and no barriers.
// At the end the block adds its groups' sums (in group order) and writes them to its partial
// slot; the slots are then added in slot order (launch_with_partials, backward/launch.cuh: by
// finalize_partials, or, opted in, by the grid itself after a grid-wide barrier).
//
// Small rows (SMALL: a row of a few hundred bytes, held by part of a warp). A group's row sums
// are shuffles among its own lanes (lanes_sum), with no barrier. Its dbias/dweight sums are in
// one of two places (Rows):
//   kSmallShared: in shared memory per group, as above; every row reads and writes them, which
//                 costs shared-memory bandwidth (a few times the row's own bytes) but no registers;
//   kSmallRegs:   in registers, 2 * NV * VEC of them a thread; the warp's groups own the same
//                 columns, so at the end their sums meet by xor-shuffles across groups (a fixed
//                 order), and the block adds its warps' sums in warp order;
//   kSmallRegsRms: the same for RMSNorm only: no dbias sums (RMSNorm has no bias; the slots'
//                 dbias halves are written as zeros) and no mean to subtract, known when the
//                 kernel is compiled rather than told per launch (norm.centered), which leaves
//                 NV * VEC registers and two adds per element free.
// The block is kSmallThreads threads, so that several blocks share an SM.
//
// A small row is only a few instructions' worth of bytes per thread, so what bounds it is
// instruction issue as much as DRAM. Its per-element work is therefore kept to the minimum:
//   - the weight row, widened to the accumulator type with the offset added, is put once per
//     block in shared memory (wt), where both passes read it ready to use;
//   - dy and x are widened a whole 16-byte vector at a time (vec.cuh's to_acc of a Packed: one
//     integer instruction per bf16 element);
//   - 1/C is taken once (a multiply per row, not a division), and pass 2 is
//     dx_i = g_i * rstd - (xhat_i * b' + a') with the row's a' = a * rstd and b' = b * rstd
//     (RMSNorm: no a'). g_i * rstd is rounded on its own (mul_rn), as a' is, so that C = 1
//     still gives dx = 0.
//
// Bytes in flight. Memory-bound code is fast only if enough loads are outstanding: each thread
// issues all 2*NV of its 16-byte loads for a row before using any. With PREFETCH, the loads of
// the group's next row are issued before the current row is reduced, so DRAM stays busy across
// the reduction's barrier; that doubles the data registers, so it is used for small NV only.
#pragma once

#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/norm_weight.cuh"
#include "common/head_rows.h"
#include "common/row_reduce.cuh"

namespace lnbwd {
namespace {

// Where a block's row groups live and keep their sums (see the top of this file).
enum class Rows { kWarps, kSmallShared, kSmallRegs, kSmallRegsRms };
template <Rows R, int NV>
constexpr int block_threads() { return R != Rows::kWarps ? kSmallThreads : max_threads(NV); }
// The (NV, PREFETCH) variants compiled: for rows of whole warps, (1, 2 prefetching; 3, 4); for
// small rows with their sums in shared memory (2 prefetching; 2, 4), in registers (2
// prefetching; 2; layernorm's and RMSNorm's alike).
constexpr bool variant(Rows r, int nv, bool prefetch) {
  switch (r) {
    case Rows::kWarps: return prefetch ? nv <= 2 : nv == 3 || nv == 4;
    case Rows::kSmallShared: return nv == 2 || (nv == 4 && !prefetch);
    case Rows::kSmallRegs:
    case Rows::kSmallRegsRms: return nv == 2;
  }
  return false;
}
// Blocks per SM the registers must allow: small rows' blocks four (64 registers a thread: 32
// warps an SM) with 16 registers of row data, else three (80: 24 warps), and two (128) with
// their sums in registers beside a prefetched row; the others one.
template <Rows R, int NV, bool PREFETCH>
constexpr int min_blocks() {
  if (R == Rows::kWarps) return 1;
  const int data = (PREFETCH ? 2 : 1) * NV;   // 16-byte vectors of each of dy and x
  if (R == Rows::kSmallRegs || R == Rows::kSmallRegsRms) return PREFETCH ? 2 : 3;
  return data <= 2 ? 4 : 3;
}

// The row whose first element is at offset `at` (row * C, or a head row's, common/head_rows.h).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_row(Packed<T, VEC> (&dyv)[NV], Packed<T, VEC> (&xv)[NV], const T* dy,
                                         const T* x, int64_t at, int C, int tpr, int t) {
  using V = Packed<T, VEC>;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < C) {
      // Streaming loads: each element is used by this thread only, for this row only.
      dyv[j] = load_cs(reinterpret_cast<const V*>(dy + at + col));
      xv[j] = load_cs(reinterpret_cast<const V*>(x + at + col));
    }
  }
}

// Which rows a block walks and where it writes its sums, as a kernel's `Where` tells the body:
//   where.rows()  {row0, end, bps, weight_offset}: its groups walk rows row0 + g * bps, then on
//                 by bps * groups, below `end` (bps: the blocks that share these rows), with the
//                 weight row at weight + weight_offset;
//   where.slot()  the partial slot it writes (asked after the row loop, where it is used);
//   where.heads   the head-row layout (common/head_rows.h), read for HEADS only.
struct BlockRows {
  int64_t row0;
  int64_t end;
  int bps;
  int64_t weight_offset;
};

// A block's work (see Where above). O: the type of weight, dweight and dbias (T, or float
// beside 16-bit T); RESID: dresidual is added to dx (dispatch_types, launch.cuh); HEADS: the rows
// are head rows laid out by where.heads, else row r is at r * C. The pointers are __restrict__
// as kernel11_rows's parameters were; kernel11_sets, which may be given dx == dy (the fused
// projection's cotangent, in place), relies on each thread reading its row's dy before it
// writes that row's dx, and on no other thread touching the row.
template <typename T, typename O, bool RESID, int VEC, int NV, bool PREFETCH, Rows R, bool HEADS, typename Where>
__device__ __forceinline__ void kernel11_body(T* __restrict__ dx, acc_t<T>* __restrict__ partials,
                                              const T* __restrict__ dy, const T* __restrict__ x,
                                              const O* __restrict__ weight, const T* dresidual,
                                              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd,
                                              const Where& where, int C, NormArgs<acc_t<T>> norm, int tpr,
                                              int groups) {
  using A = acc_t<T>;
  constexpr bool SMALL = R != Rows::kWarps;
  constexpr bool REG_SUMS = R == Rows::kSmallRegs || R == Rows::kSmallRegsRms;
  constexpr bool RMS = R == Rows::kSmallRegsRms;   // no dbias and no mean (norm.centered is 0)
  constexpr bool BIAS = !RMS;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int lane = threadIdx.x % 32;
  const int warps_per_row = SMALL ? 1 : tpr / 32;
  const int warp_in_row = t / 32;
  const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;

  // Shared memory (kernel11_smem_bytes): SMALL: the weight row wt (C accumulators) first. Then
  // per group [dbias sums | dweight sums] (C each), then the row-reduction exchange: per group
  // two buffers (alternating rows) of warps_per_row (s1, s2) pairs (none for SMALL). REG_SUMS:
  // per warp [dbias sums | dweight sums], written once at the end.
  extern __shared__ __align__(32) unsigned char smem[];
  A* wt = reinterpret_cast<A*>(smem);
  A* sums_smem = wt + (SMALL ? C : 0);
  A* db_sum = sums_smem + (REG_SUMS ? size_t{0} : static_cast<size_t>(g) * 2 * C);
  A* dw_sum = db_sum + C;
  A* exchange = sums_smem + static_cast<size_t>(groups) * 2 * C + g * 2 * warps_per_row * 2;
  AV db_reg[REG_SUMS ? NV : 1], dw_reg[REG_SUMS ? NV : 1];   // REG_SUMS: this thread's columns' sums

#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    AV zero;
#pragma unroll
    for (int k = 0; k < VEC; ++k) zero[k] = A(0);
    if constexpr (REG_SUMS) {
      db_reg[j] = zero;
      dw_reg[j] = zero;
    } else if (col < C) {
      *reinterpret_cast<AV*>(db_sum + col) = zero;
      *reinterpret_cast<AV*>(dw_sum + col) = zero;
    }
  }

  const BlockRows mine = where.rows();
  const int bps = mine.bps;
  const int64_t rows = mine.end;
  weight += mine.weight_offset;
  if constexpr (SMALL) {
    // The block's weight row, as both passes use it (g_i = (offset + weight_i) * dy_i); the
    // barrier makes it visible to every group before their first row.
    for (int c = threadIdx.x; c < C; c += blockDim.x) wt[c] = to_acc(weight[c]) + norm.offset;
    __syncthreads();
  }
  // This thread's vector j of the weight row, in the accumulator type with the offset added.
  auto weight_vec = [&](int col) -> AV {
    if constexpr (SMALL) return *reinterpret_cast<const AV*>(wt + col);
    else return weight_in_acc(load_vec<VEC>(weight + col), norm.offset);
  };
  const A inv_c = A(1) / A(C);
  const int64_t stride = static_cast<int64_t>(bps) * groups;
  int64_t row = mine.row0 + static_cast<int64_t>(g) * bps;
  const HeadRows& heads = where.heads;
  // The element offset of `row` and of the row `stride` on (head rows: by the cursor, advanced
  // at the end of each row).
  CursorOf<HEADS> cursor;
  if constexpr (HEADS) cursor = HeadCursor(heads, C, row, stride);
  auto at = [&] {
    if constexpr (HEADS) return cursor.at();
    else return row * C;
  };
  auto next_at = [&] {
    if constexpr (HEADS) return cursor.next(heads, C).at();
    else return (row + stride) * C;
  };
  V dyv[NV], xv[NV];
  A m = A(0), s = A(0);
  if (PREFETCH && row < rows) {
    load_row<T, VEC, NV>(dyv, xv, dy, x, at(), C, tpr, t);
    if constexpr (!RMS) m = norm.centered * A(mean[row]);
    s = A(rstd[row]);
  }
  int parity = 0;
  for (; row < rows; row += stride) {
    if (!PREFETCH) {
      load_row<T, VEC, NV>(dyv, xv, dy, x, at(), C, tpr, t);
      if constexpr (!RMS) m = norm.centered * A(mean[row]);
      s = A(rstd[row]);
    }
    // Prefetching takes the next row's mean and rstd with its data: loaded only when that row
    // starts, they would put a DRAM round trip on its critical path.
    V next_dy[NV], next_x[NV];
    A next_m = A(0), next_s = A(0);
    if (PREFETCH && row + stride < rows) {
      load_row<T, VEC, NV>(next_dy, next_x, dy, x, next_at(), C, tpr, t);
      if constexpr (!RMS) next_m = norm.centered * A(mean[row + stride]);
      next_s = A(rstd[row + stride]);
    }

    // Pass 1: s1 = sum g_i and s2 = sum g_i * (x_i - mean). weight is re-read per row: it is
    // C elements shared by every row, so it stays in L1 (small rows: in shared memory) and costs
    // no registers.
    A s1 = A(0), s2 = A(0);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const AV wv = weight_vec(col);
        const AV dv = to_acc(dyv[j]);
        const AV xa = to_acc(xv[j]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A gi = mul_rn(wv[k], dv[k]);
          s1 += gi;
          s2 += gi * (RMS ? xa[k] : xa[k] - m);
        }
      }
    }
    if constexpr (SMALL) {
      if constexpr (RMS) {
        s2 = lanes_sum(s2, tpr, group_lanes);   // s1 is the mean's term only
      } else {
        lanes_sum2(s1, s2, tpr, group_lanes);
      }
    } else {
      s1 = warp_sum(s1);
      s2 = warp_sum(s2);
    }
    if (warps_per_row > 1) {
      // Across the group's warps: lane 0 of each warp posts its pair, then every thread adds
      // the pairs in warp order (the same order everywhere, so all threads agree bit for bit).
      // Two buffers alternate between rows: a warp can only overwrite a buffer after passing
      // the next row's barrier, by which time every warp has read it.
      // (Written out here rather than through exchange_row_sums, row_reduce.cuh: that helper's
      // 8-byte pairs, or any call at this point, cost 5-7 of this file's variants registers or
      // spills with nvcc 13.)
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
    }
    // dx_i = (g_i - a - xhat_i * b) * rstd with a = s1/C (RMSNorm: no mean, no mean term) and
    // b = s2 * rstd / C, computed as g_i * rstd - (xhat_i * b' + a') (see the top of this file).
    const A a_s = RMS ? A(0) : norm.centered * s1 * inv_c * s;
    const A b_s = s2 * s * inv_c * s;

    // Pass 2: dx, and this row's contribution to the group's dbias/dweight sums.
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const AV wv = weight_vec(col);
        const AV dv = to_acc(dyv[j]);
        const AV xa = to_acc(xv[j]);
        // The residual gradient: read here, once, by the thread that writes this dx (it may be
        // dx's own buffer, aliased).
        V rv;
        if constexpr (RESID) rv = load_cs(reinterpret_cast<const V*>(dresidual + at() + col));
        AV db, dw;
        if constexpr (REG_SUMS) {
          if constexpr (BIAS) db = db_reg[j];
          dw = dw_reg[j];
        } else {
          db = *reinterpret_cast<AV*>(db_sum + col);
          dw = *reinterpret_cast<AV*>(dw_sum + col);
        }
        V dxv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A d = dv[k];
          const A xhat = (RMS ? xa[k] : xa[k] - m) * s;
          A v = mul_rn(mul_rn(wv[k], d), s);
          if constexpr (RMS) v -= xhat * b_s;
          else v -= xhat * b_s + a_s;
          if constexpr (RESID) v += to_acc(rv[k]);
          dxv[k] = from_acc<T>(v);
          if constexpr (BIAS) db[k] += d;
          dw[k] += d * xhat;
        }
        if constexpr (REG_SUMS) {
          if constexpr (BIAS) db_reg[j] = db;
          dw_reg[j] = dw;
        } else {
          *reinterpret_cast<AV*>(db_sum + col) = db;
          *reinterpret_cast<AV*>(dw_sum + col) = dw;
        }
        store_cs(reinterpret_cast<V*>(dx + at() + col), dxv);   // written once, read by the next op
      }
    }
    if (PREFETCH) {
#pragma unroll
      for (int j = 0; j < NV; ++j) { dyv[j] = next_dy[j]; xv[j] = next_x[j]; }
      m = next_m;
      s = next_s;
    }
    if constexpr (HEADS) cursor = cursor.next(heads, C);
  }

  // A block's last groups can have one row fewer than its first group. They pass the missing
  // row's named barrier here, so that every warp has passed as many barriers as every other when
  // all meet at __syncthreads below. The hardware does not need this (each group's barrier is its
  // own), but without it compute-sanitizer's racecheck reported the groups' sums, written
  // before the __syncthreads and read after it, as racing (51 reports on the H200; none with it).
  // (Group 0's rows are this group's minus g*B, so `row - g*B < rows` says group 0 had one more.)
  if (warps_per_row > 1 && row - static_cast<int64_t>(g) * bps < rows) group_sync(1 + g, tpr);

  // REG_SUMS: the warp's groups add their sums, lane t of every group holding the same columns:
  // xor-shuffles across groups (offsets tpr .. 16), every lane of the warp taking part (all have
  // left the row loop), columns past the row's end included (their sums are zero). Group 0 of
  // each warp then posts the warp's sums.
  if constexpr (REG_SUMS) {
    for (int offset = tpr; offset < 32; offset *= 2) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if constexpr (BIAS) db_reg[j][k] += __shfl_xor_sync(0xffffffffu, db_reg[j][k], offset);
          dw_reg[j][k] += __shfl_xor_sync(0xffffffffu, dw_reg[j][k], offset);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (lane < tpr && col < C) {
        A* mine = sums_smem + static_cast<size_t>(threadIdx.x / 32) * 2 * C;
        if constexpr (BIAS) *reinterpret_cast<AV*>(mine + col) = db_reg[j];
        *reinterpret_cast<AV*>(mine + C + col) = dw_reg[j];
      }
    }
  }

  // Add the groups' sums in group order (REG_SUMS: the warps' sums in warp order) and write this
  // block's partial slot. The barrier makes every group's shared-memory sums visible to every
  // thread.
  __syncthreads();
  A* slot = partials + where.slot() * 2 * C;
  const A* sums = sums_smem;
  const int units = REG_SUMS ? static_cast<int>(blockDim.x / 32) : groups;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    A sb = A(0), sw = A(0);   // no BIAS: the slot's dbias half is zeros
    for (int q = 0; q < units; ++q) {
      if constexpr (BIAS) sb += sums[static_cast<size_t>(q) * 2 * C + c];
      sw += sums[static_cast<size_t>(q) * 2 * C + C + c];
    }
    __stcg(slot + c, sb);       // .cg: keep in L2 for the finalize that reads it next
    __stcg(slot + C + c, sw);
  }
}

}  // namespace
}  // namespace lnbwd
