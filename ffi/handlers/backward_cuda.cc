// CUDA handlers of the backward FFI targets (targets.h: layernorm's v1 and v2, rmsnorm's): check the buffers, map the dtype,
// check the kernel's limits once through the registry (registry.h, with this GPU's limits),
// handle zero rows, and hand plain pointers to the launcher that `kernel` selects. No math here.
// A failure comes back as an ffi::Error that names the kernel, the shape and the device's limits,
// and leaves no CUDA error behind for the next call (ClearCudaError).
#include <cstdint>
#include <cstdlib>
#include <string>

#include <cuda_runtime_api.h>

#include "checks/backward.h"
#include "errors/launch_errors.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"
#include "kernels/backward/api.h"

namespace lnbwd {
namespace {

// A failed CUDA call can leave its error in the runtime's per-thread "last error", which a later
// launch in this process (an llm.c kernel's cudaGetLastError after <<<>>>) would report as its own.
// Every error path clears it; a sticky error (a faulted context) cannot be cleared, and says so.
void ClearCudaError() { (void)cudaGetLastError(); }

// The error of a failed launcher (errors/launch_errors.h), with the CUDA error cleared.
ffi::Error LaunchError(int32_t kernel, const NormBwdParams& p, ffi::DataType dtype, const LaunchPlan& plan,
                       const DeviceLimits& lim, cudaError_t err) {
  ClearCudaError();
  return ffi::Error::Internal(
      LaunchFailure(BwdOpName(p.norm), kernel, p.rows, p.C, DtypeName(dtype), p.segments, plan, lim, err));
}

// Every target. Layernorm v1 passes dresidual null and a shape whose weight_f32 is false; v2 and
// rmsnorm have checked their additions (CheckResidual, CheckKernelRuns) before they come here.
// RMSNorm (shape.norm) passes mean and dbias null, and its offset.
ffi::Error Run(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
               const ffi::AnyBuffer& weight, const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd,
               const void* dresidual, ffi::AnyBuffer* dx, ffi::AnyBuffer* dweight, ffi::AnyBuffer* dbias,
               ffi::AnyBuffer* workspace, int32_t kernel, int32_t block_size, const NormBwdShape& shape,
               double offset) {
  const char* op = BwdOpName(shape.norm);
  const std::string fn = std::string(op) + ": ";
  const KernelFacts* k = nullptr;
  if (auto e = CheckKernelAttrs(kernel, block_size, &k, op); e.failure()) return e;
  Dtype dtype;
  if (auto e = ToKernelDtype("x", x.element_type(), &dtype, op); e.failure()) return e;

  // Zero rows: the sums over rows are exactly zero and there is no dx to write. No launch.
  if (shape.rows == 0) {
    cudaError_t err = cudaMemsetAsync(dweight->untyped_data(), 0, dweight->size_bytes(), stream);
    if (err == cudaSuccess && dbias) err = cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream);
    if (err != cudaSuccess) {
      ClearCudaError();
      return ffi::Error::Internal(fn + "zeroing dweight" + (dbias ? " and dbias" : "") + " of " +
                                  ShapeStr(dweight->dimensions()) + " failed: " + cudaGetErrorString(err));
    }
    return ffi::Error::Success();
  }
  DeviceLimits lim;
  if (cudaError_t err = device_limits(device, &lim); err != cudaSuccess) {
    ClearCudaError();
    const char* caps = std::getenv("JAX_LNBWD_TEST_DEVICE_LIMITS");
    return ffi::Error::Internal(fn + "reading the limits of device " + std::to_string(device) +
                                " failed: " + cudaGetErrorString(err) +
                                (caps ? std::string(" (JAX_LNBWD_TEST_DEVICE_LIMITS='") + caps +
                                            "': expected e.g. 'smem=101376,clusters=0,cooperative=0,sms=8')"
                                      : std::string()));
  }

  // The registry judges the kernel's limits against this GPU's shared memory.
  const RefusalLimits refusal = {static_cast<int64_t>(lim.smem_optin), "this GPU"};
  if (auto e = CheckKernelLimits(*k, block_size, shape, dtype, refusal); e.failure()) return e;

