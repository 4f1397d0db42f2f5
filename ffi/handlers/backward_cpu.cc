// CPU handlers of the backward FFI targets (targets.h: layernorm's v1 and v2, rmsnorm's): a clear
// two-pass reference in C++.
// It runs for every kernel id (the CUDA kernels exist only on the GPU), so the whole API works
// and is tested on machines without a GPU. Accumulation is fp32 (fp64 for float64 data). It
// refuses what the CUDA handler refuses, through the same registry (registry.h), with the
// default device limits: a call that fails on the GPU fails here too.
// RMSNorm is the same code with mean = 0 (xhat = x * rstd, not centered), without the mean's
// term a (no mean was subtracted) and without dbias, and with g = (offset + weight) * dy.
// The row's math is cpu::NormBwdRow (cpu_rows.h), which QK-norm's handler runs too.
#include <cstdint>
#include <vector>

#include "checks/backward.h"
#include "handlers/cpu_rows.h"
#include "handlers/handlers.h"
#include "handlers/operands.h"

namespace lnbwd {
namespace {

using cpu::BF16;
using cpu::F16;
using cpu::F32;
using cpu::F64;

// One segment of rows [r0, r1): dx for its rows, and its sums written to dweight/dbias rows.
// D is the data's type (dy, x, dx, dresidual), P the parameters' (weight, dweight, dbias): D, or
// F32 beside BF16/F16 data (mixed precision; both accumulate in float). dres, if not null, is
// added to dx before it is rounded; it may be dx itself (aliased): each element is read before
// the same element of dx is written. RMSNorm (not centered): mean and db_out null, and `offset`
// is added to the weight (in A, only where it is not 0: layernorm's weight is used exactly as
// stored).
template <typename D, typename P>
void Segment(bool centered, const typename D::S* dy, const typename D::S* x, const typename P::S* w, const typename D::A* mean,
             const typename D::A* rstd, const typename D::S* dres, typename D::S* dx, typename P::S* dw_out,
             typename P::S* db_out, int64_t r0, int64_t r1, int64_t C, typename D::A offset) {
  using A = typename D::A;
  std::vector<A> dweight(C, A(0)), dbias(C, A(0));
  for (int64_t r = r0; r < r1; ++r) {
    cpu::NormBwdRow<D, P>(centered, dy + r * C, x + r * C, w, centered ? mean[r] : A(0), rstd[r],
                          dres ? dres + r * C : nullptr, dx + r * C, dweight.data(), db_out ? dbias.data() : nullptr,
                          C, offset);
  }
  for (int64_t i = 0; i < C; ++i) {
    dw_out[i] = P::Store(dweight[i]);
    if (db_out) db_out[i] = P::Store(dbias[i]);
  }
}

template <typename D, typename P = D>
void Impl(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer* mean,
          const ffi::AnyBuffer& rstd, const void* dres, ffi::AnyBuffer dx, ffi::AnyBuffer dw, ffi::AnyBuffer* db,
          const NormBwdShape& shape, double offset) {
  using S = typename D::S;
  using PS = typename P::S;
  using A = typename D::A;   // mean/rstd are fp32, or fp64 for fp64 data: the accumulator type
  const int64_t C = shape.C;
  const int64_t per_segment = shape.rows / shape.segments;
  for (int64_t seg = 0; seg < shape.segments; ++seg) {
    const int64_t w_row = shape.weight_rows == 1 ? 0 : seg;
    Segment<D, P>(shape.norm == NormKind::kLayerNorm, static_cast<const S*>(dy.untyped_data()), static_cast<const S*>(x.untyped_data()),
                  static_cast<const PS*>(w.untyped_data()) + w_row * C,
                  mean ? static_cast<const A*>(mean->untyped_data()) : nullptr,
                  static_cast<const A*>(rstd.untyped_data()), static_cast<const S*>(dres),
                  static_cast<S*>(dx.untyped_data()), static_cast<PS*>(dw.untyped_data()) + seg * C,
                  db ? static_cast<PS*>(db->untyped_data()) + seg * C : nullptr, seg * per_segment,
                  (seg + 1) * per_segment, C, static_cast<A>(offset));
  }
}

// Every target: layernorm v1 (dres null, weight of x's dtype) and v2 (mixed precision,
// residual), and rmsnorm (shape.norm: mean and dbias null, and its offset).
ffi::Error Run(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
               const ffi::AnyBuffer* mean, const ffi::AnyBuffer& rstd, const void* dres, ffi::AnyBuffer dx,
               ffi::AnyBuffer dweight, ffi::AnyBuffer* dbias, const NormBwdShape& shape, double offset) {
  if (shape.weight_f32) {
    switch (x.element_type()) {
      case ffi::DataType::BF16: Impl<BF16, F32>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
      case ffi::DataType::F16: Impl<F16, F32>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
      default:
        return ArgError(std::string("float32 weight beside x of dtype ") + DtypeName(x.element_type()) +
                            " has no CPU implementation",
                        BwdOpName(shape.norm));
    }
    return ffi::Error::Success();
  }
  switch (x.element_type()) {
    case ffi::DataType::F32: Impl<F32>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
    case ffi::DataType::F64: Impl<F64>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
    case ffi::DataType::BF16: Impl<BF16>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
    case ffi::DataType::F16: Impl<F16>(dy, x, weight, mean, rstd, dres, dx, dweight, dbias, shape, offset); break;
    default:
      return ArgError(std::string("'x' has dtype ") + DtypeName(x.element_type()) + ", which has no CPU implementation",
                      BwdOpName(shape.norm));
  }
  return ffi::Error::Success();
}

// The kernel attributes, through the registry with the default device limits. As on the GPU,
// zero rows run nothing, so no kernel limit applies (the sums are zeros).
ffi::Error CheckKernel(int32_t kernel, int32_t block_size, const NormBwdShape& shape, const ffi::AnyBuffer& x) {
  const char* op = BwdOpName(shape.norm);
  const KernelFacts* k = nullptr;
  if (auto e = CheckKernelAttrs(kernel, block_size, &k, op); e.failure()) return e;
  Dtype dtype;
  if (auto e = ToKernelDtype("x", x.element_type(), &dtype, op); e.failure()) return e;
  if (shape.rows > 0) {
    if (auto e = CheckKernelLimits(*k, block_size, shape, dtype, kDefaultRefusalLimits); e.failure()) return e;
  }
  return ffi::Error::Success();
}

ffi::Error LayernormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                           ffi::AnyBuffer rstd, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size) {
  (void)workspace;   // only the CUDA kernels need scratch
  NormBwdShape shape;
  if (auto e = CheckLayernormBwdTarget(dy, x, weight, mean, rstd, *dx, *dweight, *dbias, &shape); e.failure()) {
    return e;
  }
  if (auto e = CheckKernel(kernel, block_size, shape, x); e.failure()) return e;
  return Run(dy, x, weight, &mean, rstd, nullptr, *dx, *dweight, &*dbias, shape, 0.0);
}

// Target v2: v1 plus mixed precision (float32 weight beside 16-bit x) and an added residual
// gradient. Refused for the kernel ids whose registry entry lacks v2_operands, as the CUDA
// handler does, so that a call that fails on the GPU fails here too.
ffi::Error LayernormBwdV2Cpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer mean,
                             ffi::AnyBuffer rstd, ffi::AnyBuffer dresidual, ffi::Result<ffi::AnyBuffer> dx,
                             ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                             ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size,
                             bool has_residual) {
  (void)workspace;
  NormBwdShape shape;
  if (auto e = CheckLayernormBwdV2Target(dy, x, weight, mean, rstd, dresidual, *dx, *dweight, *dbias, kernel,
                                         has_residual, &shape);
      e.failure()) {
    return e;
  }
  if (auto e = CheckKernel(kernel, block_size, shape, x); e.failure()) return e;
  return Run(dy, x, weight, &mean, rstd, has_residual ? dresidual.untyped_data() : nullptr, *dx, *dweight, &*dbias,
             shape, 0.0);
}

