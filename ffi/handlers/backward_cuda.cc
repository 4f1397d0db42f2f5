// CUDA handlers of the backward FFI targets (layernorm v1 and v2, rmsnorm v1): check the buffers, map the dtype,
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
#include "kernels/backward/api.h"

namespace lnbwd {
namespace {

// A failed CUDA call can leave its error in the runtime's per-thread "last error", which a later
// launch in this process (an llm.c kernel's cudaGetLastError after <<<>>>) would report as its own.
// Every error path clears it; a sticky error (a faulted context) cannot be cleared, and says so.
void ClearCudaError() { (void)cudaGetLastError(); }

// The error of a failed launcher (errors/launch_errors.h), with the CUDA error cleared.
ffi::Error LaunchError(int32_t kernel, const LayernormBwdParams& p, ffi::DataType dtype, const LaunchPlan& plan,
                       const DeviceLimits& lim, cudaError_t err) {
  ClearCudaError();
  return ffi::Error::Internal(LaunchFailure(kernel, p.rows, p.C, DtypeName(dtype), p.segments, plan, lim, err, p.norm));
}

// Every target. Layernorm v1 passes dresidual null and a shape whose weight_f32 is false; v2 and
// rmsnorm have checked their additions (CheckResidual, CheckV2Kernel, CheckRmsnormKernel) before
// they come here. RMSNorm (shape.norm) passes mean and dbias null, and its offset.
ffi::Error Run(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
               const ffi::AnyBuffer& weight, const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd,
               const void* dresidual, ffi::AnyBuffer* dx, ffi::AnyBuffer* dweight, ffi::AnyBuffer* dbias,
               ffi::AnyBuffer* workspace, int32_t kernel, int32_t block_size, const LayernormBwdShape& shape,
               double offset = 0.0) {
  const std::string fn = std::string(norm_name(shape.norm)) + "_bwd: ";
  const KernelFacts* k = nullptr;
  if (auto e = CheckKernelAttrs(kernel, block_size, &k, shape.norm); e.failure()) return e;
  Dtype dtype;
  if (auto e = ToKernelDtype(x.element_type(), &dtype, shape.norm); e.failure()) return e;

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

  LayernormBwdParams p;
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
                    shape.norm);
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
      const cudaError_t err = kernel == 11 ? layernorm_bwd_kernel11(p, stream) : layernorm_bwd_kernel12(p, stream);
      if (err != cudaSuccess) return LaunchError(kernel, p, x.element_type(), plan, lim, err);
      break;
    }
    default:
      return ArgError("'kernel' is " + std::to_string(kernel) + " but this build has no launcher for it", shape.norm);
  }
  return ffi::Error::Success();
}

ffi::Error LayernormBwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel,
                            int32_t block_size) {
  LayernormBwdShape shape;
  if (auto e = CheckLayernormBwdArgs(dy, x, weight, mean, rstd, *dx, *dweight, *dbias, &shape); e.failure()) {
    return e;
  }
  return Run(stream, device, dy, x, weight, &mean, rstd, nullptr, &*dx, &*dweight, &*dbias,
             &*workspace, kernel, block_size, shape);
}

ffi::Error LayernormBwdV2Cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                              ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                              ffi::AnyBuffer dresidual, ffi::Result<ffi::AnyBuffer> dx,
                              ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                              ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size,
                              bool has_residual) {
  LayernormBwdShape shape;
  if (auto e = CheckLayernormBwdV2Target(dy, x, weight, mean, rstd, dresidual, *dx, *dweight, *dbias, kernel,
                                         has_residual, &shape);
      e.failure()) {
    return e;
  }
  return Run(stream, device, dy, x, weight, &mean, rstd, has_residual ? dresidual.untyped_data() : nullptr, &*dx,
             &*dweight, &*dbias, &*workspace, kernel, block_size, shape);
}

// RMSNorm: layernorm v2's buffers without mean and dbias, and the weight's offset. Kernels 11 and
// 12 run it (checked before anything is launched); the workspace has layernorm's layout and size.
ffi::Error RmsnormBwdCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::AnyBuffer weight, ffi::AnyBuffer rstd, ffi::AnyBuffer dresidual,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                          ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size, bool has_residual,
                          double offset) {
  LayernormBwdShape shape;
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

// Command-buffer compatible: the handler only enqueues work on XLA's stream (memsets and
// kernels, all capturable into a CUDA graph), never synchronizes, never allocates, and keeps no
// state between calls; its only scratch is the workspace buffer that XLA owns.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdLayernormBwdCuda, lnbwd::LayernormBwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                  // the CUDA device of that stream
        .Arg<xla::ffi::AnyBuffer>()   // dy [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [1 or segments, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
        .Arg<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
        .Ret<xla::ffi::AnyBuffer>()   // dx [rows, C] dtype
        .Ret<xla::ffi::AnyBuffer>()   // dweight [segments, C] dtype: sums over each segment's rows
        .Ret<xla::ffi::AnyBuffer>()   // dbias [segments, C] dtype
        .Ret<xla::ffi::AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums
        .Attr<int32_t>("kernel")      // which CUDA kernel (ids as in jax_lnbwd.KERNELS)
        .Attr<int32_t>("block_size"), // threads per block, 0 = the kernel's best
    {xla::ffi::Traits::kCmdBufferCompatible});

