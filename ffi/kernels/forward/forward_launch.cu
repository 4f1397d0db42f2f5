// The fused forward's launcher: picks where a row lives (registers, shared memory or global
// memory) and the register path's row group from C, the dtype and the device's limits, then
// launches forward_rows.cu's or forward_wide.cu's kernel (the residual variant: the same pick,
// the kernels' RES instantiation).
#include <algorithm>
#include <climits>

#include "forward/forward_launch.cuh"

namespace lnbwd {
namespace {

int item_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : d == Dtype::kF32 ? 4 : 2; }
int acc_bytes(Dtype d) { return d == Dtype::kF64 ? 8 : 4; }

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

cudaError_t device_attribute(cudaDeviceAttr attr, int* out) {
  int dev = 0;
  LNBWD_FWD_RETURN_IF_ERROR(cudaGetDevice(&dev));
  return cudaDeviceGetAttribute(out, attr, dev);
}

// 16-byte accesses need every row (of x, y, the parameters, and residual and s when present) to
// start on a 16-byte boundary: C * sizeof(T) % 16 == 0 and 16-byte aligned base pointers. An
// fp32 parameter row next to 16-bit x is then aligned too (C * 4 is a multiple of 32).
bool can_vectorize(const NormFwdParams& p) {
  const int vec = 16 / item_bytes(p.dtype);
  return p.C % vec == 0 && aligned16(p.x) && aligned16(p.y) && (p.weight == nullptr || aligned16(p.weight)) &&
         (p.bias == nullptr || aligned16(p.bias)) && (p.residual == nullptr || aligned16(p.residual)) &&
         (p.s == nullptr || aligned16(p.s)) && (p.x_bias == nullptr || aligned16(p.x_bias));
}

// The most vectors a thread of a tpr-thread row group holds, by norm kind: the register path's
// rule, written once. A thread's vectors are its bytes in flight, and also the length of its
// per-row work between one row's loads and the next's; the warps that share a row pay barrier
// rounds and each repeat the row's scalar work (the sums, rstd).
//   RMSNorm: one barrier round a row, so rows are spread over up to four warps at 4 vectors a
//            thread; wider rows take 8.
//   layernorm: two rounds (mean, then variance), so rows stay in as few warps as hold them at 8
//            vectors a thread, except that a warp alone holds at most 7: a row of 8 a lane is
//            split over two warps of 4.
// docs/results/2026-12-02-forward_policy_h200.txt has the sweep over every row group behind it.
//   groups narrower than a warp (small rows): kFwdSmallMaxNv for either kind; their sums are
//            shuffles within the group, with no barrier.
int max_vectors(NormKind norm, int tpr) {
  if (tpr < 32) return kFwdSmallMaxNv;
  if (norm == NormKind::kRmsNorm) return tpr <= 128 ? kFwdMaxNv / 2 : kFwdMaxNv;
  return tpr == 32 ? kFwdMaxNv - 1 : kFwdMaxNv;
}

// The register path's row group: the fewest threads per row (a power of two from
// kMinRowThreads to kFwdMaxRowThreads) whose threads hold the row in at most max_vectors
// each; a forced row group (only_tpr) may take up to kFwdMaxNv (kFwdSmallMaxNv below a warp).
// Scalar access (vec == 1) compiles only power-of-two NV, and only for groups of whole warps.
bool pick_registers(int64_t nvec, int vec, NormKind norm, int only_tpr, NormFwdConfig* cfg) {
  for (int tpr = kMinRowThreads; tpr <= kFwdMaxRowThreads; tpr *= 2) {
    if (only_tpr != 0 && tpr != only_tpr) continue;
    if (tpr < 32 && vec == 1) continue;
    int nv = static_cast<int>(ceil_div<int64_t>(nvec, tpr));
    if (vec == 1) {
      int pow2 = 1;
      while (pow2 < nv) pow2 *= 2;
      nv = pow2;
    }
    const int cap = only_tpr == 0 ? max_vectors(norm, tpr) : tpr < 32 ? kFwdSmallMaxNv : kFwdMaxNv;
    if (nv > cap) continue;
    cfg->path = FwdPath::kRegisters;
    cfg->nv = nv;
    cfg->tpr = tpr;
    // Groups of a warp or less share a block; a multi-warp group is a block of its own, so that
    // its barrier is __syncthreads (forward_rows.cu says why).
    cfg->rows_per_block = tpr <= 32 ? kFwdBlockThreads / tpr : 1;
    cfg->threads = tpr * cfg->rows_per_block;
    cfg->smem_bytes = 0;
    return true;
  }
  return false;
}

// The path and its block shape (norm_fwd_pick adds the grid).
cudaError_t pick_path(const NormFwdParams& p, NormFwdConfig* cfg) {
  cfg->vec = can_vectorize(p) ? 16 / item_bytes(p.dtype) : 1;
  const int64_t nvec = ceil_div<int64_t>(p.C, cfg->vec);

  if (p.path == FwdPath::kAuto || p.path == FwdPath::kRegisters) {
    if (pick_registers(nvec, cfg->vec, p.norm, p.tpr, cfg)) return cudaSuccess;
    if (p.path == FwdPath::kRegisters || p.tpr != 0) return cudaErrorInvalidValue;
  }
  cfg->threads = kFwdWideThreads;
  cfg->rows_per_block = 1;
  if (p.path == FwdPath::kAuto || p.path == FwdPath::kSharedMemory) {
    // The row, plus the kernel's static sums (2 x 32 accumulators), within the opt-in limit.
    int max_smem = 0;
    LNBWD_FWD_RETURN_IF_ERROR(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, &max_smem));
    const size_t row_bytes = static_cast<size_t>(p.C) * item_bytes(p.dtype);
    if (row_bytes + 2 * 32 * static_cast<size_t>(acc_bytes(p.dtype)) <= static_cast<size_t>(max_smem)) {
      cfg->path = FwdPath::kSharedMemory;
      cfg->smem_bytes = row_bytes;
      return cudaSuccess;
    }
    if (p.path == FwdPath::kSharedMemory) return cudaErrorInvalidValue;
  }
  cfg->path = FwdPath::kGlobal;
  cfg->smem_bytes = 0;
  return cudaSuccess;
}

}  // namespace

