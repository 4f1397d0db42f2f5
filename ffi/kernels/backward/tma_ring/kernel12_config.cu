// Kernel 12's choices (host code): which path a call takes (ring, ring of row chunks, wide rows
// or kernel 11), which configurations of each ring fit a row of C elements on this device, and
// which of them to run. The kernels and their launches are in kernel12_bulk_copy_ring.cu and
// kernel12_row_chunks.cu; the configuration's fields are in kernel12.h.
#include <algorithm>
#include <utility>
#include <vector>

#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/tma_ring/kernel12.h"

namespace lnbwd {

// C: the columns of a row that one block takes (C / split).
size_t kernel12_smem_bytes(const Kernel12Config& cfg, int64_t C, size_t item, size_t acc) {
  const size_t row = C * item;
  const size_t weight = cfg.regs ? 0 : round_up<size_t>(C * (cfg.raw_weight ? item : acc), 16);
  // The block's sums later take the ring's place: without split rows each group's nb rows of dy
  // and x (nb * 2 * item >= 2 * acc), with split rows [groups][2][C] over the weight row and ring.
  const size_t data = weight + static_cast<size_t>(cfg.groups) * cfg.nb * 2 * row;
  const size_t buffers = static_cast<size_t>(cfg.groups) * cfg.nb;
  const size_t barriers = 16 * ceil_div<size_t>(buffers, 2);
  const size_t stats = round_up<size_t>(buffers * 2 * acc, 16);   // stat_t is acc_t
  const size_t peers = cfg.split > 1 ? static_cast<size_t>(cfg.groups) * 2 * (8 + 2 * acc) : 0;
  return data + barriers + stats + static_cast<size_t>(cfg.groups) * 2 * (cfg.tpr / 32) * 2 * acc + peers;
}

namespace {

bool can_split(Dtype dtype) {
  bool can = false;
  dispatch_dtype(dtype, [&](auto t) {
    can = kCanSplit<decltype(t)>;
    return cudaSuccess;
  });
  return can;
}

// The pick among the configurations that split rows `split` ways (see kernel12_pick).
bool pick_buffers(const std::vector<Kernel12Config>& all, Dtype dtype, int64_t C, int split, Kernel12Config* cfg) {
  // What counts is how many bytes of dy and x each SM has on their way while its groups compute.
  // A group computing one row has nb - 1 rows in flight in shared-memory mode (a buffer is refilled
  // after the row's second pass), nb in register mode (refilled as soon as the row is in
  // registers). The rule (measured, docs/kernel12.md):
  //  * two buffers when the SM's groups together have at least ~56 KB in flight with them (fp32
  //    rows, in register mode, reach that at every C): more rows in flight only queue;
  //  * below that, or with a single group in shared-memory mode (whose requests would stop
  //    while it computes a row), three buffers. When the fp32 weight row leaves no room for
  //    three, the weight is staged as T (raw_weight). Four buffers never paid.
  // kernel12_candidates lists three buffers with an fp32 weight before three with a raw one.
  const size_t row_bytes = static_cast<size_t>(C / split) * dtype_bytes(dtype);
  const Kernel12Config* two = nullptr;
  const Kernel12Config* three = nullptr;
  for (const Kernel12Config& c : all) {
    if (c.split != split || c.chunks) continue;
    if (c.nb == 2 && !two) two = &c;
    if (c.nb == 3 && !three) three = &c;
  }
  const size_t in_flight = two ? static_cast<size_t>(two->groups) * (two->regs ? 2 : 1) * 2 * row_bytes : 0;
  bool two_enough = two && (two->regs || two->groups >= 2) && in_flight >= kKernel12InFlightBytes;
  // Split rows in shared-memory mode: a group also waits, every row, for the other block's sums,
  // so the slower of the pair sets the pace. With at most two groups a block, a third buffer
  // (with an fp32 weight) absorbs that; with four groups two buffers win as before, and with one
  // (C = 32768) three fit only with a 16-bit weight, which loses.
  if (split > 1 && three && !three->regs && !three->raw_weight && three->groups <= 2) two_enough = false;
  const Kernel12Config* pick = two_enough || !three ? two : three;
  if (!pick) return false;
  *cfg = *pick;
  return true;
}

}  // namespace

// The ring of row chunks' block (kernel12.h's layout): weight row, ring, two mbarriers a buffer.
size_t kernel12_chunk_smem_bytes(const Kernel12Config& cfg, int64_t C, size_t item, size_t acc, bool resid) {
  const size_t chunk = static_cast<size_t>(cfg.groups) * cfg.nv * C * item;
  return kernel12_chunk_weight_bytes(C, acc) +
         kernel12_chunk_ring_bytes(chunk, cfg.nb, resid ? 3 : 2, cfg.tpr * cfg.groups / 32, C, acc) +
         2 * sizeof(uint64_t) * cfg.nb;
}

// Rows of at most a warp of 16-byte vectors (fp64 keeps kernel 11's small rows: its sums take
// two registers each). tpr: the narrowest power of two from kMinRowThreads that holds the row, so
// a chunk is nv * kernel12_chunk_threads / tpr rows. One or two rows a group (nv), two to four
// buffers, where they fit.
std::vector<Kernel12Config> kernel12_chunk_candidates(Dtype dtype, int64_t C, const DeviceLimits& lim) {
  std::vector<Kernel12Config> out;
  const int item = dtype_bytes(dtype);
  const int vec = 16 / item;
  if (dtype == Dtype::kF64 || C % vec != 0 || C / vec > 32) return out;
  Kernel12Config cfg;
  cfg.chunks = true;
  cfg.tpr = kMinRowThreads;
  while (cfg.tpr < C / vec) cfg.tpr *= 2;
  cfg.groups = kernel12_chunk_threads(item) / cfg.tpr;
  for (int rows = 1; rows <= 2; ++rows) {
    cfg.nv = rows;
    for (int nb = 2; nb <= 4; ++nb) {
      cfg.nb = nb;
      if (kernel12_chunk_smem_bytes(cfg, C, item, 4, true) <= lim.smem_optin) out.push_back(cfg);
    }
  }
  return out;
}

// One row a group per chunk, two buffers: while a block computes on one chunk, its next is on
// its way, and so are the chunks of the SM's other blocks (two or three blocks, 16 KB of dy and
// x each). More buffers, or two rows a group, measured slower (docs/kernel12.md).
bool kernel12_chunk_pick(Dtype dtype, int64_t C, const DeviceLimits& lim, Kernel12Config* cfg) {
  const std::vector<Kernel12Config> all = kernel12_chunk_candidates(dtype, C, lim);
  if (all.empty()) return false;
  *cfg = all.front();
  return true;
}

// Configurations whose ring fits the device's opt-in shared memory; split rows only where the
// device launches clusters and has two SMs for one.
std::vector<Kernel12Config> kernel12_candidates(Dtype dtype, int64_t C, const DeviceLimits& lim, bool weight_f32) {
  const int item = dtype_bytes(dtype);
  const int vec = 16 / item;
  const size_t acc = dtype == Dtype::kF64 ? 8 : 4;
  std::vector<Kernel12Config> out;
  for (const int split : {1, 2}) {
    if (split > 1 && (!can_split(dtype) || !lim.clusters || lim.sms < split)) continue;
    if (C % (split * vec) != 0) continue;
    const int64_t Cb = C / split;
    for (const auto [nb, raw_weight] : {std::pair{3, false}, {2, false}, {3, true}}) {
      if (raw_weight && (item != 2 || weight_f32)) continue;
      Kernel12Config cfg;
      cfg.nv = item == 8 ? 2 : 4;
      cfg.nb = nb;
      cfg.regs = dtype == Dtype::kF32;
      cfg.raw_weight = raw_weight;
      cfg.split = split;
      const int64_t tpr = 32 * ceil_div<int64_t>(Cb / vec, 32 * cfg.nv);
      const int block_max = kernel12_max_threads(cfg.nv * vec * acc);
      if (tpr > block_max) continue;
      cfg.tpr = static_cast<int>(tpr);
      cfg.groups = std::min(block_max / cfg.tpr, kKernel12MaxGroups);
      while (cfg.groups > 0 && kernel12_smem_bytes(cfg, Cb, item, acc) > lim.smem_optin) --cfg.groups;
      if (cfg.groups == 0) continue;
      out.push_back(cfg);
    }
  }
  // Small rows: the ring of row chunks (kernel12_row_chunks.cu), where the row fits a warp.
  for (const Kernel12Config& c : kernel12_chunk_candidates(dtype, C, lim)) out.push_back(c);
  return out;
}

bool kernel12_pick(Dtype dtype, int64_t C, const DeviceLimits& lim, Kernel12Config* cfg, bool weight_f32) {
  // Split rows where they measured faster: 16-bit rows of 4096 columns and more. A 16-bit row
  // that one block takes whole is
  // converted in both passes by few, large groups (one group of 512 threads at C = 16384, with
  // its weight staged as bf16/fp16 for room); half a row per block doubles the groups and leaves
  // room for the fp32 weight, and a cluster's two blocks write one slot, which halves the
  // partial sums' traffic. fp32 rows split only where a whole row does not fit (C > 8192).
  const std::vector<Kernel12Config> all = kernel12_candidates(dtype, C, lim, weight_f32);
  if (dtype_bytes(dtype) == 2 && C >= 4096 && pick_buffers(all, dtype, C, 2, cfg)) return true;
  return pick_buffers(all, dtype, C, 1, cfg) || pick_buffers(all, dtype, C, 2, cfg);
}

cudaError_t norm_bwd_kernel12(const NormBwdParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(p.device, &lim));
  const bool vectorized = can_vectorize(p);
  // The bulk copy engine needs sm_90 and 16-byte aligned rows, and the build must have sm_90
  // code (else the body, guarded by __CUDA_ARCH__ >= 900, is empty). Otherwise kernel 11 does
  // the job, as it does for rows wider than the ring and the wide path take in this device's
  // shared memory (on Hopper: fp32 and 16-bit C > 16384 and 32768, fp64 beyond the ring).
  // Small rows (a row of a few hundred bytes: kernel 11 holds it in a group narrower than a
  // warp) take the ring of row chunks, a ring buffer a chunk of one row per group: a ring of
  // single rows would wait on a barrier per few hundred bytes. Where there is no chunk ring (no
  // sm_90 code, fp64), kernel 11's small rows.
  // Rows that one warp of kernel 11 holds at two vectors a thread (1 KB rows: fp32 C = 256,
  // 16-bit C = 512) stay on kernel 11 too: there its warps, each holding its row and the
  // prefetched next one in registers, measured faster than the ring's groups, which wait on a
  // barrier a row (docs/kernel12.md). Rows of more vectors a thread take the ring.
  const bool hopper = lim.cc_major >= 9 && vectorized && kernel12_has_code(lim.device);
  Kernel11Config small;
  if (vectorized && kernel11_pick(p.dtype, p.C, vectorized, lim, &small)) {
    if (small.tpr < 32) {
      Kernel12Config chunks;
      if (hopper && kernel12_chunk_pick(p.dtype, p.C, lim, &chunks)) return norm_bwd_kernel12_chunks(p, chunks, stream);
      return norm_bwd_kernel11_config(p, small, stream);
    }
    if (small.tpr == 32 && small.nv <= 2) return norm_bwd_kernel11_config(p, small, stream);
  }
  if (hopper) {
    Kernel12Config cfg;
    if (kernel12_pick(p.dtype, p.C, lim, &cfg, p.weight_f32)) return norm_bwd_kernel12_config(p, cfg, stream);
    if (kernel12_wide_fits(p.dtype, p.C, lim)) return norm_bwd_kernel12_wide(p, stream);
  }
  return norm_bwd_kernel11(p, stream);
}

}  // namespace lnbwd
