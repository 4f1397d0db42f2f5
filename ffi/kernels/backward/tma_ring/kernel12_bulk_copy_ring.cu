// Kernel 12 (Hopper, sm_90): rows streamed into shared memory by the bulk copy engine
// (cp.async.bulk, "TMA"), several rows ahead of the threads that use them.
//
// Why: layernorm backward is memory-bound, so speed is bytes in flight. Kernel 11 keeps rows in
// registers, and registers cap how many rows an SM can have in flight (a few). Here the copy
// engine moves whole rows (one instruction per row and tensor, no registers) into a ring of
// shared-memory buffers, so each row group always has the next NB-1 rows on their way while it
// computes on the current one.
//
// Work split (as kernel 11): a block holds `groups` row groups of `tpr` threads; block b of a
// segment's B blocks owns the rows b, b + B, b + 2B, ..., dealt to its groups in turn, so group g
// walks rows b + g*B, then + groups*B, ... (so blocks' row counts differ by at most one); thread
// t owns the columns
// col(j) = (j * tpr + t) * VEC, j < NV, for every row, so its dweight/dbias sums stay in
// registers (no atomics, no shared-memory traffic) until the end.
//
// The ring, per group: NB buffers, each one row of dy and one row of x plus that row's mean and
// rstd, each with an mbarrier ("full"). The group's leader thread starts the copy of row k into
// buffer k % NB and tells the barrier how many bytes to expect; the copy engine counts them
// down; the group's threads wait on the barrier's phase (k / NB) & 1. A buffer is refilled only
// after every thread of the group has finished with the row in it: the leader refills buffer
// (k-1) % NB right after the group's barrier of row k, which every thread reaches only after
// finishing row k-1.
//
// Per row (g_i = weight_i * dy_i, xhat_i = (x_i - mean) * rstd, centered; row_math.cuh):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean): shuffles, then across the group's warps;
//   pass 2: dx_i = (g_i - s1/C - xhat_i s2 rstd/C) rstd, straight to global memory;
//           dbias_i += dy_i, dweight_i += dy_i xhat_i in registers.
// RMSNorm (norm.centered = 0; norm_weight.cuh): the same with mean = 0 and without the s1/C term
// (k0 = 0), and the weight staged as offset + weight_i. The ring's copy of a row's mean then
// carries its rstd a second time (the launcher passes rstd as mean; the product with 0 is used).
// At the end the groups' sums meet in shared memory (in group order) and the block writes its
// partial slot; the slots are then added in slot order (launch_with_partials, backward/launch.cuh:
// by finalize_partials, or, opted in, by the grid itself after a grid-wide barrier).
// Deterministic.
//
// The kernel below takes its steps in order: setup (thread roles, shared-memory layout, the
// weight, the ring's first copies); per row: residual load, wait, pass 1, the group's reduction,
// refill, the other half's sums (split rows), pass 2; then the block's sums. The steps live in
// ring_steps.cuh (setup and per row) and ring_block_sums.cuh (the end); the kernel keeps the
// shared-memory layout, its accessor lambdas, the warps' exchange and pass 2, for the reason
// given at the top of ring_steps.cuh.
//
// Split rows (SPLIT = 2, kernel12_pick says where): the blocks come in clusters of two, and both
// blocks of a cluster walk the same rows, block h taking the columns [h C/2, (h + 1) C/2) of
// each; everything above applies to a block's half row. The row's sums need both halves: after
// pass 1 each group sends its half's (s1, s2) to the same group of the other block
// (cluster_exchange.cuh) and adds the pair it receives, so both halves use the same s1 and s2.
// The two blocks fill the two halves of one partial slot.
#include "backward/launch.cuh"
#include "backward/norm_weight.cuh"
#include "backward/partials_finalize.h"
#include "backward/tma_ring/row_math.cuh"
#include "common/row_reduce.cuh"
#include "backward/tma_ring/bulk_copy.cuh"
#include "backward/tma_ring/cluster_exchange.cuh"
#include "backward/tma_ring/kernel12.h"
#include "backward/tma_ring/ring_block_sums.cuh"
#include "backward/tma_ring/ring_steps.cuh"

#include <algorithm>
#include <type_traits>

