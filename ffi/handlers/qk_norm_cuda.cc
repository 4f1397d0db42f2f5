// CUDA handlers of QK-norm's targets (targets.h: qk_norm_fwd, qk_norm_fused_fwd, qk_norm_bwd,
// qk_norm_fused_bwd): check the buffers (checks/qk_norm.h), map the dtypes, describe q's and k's
// rows as two sets (their own pointers, rows and head layout, kernels/common/head_rows.h), and
// hand them to the one-launch kernels (norm_fwd_sets, norm_bwd_sets). No math here.
//
// The fused forms normalize in place: XLA aliases the result to the input (input_output_aliases
// {0: 0}), so the v heads, which no kernel touches, are already the result's. Where XLA gave the
// result a buffer of its own, the input is first copied into it on the stream.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "checks/qk_norm.h"
#include "errors/ffi_errors.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"
#include "kernels/backward/api.h"
#include "kernels/forward/api.h"

namespace lnbwd {
namespace {

// A failed CUDA call leaves its error behind for the next launch in the process: cleared here.
ffi::Error CudaFailure(const char* fn, const std::string& what, const QkShape& s, cudaError_t err) {
  (void)cudaGetLastError();
  std::string why = cudaGetErrorString(err);
  if (err == cudaErrorInvalidValue) {
    why += " (the one-launch kernels take rows of a multiple of 16 bytes, at most " +
           std::to_string(kHeadRowsMaxBytes) + " bytes: jax_lnbwd runs other rows as two norm calls)";
  }
  return ffi::Error::Internal(std::string(fn) + ": " + what + " for " + std::to_string(s.rows_q) + " q rows and " +
                              std::to_string(s.rows_k) + " k rows of D=" + std::to_string(s.D) +
                              " failed: " + why);
}

// `out` holds `in`'s bytes: nothing to do where XLA aliased them, else an async copy.
ffi::Error CopyUnlessAliased(const ffi::AnyBuffer& in, ffi::AnyBuffer& out, cudaStream_t stream, const QkShape& s,
                             const char* fn) {
  if (in.untyped_data() == out.untyped_data() || in.size_bytes() == 0) return ffi::Error::Success();
  const cudaError_t err =
      cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaFailure(fn, "copying the unaliased input", s, err);
}

void* Offset(void* p, int64_t elems, int64_t item) { return static_cast<char*>(p) + elems * item; }

// One set's forward: rows of D at x (y, in place or not), laid out by `heads`.
NormFwdParams FwdSet(const QkShape& s, Dtype dtype, Dtype pdtype, const void* x, void* y, void* mean, void* rstd,
                     const ffi::AnyBuffer& weight, int64_t weight_rows, int64_t rows, HeadRows heads, double eps,
                     double offset) {
  NormFwdParams p = {};
  p.y = y;
  p.mean = s.norm == NormKind::kLayerNorm ? mean : nullptr;
  p.rstd = rstd;
  p.x = x;
  p.weight = weight_rows > 0 ? weight.untyped_data() : nullptr;
  p.weight_rows = weight_rows;
  p.rows = rows;
  p.C = s.D;
  p.dtype = dtype;
  p.param_dtype = pdtype;
  p.eps = eps;
  p.path = FwdPath::kAuto;
  p.norm = s.norm;
  p.offset = offset;
  p.heads = heads;
  return p;
}

// One set's backward (a's also carries what both share: the dweights, the workspace).
NormBwdParams BwdSet(const QkShape& s, Dtype dtype, bool weight_f32, const void* dy, const void* x, void* dx,
                     const ffi::AnyBuffer& weight, const ffi::AnyBuffer& mean, const ffi::AnyBuffer& rstd,
                     int64_t rows, HeadRows heads, double offset, int32_t device) {
  NormBwdParams p = {};
  p.dx = dx;
  p.dy = dy;
  p.x = x;
  p.weight = weight.untyped_data();
  p.mean = s.norm == NormKind::kLayerNorm ? mean.untyped_data() : nullptr;
  p.rstd = rstd.untyped_data();
  p.rows = rows;
  p.C = s.D;
  p.segments = 1;
  p.dtype = dtype;
  p.device = device;
  p.weight_f32 = weight_f32;
  p.norm = s.norm;
  p.offset = offset;
  p.heads = heads;
  return p;
}

// Both sets' backward, with the dweights [2, D] (q's row, then k's) written whatever the rows.
ffi::Error LaunchBwd(NormBwdParams& a, const NormBwdParams& b, ffi::AnyBuffer& dweights, ffi::AnyBuffer& workspace,
                     cudaStream_t stream, const QkShape& s, const char* fn) {
  a.dweight = dweights.untyped_data();
  a.workspace = workspace.untyped_data();
  a.workspace_bytes = workspace.size_bytes();
  if (a.rows == 0 && b.rows == 0) {   // sums over no rows: zero, and nothing to launch
    const cudaError_t err = cudaMemsetAsync(dweights.untyped_data(), 0, dweights.size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaFailure(fn, "zeroing the dweights", s, err);
  }
  const cudaError_t err = norm_bwd_sets(a, b, stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaFailure(fn, "the backward launch", s, err);
}

ffi::Error QkNormFwdCuda(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight,
                         ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> q_mean, ffi::Result<ffi::AnyBuffer> q_rstd,
                         ffi::Result<ffi::AnyBuffer> k_mean, ffi::Result<ffi::AnyBuffer> k_rstd, double eps,
                         double offset, int32_t norm, cudaStream_t stream) {
  const char* fn = "qk_norm_fwd";
  QkShape s;
  if (auto e = CheckQkNormFwdArgs(q, k, q_weight, k_weight, *q_out, *k_out, *q_mean, *q_rstd, *k_mean, *k_rstd, eps,
                                  offset, norm, &s);
      e.failure()) {
    return e;
  }
  Dtype dtype, pdtype;
  if (auto e = ToKernelDtype("q", q.element_type(), &dtype, fn); e.failure()) return e;
  if (auto e = ToKernelDtype("q_weight", s.param_dtype, &pdtype, fn); e.failure()) return e;
  const NormFwdParams a = FwdSet(s, dtype, pdtype, q.untyped_data(), q_out->untyped_data(), q_mean->untyped_data(),
                                 q_rstd->untyped_data(), q_weight, s.q_weight_rows, s.rows_q, HeadRows{}, eps, offset);
  const NormFwdParams b = FwdSet(s, dtype, pdtype, k.untyped_data(), k_out->untyped_data(), k_mean->untyped_data(),
                                 k_rstd->untyped_data(), k_weight, s.k_weight_rows, s.rows_k, HeadRows{}, eps, offset);
  const cudaError_t err = norm_fwd_sets(a, b, stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaFailure(fn, "the forward launch", s, err);
}

ffi::Error QkNormFusedFwdCuda(ffi::AnyBuffer qkv, ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight,
                              ffi::Result<ffi::AnyBuffer> qkv_out, ffi::Result<ffi::AnyBuffer> q_mean,
                              ffi::Result<ffi::AnyBuffer> q_rstd, ffi::Result<ffi::AnyBuffer> k_mean,
                              ffi::Result<ffi::AnyBuffer> k_rstd, double eps, double offset, int32_t norm,
                              int64_t q_heads, int64_t kv_heads, cudaStream_t stream) {
  const char* fn = "qk_norm_fused_fwd";
  QkShape s;
  if (auto e = CheckQkNormFusedFwdArgs(qkv, q_weight, k_weight, *qkv_out, *q_mean, *q_rstd, *k_mean, *k_rstd, eps,
                                       offset, norm, q_heads, kv_heads, &s);
      e.failure()) {
    return e;
  }
  Dtype dtype, pdtype;
  if (auto e = ToKernelDtype("qkv", qkv.element_type(), &dtype, fn); e.failure()) return e;
  if (auto e = ToKernelDtype("q_weight", s.param_dtype, &pdtype, fn); e.failure()) return e;
  if (auto e = CopyUnlessAliased(qkv, *qkv_out, stream, s, fn); e.failure()) return e;
  // In place in qkv_out: q's heads start at the token's first element, k's Hq heads on.
  const int64_t item = dtype_item_bytes(dtype);
  void* base = qkv_out->untyped_data();
  void* k_base = Offset(base, s.q_heads * s.D, item);
  const NormFwdParams a = FwdSet(s, dtype, pdtype, base, base, q_mean->untyped_data(), q_rstd->untyped_data(),
                                 q_weight, s.q_weight_rows, s.rows_q, HeadRows{s.q_heads, s.width}, eps, offset);
  const NormFwdParams b = FwdSet(s, dtype, pdtype, k_base, k_base, k_mean->untyped_data(), k_rstd->untyped_data(),
                                 k_weight, s.k_weight_rows, s.rows_k, HeadRows{s.kv_heads, s.width}, eps, offset);
  const cudaError_t err = norm_fwd_sets(a, b, stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaFailure(fn, "the forward launch", s, err);
}

ffi::Error QkNormBwdCuda(ffi::AnyBuffer dq_out, ffi::AnyBuffer dk_out, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer q_weight, ffi::AnyBuffer k_weight, ffi::AnyBuffer q_mean, ffi::AnyBuffer q_rstd,
                         ffi::AnyBuffer k_mean, ffi::AnyBuffer k_rstd, ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dweights,
                         ffi::Result<ffi::AnyBuffer> workspace, double offset, int32_t norm, cudaStream_t stream,
                         int32_t device) {
  const char* fn = "qk_norm_bwd";
  QkShape s;
  if (auto e = CheckQkNormBwdArgs(dq_out, dk_out, q, k, q_weight, k_weight, q_mean, q_rstd, k_mean, k_rstd, *dq, *dk,
                                  *dweights, *workspace, offset, norm, &s);
      e.failure()) {
    return e;
  }
  Dtype dtype;
  if (auto e = ToKernelDtype("q", q.element_type(), &dtype, fn); e.failure()) return e;
  const bool f32w = s.param_dtype != q.element_type();
  NormBwdParams a = BwdSet(s, dtype, f32w, dq_out.untyped_data(), q.untyped_data(), dq->untyped_data(), q_weight,
                           q_mean, q_rstd, s.rows_q, HeadRows{}, offset, device);
  const NormBwdParams b = BwdSet(s, dtype, f32w, dk_out.untyped_data(), k.untyped_data(), dk->untyped_data(),
                                 k_weight, k_mean, k_rstd, s.rows_k, HeadRows{}, offset, device);
  return LaunchBwd(a, b, *dweights, *workspace, stream, s, fn);
}

ffi::Error QkNormFusedBwdCuda(ffi::AnyBuffer dqkv_out, ffi::AnyBuffer qkv, ffi::AnyBuffer q_weight,
                              ffi::AnyBuffer k_weight, ffi::AnyBuffer q_mean, ffi::AnyBuffer q_rstd,
                              ffi::AnyBuffer k_mean, ffi::AnyBuffer k_rstd, ffi::Result<ffi::AnyBuffer> dqkv,
                              ffi::Result<ffi::AnyBuffer> dweights, ffi::Result<ffi::AnyBuffer> workspace,
                              double offset, int32_t norm, int64_t q_heads, int64_t kv_heads, cudaStream_t stream,
                              int32_t device) {
  const char* fn = "qk_norm_fused_bwd";
  QkShape s;
  if (auto e = CheckQkNormFusedBwdArgs(dqkv_out, qkv, q_weight, k_weight, q_mean, q_rstd, k_mean, k_rstd, *dqkv,
                                       *dweights, *workspace, offset, norm, q_heads, kv_heads, &s);
      e.failure()) {
    return e;
  }
  Dtype dtype;
  if (auto e = ToKernelDtype("qkv", qkv.element_type(), &dtype, fn); e.failure()) return e;
  // dqkv holds dqkv_out (aliased, or copied): its v heads are the result's, and q's and k's are
  // read as dy and written over as dx, each row by the threads that read it.
  if (auto e = CopyUnlessAliased(dqkv_out, *dqkv, stream, s, fn); e.failure()) return e;
  const int64_t item = dtype_item_bytes(dtype);
  void* g = dqkv->untyped_data();
  const void* x = qkv.untyped_data();
  const int64_t k_at = s.q_heads * s.D;
  const bool f32w = s.param_dtype != qkv.element_type();
  NormBwdParams a = BwdSet(s, dtype, f32w, g, x, g, q_weight, q_mean, q_rstd, s.rows_q, HeadRows{s.q_heads, s.width},
                           offset, device);
  const NormBwdParams b =
      BwdSet(s, dtype, f32w, Offset(g, k_at, item), static_cast<const char*>(x) + k_at * item, Offset(g, k_at, item),
             k_weight, k_mean, k_rstd, s.rows_k, HeadRows{s.kv_heads, s.width}, offset, device);
  return LaunchBwd(a, b, *dweights, *workspace, stream, s, fn);
}

}  // namespace
}  // namespace lnbwd

// The QK-norm targets' CUDA handler symbols: each target's operands (handlers/operands.h), then
// XLA's stream (and, for the backwards, the device of that stream). Command-buffer compatible:
// the handlers only enqueue work on XLA's stream (copies, memsets and kernels), never
// synchronize or allocate; their only scratch is the workspace buffer XLA owns.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwdQkNormFwdCuda, lnbwd::QkNormFwdCuda,
                              lnbwd::QkNormFwdOperands().Ctx<xla::ffi::PlatformStream<cudaStream_t>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwdQkNormFusedFwdCuda, lnbwd::QkNormFusedFwdCuda,
                              lnbwd::QkNormFusedFwdOperands().Ctx<xla::ffi::PlatformStream<cudaStream_t>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwdQkNormBwdCuda, lnbwd::QkNormBwdCuda,
                              lnbwd::QkNormBwdOperands()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwdQkNormFusedBwdCuda, lnbwd::QkNormFusedBwdCuda,
                              lnbwd::QkNormFusedBwdOperands()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
