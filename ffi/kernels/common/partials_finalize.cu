// Finalize pass for the kernels that leave per-block partial sums in the workspace, when their
// grid could not finish the sums itself (launch_with_partials, dispatch.cuh: more blocks than fit
// on the GPU at once, which only many vmapped segments ask for):
//   dbias[seg][c]   = sum over the segment's slots s of partials[s][0][c]
//   dweight[seg][c] = sum over the segment's slots s of partials[s][1][c]
// where segment seg owns slots [seg * slots, (seg + 1) * slots) (one segment unless vmapped).
// Deterministic: every column is summed over the slots in the same fixed order every run.
//
// One block per tile of 32 columns of one segment (sum_partials_tile, partials_sum.cuh, which
// also says why each thread loads BATCH = 4 slots before adding them). Two shapes of block,
// measured on an H200 (tests/cuda/harness.cu sweep, whole backward):
//  * C <= 8192: 32 warps. Few columns, so few blocks: every warp adds loads in flight.
//  * C > 8192: 16 warps. Enough columns to fill the GPU, and more requests at once only queue:
//    at C = 16384 (17 MB of partials) the backward took 134 us with 32 warps, 130 with 16.
//
// Programmatic dependent launch (sm_90). The finalize kernel is launched while the kernel that
// writes the partials still runs, and waits for it on the GPU (griddepcontrol.wait: the earlier
// grid has completed and its writes are visible). Its launch then overlaps the earlier kernel's
// tail instead of following it.
#include "common/launch.cuh"
#include "common/partials_finalize.h"
#include "common/partials_sum.cuh"

namespace lnbwd {
namespace {

// LANES warps per tile of 32 columns; BATCH slots whose loads a thread issues before it adds them.
// O: the type of dweight and dbias (T, or float beside 16-bit T: mixed precision).
template <typename T, typename O, int LANES, int BATCH>
__global__ void __launch_bounds__(32 * LANES)
finalize_partials(O* __restrict__ dweight, O* __restrict__ dbias, const acc_t<T>* __restrict__ partials,
                  int slots, int C) {
  __shared__ acc_t<T> sums[2 * LANES * 32];
  const size_t segment = blockIdx.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");   // the partials' writer has finished
#endif
  sum_partials_tile<T, BATCH, 1, O>(dweight + segment * C, dbias + segment * C, partials + segment * slots * 2 * C, slots,
                              C, blockIdx.x * 32, LANES, sums);
}

template <typename T, typename O, int LANES, int BATCH>
cudaError_t launch(const LayernormBwdParams& p, int slots, cudaStream_t stream) {
  int major = 0;
  LNBWD_RETURN_IF_CUDA_ERROR(compute_capability_major(&major));
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(ceil_div<int64_t>(p.C, 32)), static_cast<unsigned int>(p.segments));
  cfg.blockDim = dim3(32 * LANES);
  cfg.stream = stream;
  cfg.attrs = &dependent;
  cfg.numAttrs = major >= 9 ? 1 : 0;   // griddepcontrol needs sm_90; before it, a plain launch
  return cudaLaunchKernelEx(&cfg, finalize_partials<T, O, LANES, BATCH>, static_cast<O*>(p.dweight),
                            static_cast<O*>(p.dbias), static_cast<const acc_t<T>*>(partials_of<T>(p)), slots,
                            static_cast<int>(p.C));
}

}  // namespace

cudaError_t finalize_partials_launch(const LayernormBwdParams& p, int slots, cudaStream_t stream) {
  if (p.segments > 65535) return cudaErrorInvalidConfiguration;   // grid.y limit
  return dispatch_types(p, [&](auto t, auto o, auto) {
    using T = decltype(t);
    using O = decltype(o);
    return p.C <= 8192 ? launch<T, O, 32, 4>(p, slots, stream) : launch<T, O, 16, 4>(p, slots, stream);
  });
}

}  // namespace lnbwd