  NormBwdParams p;
  p.dx = dx->untyped_data();
  p.dweight = dweight->untyped_data();
  p.dbias = dbias ? dbias->untyped_data() : nullptr;
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.weight = weight.untyped_data();
  p.mean = mean ? mean->untyped_data() : nullptr;
  p.rstd = rstd.untyped_data();
  p.rows = shape.rows;
  p.C = shape.C;
  p.segments = shape.segments;
  p.weight_stride = shape.weight_rows == 1 ? 0 : shape.C;
  p.dtype = dtype;
  p.block_size = block_size;
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  p.device = device;
  p.dresidual = dresidual;
  p.weight_f32 = shape.weight_f32;
  p.norm = shape.norm;
  p.offset = offset;
  // A launcher uses as many partial slots as it finds room for, down to one per segment.
  const size_t least = kWorkspaceHeaderBytes +
                       static_cast<size_t>(p.segments) * 2 * static_cast<size_t>(p.C) * (p.dtype == Dtype::kF64 ? 8 : 4);
  if (p.workspace_bytes < least) {
    return ArgError("'workspace' has shape " + ShapeStr(workspace->dimensions()) + " but expected at least " +
                        std::to_string(least) + " bytes (a " + std::to_string(kWorkspaceHeaderBytes) +
                        "-byte header and a partial slot of 2*C accumulators per segment) for x of shape " +
                        ShapeStr(x.dimensions()) + " in " + std::to_string(p.segments) + " segment(s)",
                    op);
  }
  switch (kernel) {
    case 1: case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 9: case 10:
      if (cudaError_t err = kLlmcLaunchers[kernel - 1](p, stream); err != cudaSuccess) {
        return LaunchError(kernel, p, x.element_type(), LaunchPlan{}, lim, err);
      }
      break;
    case 11:
    case 12: {
      LaunchPlan plan;
      p.plan = &plan;
      const cudaError_t err = kernel == 11 ? norm_bwd_kernel11(p, stream) : norm_bwd_kernel12(p, stream);
      if (err != cudaSuccess) return LaunchError(kernel, p, x.element_type(), plan, lim, err);
      break;
    }
    default:
      return ArgError("'kernel' is " + std::to_string(kernel) + " but this build has no launcher for it", op);
  }
  return ffi::Error::Success();
}

ffi::Error LayernormBwdCuda(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                            ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel,
                            int32_t block_size, cudaStream_t stream, int32_t device) {
  NormBwdShape shape;
  if (auto e = CheckLayernormBwdTarget(dy, x, weight, mean, rstd, *dx, *dweight, *dbias, &shape); e.failure()) {
    return e;
  }
  return Run(stream, device, dy, x, weight, &mean, rstd, nullptr, &*dx, &*dweight, &*dbias,
             &*workspace, kernel, block_size, shape, 0.0);
}

ffi::Error LayernormBwdV2Cuda(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                              ffi::AnyBuffer rstd, ffi::AnyBuffer dresidual, ffi::Result<ffi::AnyBuffer> dx,
                              ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                              ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size,
                              bool has_residual, cudaStream_t stream, int32_t device) {
  NormBwdShape shape;
  if (auto e = CheckLayernormBwdV2Target(dy, x, weight, mean, rstd, dresidual, *dx, *dweight, *dbias, kernel,
                                         has_residual, &shape);
      e.failure()) {
    return e;
  }
  return Run(stream, device, dy, x, weight, &mean, rstd, has_residual ? dresidual.untyped_data() : nullptr, &*dx,
             &*dweight, &*dbias, &*workspace, kernel, block_size, shape, 0.0);
}

// RMSNorm: layernorm v2's buffers without mean and dbias, and the weight's offset. The kernels
// whose registry entry says rmsnorm run it (checked before anything is launched); the workspace
// has layernorm's layout and size.
ffi::Error RmsnormBwdCuda(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer rstd,
                          ffi::AnyBuffer dresidual, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                          ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size, bool has_residual,
                          double offset, cudaStream_t stream, int32_t device) {
  NormBwdShape shape;
  if (auto e = CheckRmsnormBwdTarget(dy, x, weight, rstd, dresidual, *dx, *dweight, kernel, has_residual, offset,
                                     &shape);
      e.failure()) {
    return e;
  }
  return Run(stream, device, dy, x, weight, nullptr, rstd, has_residual ? dresidual.untyped_data() : nullptr, &*dx,
             &*dweight, nullptr, &*workspace, kernel, block_size, shape, offset);
}

}  // namespace
}  // namespace lnbwd

// The backward targets' CUDA handler symbols: each target's operands (handlers/operands.h), then
// XLA's stream and the CUDA device of that stream, bound to its implementation above.
// Command-buffer compatible: the handler only enqueues work on XLA's stream (memsets and kernels,
// all capturable into a CUDA graph), never synchronizes, never allocates, and keeps no state
// between calls; its only scratch is the workspace buffer that XLA owns.
#define LNBWD_CUDA_HANDLER(Handler, key, name)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                            \
      JaxLnbwd##Handler##Cuda, lnbwd::Handler##Cuda,                                                        \
      lnbwd::Handler##Operands().Ctx<xla::ffi::PlatformStream<cudaStream_t>>().Ctx<xla::ffi::DeviceOrdinal>(), \
      {xla::ffi::Traits::kCmdBufferCompatible});
LNBWD_BACKWARD_TARGETS(LNBWD_CUDA_HANDLER)
#undef LNBWD_CUDA_HANDLER
