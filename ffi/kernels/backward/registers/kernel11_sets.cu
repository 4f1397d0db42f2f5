// QK-norm's backward in one launch on kernel 11's row loop (kernel11_body.cuh): the two sets of
// head rows (backward/sets.cuh) walked by one persistent grid, then one finalize_partials launch
// for both dweights. The configuration is kernel 11's pick for C, held to row groups of at most a
// warp (the head rows' widest is kHeadRowsMaxBytes).
#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/registers/kernel11_body.cuh"
#include "backward/sets.cuh"

namespace lnbwd {
namespace {

// A block of kernel11_sets: the rows of its set, the set's blocks, and its slot in the set's
// segment of slots.
struct SetRows {
  int64_t first;   // the block's index among its set's blocks: its groups' first rows
  int64_t end;     // the set's rows
  int bps;         // the set's blocks
  size_t own_slot;
  HeadRows heads;
  __device__ __forceinline__ BlockRows rows() const { return {first, end, bps, 0}; }
  __device__ __forceinline__ size_t slot() const { return own_slot; }
};

// Two sets of head rows in one grid (QK-norm's q heads and k heads, backward/sets.cuh): blocks
// [0, blocks0) walk set 0's rows, the others set 1's, as kernel 11 walks a segment.
// HEADS: some set is head rows inside wider token rows (the fused projection); without, both sets
// are contiguous and the row loop is kernel 11's own (row * C), with no cursor to hold.
template <typename T, typename O, int VEC, int NV, bool PREFETCH, Rows R, bool HEADS>
__global__ void __launch_bounds__(block_threads<R, NV>(), min_blocks<R, NV, PREFETCH>())
kernel11_sets(acc_t<T>* __restrict__ partials, BwdSets<T, O> sets, int C, NormArgs<acc_t<T>> norm, int tpr,
              int groups) {
  allow_finalize_launch();
  const int k = set_of_block(partials, sets.blocks0, C);
  // Each field chosen by the (block-uniform) set: a select of two parameters, no local copy.
  auto pick = [k](auto a, auto b) { return k ? b : a; };
  const BwdSet<T, O>& s0 = sets.set[0];
  const BwdSet<T, O>& s1 = sets.set[1];
  const SetRows where{k ? blockIdx.x - sets.blocks0 : blockIdx.x, pick(s0.rows, s1.rows),
                      k ? static_cast<int>(gridDim.x) - sets.blocks0 : sets.blocks0,
                      static_cast<size_t>(k) * gridDim.x + blockIdx.x,
                      HeadRows{pick(s0.heads.heads, s1.heads.heads), pick(s0.heads.token_stride, s1.heads.token_stride)}};
  kernel11_body<T, O, false, VEC, NV, PREFETCH, R, HEADS>(pick(s0.dx, s1.dx), partials, pick(s0.dy, s1.dy),
                                                         pick(s0.x, s1.x), pick(s0.weight, s1.weight), nullptr,
                                                         pick(s0.mean, s1.mean), pick(s0.rstd, s1.rstd), where, C,
                                                         norm, tpr, groups);
}

// The launch (backward/sets.cuh) of the kernel of this configuration (plan_only: the plan).
template <typename T, typename O, int VEC, int NV, bool PREFETCH, Rows R>
cudaError_t launch_sets(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                        cudaStream_t stream) {
  constexpr bool compiled = VEC > 1 && variant(R, NV, PREFETCH);
  if constexpr (!compiled) {
    return cudaErrorInvalidValue;
  } else {
    const bool heads = a.heads.heads > 0 || b.heads.heads > 0;
    auto kernel = heads ? kernel11_sets<T, O, VEC, NV, PREFETCH, R, true> : kernel11_sets<T, O, VEC, NV, PREFETCH, R, false>;
    return launch_sets_grid<T, O>(a, b, kernel, cfg.tpr * cfg.groups, kernel11_smem_bytes(cfg, a.C, sizeof(acc_t<T>)),
                                  cfg.groups, 11, "head rows, two sets", stream, cfg.tpr, cfg.groups);
  }
}

template <typename T, typename O, int VEC>
cudaError_t launch_variant(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                           cudaStream_t stream) {
  auto with_rows = [&](auto nv, auto prefetch) -> cudaError_t {
    constexpr int NV = decltype(nv)::value;
    constexpr bool PF = decltype(prefetch)::value;
    if (cfg.tpr == 32) return launch_sets<T, O, VEC, NV, PF, Rows::kWarps>(a, b, cfg, stream);
    if (cfg.tpr > 32 || cfg.tpr * cfg.groups != kSmallThreads) return cudaErrorInvalidValue;
    if (!cfg.reg_sums) return launch_sets<T, O, VEC, NV, PF, Rows::kSmallShared>(a, b, cfg, stream);
    return a.norm == NormKind::kRmsNorm ? launch_sets<T, O, VEC, NV, PF, Rows::kSmallRegsRms>(a, b, cfg, stream)
                                        : launch_sets<T, O, VEC, NV, PF, Rows::kSmallRegs>(a, b, cfg, stream);
  };
  using std::integral_constant;
  if (cfg.prefetch) {
    switch (cfg.nv) {
      case 1: return with_rows(integral_constant<int, 1>{}, std::true_type{});
      case 2: return with_rows(integral_constant<int, 2>{}, std::true_type{});
    }
    return cudaErrorInvalidValue;
  }
  switch (cfg.nv) {
    case 2: return with_rows(integral_constant<int, 2>{}, std::false_type{});
    case 3: if constexpr (sizeof(T) <= 4) return with_rows(integral_constant<int, 3>{}, std::false_type{}); break;
    case 4: return with_rows(integral_constant<int, 4>{}, std::false_type{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t norm_bwd_sets_config(const NormBwdParams& a, const NormBwdParams& b, const Kernel11Config& cfg,
                                 cudaStream_t stream) {
  if (!bwd_sets_ok(a, b)) return cudaErrorInvalidValue;
  return dispatch_types(a, [&](auto t, auto o, auto) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr int vec = 16 / sizeof(T);
    if (cfg.vec != vec || (!a.plan_only && (!can_vectorize<T>(a) || !can_vectorize<T>(b)))) {
      return cudaErrorInvalidValue;
    }
    return launch_variant<T, O, vec>(a, b, cfg, stream);
  });
}

}  // namespace lnbwd
