// Device code shared by the two ways the per-block partial slots become dweight and dbias: the
// finalize_partials kernel (partials_finalize.cu, the default) and, opted in with
// JAX_LNBWD_COOPERATIVE_FINISH=1, a cooperative grid that finishes its own sums after a
// grid-wide barrier (finish_partials_in_grid, kernels 11 and 12). Both add every column over the
// slots in the same fixed order every run: deterministic.
//   dbias[c]   = sum over slots s of partials[s][0][c]   (not written when dbias is null: RMSNorm)
//   dweight[c] = sum over slots s of partials[s][1][c]
// T is the data's type (it sets the accumulator, acc_t<T>, and the tuning), O the type dweight
// and dbias are stored as: T, or float beside 16-bit data (mixed precision; acc_t<O> == acc_t<T>).
#pragma once

#include <cooperative_groups.h>

#include "common/vec.cuh"

namespace lnbwd {

// One tile: 32 * V columns c0 .. c0 + 32 * V - 1 (V consecutive columns per lane, so every load
// of a warp is 32 * V contiguous accumulators: one 128-byte line for V = 1, 512 bytes in 16-byte
// loads for V = 16 / sizeof(acc_t<T>)) of one segment, summed by `warps` warps of the block:
// warp j adds slots j, j + warps, ... and the warps' sums are then added in warp order through
// shared memory (`sums`, 2 * warps * 32 * V accumulators). V > 1 needs C % V == 0, so a lane's
// columns are all below C or none is. Every thread of the block calls it (it has a barrier); the
// block's other warps only pass the barrier. Each column is added over the same slots in the same
// order whatever V is: V changes how many bytes a load moves, not the result.
//
// Why BATCH slots per load round: the tile reads 2 * 32 * V * slots accumulators, and each round
// trip to L2 costs about a microsecond under load. With one load in flight per thread the sum is
// a chain of such round trips (6 us at C = 1600 with 132 slots, against 44 us for the main
// kernel, ncu). A thread loads BATCH slots of both sums before it adds any of them (the loads
// are hoisted, not the additions: each sum still runs over its slots in order).
template <typename T, int BATCH, int V = 1, typename O = T>
__device__ __forceinline__ void sum_partials_tile(O* __restrict__ dweight, O* __restrict__ dbias,
                                                  const acc_t<T>* __restrict__ partials, int slots, int C, int c0,
                                                  int warps, acc_t<T>* sums) {
  using A = acc_t<T>;
  using P = Packed<A, V>;
  const int lane = threadIdx.x % 32;
  const int j = threadIdx.x / 32;
  const int c = c0 + lane * V;
  P* psums = reinterpret_cast<P*>(sums);
  if (j < warps) {
    P sb, sw;
#pragma unroll
    for (int v = 0; v < V; ++v) { sb[v] = A(0); sw[v] = A(0); }
    if (c < C) {
      for (int s0 = j; s0 < slots; s0 += BATCH * warps) {
        P b[BATCH], w[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
          const int s = s0 + u * warps;
          if (s < slots) {
            const A* slot = partials + static_cast<size_t>(s) * 2 * C;
            b[u] = load_cg(reinterpret_cast<const P*>(slot + c));   // .cg: written by other blocks, L2 is the truth
            w[u] = load_cg(reinterpret_cast<const P*>(slot + C + c));
          }
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
          if (s0 + u * warps < slots) {
#pragma unroll
            for (int v = 0; v < V; ++v) {
              sb[v] += b[u][v];
              sw[v] += w[u][v];
            }
          }
        }
      }
    }
    psums[j * 32 + lane] = sb;
    psums[(warps + j) * 32 + lane] = sw;
  }
  __syncthreads();
  // Warp 0 adds the warps' dbias sums, warp 1 their dweight sums, each in warp order; a block of
  // one warp (kernel 12 with a single group of 32 threads) adds both.
  const int block_warps = static_cast<int>(blockDim.x / 32);
  for (int kind = j; kind < 2 && c < C; kind += block_warps) {
    P t;
#pragma unroll
    for (int v = 0; v < V; ++v) t[v] = A(0);
    for (int k = 0; k < warps; ++k) {
      const P s = psums[(kind * warps + k) * 32 + lane];
#pragma unroll
      for (int v = 0; v < V; ++v) t[v] += s[v];
    }
    O* out = kind == 0 ? dbias : dweight;
    if (out == nullptr) continue;   // RMSNorm has no dbias (a uniform branch)
#pragma unroll
    for (int v = 0; v < V; ++v) out[c + v] = from_acc<O>(t[v]);
  }
}

// Where a cooperative grid's blocks put dweight and dbias when they finish the sums themselves.
template <typename T, typename O = T>
struct GridFinish {
  O* dweight = nullptr;   // [segments, C]; null: a finalize_partials launch follows instead
  O* dbias = nullptr;     // [segments, C]; null for RMSNorm
  int segments = 1;
  int vec = 1;            // columns per lane of a tile: 1, 2, .. kFinishMaxVec<T> (finish_vec)
};

// The widest tile: 16 bytes of accumulators per lane and load.
template <typename T>
constexpr int kFinishMaxVec = 16 / static_cast<int>(sizeof(acc_t<T>));

// Columns per lane for the in-grid finish of `blocks` blocks: the narrowest tiles (32 * vec
// columns) of which every block gets at most one, so that the sum takes one round of tiles with
// as many blocks as possible sharing it; where even the widest tiles outnumber the blocks, the
// widest, which move 16 bytes per load and so need fewest rounds. Wider tiles need C % vec == 0.
// Measured on an H200 (tools/tune/tune.cu sweep, whole backward): at bf16 4096x16384, whose
// 132 slots of 16384 columns are 17 MB, 128 tiles of 128 columns (one round) against 512 tiles
// of 32 columns (four): 127.7-128.5 against 130.2-130.8 us over three runs each (fp16, whose
// runs spread from 115 to 126 us either way, did not tell them apart).
template <typename T>
int finish_vec(int64_t C, int64_t segments, int64_t blocks) {
  int vec = 1;
  while (vec < kFinishMaxVec<T> && C % (2 * vec) == 0 && ceil_div<int64_t>(C, 32 * vec) * segments > blocks) vec *= 2;
  return vec;
}

// Slots a thread loads per round in the grid's finish: 8; 16 for 16-bit types' tiles of 32
// columns, so that a block of 16 warps takes a grid of 132 slots (one per SM) in one round rather
// than two (128 + 4). Harness sweep on the H200, 8 -> 16: 16384x1600 bf16 50.9/50.4 -> 50.3/50.2
// us, fp16 48.7/48.2 -> 48.1/48.1. fp32 keeps 8: graph-timed, three runs each, 8 -> 16,
// 1024x768 8.52/8.68/8.70 -> 8.90/8.92/8.97 us, 16384x1600 87.7/88.1/88.0 -> 87.9/88.0/87.8,
// 16384x2048 108.1/108.5/108.5 -> 108.2/108.4/108.1: a loss where the grid has few rows, nothing
// elsewhere. (A scratch build that chose the batch at run time; its 1024x768 rows ran slower
// than this build's, 8.5 against 7.3 us, the same in both arms.)
template <typename T, int V>
constexpr int kTileBatch = sizeof(T) == 2 && V == 1 ? 16 : 8;

// The end of a kernel launched cooperatively (cudaLaunchAttributeCooperative) that has written
// its `slots` partial slots per segment: wait at a grid-wide barrier until every block's slot is
// written, then the blocks share the tiles of all segments and sum them as finalize_partials
// would, with one kernel launch and its drain fewer. The first `warps` warps of each block add
// (the others only pass the barriers); `sums` is shared memory for 2 * 32 * warps * f.vec
// accumulators (grid_finish_smem, launch.cuh), free by now. Every thread of every block calls it.
//
// Each warp takes every warps-th slot and loads kTileBatch of them at a time: 16 warps (512
// threads) cover 128 or 256 slots per round, about one block per SM.
// Measured on an H200 (tools/tune/tune.cu sweep, whole backward, against a plain launch
// followed by finalize_partials): bf16 16384x1600 49.7 -> 48.5 us, fp32 16384x2048 112.5 ->
// 109.9 us, fp32 8192x8192 220.3 -> 216.9 us; bf16 4096x16384 131.3 -> 131.0 us with tiles of 32
// columns (17 MB of slots to read cost the same either way).
template <typename T, int V, typename O>
__device__ void sum_tiles_in_grid(const GridFinish<T, O>& f, const acc_t<T>* partials, int slots, int C, int warps,
                                  acc_t<T>* sums) {
  const int tiles = ceil_div(C, 32 * V);
  for (int64_t tile = blockIdx.x; tile < static_cast<int64_t>(tiles) * f.segments; tile += gridDim.x) {
    const int64_t segment = tile / tiles;
    const int c0 = static_cast<int>(tile % tiles) * 32 * V;
    sum_partials_tile<T, kTileBatch<T, V>, V, O>(f.dweight + segment * C, f.dbias ? f.dbias + segment * C : nullptr,
                                              partials + segment * slots * 2 * static_cast<size_t>(C), slots, C,
                                              c0, warps, sums);
    __syncthreads();   // warps 0 and 1 have read `sums` before the next tile overwrites it
  }
}

template <typename T, typename O>
__device__ void finish_partials_in_grid(const GridFinish<T, O>& f, const acc_t<T>* partials, int slots, int C,
                                        int warps, acc_t<T>* sums) {
  // grid.sync() orders every block's slot writes before any block's reads past it (.cg: in L2).
  cooperative_groups::this_grid().sync();
  if (f.vec == 1) return sum_tiles_in_grid<T, 1, O>(f, partials, slots, C, warps, sums);
  if constexpr (kFinishMaxVec<T> >= 4) {
    if (f.vec == 4) return sum_tiles_in_grid<T, 4, O>(f, partials, slots, C, warps, sums);
  }
  sum_tiles_in_grid<T, 2, O>(f, partials, slots, C, warps, sums);
}

// The same, as a call rather than inlined: for kernels that keep many sums in registers through
// their row loop (kernel 11's small rows), where the inlined finish's own registers would push
// the loop's into local memory.
template <typename T, typename O>
__device__ __noinline__ void finish_partials_in_grid_call(const GridFinish<T, O>& f, const acc_t<T>* partials,
                                                          int slots, int C, int warps, acc_t<T>* sums) {
  finish_partials_in_grid<T, O>(f, partials, slots, C, warps, sums);
}

}  // namespace lnbwd
