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
//                 order), and the block adds its warps' sums in warp order.
// The block is kSmallThreads threads, so that several blocks share an SM.
//
// Bytes in flight. Memory-bound code is fast only if enough loads are outstanding: each thread
// issues all 2*NV of its 16-byte loads for a row before using any. With PREFETCH, the loads of
// the group's next row are issued before the current row is reduced, so DRAM stays busy across
// the reduction's barrier; that doubles the data registers, so it is used for small NV only.
#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/norm_weight.cuh"
#include "backward/partials_finalize.h"
#include "common/row_reduce.cuh"

namespace lnbwd {
namespace {

// Where a block's row groups live and keep their sums (see the top of this file).
enum class Rows { kWarps, kSmallShared, kSmallRegs };
template <Rows R, int NV>
constexpr int block_threads() { return R != Rows::kWarps ? kSmallThreads : max_threads(NV); }
// The (NV, PREFETCH) variants compiled: for rows of whole warps, (1, 2 prefetching; 3, 4); for
// small rows with their sums in shared memory (2 prefetching; 2, 4), in registers (2
// prefetching; 2).
constexpr bool variant(Rows r, int nv, bool prefetch) {
  switch (r) {
    case Rows::kWarps: return prefetch ? nv <= 2 : nv == 3 || nv == 4;
    case Rows::kSmallShared: return nv == 2 || (nv == 4 && !prefetch);
    case Rows::kSmallRegs: return nv == 2;
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
  if (R == Rows::kSmallRegs) return PREFETCH ? 2 : 3;
  return data <= 2 ? 4 : 3;
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_row(Packed<T, VEC> (&dyv)[NV], Packed<T, VEC> (&xv)[NV], const T* dy,
                                         const T* x, int64_t row, int C, int tpr, int t) {
  using V = Packed<T, VEC>;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col = (j * tpr + t) * VEC;
    if (col < C) {
      // Streaming loads: each element is used by this thread only, for this row only.
      dyv[j] = load_cs(reinterpret_cast<const V*>(dy + row * C + col));
      xv[j] = load_cs(reinterpret_cast<const V*>(x + row * C + col));
    }
  }
}

// O: the type of weight, dweight and dbias (T, or float beside 16-bit T); RESID: dresidual is
// added to dx (dispatch_types, launch.cuh).
template <typename T, typename O, bool RESID, int VEC, int NV, bool PREFETCH, Rows R>
__global__ void __launch_bounds__(block_threads<R, NV>(), min_blocks<R, NV, PREFETCH>())
kernel11_rows(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const O* __restrict__ weight, const T* dresidual,
              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment,
              int blocks_per_segment, int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish, int tpr,
              int groups) {
  using A = acc_t<T>;
  constexpr bool SMALL = R != Rows::kWarps;
  constexpr bool REG_SUMS = R == Rows::kSmallRegs;
  allow_finalize_launch();
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int lane = threadIdx.x % 32;
  const int warps_per_row = SMALL ? 1 : tpr / 32;
  const int warp_in_row = t / 32;
  const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;

  // Shared memory: per group [dbias sums | dweight sums] (C each), then the row-reduction
  // exchange: per group two buffers (alternating rows) of warps_per_row (s1, s2) pairs (none
  // for SMALL). REG_SUMS: per warp [dbias sums | dweight sums], written once at the end.
  extern __shared__ __align__(32) unsigned char smem[];
  A* db_sum = reinterpret_cast<A*>(smem) + (REG_SUMS ? size_t{0} : static_cast<size_t>(g) * 2 * C);
  A* dw_sum = db_sum + C;
  A* exchange = reinterpret_cast<A*>(smem) + static_cast<size_t>(groups) * 2 * C + g * 2 * warps_per_row * 2;
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

  // Segments (per-example sums under vmap): blocks [s * bps, (s + 1) * bps) work on the rows of
  // segment s only, so each partial slot holds sums of a single segment.
  const int bps = blocks_per_segment;
  const int64_t segment = blockIdx.x / bps;
  const int64_t rows = (segment + 1) * rows_per_segment;   // end of this block's segment
  weight += segment * weight_stride;
  const int64_t stride = static_cast<int64_t>(bps) * groups;
  int64_t row = segment * rows_per_segment + blockIdx.x % bps + static_cast<int64_t>(g) * bps;
  V dyv[NV], xv[NV];
  A m = A(0), s = A(0);
  if (PREFETCH && row < rows) {
    load_row<T, VEC, NV>(dyv, xv, dy, x, row, C, tpr, t);
    m = norm.centered * A(mean[row]);
    s = A(rstd[row]);
  }
  int parity = 0;
  for (; row < rows; row += stride) {
    if (!PREFETCH) {
      load_row<T, VEC, NV>(dyv, xv, dy, x, row, C, tpr, t);
      m = norm.centered * A(mean[row]);
      s = A(rstd[row]);
    }
    // Prefetching takes the next row's mean and rstd with its data: loaded only when that row
    // starts, they would put a DRAM round trip on its critical path.
    V next_dy[NV], next_x[NV];
    A next_m = A(0), next_s = A(0);
    if (PREFETCH && row + stride < rows) {
      load_row<T, VEC, NV>(next_dy, next_x, dy, x, row + stride, C, tpr, t);
      next_m = norm.centered * A(mean[row + stride]);
      next_s = A(rstd[row + stride]);
    }

    // Pass 1: s1 = sum g_i and s2 = sum g_i * (x_i - mean). weight is re-read per row: it is
    // C elements shared by every row, so it stays in L1 and costs no registers.
    A s1 = A(0), s2 = A(0);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const AV wv = weight_in_acc(load_vec<VEC>(weight + col), norm.offset);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A gi = mul_rn(wv[k], to_acc(dyv[j][k]));
          s1 += gi;
          s2 += gi * (to_acc(xv[j][k]) - m);
        }
      }
    }
    if constexpr (SMALL) {
      s1 = lanes_sum(s1, tpr, group_lanes);
      s2 = lanes_sum(s2, tpr, group_lanes);
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
    const A a = (norm.centered * s1) / A(C);   // RMSNorm: no mean, no mean term
    const A b = s2 * s / A(C);

    // Pass 2: dx, and this row's contribution to the group's dbias/dweight sums.
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < C) {
        const AV wv = weight_in_acc(load_vec<VEC>(weight + col), norm.offset);
        // The residual gradient: read here, once, by the thread that writes this dx (it may be
        // dx's own buffer, aliased).
        V rv;
        if constexpr (RESID) rv = load_cs(reinterpret_cast<const V*>(dresidual + row * C + col));
        AV db, dw;
        if constexpr (REG_SUMS) {
          db = db_reg[j];
          dw = dw_reg[j];
        } else {
          db = *reinterpret_cast<AV*>(db_sum + col);
          dw = *reinterpret_cast<AV*>(dw_sum + col);
        }
        V dxv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A d = to_acc(dyv[j][k]);
          const A xhat = (to_acc(xv[j][k]) - m) * s;
          A v = (mul_rn(wv[k], d) - a - xhat * b) * s;
          if constexpr (RESID) v += to_acc(rv[k]);
          dxv[k] = from_acc<T>(v);
          db[k] += d;
          dw[k] += d * xhat;
        }
        if constexpr (REG_SUMS) {
          db_reg[j] = db;
          dw_reg[j] = dw;
        } else {
          *reinterpret_cast<AV*>(db_sum + col) = db;
          *reinterpret_cast<AV*>(dw_sum + col) = dw;
        }
        store_cs(reinterpret_cast<V*>(dx + row * C + col), dxv);   // written once, read by the next op
      }
    }
    if (PREFETCH) {
#pragma unroll
      for (int j = 0; j < NV; ++j) { dyv[j] = next_dy[j]; xv[j] = next_x[j]; }
      m = next_m;
      s = next_s;
    }
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
          db_reg[j][k] += __shfl_xor_sync(0xffffffffu, db_reg[j][k], offset);
          dw_reg[j][k] += __shfl_xor_sync(0xffffffffu, dw_reg[j][k], offset);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (lane < tpr && col < C) {
        A* mine = reinterpret_cast<A*>(smem) + static_cast<size_t>(threadIdx.x / 32) * 2 * C;
        *reinterpret_cast<AV*>(mine + col) = db_reg[j];
        *reinterpret_cast<AV*>(mine + C + col) = dw_reg[j];
      }
    }
  }

  // Add the groups' sums in group order (REG_SUMS: the warps' sums in warp order) and write this
  // block's partial slot. The barrier makes every group's shared-memory sums visible to every
  // thread.
  __syncthreads();
  A* slot = partials + static_cast<size_t>(blockIdx.x) * 2 * C;
  const A* sums = reinterpret_cast<const A*>(smem);
  const int units = REG_SUMS ? static_cast<int>(blockDim.x / 32) : groups;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    A sb = A(0), sw = A(0);
    for (int q = 0; q < units; ++q) {
      sb += sums[static_cast<size_t>(q) * 2 * C + c];
      sw += sums[static_cast<size_t>(q) * 2 * C + C + c];
    }
    __stcg(slot + c, sb);       // .cg: keep in L2 for the finalize that reads it next
    __stcg(slot + C + c, sw);
  }
  if (finish.dweight) {
    if constexpr (SMALL) finish_partials_in_grid_call(finish, partials, bps, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
    else finish_partials_in_grid(finish, partials, bps, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
  }
}

// Persistent grid: as many blocks as fit on the GPU at once, but no more than there are row
// groups of work, and no more than the workspace has partial slots.
template <typename T, typename O, bool RESID, int VEC, int NV, bool PREFETCH, Rows R>
cudaError_t launch_rows(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream) {
  // One element per access (VEC == 1) has its own variants, for rows of whole warps only.
  constexpr bool compiled = VEC == 1 ? R == Rows::kWarps : variant(R, NV, PREFETCH);
  if constexpr (!compiled) {
    return cudaErrorInvalidValue;
  } else {
    return launch_with_partials<T, O>(p, kernel11_rows<T, O, RESID, VEC, NV, PREFETCH, R>, cfg.tpr * cfg.groups,
                                      kernel11_smem_bytes(cfg, p.C, sizeof(acc_t<T>)), BlocksPerSm::kOccupancy, cfg.groups, 1,
                                      stream, cfg.tpr, cfg.groups);
  }
}

template <typename T, typename O, bool RESID, int VEC, int NV, bool PREFETCH>
cudaError_t launch(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream) {
  if (p.plan) {
    p.plan->kernel = 11;
    p.plan->path = cfg.tpr >= 32 ? "rows in registers" : cfg.reg_sums ? "small rows, sums in registers"
                                                                        : "small rows, sums in shared memory";
  }
  if (cfg.tpr >= 32) return launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kWarps>(p, cfg, stream);
  if (cfg.tpr * cfg.groups != kSmallThreads) return cudaErrorInvalidValue;
  return cfg.reg_sums ? launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kSmallRegs>(p, cfg, stream)
                      : launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kSmallShared>(p, cfg, stream);
}

// The (NV, PREFETCH) variants compiled for each vector width (variant(), above, says which row
// groups each serves). Registers per thread for the row data are 2 tensors * NV * 16 bytes
// (twice that with PREFETCH).
template <typename T, typename O, bool RESID, int VEC>
cudaError_t launch_variant(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream) {
  if constexpr (VEC == 1) {
    switch (cfg.nv) {
      case 2: return launch<T, O, RESID, VEC, 2, false>(p, cfg, stream);
      case 4: return launch<T, O, RESID, VEC, 4, false>(p, cfg, stream);
      case 8: return launch<T, O, RESID, VEC, 8, false>(p, cfg, stream);
    }
    return cudaErrorInvalidValue;
  } else {
  if (cfg.prefetch) {
    switch (cfg.nv) {
      case 1: return launch<T, O, RESID, VEC, 1, true>(p, cfg, stream);
      case 2: return launch<T, O, RESID, VEC, 2, true>(p, cfg, stream);
    }
    return cudaErrorInvalidValue;
  }
  switch (cfg.nv) {
    case 2: return launch<T, O, RESID, VEC, 2, false>(p, cfg, stream);   // small rows only
    case 3: if constexpr (sizeof(T) <= 4) return launch<T, O, RESID, VEC, 3, false>(p, cfg, stream); break;
    case 4: return launch<T, O, RESID, VEC, 4, false>(p, cfg, stream);
  }
  return cudaErrorInvalidValue;
  }
}

}  // namespace

bool kernel11_small_variant(bool reg_sums, int nv, bool prefetch) {
  return variant(reg_sums ? Rows::kSmallRegs : Rows::kSmallShared, nv, prefetch);
}

cudaError_t norm_bwd_kernel11_config(const NormBwdParams& p, const Kernel11Config& cfg, cudaStream_t stream) {
  return dispatch_types(p, [&](auto t, auto o, auto resid) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    constexpr int vec = 16 / sizeof(T);
    if (cfg.vec == vec && can_vectorize<T>(p)) return launch_variant<T, O, R, vec>(p, cfg, stream);
    if (cfg.vec == 1) return launch_variant<T, O, R, 1>(p, cfg, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace lnbwd