namespace lnbwd {
namespace {

// O: the type of weight, dweight and dbias (T, or float beside 16-bit T: mixed precision);
// RESID: dresidual is added to dx (dispatch_types, launch.cuh).
// W: the type the weight row is staged as in shared memory (shared-memory mode): acc_t<T>,
// converted once; or T itself (O = T only), half the bytes, converted in every pass, for 16-bit
// rows so wide that an fp32 copy of the weight would cost the ring a buffer.
template <typename T, typename O, bool RESID, int VEC, int NV, int NB, bool REGS, typename W, int SPLIT>
__global__ void __launch_bounds__(kernel12_max_threads(NV * VEC * sizeof(acc_t<T>)), 1)
kernel12_ring(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const O* __restrict__ weight, const T* dresidual,
              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment,
              int blocks_per_segment, int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish, int tpr,
              int groups) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  using AV = Packed<A, VEC>;
  using Pair = Packed<A, 2>;
  using S = stat_t<T>;
  const int g = threadIdx.x / tpr;
  const int t = threadIdx.x % tpr;
  const int lane = threadIdx.x % 32;
  const int warps_per_row = tpr / 32;
  const int warp_in_row = t / 32;
  // The leader issues the group's bulk copies. In register mode without split rows (fp32) it is
  // the first thread of the group's last warp: a row's vectors run out from the top, so the
  // first warp can have a vector more per thread than the last (fp32 C = 1600: 4 against 3), and
  // the leader's work then lands on a warp with less. Elsewhere it is thread 0 (for 16-bit rows
  // the other choice changed the loop's schedule for the worse; docs/kernel12.md).
  const bool leader = t == (REGS && SPLIT == 1 ? tpr - 32 : 0);
  // Split rows (SPLIT = 2): the block of cluster rank h takes the columns [h * Cb, (h + 1) * Cb)
  // of every row its cluster works on; Cb is this block's share of a row, and every column index
  // below counts from col0.
  const int rank = SPLIT > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int Cb = C / SPLIT;
  const int col0 = rank * Cb;
  const size_t row_bytes = static_cast<size_t>(Cb) * sizeof(T);

  // Shared memory: [weight row as W (shared-memory mode only) | ring buffers: groups x NB x
  // (dy row, x row) | their mbarriers | their (mean, rstd) pairs | reduction exchange | split rows
  // only: groups x 2 peer mbarriers | groups x 2 peer pairs]. Each piece starts on a 16-byte
  // boundary. buf_dy(q, b) and buf_x(q, b) are the rows of ring buffer b of group q.
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr bool kWeightAcc = std::is_same_v<W, A>;
  static_assert(kWeightAcc || std::is_same_v<O, T>, "a float32 weight is staged as float, never rounded");
  W* w_sh = reinterpret_cast<W*>(smem);
  unsigned char* ring = smem + (REGS ? 0 : round_up<size_t>(static_cast<size_t>(Cb) * sizeof(W), 16));
  auto buf_dy = [&](int q, int b) { return reinterpret_cast<T*>(ring + ((size_t)q * NB + b) * 2 * row_bytes); };
  auto buf_x = [&](int q, int b) { return reinterpret_cast<T*>(ring + (((size_t)q * NB + b) * 2 + 1) * row_bytes); };
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + (size_t)groups * NB * 2 * row_bytes);
  S* stats = reinterpret_cast<S*>(full + 2 * ceil_div(groups * NB, 2));
  Pair* exchange = reinterpret_cast<Pair*>(reinterpret_cast<unsigned char*>(stats) +
                                          round_up<size_t>(static_cast<size_t>(groups) * NB * 2 * sizeof(S), 16)) +
                   g * 2 * warps_per_row;
  // Split rows: per group, two (barrier, pair) slots that the other block's group sends its
  // half-row sums into, alternating between rows. They follow all groups' exchange pairs.
  // (Each is found from the previous group-offset pointer: back by the offset, on by the region.
  // Each region's start plus the offset gives the same addresses, but nvcc allocates the
  // split-row variants' registers worse with that form.)
  uint64_t* peer_bar =
      reinterpret_cast<uint64_t*>(exchange - g * 2 * warps_per_row + groups * 2 * warps_per_row) + g * 2;
  Pair* peer_sum = reinterpret_cast<Pair*>(peer_bar - g * 2 + groups * 2) + g * 2;

