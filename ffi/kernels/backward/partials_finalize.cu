// The finalize pass of the kernels that leave per-block partial sums in the workspace (kernels
// 11 and 12, launch_with_partials in launch.cuh):
//   dbias[seg][c]   = sum over the segment's slots s of partials[s][0][c]
//   dweight[seg][c] = sum over the segment's slots s of partials[s][1][c]
// where segment seg owns slots [seg * slots, (seg + 1) * slots) (one segment unless vmapped).
// Deterministic: every column is summed over the slots in the same fixed order every run.
//
// One block per tile of 32 * V columns of one segment (sum_partials_tile, partials_sum.cuh, which
// says why each thread loads BATCH slots before adding them). The grid is one-dimensional over
// (segment, tile), so any number of segments works (a grid's y dimension stops at 65535).
// Shapes, chosen before the launch:
//  * V, columns per lane: the narrowest tiles of which there are no more than SMs (finish_vec),
//    so that wide rows take fewer, larger 16-byte loads and narrow rows spread over more SMs;
//  * warps per block: enough that one round of BATCH loads per thread covers a segment's slots
//    (a slot per block of a grid sized to the GPU: about 132 on an H200), at most 16. A tile's
//    time is one round trip to L2 for the loads, then the warps' sums added in warp order, one
//    after another: few warps with many loads each keep that chain short. One slot a segment
//    (many vmapped segments): one warp.
//
// Programmatic dependent launch (sm_90). The finalize kernel is launched while the kernel that
// writes the partials still runs, and waits for it on the GPU (griddepcontrol.wait: the earlier
// grid has completed and its writes are visible). Its launch then overlaps the earlier kernel's
// tail instead of following it. Stream capture records the dependency as a programmatic edge, so
// XLA's command buffers (CUDA graphs) keep it.
#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "backward/partials_sum.cuh"

namespace lnbwd {
namespace {

constexpr int kMaxWarps = 16;
// Slots whose loads a thread issues before it adds them: 2 * BATCH * V accumulators in registers.
template <int V>
constexpr int kBatch = V == 1 ? 16 : 8;

// At most MAX_WARPS warps (blockDim.x / 32 of them run) per tile of 32 * V columns. O: the type
// of dweight and dbias (T, or float beside 16-bit T: mixed precision).
template <typename T, typename O, int V, int MAX_WARPS>
__global__ void __launch_bounds__(32 * MAX_WARPS)
finalize_partials(O* __restrict__ dweight, O* __restrict__ dbias, const acc_t<T>* __restrict__ partials,
                  int slots, int C, int tiles) {
  __shared__ __align__(16) acc_t<T> sums[2 * MAX_WARPS * 32 * V];
  const int64_t segment = blockIdx.x / tiles;
  const int tile = static_cast<int>(blockIdx.x % tiles);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");   // the partials' writer has finished
#endif
  sum_partials_tile<T, kBatch<V>, V, O>(dweight + segment * C, dbias ? dbias + segment * C : nullptr,
                                  partials + segment * slots * 2 * static_cast<size_t>(C), slots, C, tile * 32 * V,
                                  static_cast<int>(blockDim.x / 32), sums);
}

}  // namespace

// Whether the finalize launch may carry the programmatic-serialization attribute: griddepcontrol
// needs sm_90, and stream capture (XLA's command buffers) records programmatic dependencies from
// CUDA 12.3 on; an older driver that is capturing gets a plain launch, and so does the legacy
// default stream (the standalone harness's checks), which synchronizes with every other stream.
bool dependent_launch_ok(const DeviceLimits& lim, cudaStream_t stream) {
  if (lim.cc_major < 9 || stream == nullptr || stream == cudaStreamLegacy) return false;
  static const int driver = [] {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
  }();
  if (driver >= 12030) return true;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return capturing == cudaStreamCaptureStatusNone;
}

cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool programmatic) {
  // One attribute for every launch: cudaLaunchKernelEx reads it during the call and no launch
  // changes it.
  static cudaLaunchAttribute programmatic_attr = [] {
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
    return a;
  }();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &programmatic_attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cfg;
}

namespace {

template <typename T, typename O, int V, int MAX_WARPS>
cudaError_t launch(const NormBwdParams& p, const DeviceLimits& lim, int slots, cudaStream_t stream) {
  const int64_t tiles = ceil_div<int64_t>(p.C, 32 * V);
  if (tiles * p.segments > INT32_MAX) return cudaErrorInvalidConfiguration;
  const int warps = static_cast<int>(std::clamp<int64_t>(ceil_div<int64_t>(slots, kBatch<V>), 1, MAX_WARPS));
  cudaLaunchConfig_t cfg = launch_config(dim3(static_cast<unsigned int>(tiles * p.segments)), dim3(32 * warps), 0,
                                         stream, dependent_launch_ok(lim, stream));
  return cudaLaunchKernelEx(&cfg, finalize_partials<T, O, V, MAX_WARPS>, static_cast<O*>(p.dweight),
                            static_cast<O*>(p.dbias), static_cast<const acc_t<T>*>(partials_of<T>(p)), slots,
                            static_cast<int>(p.C), static_cast<int>(tiles));
}

}  // namespace

cudaError_t finalize_partials_launch(const NormBwdParams& p, const DeviceLimits& lim, int slots,
                                     cudaStream_t stream) {
  if (slots < 1) return cudaErrorInvalidValue;
  return dispatch_types(p, [&](auto t, auto o, auto) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    const int vec = finish_vec<T>(p.C, p.segments, lim.sms);
    if constexpr (kFinishMaxVec<T> >= 4) {
      if (vec == 4) return launch<T, O, 4, kMaxWarps>(p, lim, slots, stream);
    }
    if (vec == 2) return launch<T, O, 2, kMaxWarps>(p, lim, slots, stream);
    return launch<T, O, 1, kMaxWarps>(p, lim, slots, stream);
  });
}

}  // namespace lnbwd
