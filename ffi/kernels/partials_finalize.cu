// Finalize pass shared by the kernels that leave per-block partial sums in the workspace:
//   dbias[seg][c]   = sum over the segment's slots s of partials[s][0][c]
//   dweight[seg][c] = sum over the segment's slots s of partials[s][1][c]
// where segment seg owns slots [seg * slots, (seg + 1) * slots) (one segment unless vmapped).
// Deterministic: every column is summed over the slots in the same fixed order every run.
//
// Layout of one block: 32 columns (one per lane, so every load of a warp is one 128-byte line)
// times LANES rows of threads; thread (lane, j) sums slots j, j + LANES, ... and the LANES
// partial sums are then added in order through shared memory.
//
// Why several slots per thread: the kernel reads 2 * C * slots accumulators, and each round
// trip to L2 costs about a microsecond under load. With one load in flight per thread the
// finalize was a chain of such round trips: 6 us at C = 1600 with 132 slots, against 44 us for
// the main kernel (ncu). Each thread now loads BATCH = 4 slots of both sums before it adds any
// of them (the loads are hoisted, not the additions: each sum still runs over its slots in
// order): 4 us.
//
// Two shapes of block, measured on an H200 (tests/cuda/harness.cu sweep, whole backward):
//  * C <= 8192: 32 lanes. Few columns, so few blocks: every lane adds loads in flight.
//  * C > 8192: 16 lanes. Enough columns to fill the GPU, and more requests at once only queue:
//    at C = 16384 (17 MB of partials) the backward took 134 us with 32 lanes, 130 with 16.
//
// Programmatic dependent launch (sm_90). The finalize kernel is launched while the kernel that
// writes the partials still runs, and waits for it on the GPU (griddepcontrol.wait: the earlier
// grid has completed and its writes are visible). Its launch then overlaps the earlier kernel's
// tail instead of following it.
#include "dispatch.cuh"
#include "partials_finalize.h"

namespace lnbwd {
namespace {

// LANES threads per column; BATCH slots whose loads a thread issues before it adds them.
template <typename T, int LANES, int BATCH>
__global__ void __launch_bounds__(32 * LANES)
finalize_partials(T* __restrict__ dweight, T* __restrict__ dbias, const acc_t<T>* __restrict__ partials,
                  int slots, int C) {
  using A = acc_t<T>;
  __shared__ A sums[2][LANES][32];
  const int lane = threadIdx.x % 32;
  const int j = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + lane;
  const size_t segment = blockIdx.y;
  partials += segment * slots * 2 * C;
  dweight += segment * C;
  dbias += segment * C;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");   // the partials' writer has finished
#endif
  A sb = A(0), sw = A(0);
  if (c < C) {
    for (int s0 = j; s0 < slots; s0 += BATCH * LANES) {
      A b[BATCH], w[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int s = s0 + u * LANES;
        if (s < slots) {
          const A* slot = partials + static_cast<size_t>(s) * 2 * C;
          b[u] = __ldcg(slot + c);        // .cg: the slots were just written by another kernel
          w[u] = __ldcg(slot + C + c);
        }
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        if (s0 + u * LANES < slots) {
          sb += b[u];
          sw += w[u];
        }
      }
    }
  }
  sums[0][j][lane] = sb;
  sums[1][j][lane] = sw;
  __syncthreads();
  // Warp 0 adds the dbias lanes, warp 1 the dweight lanes, each in lane order.
  if (j < 2 && c < C) {
    A t = A(0);
#pragma unroll
    for (int k = 0; k < LANES; ++k) t += sums[j][k][lane];
    (j == 0 ? dbias : dweight)[c] = from_acc<T>(t);
  }
}

template <typename T, int LANES, int BATCH>
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
  return cudaLaunchKernelEx(&cfg, finalize_partials<T, LANES, BATCH>, static_cast<T*>(p.dweight),
                            static_cast<T*>(p.dbias), static_cast<const acc_t<T>*>(partials_of<T>(p)), slots,
                            static_cast<int>(p.C));
}

}  // namespace

cudaError_t finalize_partials_launch(const LayernormBwdParams& p, int slots, cudaStream_t stream) {
  if (p.segments > 65535) return cudaErrorInvalidConfiguration;   // grid.y limit
  return dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    return p.C <= 8192 ? launch<T, 32, 4>(p, slots, stream) : launch<T, 16, 4>(p, slots, stream);
  });
}

}  // namespace lnbwd
