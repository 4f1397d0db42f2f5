// The fused forward's main path: each row is read from DRAM once into registers, where it stays
// for the three passes (mean, variance, output); y is written once.
//
// Work split. A block holds `groups` row groups of `tpr` threads, tpr a power of two: rows of
// a few hundred bytes get part of a warp each (SMALL: 4 to 16 threads, several groups to a warp,
// whose sums are shuffles among the group's own lanes, lanes_sum), mid-sized rows a warp each
// (warp shuffles only, no barrier; a block holds several), wide rows a few warps that make up
// the whole block (the warps' sums meet in shared memory behind __syncthreads). Only barrier 0
// is ever used: a block that names more hardware barriers (one per row group) is charged for
// all of them, and the SM's barriers would then cap the blocks resident below what the
// registers allow. Thread t of a group holds NV vectors of VEC elements, at columns
//   col(j) = (j * tpr + t) * VEC,  j = 0..NV-1,
// so for every j the group's loads are one contiguous, coalesced span of the row. tpr and NV
// are chosen by norm_fwd_pick (forward_launch.cu): the fewest threads per row that hold
// it with at most max_vectors(norm kind, tpr) vectors each. Blocks are small (128 threads, or one larger group)
// so that the SM's register file fills evenly: at 72 registers a thread (the lean kernel's cap)
// 128-thread blocks use 28 warps of an SM; blocks of 512 threads are held to 64 registers so
// that two fit (the pair kernel). The registers are what holds the bytes in flight, so the
// packed 16-bit row is widened again in every pass (widen) rather than kept widened.
//
// Instructions. At C = 1600 bf16 a warp issues about a thousand instructions a row, and the
// SM's schedulers issue in 3 cycles of 4 what a copy's bytes would allow: the per-access work
// is kept small (pointers stepped by tpr vectors, only the last slot tested against C).
//
// Bytes in flight. A memory-bound kernel is as fast as the loads it keeps outstanding: each
// thread issues all NV of its 16-byte loads before it uses any, and a row's reductions (two
// shuffle trees, two barriers for multi-warp groups) overlap with the other groups' loads on
// the same SM. There is no grid-wide wait: blocks are independent, and grid-stride over rows
// only when there are more row groups than the grid may have blocks.
//
// Per row, in the accumulator type A (fp32; fp64 for fp64):
//   pass 1: mean = (1/C) sum x_i                  (registers, then the group's sum)
//   pass 2: var  = (1/C) sum (x_i - mean)^2       (the same registers: centered, exact two-pass)
//   pass 3: y_i  = ((x_i - mean) rstd) w_i + b_i, rstd = 1/sqrt(var + eps), stored as T.
// RMSNorm (api.h; the kernels' K = kRmsNorm): pass 1 is not compiled in (no mean), pass 2 sums
// x_i^2 and pass 3 is y_i = (x_i rstd) (offset + w_i).
// RES (the residual variant, add_layernorm): the residual row is loaded next to x, the row
// becomes s = x + residual rounded to T (add_round; with x's own bias, (x + x_bias) + residual:
// add_bias_round, the bias from L1 like weight and bias) in the same registers, s is stored, and the
// three passes run on s. The RES = false instantiations are the plain forward, unchanged.
#include <algorithm>
#include <type_traits>

#include "common/head_rows.h"
#include "forward/forward_launch.cuh"

