// Finalize pass shared by the kernels that leave per-block partial sums in the workspace:
//   dbias[seg][c]   = sum over the segment's slots s of partials[s][0][c]
//   dweight[seg][c] = sum over the segment's slots s of partials[s][1][c]
// where segment seg owns slots [seg * slots, (seg + 1) * slots) (one segment unless vmapped).
// Deterministic: every column is summed over the slots in the same fixed order every run.
//
// Layout of one block: 32 columns (one per lane, so every load of a warp is one 128-byte line)
// times kSlotLanes rows of threads; thread (lane, j) sums slots j, j + kSlotLanes, ... and the
// kSlotLanes partial sums are then added in order through shared memory. Splitting the slots
// over kSlotLanes threads keeps kSlotLanes independent loads in flight per column, which matters
// when C is small (few blocks) and there are hundreds of slots.
#include "dispatch.cuh"
#include "partials_finalize.h"

namespace lnbwd {
namespace {

constexpr int kSlotLanes = 16;

template <typename T>
__global__ void __launch_bounds__(32 * kSlotLanes)
finalize_partials(T* __restrict__ dweight, T* __restrict__ dbias, const acc_t<T>* __restrict__ partials,
                  int slots, int C) {
  using A = acc_t<T>;
  __shared__ A sums[2][kSlotLanes][32];
  const int lane = threadIdx.x % 32;
  const int j = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + lane;
  const size_t segment = blockIdx.y;
  partials += segment * slots * 2 * C;
  dweight += segment * C;
  dbias += segment * C;
  A sb = A(0), sw = A(0);
  if (c < C) {
    for (int s = j; s < slots; s += kSlotLanes) {
      const A* slot = partials + static_cast<size_t>(s) * 2 * C;
      sb += __ldcg(slot + c);        // .cg: the slots were just written by another kernel
      sw += __ldcg(slot + C + c);
    }
  }
  sums[0][j][lane] = sb;
  sums[1][j][lane] = sw;
  __syncthreads();
  if (j == 0 && c < C) {
    A tb = A(0), tw = A(0);
#pragma unroll
    for (int k = 0; k < kSlotLanes; ++k) { tb += sums[0][k][lane]; tw += sums[1][k][lane]; }
    dbias[c] = from_acc<T>(tb);
    dweight[c] = from_acc<T>(tw);
  }
}

}  // namespace

cudaError_t finalize_partials_launch(const LayernormBwdParams& p, int slots, cudaStream_t stream) {
  if (p.segments > 65535) return cudaErrorInvalidConfiguration;   // grid.y limit
  return dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    const dim3 blocks(static_cast<unsigned int>(ceil_div<int64_t>(p.C, 32)), static_cast<unsigned int>(p.segments));
    finalize_partials<T><<<blocks, 32 * kSlotLanes, 0, stream>>>(
        static_cast<T*>(p.dweight), static_cast<T*>(p.dbias), partials_of<T>(p), slots, static_cast<int>(p.C));
    return cudaGetLastError();
  });
}

}  // namespace lnbwd
