// Kernel 11, our default backward: each row is read from DRAM exactly once and kept in registers
// between the two passes; dx is written once; dweight/dbias go through per-block fp32 partial
// sums and a finalize pass. Deterministic: no float atomics anywhere. The row loop, and how a
// block's groups share rows and keep their sums, is kernel11_body.cuh's; this file holds the
// kernel over segments and its launch.
#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "backward/registers/kernel11.h"
#include "backward/registers/kernel11_body.cuh"

namespace lnbwd {
namespace {

// Segments (per-example sums under vmap): blocks [s * bps, (s + 1) * bps) work on the rows of
// segment s only, so each partial slot holds sums of a single segment.
struct SegmentRows {
  int64_t rows_per_segment;
  int bps;
  int64_t weight_stride;
  HeadRows heads;   // unused: contiguous rows
  __device__ __forceinline__ BlockRows rows() const {
    const int64_t segment = blockIdx.x / bps;
    return {segment * rows_per_segment + blockIdx.x % bps, (segment + 1) * rows_per_segment, bps,
            segment * weight_stride};
  }
  __device__ __forceinline__ size_t slot() const { return blockIdx.x; }
};

// Kernel 11 (PartialsKernel, launch.cuh).
template <typename T, typename O, bool RESID, int VEC, int NV, bool PREFETCH, Rows R>
__global__ void __launch_bounds__(block_threads<R, NV>(), min_blocks<R, NV, PREFETCH>())
kernel11_rows(T* __restrict__ dx, acc_t<T>* __restrict__ partials, const T* __restrict__ dy,
              const T* __restrict__ x, const O* __restrict__ weight, const T* dresidual,
              const stat_t<T>* __restrict__ mean, const stat_t<T>* __restrict__ rstd, int64_t rows_per_segment,
              int blocks_per_segment, int64_t weight_stride, int C, NormArgs<acc_t<T>> norm, GridFinish<T, O> finish, int tpr,
              int groups) {
  using A = acc_t<T>;
  allow_finalize_launch();
  kernel11_body<T, O, RESID, VEC, NV, PREFETCH, R, false>(
      dx, partials, dy, x, weight, dresidual, mean, rstd,
      SegmentRows{rows_per_segment, blocks_per_segment, weight_stride, {}}, C, norm, tpr, groups);
  if (finish.dweight) {
    extern __shared__ __align__(32) unsigned char smem[];
    if constexpr (R != Rows::kWarps) {
      finish_partials_in_grid_call(finish, partials, blocks_per_segment, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
    } else {
      finish_partials_in_grid(finish, partials, blocks_per_segment, C, blockDim.x / 32, reinterpret_cast<A*>(smem));
    }
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
  if (!cfg.reg_sums) return launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kSmallShared>(p, cfg, stream);
  return p.norm == NormKind::kRmsNorm ? launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kSmallRegsRms>(p, cfg, stream)
                                     : launch_rows<T, O, RESID, VEC, NV, PREFETCH, Rows::kSmallRegs>(p, cfg, stream);
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