// RMSNorm (target rmsnorm_bwd): v2's buffers without mean and dbias, and the weight's offset.
// Refused for the kernel ids whose registry entry lacks rmsnorm, as the CUDA handler does.
ffi::Error RmsnormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer rstd,
                         ffi::AnyBuffer dresidual, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                         ffi::Result<ffi::AnyBuffer> workspace, int32_t kernel, int32_t block_size, bool has_residual,
                         double offset) {
  (void)workspace;
  NormBwdShape shape;
  if (auto e = CheckRmsnormBwdTarget(dy, x, weight, rstd, dresidual, *dx, *dweight, kernel, has_residual, offset,
                                     &shape);
      e.failure()) {
    return e;
  }
  if (auto e = CheckKernel(kernel, block_size, shape, x); e.failure()) return e;
  return Run(dy, x, weight, nullptr, rstd, has_residual ? dresidual.untyped_data() : nullptr, *dx, *dweight, nullptr,
             shape, offset);
}

}  // namespace
}  // namespace lnbwd

// The backward targets' CPU handler symbols: each target's operands (handlers/operands.h) bound
// to its implementation above.
#define LNBWD_CPU_HANDLER(Handler, key, name) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLnbwd##Handler##Cpu, lnbwd::Handler##Cpu, lnbwd::Handler##Operands());
LNBWD_BACKWARD_TARGETS(LNBWD_CPU_HANDLER)
#undef LNBWD_CPU_HANDLER