namespace lnbwd {
namespace {

// The kernel's body; the three kernels below differ in their register budget (and the lean one
// in x's cache policy, STREAM_X).
// block and blocks: this block's index among the blocks that share a's rows, and their count
// (blockIdx.x and gridDim.x, except in forward_rows_sets, whose grid serves two sets of rows).
// HEADS: a's rows are heads inside wider token rows (common/head_rows.h), laid out by `heads`.
template <NormKind K, typename T, typename P, int VEC, int NV, bool RES, bool SMALL, bool STREAM_X = false,
          bool HEADS = false>
__device__ __forceinline__ void forward_rows_body(const FwdArgs<T, P>& a, int tpr, int groups, unsigned block,
                                                  unsigned blocks, const HeadRows& heads = {}) {
  using A = acc_t<T>;
  using V = Packed<T, VEC>;
  // tpr is a power of two (norm_fwd_pick): a shift and a mask, not a division, stand before
  // the row's first load.
  const int g = threadIdx.x >> (__ffs(tpr) - 1);
  const int t = threadIdx.x & (tpr - 1);
  const int lane = threadIdx.x % 32;
  const int warps = SMALL ? 1 : tpr / 32;
  const int warp = t / 32;
  const int C = a.C;
  // The warps' partial sums (row_sum): two buffers per group, each of `warps` slots; unused for
  // tpr = 32. A buffer may be written again only once every warp has read it, and the only
  // ordering between warps is the barrier inside row_sum. Layernorm's two sums a row take one
  // each (mean's, variance's): a warp that posts the next row's mean has passed this row's
  // variance barrier, which every warp reaches only after reading this row's mean. RMSNorm's one
  // sum a row alternates between the two by the block's row parity, for the same reason: with a
  // single buffer, a warp that strides on to its next row could post that row's sum while a
  // slower warp still reads this row's (blocks stride once rows outnumber the grid).
  __shared__ A exchange[2][kFwdMaxRowThreads / 32 > kFwdBlockThreads / 32 ? kFwdMaxRowThreads / 32
                                                                          : kFwdBlockThreads / 32];
  A* ex_mean = exchange[0] + (SMALL ? 0 : g * warps);
  A* ex_var = exchange[1] + (SMALL ? 0 : g * warps);
  // The group's barrier, needed only when several warps share a row: the group is then the
  // whole block (groups == 1, norm_fwd_pick), so it is __syncthreads.
  auto sync = [] { __syncthreads(); };
  // A row's sum over its group: within the group's lanes for SMALL groups (the warp's other
  // groups may be on their last row already done), else row_sum (the warp, then its warps).
  const unsigned group_lanes = SMALL ? lanes_mask(tpr, lane) : 0xffffffffu;
  auto group_sum = [&](A v, A* ex) {
    if constexpr (SMALL) return lanes_sum(v, tpr, group_lanes);
    else return row_sum(v, ex, warps, warp, lane, sync);
  };

  // Thread t's vector slots: slot j is vector j * tpr + t of the row, VEC elements at column
  // (j * tpr + t) * VEC. Each pass walks its slots with a pointer that steps tpr vectors (one
  // wide add per access) instead of forming a 64-bit address per column: the forward issues
  // about a thousand instructions per row of 1600 bf16 per warp, close to the SM's issue rate.
  // Only the last slot can lie past the row's end: for 16-byte vectors the pick makes NV exactly
  // ceil(C / VEC / tpr) (launch checks it), so slots j < NV - 1 are inside every row and their
  // test folds away; scalar access rounds NV up to a power of two, so every slot tests.
  auto col = [&](int j) { return (j * tpr + t) * VEC; };   // slot j's first column
  auto in_row = [&](int j) { return (VEC > 1 && j < NV - 1) || col(j) < C; };
  // Each pass widens the row again from its packed registers (widen, forward_math.cuh); the
  // residual variant, which holds two rows while it adds them, widens with to_acc.
  auto wide = [](auto pass, const V& v) {
    if constexpr (RES) return to_acc(v);
    else return widen<decltype(pass)::value>(v);
  };
  using Pass1 = std::integral_constant<int, 1>;
  using Pass2 = std::integral_constant<int, 2>;
  using Pass3 = std::integral_constant<int, 3>;

  int64_t parity = 0;   // the block's rows so far, mod 2 (RMSNorm's buffer, above)
  for (int64_t row = static_cast<int64_t>(block) * groups + g; row < a.rows;
       row += static_cast<int64_t>(blocks) * groups, parity ^= 1) {
    // The row's first element: row * C, or the head row's (a thread has about one row: no cursor).
    auto at = [&] {
      if constexpr (HEADS) return head_row_offset(heads, C, row);
      else return row * C;
    };
    const V* x = reinterpret_cast<const V*>(a.x + at()) + t;
    // x is read once: ld.global.cg caches it in L2 at normal priority and not in L1, so L1 holds
    // only the parameters that every row reads again. The lean kernel (STREAM_X: 7 vectors a
    // thread, the fewest warps an SM holds) loads it evict-first instead (ld.global.cs): the one
    // row group where that policy measured faster (docs/forward.md, on the cache policy).
    V xv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j, x += tpr) {
      if (in_row(j)) xv[j] = STREAM_X ? load_cs(x) : load_cg(x);
    }
    if constexpr (RES) {
      // The residual's loads go out before any use of x's; then the row is s, stored once.
      const V* r = reinterpret_cast<const V*>(a.residual + at()) + t;
      V rv[NV];
#pragma unroll
      for (int j = 0; j < NV; ++j, r += tpr) {
        if (in_row(j)) rv[j] = load_cg(r);
      }
      V* sp = reinterpret_cast<V*>(a.s + at()) + t;
      const P* xb = param_row(a.x_bias, row, a.x_bias_div, C);   // x's own bias, or nullptr
#pragma unroll
      for (int j = 0; j < NV; ++j, sp += tpr) {
        if (in_row(j)) {
          // A uniform branch: x_bias is there for the whole launch or not at all.
          xv[j] = xb == nullptr ? add_round(xv[j], rv[j])
                                : add_bias_round(xv[j], load_params<A, P, VEC>(xb + col(j)), rv[j]);
          *sp = xv[j];
        }
      }
    }

    // Pass 1: the mean (layernorm only: RMSNorm has none, and pass 2 then sums x_i^2).
    A mean = A(0);
    if constexpr (K == NormKind::kLayerNorm) {
      A s = A(0);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (in_row(j)) s += sum_of(wide(Pass1{}, xv[j]));
      }
      mean = group_sum(s, ex_mean) / A(C);
    }

