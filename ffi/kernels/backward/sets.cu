// QK-norm's backward (backward/sets.cuh): which kernel takes the two sets, and the workspace it
// needs. q and k in buffers of their own, in rows of at most a warp of 16-byte vectors (16-bit
// D <= 256, fp32 D <= 128), run where sm_90 code runs on kernel 12's ring of row chunks, one
// launch of a tensor's kernel a set (tma_ring/kernel12_chunk_sets.cu): there they stream as two
// calls of the ring do. The others take kernel 11's row loop with groups of at most a warp over
// both sets in one grid (registers/kernel11_sets.cu): 1 KB rows (fp32 D = 256, which a tensor's
// backward also leaves to kernel 11), and the fused projection's head rows, which kernel 11 reads
// in place (docs/kernel12.md).
#include "backward/launch.cuh"
#include "backward/registers/kernel11.h"
#include "backward/sets.cuh"
#include "backward/tma_ring/kernel12.h"

namespace lnbwd {

bool bwd_sets_ok(const NormBwdParams& a, const NormBwdParams& b) {
  const bool rms = a.norm == NormKind::kRmsNorm;
  if (!rms && a.norm != NormKind::kLayerNorm) return false;
  if (b.dtype != a.dtype || b.C != a.C || b.weight_f32 != a.weight_f32 || b.norm != a.norm || b.offset != a.offset) {
    return false;
  }
  const int64_t item = dtype_bytes(a.dtype);
  if (a.C < 1 || a.C * item > kHeadRowsMaxBytes || a.dbias != nullptr) return false;
  for (const NormBwdParams* p : {&a, &b}) {
    if (p->rows < 0 || p->dresidual != nullptr || !head_rows_ok(p->heads, p->C) || rms != (p->mean == nullptr)) {
      return false;
    }
    // Every head row on a 16-byte boundary, as the kernels' vector loads and bulk copies need.
    if (p->heads.heads > 0 && p->heads.token_stride * item % 16 != 0) return false;
  }
  return true;
}

namespace {

// The pick, for sets laid out as `contiguous` says (the workspace query plans a layout it is told,
// without the real heads).
cudaError_t run_sets(const NormBwdParams& a, const NormBwdParams& b, bool contiguous, cudaStream_t stream) {
  DeviceLimits lim;
  LNBWD_RETURN_IF_CUDA_ERROR(device_limits(a.device, &lim));
  // A plan (the workspace query) has no buffers: it plans for aligned ones, as XLA's are.
  const bool vectorized = a.plan_only || (can_vectorize(a) && can_vectorize(b));
  Kernel12Config chunks;
  if (contiguous && vectorized && lim.cc_major >= 9 && kernel12_has_code(lim.device) &&
      kernel12_chunk_pick(a.dtype, a.C, lim, &chunks)) {
    return norm_bwd_kernel12_chunk_sets(a, b, chunks, stream);
  }
  Kernel11Config cfg;
  if (!kernel11_pick(a.dtype, a.C, true, lim, &cfg, 32) || cfg.tpr > 32) return cudaErrorInvalidValue;
  return norm_bwd_sets_config(a, b, cfg, stream);
}

}  // namespace

cudaError_t norm_bwd_sets(const NormBwdParams& a, const NormBwdParams& b, cudaStream_t stream) {
  if (!bwd_sets_ok(a, b)) return cudaErrorInvalidValue;
  if (a.rows == 0 && b.rows == 0 && !a.plan_only) return cudaSuccess;
  return run_sets(a, b, a.heads.heads == 0 && b.heads.heads == 0, stream);
}

cudaError_t norm_bwd_sets_workspace_bytes(Dtype dtype, int64_t rows_a, int64_t rows_b, int64_t C, bool fused,
                                          int device, LaunchPlan* plan) {
  NormBwdParams a = {};
  a.dtype = dtype;
  a.C = C;
  a.rows = rows_a;
  a.segments = 1;
  a.norm = NormKind::kRmsNorm;   // the plan is the same for both kinds
  a.workspace_bytes = SIZE_MAX;  // no limit from the workspace: this asks what it must hold
  a.device = device;
  a.plan = plan;
  a.plan_only = true;
  NormBwdParams b = a;
  b.rows = rows_b;
  b.plan = nullptr;
  if (rows_a + rows_b == 0) {
    *plan = LaunchPlan{};
    plan->workspace_bytes = kWorkspaceHeaderBytes;
    return cudaSuccess;
  }
  if (!bwd_sets_ok(a, b)) return cudaErrorInvalidValue;
  return run_sets(a, b, !fused, nullptr);
}

}  // namespace lnbwd