cudaError_t norm_fwd_pick(const NormFwdParams& p, NormFwdConfig* cfg) {
  if (p.C < 1 || p.C > INT32_MAX || p.rows < 0 || p.max_blocks < 0) return cudaErrorInvalidValue;
  *cfg = NormFwdConfig{};
  LNBWD_FWD_RETURN_IF_ERROR(pick_path(p, cfg));
  // A block per row group up to the grid's limit; beyond it the kernels' row loops stride.
  int max_grid = 0;
  LNBWD_FWD_RETURN_IF_ERROR(device_attribute(cudaDevAttrMaxGridDimX, &max_grid));
  int64_t blocks = std::min<int64_t>(ceil_div<int64_t>(p.rows, cfg->rows_per_block), max_grid);
  if (p.max_blocks > 0) blocks = std::min(blocks, p.max_blocks);
  cfg->blocks = static_cast<unsigned int>(std::max<int64_t>(1, blocks));
  return cudaSuccess;
}

namespace {

// The buffers every launch reads and writes, and that they agree with p.norm (the kernels'
// template parameter K): layernorm writes mean, RMSNorm has neither mean nor bias.
bool buffers_ok(const NormFwdParams& p) {
  if (p.x == nullptr || p.y == nullptr || p.rstd == nullptr) return false;
  if (p.norm == NormKind::kLayerNorm) return p.mean != nullptr;
  if (p.norm == NormKind::kRmsNorm) return p.mean == nullptr && p.bias == nullptr;
  return false;   // not a kind
}

}  // namespace

cudaError_t norm_fwd(const NormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;   // nothing to read or write
  if (!buffers_ok(p)) return cudaErrorInvalidValue;
  if ((p.residual == nullptr) != (p.s == nullptr)) return cudaErrorInvalidValue;   // the variant needs both
  for (int64_t prows : {p.weight_rows, p.bias_rows, p.x_bias_rows}) {
    if (prows < 0 || (prows > 0 && p.rows % prows != 0)) return cudaErrorInvalidValue;
  }
  if ((p.weight != nullptr && p.weight_rows < 1) || (p.bias != nullptr && p.bias_rows < 1)) return cudaErrorInvalidValue;
  if (p.x_bias != nullptr && (p.x_bias_rows < 1 || p.residual == nullptr)) return cudaErrorInvalidValue;
  if (p.heads.heads != 0) return cudaErrorInvalidValue;   // head rows: norm_fwd_sets only
  NormFwdConfig cfg;
  LNBWD_FWD_RETURN_IF_ERROR(norm_fwd_pick(p, &cfg));
  return cfg.path == FwdPath::kRegisters ? norm_fwd_rows(p, cfg, stream) : norm_fwd_wide(p, cfg, stream);
}