  // Segments: blocks [s * bps, (s + 1) * bps) work on segment s only, in units of SPLIT blocks
  // (a cluster) that share their rows.
  const int64_t segment = blockIdx.x / blocks_per_segment;
  const int64_t rows = (segment + 1) * rows_per_segment;
  const int units = blocks_per_segment / SPLIT;
  const int unit = blockIdx.x % blocks_per_segment / SPLIT;
  weight += segment * weight_stride + col0;
  const int64_t stride = static_cast<int64_t>(units) * groups;
  const int64_t first = segment * rows_per_segment + unit + static_cast<int64_t>(g) * units;

  // The weight loads go out first, then the ring's first NB rows.
  Packed<O, VEC> w_raw[NV];
  load_weight<VEC, NV, REGS>(w_raw, weight, tpr, t, Cb);
  const A inv_c = A(1) / A(C);

  // Barriers initialized before anyone uses them: the other block of the cluster too, which
  // sends into this block's peer barriers.
  if (leader) init_ring_barriers<NB, SPLIT>(full, g, peer_bar);
  sync_row_sharers<SPLIT>();
  // The leader starts row r's copies into buffer b of its group.
  auto issue = [&](int b, int64_t r) {
    issue_row(&full[g * NB + b], buf_dy(g, b), buf_x(g, b), &stats[(g * NB + b) * 2], dy + r * C + col0,
              x + r * C + col0, mean + r, rstd + r, static_cast<uint32_t>(row_bytes));
  };
  if (leader) {
    for (int b = 0; b < NB; ++b) {
      const int64_t r = first + b * stride;
      if (r < rows) issue(b, r);
    }
  }
  // The thread's dbias/dweight sums live in registers; in register mode its weight columns too.
  // Shared-memory mode stages the weight row, and the barrier publishes it.
  AV wv[NV];
  AV db[NV], dw[NV];
  stage_weight_and_clear_sums<T, VEC, NV, REGS>(w_raw, wv, w_sh, db, dw, tpr, t, Cb, norm.offset);
  if (!REGS) __syncthreads();

