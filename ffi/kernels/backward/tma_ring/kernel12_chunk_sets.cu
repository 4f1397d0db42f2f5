// QK-norm's backward on kernel 12's ring of row chunks (sm_90): one launch a set
// (launch_sets_apart, backward/sets.cuh), each on the whole grid, each block walking its share of
// the set's rows as kernel12_chunks walks a segment's (kernel12_chunk_rows.cuh), then one
// finalize_partials launch for both dweights. That streams as two calls of the ring do, with one
// finalize and one custom call fewer; one grid over both sets streamed more slowly than two
// launches (docs/kernel12.md). q and k in buffers of their own take one bulk copy a chunk; head
// rows inside the fused projection a token's run of heads per copy (issue_head_chunk).
#include "backward/launch.cuh"
#include "backward/sets.cuh"
#include "backward/tma_ring/kernel12.h"
#include "backward/tma_ring/kernel12_chunk_rows.cuh"

namespace lnbwd {

namespace {

// One set's rows on the whole grid: block b writes slot b of `segment` (the set's slots), zeros
// if the set has no chunk for it. One row a group per chunk (the pick's). HEADS: the set's rows
// are head rows inside wider token rows (the fused projection), else contiguous.
template <typename T, typename O, int VEC, bool RMS, int THREADS, int TPR, bool HEADS>
__global__ void __launch_bounds__(THREADS, kernel12_chunk_blocks_per_sm(THREADS))
kernel12_chunk_set(acc_t<T>* __restrict__ segment, BwdSet<T, O> set, int C, NormArgs<acc_t<T>> norm, int nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  allow_finalize_launch();
  kernel12_chunk_rows<T, O, false, VEC, RMS, THREADS, TPR, 1, HEADS>(
      set.dx, segment + static_cast<size_t>(blockIdx.x) * 2 * C, set.dy, set.x, set.weight, nullptr, set.mean,
      set.rstd, set.rows, blockIdx.x, static_cast<int>(gridDim.x), set.heads, C, norm, nb);
#endif
}

template <typename T, typename O, int VEC, bool RMS, int TPR>
cudaError_t launch(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kThreads = kernel12_chunk_threads(sizeof(T));
  if (cfg.tpr * cfg.groups != kThreads || cfg.nv != 1) return cudaErrorInvalidValue;
  const size_t smem = kernel12_chunk_smem_bytes(cfg, a.C, sizeof(T), sizeof(acc_t<T>), false);
  const bool heads = a.heads.heads > 0 || b.heads.heads > 0;
  auto kernel = heads ? kernel12_chunk_set<T, O, VEC, RMS, kThreads, TPR, true>
                      : kernel12_chunk_set<T, O, VEC, RMS, kThreads, TPR, false>;
  // As many blocks an SM as kernel12_chunks runs, the count it measured fastest at (kernel12.h);
  // this kernel's fewer registers would let more fit.
  return launch_sets_apart<T, O>(a, b, kernel, kThreads, smem, kernel12_chunk_blocks_per_sm(kThreads), cfg.groups, 12,
                                 "ring of row chunks, a launch a set", stream, cfg.nb);
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