// The sets' row group is the register path's pick for their C, held to groups of at most a warp
// and kFwdSmallMaxNv vectors a thread (the variants forward_rows_sets is compiled for): the rows
// of at most kHeadRowsMaxBytes. Blocks are dealt in proportion to the sets' rows, so that both
// sets' blocks finish together; each set gets at least one block when it has rows.
cudaError_t norm_fwd_sets_pick(const NormFwdParams& a, const NormFwdParams& b, NormFwdConfig* cfg,
                               unsigned int* blocks0) {
  const bool same = a.C == b.C && a.dtype == b.dtype && a.param_dtype == b.param_dtype && a.norm == b.norm &&
                    a.eps == b.eps && a.offset == b.offset;
  if (!same || a.C < 1 || a.rows < 0 || b.rows < 0) return cudaErrorInvalidValue;
  for (const NormFwdParams* p : {&a, &b}) {
    if (p->residual != nullptr || p->s != nullptr || p->x_bias != nullptr || p->weight_rows > 1 ||
        p->bias_rows > 1 || !head_rows_ok(p->heads, p->C)) {
      return cudaErrorInvalidValue;
    }
    if (!can_vectorize(*p)) return cudaErrorInvalidValue;
  }
  if (a.C * item_bytes(a.dtype) > kHeadRowsMaxBytes) return cudaErrorInvalidValue;
  *cfg = NormFwdConfig{};
  cfg->vec = 16 / item_bytes(a.dtype);
  if (!pick_registers(ceil_div<int64_t>(a.C, cfg->vec), cfg->vec, a.norm, 0, cfg) || cfg->tpr > 32 ||
      cfg->nv > kFwdSmallMaxNv) {
    return cudaErrorInvalidValue;
  }
  int max_grid = 0;
  LNBWD_FWD_RETURN_IF_ERROR(device_attribute(cudaDevAttrMaxGridDimX, &max_grid));
  int64_t n0 = ceil_div<int64_t>(a.rows, cfg->rows_per_block);
  int64_t n1 = ceil_div<int64_t>(b.rows, cfg->rows_per_block);
  if (n0 + n1 > max_grid) {   // the blocks then stride over their set's rows
    const int64_t scaled = static_cast<int64_t>(static_cast<double>(max_grid) * n0 / (n0 + n1));
    n0 = std::clamp<int64_t>(scaled, n0 > 0 ? 1 : 0, max_grid - (n1 > 0 ? 1 : 0));
    n1 = std::min<int64_t>(n1, max_grid - n0);
  }
  if (n0 + n1 == 0) n1 = 1;   // nothing to do; a launch still needs a block (norm_fwd_sets launches none)
  cfg->blocks = static_cast<unsigned int>(n0 + n1);
  *blocks0 = static_cast<unsigned int>(n0);
  return cudaSuccess;
}

cudaError_t norm_fwd_sets(const NormFwdParams& a, const NormFwdParams& b, cudaStream_t stream) {
  for (const NormFwdParams* p : {&a, &b}) {
    if (p->rows > 0 && !buffers_ok(*p)) return cudaErrorInvalidValue;   // a set of no rows needs none
    if ((p->weight != nullptr) != (p->weight_rows == 1) || (p->bias != nullptr) != (p->bias_rows == 1)) {
      return cudaErrorInvalidValue;
    }
  }
  NormFwdConfig cfg;
  unsigned int blocks0 = 0;
  LNBWD_FWD_RETURN_IF_ERROR(norm_fwd_sets_pick(a, b, &cfg, &blocks0));
  if (a.rows == 0 && b.rows == 0) return cudaSuccess;
  return norm_fwd_rows_sets(a, b, cfg, blocks0, stream);
}

}  // namespace lnbwd