// Target jax_lnbwd_layernorm_bwd_v2: v1 plus two things (kernels 11 and 12; 1-10 refuse them).
//  * Mixed precision: weight may be float32 beside bfloat16/float16 x ("pdtype" below: x's dtype,
//    or float32). g = weight * dy is formed in fp32 from the float32 weight, never rounded, and
//    dweight/dbias, summed in fp32 as always, are stored as pdtype.
//  * A residual gradient: with has_residual, dx = layernorm's dx + dresidual, added in fp32 and
//    rounded once (the backward of add_layernorm: the residual stream's gradient passes through).
//    The caller aliases dresidual to dx (input_output_aliases {5: 0}): XLA then writes dx in
//    dresidual's buffer where that is dead after the call, and copies it first where it is not.
//    Each element is read once and written once, by the same thread. Absent (has_residual
//    false), dresidual is a placeholder with no elements, e.g. a (0,) array, and nothing aliases.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdLayernormBwdV2Cuda, lnbwd::LayernormBwdV2Cuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                  // the CUDA device of that stream
        .Arg<xla::ffi::AnyBuffer>()   // dy [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [1 or segments, C] pdtype: dtype, or float32 beside bf16/f16
        .Arg<xla::ffi::AnyBuffer>()   // mean [rows] float32 (float64 for float64 x)
        .Arg<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
        .Arg<xla::ffi::AnyBuffer>()   // dresidual [rows, C] dtype, added to dx (may be aliased to it); (0,) when !has_residual
        .Ret<xla::ffi::AnyBuffer>()   // dx [rows, C] dtype: layernorm's dx (+ dresidual)
        .Ret<xla::ffi::AnyBuffer>()   // dweight [segments, C] pdtype: sums over each segment's rows
        .Ret<xla::ffi::AnyBuffer>()   // dbias [segments, C] pdtype
        .Ret<xla::ffi::AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums
        .Attr<int32_t>("kernel")      // which CUDA kernel (ids as in jax_lnbwd.KERNELS)
        .Attr<int32_t>("block_size")  // threads per block, 0 = the kernel's best
        .Attr<bool>("has_residual"),  // whether dresidual is added (else it is a placeholder)
    {xla::ffi::Traits::kCmdBufferCompatible});

// Target jax_lnbwd_rmsnorm_bwd_v1: RMSNorm's backward, with g_i = (offset + weight_i) * dy_i and
// xhat_i = x_i * rstd:
//   dx_i = (g_i - xhat_i * mean_j(g_j xhat_j)) * rstd  [+ dresidual_i, added in fp32, rounded once]
//   dweight_i = sum over each segment's rows of dy_i * xhat_i   (offset does not enter it)
// Mixed precision and the residual gradient as in layernorm v2 (dresidual may be aliased to dx:
// input_output_aliases {4: 0}). Kernels 11 and 12 only; 1-10 refuse it. The workspace has the
// layout and the size of layernorm's for the same kernel, dtype, rows, C and segments
// (launch_plan in ffi/module.cc sizes both).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxLnbwdRmsnormBwdCuda, lnbwd::RmsnormBwdCuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
        .Ctx<xla::ffi::DeviceOrdinal>()                  // the CUDA device of that stream
        .Arg<xla::ffi::AnyBuffer>()   // dy [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // x [rows, C] dtype
        .Arg<xla::ffi::AnyBuffer>()   // weight [1 or segments, C] pdtype: dtype, or float32 beside bf16/f16
        .Arg<xla::ffi::AnyBuffer>()   // rstd [rows] float32 (float64 for float64 x)
        .Arg<xla::ffi::AnyBuffer>()   // dresidual [rows, C] dtype, added to dx (may be aliased to it); (0,) when !has_residual
        .Ret<xla::ffi::AnyBuffer>()   // dx [rows, C] dtype: rmsnorm's dx (+ dresidual)
        .Ret<xla::ffi::AnyBuffer>()   // dweight [segments, C] pdtype: sums over each segment's rows
        .Ret<xla::ffi::AnyBuffer>()   // workspace [bytes] uint8: flags, then per-block partial sums (layernorm's size)
        .Attr<int32_t>("kernel")      // which CUDA kernel: 11 or 12 (1-10 refuse rmsnorm)
        .Attr<int32_t>("block_size")  // threads per block, 0 = the kernel's best
        .Attr<bool>("has_residual")   // whether dresidual is added (else it is a placeholder)
        .Attr<double>("offset"),      // g = (offset + weight) * dy, in the accumulator type (Gemma: 1)
    {xla::ffi::Traits::kCmdBufferCompatible});
