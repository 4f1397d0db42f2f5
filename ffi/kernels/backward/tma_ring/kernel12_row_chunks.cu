// Kernel 12's small rows (Hopper, sm_90): rows of a few hundred bytes (at most a warp of 16-byte
// vectors: bf16/fp16 C <= 256, fp32 C <= 128), streamed into shared memory a chunk of many
// consecutive rows at a time.
//
// Why: a small row is held by a group of a few threads, so kernel 11's way of keeping rows in
// flight (each thread loads its next row into registers before reducing the current one) costs
// registers per byte in flight, and registers are what caps an SM's warps: its 16-bit small rows
// ran 16 warps an SM, half their stalls waiting on global loads. Here the bytes in flight cost
// shared memory instead. Rows are contiguous, so a chunk of consecutive rows of a tensor is one
// contiguous span, and one bulk copy (cp.async.bulk, "TMA") moves it, one instruction for 8 KB.
// A thread keeps one 16-byte vector of a row in registers, which leaves room for more warps.
//
// Work split. A block is THREADS threads (kernel12_chunk_threads: 512 for 16-bit rows, two blocks
// an SM; 256 for fp32, three) in kGroups row groups of TPR threads (the narrowest power of two
// from kMinRowThreads that holds a row in one vector a thread); thread t of a group owns the
// columns [t * VEC, (t + 1) * VEC) of every row, so its dbias/dweight sums stay in registers. A
// chunk is RPG * kGroups consecutive rows (RPG rows a group: the pick takes one), row
// r * kGroups + g of it for group g, so a warp's rows are adjacent in the buffer and its
// shared-memory loads contiguous. Block b of a segment's B blocks takes the segment's chunks b,
// b + B, b + 2B, ... (the last chunk of a segment may be short).
//
// The ring: nb buffers, each one chunk of dy and of x (and of dresidual, RESID), each with two
// mbarriers. `full` completes when thread 0 has announced the chunk's bytes and they have all
// landed; `empty` completes when every thread of the block is done with the chunk (one arrival a
// thread). Thread 0 refills a buffer once its `empty` phase has completed: at the start of the
// block's chunk k it waits for chunk k - 1 to be done with and copies chunk k - 1 + nb into its
// buffer, so nb - 1 chunks are on their way while the block computes on one, and the SM's other
// blocks have theirs in flight too. mean and rstd are too few bytes for a bulk copy (and a short
// chunk's need not be a multiple of 16): each group loads the pairs of its rows of the block's
// next chunk as it starts a chunk, a chunk's time ahead of their use.
//
// Per row (g_i = (offset + weight_i) dy_i, xhat_i = (x_i - mean) rstd, centered), as kernel 11's
// small rows (kernel11_body.cuh):
//   pass 1: s1 = sum g_i, s2 = sum g_i (x_i - mean): the thread's vector, then xor-shuffles
//           within the group;
//   pass 2: dx_i = g_i rstd - (xhat_i b' + a') with a' = s1/C rstd and b' = s2 rstd/C rstd,
//           straight to global memory; dbias_i += dy_i, dweight_i += dy_i xhat_i in registers.
// The weight row is widened once per block, with RMSNorm's offset added, into shared memory.
// RMS (RMSNorm, fixed when compiled): no mean, no s1 term, no dbias sums (the slot's dbias half
// is written as zeros). At the end the warp's groups, which own the same columns, add their sums
// by xor-shuffles across groups (a fixed order), the block adds its warps' sums in warp order
// into its partial slot, and the slots are added in slot order (launch_with_partials,
// backward/launch.cuh). Deterministic.
//
// A block's walk, from its first copy to its slot, and the kernel over a tensor's segments are
// kernel12_chunk_rows.cuh, which QK-norm's two sets of rows share (kernel12_chunk_sets.cu); this
// file is a tensor's launch.
#include "backward/launch.cuh"
#include "backward/partials_finalize.h"
#include "backward/tma_ring/kernel12.h"
#include "backward/tma_ring/kernel12_chunk_rows.cuh"

namespace lnbwd {

namespace {

template <typename T, typename O, bool RESID, int VEC, bool RMS, int TPR, int RPG>
cudaError_t launch(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  constexpr int kThreads = kernel12_chunk_threads(sizeof(T));
  if (cfg.tpr * cfg.groups != kThreads) return cudaErrorInvalidValue;
  if (p.plan) {
    p.plan->kernel = 12;
    p.plan->path = "ring of row chunks (small rows)";
  }
  return launch_with_partials<T, O>(p, kernel12_chunks<T, O, RESID, VEC, RMS, kThreads, TPR, RPG>, kThreads,
                                    kernel12_chunk_smem_bytes(cfg, p.C, sizeof(T), sizeof(acc_t<T>), RESID),
                                    BlocksPerSm::kOccupancy, cfg.groups * cfg.nv, 1, stream, cfg.nb);
}

template <typename T, typename O, bool RESID, int VEC, bool RMS>
cudaError_t launch_tpr(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  return with_chunk_tpr(cfg.tpr, [&](auto tpr) -> cudaError_t {
    constexpr int kTpr = decltype(tpr)::value;
    if (cfg.nv == 1) return launch<T, O, RESID, VEC, RMS, kTpr, 1>(p, cfg, stream);
    if (cfg.nv == 2) return launch<T, O, RESID, VEC, RMS, kTpr, 2>(p, cfg, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace

cudaError_t norm_bwd_kernel12_chunks(const NormBwdParams& p, const Kernel12Config& cfg, cudaStream_t stream) {
  if (!cfg.chunks) return cudaErrorInvalidValue;
  return dispatch_types(p, [&](auto t, auto o, auto resid) -> cudaError_t {
    using T = decltype(t);
    using O = decltype(o);
    constexpr bool R = decltype(resid)::value;
    constexpr int vec = 16 / sizeof(T);
    if constexpr (sizeof(T) == 8) {
      return cudaErrorInvalidValue;
    } else {
      if (!can_vectorize<T>(p) || cfg.tpr * vec < p.C) return cudaErrorInvalidValue;   // launch_tpr: tpr <= 32
      if (p.norm == NormKind::kRmsNorm) return launch_tpr<T, O, R, vec, true>(p, cfg, stream);
      return launch_tpr<T, O, R, vec, false>(p, cfg, stream);
    }
  });
}

}  // namespace lnbwd