    // Pass 2: the variance about that mean, from the same registers.
    A q = A(0);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      if (in_row(j)) q += squares_of<K>(wide(Pass2{}, xv[j]), mean);
    }
    A* ex_q = K == NormKind::kLayerNorm ? ex_var : exchange[parity] + (SMALL ? 0 : g * warps);
    const A rstd = rstd_of(group_sum(q, ex_q), C, a.eps);

    // Pass 3: y, one 16-byte store per vector.
    const P* w = param_row(a.weight, row, a.weight_div, C);
    const P* b = param_row(a.bias, row, a.bias_div, C);
    V* y = reinterpret_cast<V*>(a.y + at()) + t;
#pragma unroll
    for (int j = 0; j < NV; ++j, y += tpr) {
      if (in_row(j)) *y = normalize<K, T, P, VEC>(wide(Pass3{}, xv[j]), mean, rstd, w, b, col(j), a.offset);
    }
    if (t == 0) {
      if constexpr (K == NormKind::kLayerNorm) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
  }
}

// Registers, three budgets (forward_launch.cuh says which variant gets which):
//   forward_rows       __launch_bounds__(kFwdMaxRowThreads): up to 128 a thread;
//   forward_rows_lean  kFwdLeanRowRegs with __maxnreg__ where that fits without spilling: sm_90
//                      and later (on sm_80, ptxas spills the bf16 rows beside fp32 parameters);
//                      elsewhere, and with nvcc before 12.4 (no __maxnreg__), as forward_rows;
//   forward_rows_pair  two blocks of kFwdMaxRowThreads per SM: 64 a thread;
//   forward_rows_small groups narrower than a warp, in blocks of kFwdBlockThreads.
template <NormKind K, typename T, typename P, int VEC, int NV, bool RES>
__global__ void __launch_bounds__(kFwdMaxRowThreads) forward_rows(FwdArgs<T, P> a, int tpr, int groups) {
  forward_rows_body<K, T, P, VEC, NV, RES, false>(a, tpr, groups, blockIdx.x, gridDim.x);
}

