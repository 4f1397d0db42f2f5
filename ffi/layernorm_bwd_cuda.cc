// CUDA handler of the layernorm backward FFI target: checks the buffers, checks the kernel's
// limits once through the registry (registry.h, with this GPU's limits), handles zero rows, and
// hands plain pointers to the kernel launcher that `kernel` selects. No math here.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "checks.h"
#include "device_limits_cuda.h"
#include "kernels/api.h"
#include "layernorm_bwd_cuda.h"

namespace lnbwd {
namespace {

ffi::Error LayernormBwdCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                            ffi::AnyBuffer mean, ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size) {
  LayernormBwdShape shape;
  if (auto e = CheckLayernormBwdArgs(dy, x, weight, mean, rstd, *dx, *dweight, *dbias, &shape); e.failure()) {
    return e;
  }
  const KernelFacts* k = nullptr;
  if (auto e = CheckKernelAttrs(kernel, block_size, &k); e.failure()) return e;
  Dtype dtype;
  if (auto e = ToKernelDtype(x.element_type(), &dtype); e.failure()) return e;

  // Zero rows: the sums over rows are exactly zero and there is no dx to write. No launch.
  if (shape.rows == 0) {
    LNBWD_FFI_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(dweight->untyped_data(), 0, dweight->size_bytes(), stream));
    LNBWD_FFI_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream));
    return ffi::Error::Success();
  }

  DeviceLimits device = kDefaultDeviceLimits;   // only asked of the GPU where the limits depend on it
  if (k->device_limited) LNBWD_FFI_RETURN_IF_CUDA_ERROR(QueryCurrentDeviceLimits(&device));
  if (auto e = CheckKernelLimits(*k, block_size, shape, dtype, device); e.failure()) return e;

  LayernormBwdParams p;
  p.dx = dx->untyped_data();
  p.dweight = dweight->untyped_data();
  p.dbias = dbias->untyped_data();
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.weight = weight.untyped_data();
  p.mean = mean.untyped_data();
  p.rstd = rstd.untyped_data();
  p.rows = shape.rows;
  p.C = shape.C;
  p.segments = shape.segments;
  p.weight_stride = shape.weight_rows == 1 ? 0 : shape.C;
  p.dtype = dtype;
  p.block_size = block_size;
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  if (p.workspace_bytes < kWorkspaceHeaderBytes + 2 * static_cast<size_t>(p.C) * (p.dtype == Dtype::kF64 ? 8 : 4)) {
    return ArgError("'workspace' has shape " + ShapeStr(workspace->dimensions()) +
                    " but expected room for at least one partial slot of 2*C accumulators");
  }

  switch (kernel) {
    case 1: case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 9: case 10:
      LNBWD_FFI_RETURN_IF_CUDA_ERROR(kLlmcLaunchers[kernel - 1](p, stream));
      break;
    case 11:
      LNBWD_FFI_RETURN_IF_CUDA_ERROR(layernorm_bwd_kernel11(p, stream));
      break;
    case 12:
      LNBWD_FFI_RETURN_IF_CUDA_ERROR(layernorm_bwd_kernel12(p, stream));
      break;
    default:
      return ArgError("'kernel' is " + std::to_string(kernel) + " but this build has no launcher for it");
  }
  return ffi::Error::Success();
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
