// QK-norm's backward in one launch on kernel 12's ring of row chunks (sm_90): the two sets of
// head rows (backward/sets.cuh) walked by one persistent grid, each block a set's share as
// kernel12_chunks walks a segment's (kernel12_chunk_rows.cuh), then one finalize_partials
// launch for both dweights. Head rows inside the fused projection reach the ring a token's run
// of heads per bulk copy (issue_head_chunk); q and k in buffers of their own, one copy a chunk.
#include "backward/launch.cuh"
#include "backward/sets.cuh"
#include "backward/tma_ring/kernel12.h"
#include "backward/tma_ring/kernel12_chunk_rows.cuh"

namespace lnbwd {

namespace {

// Blocks [0, blocks0) walk set 0's rows, the others set 1's. One row a group per chunk (the
// pick's). HEADS: some set is head rows inside wider token rows (the fused projection); without,
// both sets are contiguous.
template <typename T, typename O, int VEC, bool RMS, int THREADS, int TPR, bool HEADS>
__global__ void __launch_bounds__(THREADS, kernel12_chunk_blocks_per_sm(THREADS))
kernel12_chunk_sets(acc_t<T>* __restrict__ partials, BwdSets<T, O> sets, int C, NormArgs<acc_t<T>> norm, int nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  const int k = set_of_block(partials, sets.blocks0, C);
  // Each field chosen by the (block-uniform) set: a select of two parameters, no local copy.
  auto pick = [k](auto a, auto b) { return k ? b : a; };
  const BwdSet<T, O>& s0 = sets.set[0];
  const BwdSet<T, O>& s1 = sets.set[1];
  const HeadRows heads{pick(s0.heads.heads, s1.heads.heads), pick(s0.heads.token_stride, s1.heads.token_stride)};
  kernel12_chunk_rows<T, O, false, VEC, RMS, THREADS, TPR, 1, HEADS>(
      pick(s0.dx, s1.dx), partials + (static_cast<size_t>(k) * gridDim.x + blockIdx.x) * 2 * C, pick(s0.dy, s1.dy),
      pick(s0.x, s1.x), pick(s0.weight, s1.weight), nullptr, pick(s0.mean, s1.mean), pick(s0.rstd, s1.rstd),
      pick(s0.rows, s1.rows), k ? blockIdx.x - sets.blocks0 : blockIdx.x,
      k ? static_cast<int>(gridDim.x) - sets.blocks0 : sets.blocks0, heads, C, norm, nb);
#endif
}

template <typename T, typename O, int VEC, bool RMS, int TPR>
cudaError_t launch(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kThreads = kernel12_chunk_threads(sizeof(T));
  if (cfg.tpr * cfg.groups != kThreads || cfg.nv != 1) return cudaErrorInvalidValue;
  const bool heads = a.heads.heads > 0 || b.heads.heads > 0;
  auto kernel = heads ? kernel12_chunk_sets<T, O, VEC, RMS, kThreads, TPR, true>
                      : kernel12_chunk_sets<T, O, VEC, RMS, kThreads, TPR, false>;
  return launch_sets_grid<T, O>(a, b, kernel, kThreads,
                                kernel12_chunk_smem_bytes(cfg, a.C, sizeof(T), sizeof(acc_t<T>), false), cfg.groups,
                                12, "ring of row chunks, two sets", stream, cfg.nb);
}

}  // namespace

cudaError_t norm_bwd_kernel12_chunk_sets(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg,
                                         cudaStream_t stream) {
  if (!cfg.chunks || !bwd_sets_ok(a, b)) return cudaErrorInvalidValue;
  return dispatch_types(a, [&](auto t, auto o, auto) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr int vec = 16 / sizeof(T);
    if constexpr (sizeof(T) == 8) {
      return cudaErrorInvalidValue;
    } else {
      if (cfg.tpr * vec < a.C || (!a.plan_only && (!can_vectorize<T>(a) || !can_vectorize<T>(b)))) {
        return cudaErrorInvalidValue;
      }
      return with_chunk_tpr(cfg.tpr, [&](auto tpr) -> cudaError_t {
        constexpr int kTpr = decltype(tpr)::value;
        if (a.norm == NormKind::kRmsNorm) return launch<T, O, vec, true, kTpr>(a, b, cfg, stream);
        return launch<T, O, vec, false, kTpr>(a, b, cfg, stream);
      });
    }
  });
}

}  // namespace lnbwd