template <NormKind K, typename T, typename P, int VEC, int NV, bool RES>
__global__ void __launch_bounds__(kFwdBlockThreads) forward_rows_small(FwdArgs<T, P> a, int tpr, int groups) {
  forward_rows_body<K, T, P, VEC, NV, RES, true>(a, tpr, groups, blockIdx.x, gridDim.x);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define LNBWD_FWD_LEAN_REGS __maxnreg__(kFwdLeanRowRegs)
#else
#define LNBWD_FWD_LEAN_REGS __launch_bounds__(kFwdMaxRowThreads)
#endif

template <NormKind K, typename T, typename P, int VEC, int NV>
__global__ void LNBWD_FWD_LEAN_REGS forward_rows_lean(FwdArgs<T, P> a, int tpr, int groups) {
  forward_rows_body<K, T, P, VEC, NV, false, false, true>(a, tpr, groups, blockIdx.x, gridDim.x);
}

// The widest register rows (the plain variants whose pick takes kFwdMaxRowThreads threads a row:
// the row group is the whole block) are held to two blocks per SM (fwd_row_pair): an SM's 64K
// registers over two 512-thread blocks are 64 a thread. With one block an SM has no loads in
// flight while that block sums its row and stores it.
template <NormKind K, typename T, typename P, int VEC, int NV>
__global__ void __launch_bounds__(kFwdMaxRowThreads, 2) forward_rows_pair(FwdArgs<T, P> a, int tpr, int groups) {
  forward_rows_body<K, T, P, VEC, NV, false, false>(a, tpr, groups, blockIdx.x, gridDim.x);
}

// Two sets of head rows (QK-norm's q heads and k heads, common/head_rows.h) in one grid: blocks
// [0, blocks0) walk set 0's rows and the others set 1's, each set as forward_rows walks its rows.
// The sets share C, the dtypes and the norm, so one row group serves both (norm_fwd_sets deals
// the blocks to the sets in proportion to their rows). The branch is uniform per block.
template <NormKind K, typename T, typename P, int VEC, int NV, bool SMALL>
__global__ void __launch_bounds__(SMALL ? kFwdBlockThreads : kFwdMaxRowThreads)
forward_rows_sets(FwdSets<T, P> s, int tpr, int groups) {
  if (blockIdx.x < s.blocks0) {
    forward_rows_body<K, T, P, VEC, NV, false, SMALL, false, true>(s.set[0], tpr, groups, blockIdx.x, s.blocks0,
                                                                   s.heads[0]);
  } else {
    forward_rows_body<K, T, P, VEC, NV, false, SMALL, false, true>(s.set[1], tpr, groups, blockIdx.x - s.blocks0,
                                                                   gridDim.x - s.blocks0, s.heads[1]);
  }
}

template <NormKind K, typename T, typename P, int VEC, int NV, bool RES>
cudaError_t launch(const FwdArgs<T, P>& a, const NormFwdConfig& cfg, cudaStream_t stream) {
  // The kernel tests only its last slot against the row's end for 16-byte vectors (see
  // forward_rows_body): that needs NV = ceil(C / VEC / tpr) exactly, as norm_fwd_pick makes it.
  if (VEC > 1 && NV != ceil_div<int64_t>(a.C / VEC, cfg.tpr)) return cudaErrorInvalidValue;
  const unsigned int blocks = cfg.blocks;
  if constexpr (VEC > 1 && NV <= kFwdSmallMaxNv) {
    if (cfg.tpr < 32) {
      forward_rows_small<K, T, P, VEC, NV, RES><<<blocks, cfg.threads, 0, stream>>>(a, cfg.tpr, cfg.rows_per_block);
      return cudaGetLastError();
    }
  }
  if (cfg.tpr < 32) return cudaErrorInvalidValue;   // scalar rows and NV > kFwdSmallMaxNv: whole warps only
  if constexpr (fwd_row_pair(NV, RES)) {
    if (cfg.threads == kFwdMaxRowThreads) {
      forward_rows_pair<K, T, P, VEC, NV><<<blocks, cfg.threads, 0, stream>>>(a, cfg.tpr, cfg.rows_per_block);
      return cudaGetLastError();
    }
  }
  if constexpr (fwd_row_lean(NV, RES, sizeof(T))) {
    forward_rows_lean<K, T, P, VEC, NV><<<blocks, cfg.threads, 0, stream>>>(a, cfg.tpr, cfg.rows_per_block);
  } else {
    forward_rows<K, T, P, VEC, NV, RES><<<blocks, cfg.threads, 0, stream>>>(a, cfg.tpr, cfg.rows_per_block);
  }
  return cudaGetLastError();
}

// The NV variants compiled: every NV up to kFwdMaxNv for 16-byte vectors (the pick uses the
// smallest NV that holds the row, so no thread holds dead registers), and powers of two for
// one element per access (unaligned rows, kept to fewer variants).
template <NormKind K, typename T, typename P, int VEC, bool RES>
cudaError_t launch_nv(const FwdArgs<T, P>& a, const NormFwdConfig& cfg, cudaStream_t stream) {
  static_assert(kFwdMaxNv == 8, "the variant list below covers NV = 1..8");
  switch (cfg.nv) {
    case 1: return launch<K, T, P, VEC, 1, RES>(a, cfg, stream);
    case 2: return launch<K, T, P, VEC, 2, RES>(a, cfg, stream);
    case 4: return launch<K, T, P, VEC, 4, RES>(a, cfg, stream);
    case 8: return launch<K, T, P, VEC, 8, RES>(a, cfg, stream);
  }
  if constexpr (VEC > 1) {
    switch (cfg.nv) {
      case 3: return launch<K, T, P, VEC, 3, RES>(a, cfg, stream);
      case 5: return launch<K, T, P, VEC, 5, RES>(a, cfg, stream);
      case 6: return launch<K, T, P, VEC, 6, RES>(a, cfg, stream);
      case 7: return launch<K, T, P, VEC, 7, RES>(a, cfg, stream);
    }
  }
  return cudaErrorInvalidValue;
}

// The sets' variants: 16-byte vectors, NV 1 to kFwdSmallMaxNv, groups of up to a warp (the
// configurations norm_fwd_sets picks).
template <NormKind K, typename T, typename P, int VEC>
cudaError_t launch_sets(const FwdSets<T, P>& s, const NormFwdConfig& cfg, cudaStream_t stream) {
  static_assert(kFwdSmallMaxNv == 4, "the variant list below covers NV = 1..4");
  static_assert(32 * kFwdSmallMaxNv * 16 >= kHeadRowsMaxBytes, "a warp's group holds the widest head row");
  if constexpr (VEC == 1) {
    return cudaErrorInvalidValue;
  } else {
  if (cfg.tpr > 32) return cudaErrorInvalidValue;
  const unsigned int blocks = cfg.blocks;
  auto go = [&](auto nv, auto small) -> cudaError_t {
    forward_rows_sets<K, T, P, VEC, decltype(nv)::value, decltype(small)::value>
        <<<blocks, cfg.threads, 0, stream>>>(s, cfg.tpr, cfg.rows_per_block);
    return cudaGetLastError();
  };
  auto with_nv = [&](auto small) -> cudaError_t {
    switch (cfg.nv) {
      case 1: return go(std::integral_constant<int, 1>{}, small);
      case 2: return go(std::integral_constant<int, 2>{}, small);
      case 3: return go(std::integral_constant<int, 3>{}, small);
      case 4: return go(std::integral_constant<int, 4>{}, small);
    }
    return cudaErrorInvalidValue;
  };
  return cfg.tpr < 32 ? with_nv(std::true_type{}) : with_nv(std::false_type{});
  }
}

}  // namespace

