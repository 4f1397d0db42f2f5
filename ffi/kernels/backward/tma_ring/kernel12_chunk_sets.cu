// QK-norm's backward on kernel 12's ring of row chunks (sm_90), for q and k in buffers of their
// own: one launch of kernel12_chunks a set (kernel12_chunk_rows.cuh, the kernel a tensor's
// backward runs), each on the whole grid over its own set's rows as one segment, writing its
// set's segment of partial slots; then one finalize_partials launch for both dweights
// (run_sets_grid, backward/sets.cuh). That streams as two calls of the ring do, with one finalize
// and one custom call fewer; for short rows the second launch is programmatic (below). One grid
// over both sets streamed more slowly than two launches (docs/kernel12.md). Head rows inside the
// fused projection are not taken here: kernel 11's sets run them (backward/sets.cu).
#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "backward/sets.cuh"
#include "backward/tma_ring/kernel12.h"
#include "backward/tma_ring/kernel12_chunk_rows.cuh"

namespace lnbwd {

namespace {

template <typename T, typename O, int VEC, bool RMS, int TPR, int RPG>
cudaError_t launch(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kThreads = kernel12_chunk_threads(sizeof(T));
  if (cfg.tpr * cfg.groups != kThreads) return cudaErrorInvalidValue;
  const size_t smem = kernel12_chunk_smem_bytes(cfg, a.C, sizeof(T), sizeof(acc_t<T>), false);
  auto kernel = kernel12_chunks<T, O, false, VEC, RMS, kThreads, TPR, RPG>;
  // As many blocks an SM as fit, as a tensor's launch runs (launch_with_partials, kOccupancy).
  return run_sets_grid<T>(
      a, b, SetsGrid::kApart, reinterpret_cast<const void*>(kernel), kThreads, smem, cfg.groups * cfg.nv, 12,
      "ring of row chunks, a launch a set", stream, [&](int blocks, NormArgs<acc_t<T>> norm, const DeviceLimits& lim) -> cudaError_t {
        // For short rows (kKernel12SetsOverlapRowBytes) the second set's launch is programmatic
        // where the stream allows it: its blocks start as the first set's leave the SMs (the first
        // grid lets dependents launch from its start), and each ends only once the first grid has
        // (wait_for_earlier_grid), so that the finalize, launched the same way after it, finds
        // both sets' slots.
        const bool overlap = static_cast<size_t>(a.C) * sizeof(T) <= kKernel12SetsOverlapRowBytes &&
                             dependent_launch_ok(lim, stream);
        int k = 0;
        for (const NormBwdParams* p : {&a, &b}) {
          // The set's rows as one segment of `blocks` blocks, into its own segment of slots;
          // no finish in the grid (finish.dweight null): run_sets_grid's finalize adds both.
          const BwdSet<T, O> s = bwd_set_of<T, O>(*p);
          acc_t<T>* segment = partials_of<T>(a) + static_cast<size_t>(k) * blocks * 2 * a.C;
          cudaLaunchConfig_t launch = launch_config(dim3(static_cast<unsigned int>(blocks)), dim3(kThreads), smem,
                                                    stream, k > 0 && overlap);
          LNBWD_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&launch, kernel, s.dx, segment, s.dy, s.x, s.weight,
                                                        static_cast<const T*>(nullptr), s.mean, s.rstd, s.rows, blocks,
                                                        int64_t{0}, static_cast<int>(a.C), norm, GridFinish<T, O>{},
                                                        cfg.nb));
          ++k;
        }
        return cudaSuccess;
      });
}

}  // namespace

cudaError_t norm_bwd_kernel12_chunk_sets(const NormBwdParams& a, const NormBwdParams& b, const Kernel12Config& cfg,
                                         cudaStream_t stream) {
  if (!cfg.chunks || !bwd_sets_ok(a, b) || a.heads.heads > 0 || b.heads.heads > 0) return cudaErrorInvalidValue;
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
        auto rows = [&](auto rpg) -> cudaError_t {
          constexpr int kRpg = decltype(rpg)::value;
          if (a.norm == NormKind::kRmsNorm) return launch<T, O, vec, true, kTpr, kRpg>(a, b, cfg, stream);
          return launch<T, O, vec, false, kTpr, kRpg>(a, b, cfg, stream);
        };
        if (cfg.nv == 1) return rows(std::integral_constant<int, 1>{});
        if (cfg.nv == 2) return rows(std::integral_constant<int, 2>{});
        return cudaErrorInvalidValue;
      });
    }
  });
}

}  // namespace lnbwd
