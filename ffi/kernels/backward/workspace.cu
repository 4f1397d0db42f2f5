// norm_bwd_workspace_bytes (backward/api.h): the workspace kernels 11 and 12 use, from the
// launch they would make. It runs the launcher itself with plan_only set, so the size XLA allocates
// (jax_lnbwd/kernels.py asks at trace time) and the slots the launcher uses come from one piece of
// code and cannot drift apart.
#include <cstdint>

#include "backward/api.h"

namespace lnbwd {

cudaError_t norm_bwd_workspace_bytes(int kernel, Dtype dtype, int64_t rows, int64_t C, int64_t segments,
                                          int device, LaunchPlan* plan) {
  if ((kernel != 11 && kernel != 12) || plan == nullptr) return cudaErrorInvalidValue;
  if (rows < 0 || C < 1 || segments < 1 || rows % segments != 0) return cudaErrorInvalidValue;
  const size_t acc = dtype == Dtype::kF64 ? 8 : 4;
  *plan = LaunchPlan{};
  if (rows == 0) {   // the handler launches nothing; it still asks for one slot's room
    plan->kernel = kernel;
    plan->workspace_bytes = kWorkspaceHeaderBytes + 2 * static_cast<size_t>(C) * acc;
    return cudaSuccess;
  }
  // Stand-in buffers, never touched: 16-byte aligned addresses, as XLA's buffers are.
  void* const aligned = reinterpret_cast<void*>(uintptr_t{4096});
  // Layernorm's launch: RMSNorm's (no mean, no dbias) is the same launch with the same workspace.
  NormBwdParams p;
  p.norm = NormKind::kLayerNorm;
  p.dx = p.dweight = p.dbias = aligned;
  p.dy = p.x = p.weight = p.mean = p.rstd = aligned;
  p.rows = rows;
  p.C = C;
  p.segments = segments;
  p.weight_stride = 0;
  p.dtype = dtype;
  p.block_size = 0;
  p.workspace = aligned;
  p.workspace_bytes = SIZE_MAX;   // no cap from the workspace: the size is what is being asked
  p.device = device;
  p.plan = plan;
  p.plan_only = true;
  return kernel == 11 ? norm_bwd_kernel11(p, nullptr) : norm_bwd_kernel12(p, nullptr);
}

}  // namespace lnbwd