  int parity = 0;           // which exchange buffer this row uses
  int b = 0;                // the ring buffer of this row: (rows processed) % NB
  uint32_t phase = 0;       // the phase of its barrier: ((rows processed) / NB) & 1
  int peer = 0;             // split rows: the peer slot of this row, (rows processed) & 1
  uint32_t peer_phase = 0;  // and its barrier's phase, ((rows processed) / 2) & 1
  bool first_row = true;
  int64_t row = first;
  for (; row < rows; row += stride) {
    V rv[NV];
    if constexpr (RESID) load_residual(rv, dresidual + row * C + col0, tpr, t, Cb);
    // The row is in its buffer once the barrier's phase completes (all its bytes have landed).
    mbar_wait(&full[g * NB + b], phase);
    // Register mode copies the row out of shared memory once, and both passes use registers;
    // shared-memory mode reads it in each pass (fewer registers, more shared-memory loads). The
    // passes read vector j (first column col) of the row and of the weight through these.
    V dyv[NV], xv[NV];
    if (REGS) copy_row_to_registers(dyv, xv, buf_dy, buf_x, g, b, tpr, t, Cb);
    auto dy_at = [&](int j, int col) { return REGS ? dyv[j] : *reinterpret_cast<const V*>(buf_dy(g, b) + col); };
    auto x_at = [&](int j, int col) { return REGS ? xv[j] : *reinterpret_cast<const V*>(buf_x(g, b) + col); };
    auto w_at = [&](int j, int col) -> AV {
      if constexpr (REGS) return wv[j];
      if constexpr (kWeightAcc) return *reinterpret_cast<const AV*>(w_sh + col);
      return weight_in_acc(*reinterpret_cast<const V*>(w_sh + col), norm.offset);   // offset + w (RMSNorm)
    };
    const A m = norm.centered * A(stats[(g * NB + b) * 2]);   // RMSNorm: no mean
    const A s = A(stats[(g * NB + b) * 2 + 1]);

    // Pass 1: the row's sums, over the thread's columns, its warp, then its group.
    A s1 = A(0), s2 = A(0);
    add_thread_row_sums<T, VEC, NV>(dy_at, x_at, w_at, m, tpr, t, Cb, s1, s2);
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (warps_per_row > 1) {
      // Across the group's warps: lane 0 posts the warp's (s1, s2) pair, every thread adds the
      // pairs in warp order, one 8-byte load each. Two exchange buffers alternate between
      // rows: one is overwritten only after the next row's barrier, when all have read it.
      // (Written out here rather than through exchange_row_sums, row_reduce.cuh: with this loop
      // in a function, nvcc 13 compiles the kernel differently, and the fp64 two-buffer variant
      // spills.)
      Pair* ex = exchange + parity * warps_per_row;
      if (lane == 0) {
        Pair mine;
        mine[0] = s1;
        mine[1] = s2;
        ex[warp_in_row] = mine;
      }
      group_sync(1 + g, tpr);
      s1 = A(0);
      s2 = A(0);
      for (int w = 0; w < warps_per_row; ++w) {
        const Pair p = ex[w];
        s1 += p[0];
        s2 += p[1];
      }
      parity ^= 1;
    } else {
      group_sync(1 + g, tpr);
    }
    // Refill a buffer nobody reads any more. Register mode: every thread has copied row k out
    // of buffer b, so it takes row k + NB. Shared-memory mode: every thread is past row k - 1,
    // so its buffer takes row k - 1 + NB.
    if (leader && (REGS || !first_row)) {
      const int64_t r = row + (REGS ? NB : NB - 1) * stride;
      const int rb = REGS ? b : (b == 0 ? NB - 1 : b - 1);
      if (r < rows) issue(rb, r);
    }
    first_row = false;
    if constexpr (SPLIT > 1) {
      if (leader) send_half_sums(peer_sum, peer_bar, peer, rank, s1, s2);
      add_other_half_sums(peer_sum, peer_bar, peer, peer_phase, s1, s2);
      peer_phase ^= peer;   // the two slots alternate, so each one's phase flips every other row
      peer ^= 1;
    }

    // Pass 2: dx out (row_math.cuh), and the thread's column sums.
    const RowCoefficients<A> coef(norm.centered * s1, s2, s, inv_c);   // RMSNorm: k0 = 0
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int col = (j * tpr + t) * VEC;
      if (col < Cb) {
        const V dxv =
            dx_and_add_sums<T, VEC, RESID>(dy_at(j, col), x_at(j, col), w_at(j, col), m, s, coef, db[j], dw[j], &rv[j]);
        store_cs(reinterpret_cast<V*>(dx + row * C + col0 + col), dxv);   // written once, not re-read here
      }
    }
    if (++b == NB) {
      b = 0;
      phase ^= 1;
    }
  }

  // A block's last groups can have one row fewer than its first group. They pass the missing
  // row's named barrier (`balance`), so that every warp has passed as many barriers as every
  // other when all meet at the block's barrier below. The hardware does not need this (each
  // group's barrier is its own), but compute-sanitizer's racecheck does: without it, it reports
  // the sums exchanged below as racing. Group 0's rows are this group's minus g*B, so group 0
  // had one row more if its next row, row - g*B, is still below `rows`.
  const bool balance = row - static_cast<int64_t>(g) * units < rows;
  if constexpr (SPLIT > 1) {
    if (balance) group_sync(1 + g, tpr);
  }

  // The block's sums, each column's over the groups in group order, into this block's partial
  // slot; the two layouts in which the groups' sums meet are in ring_block_sums.cuh. Past
  // sync_row_sharers nobody waits on the ring's mbarriers any more: their leaders retire
  // them. Split rows: every pair this block sent has landed too (the other block waited for
  // each), so no send is in flight into a block that has moved on.
  if constexpr (SPLIT == 1) {
    // The group's own barrier first (every thread of the group is done with its ring buffers),
    // then the balancing one. In the other order, nvcc reloads kernel parameters from the
    // constant bank inside the 16-bit row loop.
    group_sync(1 + g, tpr);
    if (balance) group_sync(1 + g, tpr);
    store_group_sums(reinterpret_cast<A*>(buf_dy(g, 0)), db, dw, tpr, t, Cb);
  }
  sync_row_sharers<SPLIT>();
  if (leader) retire_ring_barriers<NB, SPLIT>(full, g, peer_bar);
  if constexpr (SPLIT == 1) {
    write_block_sums_from_rings<A, NB>(buf_dy, row_bytes, partials, C, Cb, groups);
  } else {
    write_block_sums_split<SPLIT>(reinterpret_cast<A*>(smem), db, dw, partials, C, Cb, col0, g, groups, tpr, t);
  }
  if (finish.dweight) finish_partials_in_grid(finish, partials, units, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
#endif
}