cudaError_t norm_fwd_rows(const NormFwdParams& p, const NormFwdConfig& cfg, cudaStream_t stream) {
  if (cfg.path != FwdPath::kRegisters) return cudaErrorInvalidValue;
  return dispatch_fwd_variant(p, cfg, [&](auto kind, auto t, auto pt, auto vec, auto res) -> cudaError_t {
    using T = decltype(t);
    using P = decltype(pt);
    constexpr NormKind K = decltype(kind)::value;
    return launch_nv<K, T, P, decltype(vec)::value, decltype(res)::value>(fwd_args<T, P>(p), cfg, stream);
  });
}

cudaError_t norm_fwd_rows_sets(const NormFwdParams& a, const NormFwdParams& b, const NormFwdConfig& cfg,
                               unsigned int blocks0, cudaStream_t stream) {
  if (cfg.path != FwdPath::kRegisters) return cudaErrorInvalidValue;
  return dispatch_fwd_variant(a, cfg, [&](auto kind, auto t, auto pt, auto vec, auto res) -> cudaError_t {
    using T = decltype(t);
    using P = decltype(pt);
    if constexpr (decltype(res)::value) {
      return cudaErrorInvalidValue;   // the sets have no residual variant
    } else {
      FwdSets<T, P> s;
      s.set[0] = fwd_args<T, P>(a);
      s.set[1] = fwd_args<T, P>(b);
      s.heads[0] = head_layout(a);
      s.heads[1] = head_layout(b);
      s.blocks0 = blocks0;
      return launch_sets<decltype(kind)::value, T, P, decltype(vec)::value>(s, cfg, stream);
    }
  });
}

}  // namespace lnbwd
