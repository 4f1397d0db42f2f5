// Kernel 11's choices (host code): which configurations hold a row of C on this device, which
// of them the default launcher runs, and the path a call takes (registers, small rows or wide
// rows). The kernel and its launch are in kernel11_rows_in_registers.cu; the configuration's
// fields and the facts both files use are in kernel11.h.
#include <algorithm>
#include <utility>
#include <vector>

#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"

namespace lnbwd {

// Small rows: the weight row (C accumulators: kernel11_body.cuh's wt) first. Then per group
// [dbias sums | dweight sums] (C each) and two buffers of the group's warps' (s1, s2) pairs;
// with the sums in registers (small rows), one [dbias | dweight] row per warp, written once.
size_t kernel11_smem_bytes(const Kernel11Config& cfg, int64_t C, size_t acc_bytes) {
  const size_t weight = cfg.tpr < 32 ? static_cast<size_t>(C) * acc_bytes : 0;
  if (cfg.tpr < 32 && cfg.reg_sums) return weight + static_cast<size_t>(cfg.tpr) * cfg.groups / 32 * 2 * C * acc_bytes;   // per warp
  return weight + (static_cast<size_t>(cfg.groups) * 2 * C + static_cast<size_t>(cfg.groups) * 2 * (cfg.tpr / 32) * 2) * acc_bytes;
}

// The groups' dweight/dbias sums live in shared memory (or, for small rows, in registers): a
// block has as many groups as the device's opt-in shared memory holds (lim.smem_optin), and a
// row too wide for one group takes the wide path.
std::vector<Kernel11Config> kernel11_candidates(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim) {
  const int item = dtype_bytes(dtype);
  const int vec = vectorized ? 16 / item : 1;
  const size_t acc = dtype == Dtype::kF64 ? 8 : 4;
  std::vector<std::pair<int, bool>> variants;
  if (vec == 1) {
    variants = {{2, false}, {4, false}, {8, false}};
  } else {
    variants = {{1, true}, {2, true}, {4, false}};
    if (item <= 4) variants.push_back({3, false});
  }
  std::vector<Kernel11Config> out;
  const int64_t nvec = ceil_div<int64_t>(C, vec);
  // Small rows: the group narrower than a warp (a power of two from kMinRowThreads) whose
  // threads hold the row in NV vectors each, where there is one; every compiled variant.
  if (vec > 1) {
    for (const bool reg_sums : {false, true}) {
      for (auto [nv, prefetch] : {std::pair{2, true}, {2, false}, {4, false}}) {
        if (!kernel11_small_variant(reg_sums, nv, prefetch) || ceil_div<int64_t>(nvec, nv) > 16) continue;
        Kernel11Config cfg;
        cfg.vec = vec;
        cfg.nv = nv;
        cfg.prefetch = prefetch;
        cfg.reg_sums = reg_sums;
        cfg.tpr = kMinRowThreads;
        while (cfg.tpr < ceil_div<int64_t>(nvec, nv)) cfg.tpr *= 2;
        cfg.groups = kSmallThreads / cfg.tpr;
        if (kernel11_smem_bytes(cfg, C, acc) <= lim.smem_optin) out.push_back(cfg);
      }
    }
  }
  for (auto [nv, prefetch] : variants) {
    Kernel11Config cfg;
    cfg.vec = vec;
    cfg.nv = nv;
    cfg.prefetch = prefetch;
    const int64_t tpr = 32 * ceil_div<int64_t>(nvec, 32 * nv);
    const int block_max = max_threads(nv);
    if (tpr > block_max) continue;
    cfg.tpr = static_cast<int>(tpr);
    cfg.groups = cfg.tpr == 32 ? block_max / 32 : std::min(block_max / cfg.tpr, kMaxNamedBarrierGroups);
    while (cfg.groups > 0 && kernel11_smem_bytes(cfg, C, acc) > lim.smem_optin) --cfg.groups;
    if (cfg.groups == 0) continue;
    out.push_back(cfg);
  }
  return out;
}

bool kernel11_pick(Dtype dtype, int64_t C, bool vectorized, const DeviceLimits& lim, Kernel11Config* cfg,
                   int max_tpr) {
  const std::vector<Kernel11Config> all = kernel11_candidates(dtype, C, vectorized, lim);
  if (all.empty()) return false;
  // Small rows (a group narrower than a warp holds the row in NV = 2 vectors a thread): the
  // sums in registers, except for fp64 (two registers an accumulator: in shared memory, which
  // leaves the registers to more warps an SM). 16-bit rows prefetch the next row: their 16-byte
  // vectors carry twice as many elements as fp32's, so a row takes half the vectors and the
  // next one fits beside it; fp32 and fp64 rows spend those registers on more warps instead.
  const bool regs = dtype != Dtype::kF64;
  const bool prefetch = dtype_bytes(dtype) == 2;
  for (const Kernel11Config& c : all) {
    if (c.tpr < 32 && c.nv == 2 && c.reg_sums == regs && c.prefetch == prefetch) {
      *cfg = c;
      return true;
    }
  }
  // Rows of whole warps. Prefer: at least 70% of the threads' vector slots used; then
  // prefetching; then more vectors per thread (more bytes in flight per thread, fewer threads
  // per row to reduce over).
  const int64_t nvec = ceil_div<int64_t>(C, all[0].vec);
  auto score = [&](const Kernel11Config& c) {
    const double util = static_cast<double>(nvec) / (static_cast<double>(c.tpr) * c.nv);
    return (util >= 0.7 ? 1000.0 : 0.0) + (c.prefetch ? 100.0 : 0.0) + 10.0 * c.nv + util;
  };
  bool any = false;
  for (const Kernel11Config& c : all) {
    if (c.tpr < 32 || c.tpr > max_tpr) continue;
    if (!any || score(c) > score(*cfg)) *cfg = c;
    any = true;
  }
  return any;
}

cudaError_t norm_bwd_kernel11(const NormBwdParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(p.device, &lim));
  const bool vectorized = can_vectorize(p);
  Kernel11Config cfg;
  if (kernel11_pick(p.dtype, p.C, vectorized, lim, &cfg)) return norm_bwd_kernel11_config(p, cfg, stream);
  return norm_bwd_kernel11_wide(p, stream);
}

}  // namespace lnbwd