template <typename T, typename O, bool RESID, int VEC, int NV, int NB, bool REGS, typename W, int SPLIT>
cudaError_t launch(const NormBwdParams& p, Kernel12Config cfg, cudaStream_t stream) {
  if (p.plan) {
    p.plan->kernel = 12;
    p.plan->path = SPLIT > 1 ? "ring, rows split over a cluster" : "ring";
  }
  // Few rows: every group should take at least kKernel12MinRowsPerGroup rows, so that its ring loads the
  // next row while the group computes one. (A group with a single row loads it, computes,
  // stores, with nothing to overlap: the whole backward is then one chain of latencies.) Within
  // that, as many blocks as the GPU has units, each with fewer groups, so that the rows spread
  // over more SMs and each block's end (its groups' sums added column by column in shared
  // memory, a chain of 2 * groups loads per column) is shorter. The grid is then capped at
  // ceil(rows / (groups * kKernel12MinRowsPerGroup)) units. (A cluster of SPLIT blocks takes a row per
  // group; a GPU, or a partition of one, can have fewer SMs than SPLIT.) Many rows: nothing
  // changes, every group already takes many.
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(p.device, &lim));
  const int64_t units_on_gpu = std::max(1, lim.sms / SPLIT);
  cfg.groups = static_cast<int>(
      std::clamp<int64_t>(ceil_div<int64_t>(p.rows, units_on_gpu * kKernel12MinRowsPerGroup), 1, cfg.groups));
  return launch_with_partials<T, O>(p, kernel12_ring<T, O, RESID, VEC, NV, NB, REGS, W, SPLIT>, cfg.tpr * cfg.groups,
                                 kernel12_smem_bytes(cfg, p.C / SPLIT, sizeof(T), sizeof(acc_t<T>)), BlocksPerSm::kOccupancy,
                                 cfg.groups * kKernel12MinRowsPerGroup, SPLIT, stream, cfg.tpr, cfg.groups);
}

// The compiled variants (measured fastest, docs/kernel12.md): 16-bit types re-read shared
// memory in both passes with NV = 4 (register mode needs too many registers there), the weight
// staged as fp32 or, three buffers only, as T; fp32 runs in register mode with NV = 4; fp64 NV = 2.
template <typename T>
constexpr bool kRegsMode = std::is_same_v<T, float>;

// A float32 weight beside 16-bit data (O = float) is never staged raw: that would round it.
template <typename T, typename O, bool RESID, int VEC, int SPLIT>
cudaError_t launch_variant(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int nv = sizeof(T) == 8 ? 2 : 4;
  if (cfg.nv != nv || cfg.regs != kRegsMode<T>) return cudaErrorInvalidValue;
  if (cfg.raw_weight) {
    if constexpr (sizeof(T) == 2 && std::is_same_v<O, T>) {
      if (cfg.nb == 3) return launch<T, O, RESID, VEC, nv, 3, false, T, SPLIT>(p, cfg, stream);
    }
    return cudaErrorInvalidValue;
  }
  if (cfg.nb == 3) return launch<T, O, RESID, VEC, nv, 3, kRegsMode<T>, acc_t<T>, SPLIT>(p, cfg, stream);
  if (cfg.nb == 2) return launch<T, O, RESID, VEC, nv, 2, kRegsMode<T>, acc_t<T>, SPLIT>(p, cfg, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t norm_bwd_kernel12_config(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  if (cfg.chunks) return norm_bwd_kernel12_chunks(p, cfg, stream);
  return dispatch_types(p, [&](auto t, auto o, auto resid) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    constexpr int vec = 16 / sizeof(T);
    if (!can_vectorize<T>(p)) return cudaErrorInvalidValue;
    if (cfg.split == 1) return launch_variant<T, O, R, vec, 1>(p, cfg, stream);
    if constexpr (kCanSplit<T>) {
      if (cfg.split == 2 && p.C % (2 * vec) == 0) return launch_variant<T, O, R, vec, 2>(p, cfg, stream);
    }
    return cudaErrorInvalidValue;
  });
}

bool kernel12_has_code(int device) {
  // The ring and the wide-row kernel are compiled in one CMake target, for the same
  // architectures: one of them answers for both.
  int arch = 0;
  if (kernel_code_arch(device, reinterpret_cast<const void*>(kernel12_ring<float, float, false, 4, 4, 2, true, float, 1>), &arch) !=
      cudaSuccess) {
    (void)cudaGetLastError();   // no code for this GPU at all: kernel 11 will say so
    return false;
  }
  return arch >= 90;
}

}  // namespace lnbwd
